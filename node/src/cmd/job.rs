//! `cannabis job`: jobs from the requester's side.

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use cannabis_api::ApiClient;
use cannabis_api::{JobDetail, TaskExplanation};
use cannabis_market::job::LeaseState;
use cannabis_market::spec::JobSpec;
use cannabis_protocol::{Amount, Digest, FOUNDER_FEE_BPS, Quote};
use sha2::{Digest as _, Sha256};

use crate::cli::JobCommand;
use crate::output::{self, out};

pub(super) fn run(
    command: JobCommand,
    data_dir: impl Fn() -> anyhow::Result<PathBuf>,
) -> anyhow::Result<()> {
    match command {
        JobCommand::Quote {
            budget,
            fee_bps,
            format,
        } => {
            let q = Quote::for_budget(budget, fee_bps)?;
            if format.json {
                return output::json(&q);
            }
            print_quote(&q)?;
            Ok(())
        }
        JobCommand::Submit {
            file,
            yes,
            dry_run,
            format,
        } => submit(&file, yes, dry_run, format.json, &data_dir()?),
        JobCommand::Status { id, format } => {
            let job = ApiClient::from_data_dir(&data_dir()?)?.job(&id)?;
            if format.json {
                return output::json(&job);
            }
            print_job(&job)
        }
        JobCommand::List { format } => {
            let jobs = ApiClient::from_data_dir(&data_dir()?)?.jobs()?;
            if format.json {
                return output::json(&jobs);
            }
            out!(
                "{:<36} {:<20} {:<10} {:>12} {:>12} {:>5}  tasks",
                "job",
                "name",
                "state",
                "budget",
                "used",
                "bids"
            )?;
            for j in &jobs {
                out!(
                    "{:<36} {:<20} {:<10} {:>12} {:>12} {:>5}  {}",
                    j.job_id,
                    j.name,
                    format!("{:?}", j.state).to_lowercase(),
                    j.budget,
                    money(j.used),
                    j.bids,
                    j.tasks.join(",")
                )?;
            }
            out!("{} jobs", jobs.len())?;
            Ok(())
        }
        JobCommand::Cancel { id } => {
            let j = ApiClient::from_data_dir(&data_dir()?)?.cancel_job(&id)?;
            out!("job {} cancelled; every leased rank was told", j.job_id)?;
            Ok(())
        }
        JobCommand::Accept { id, part, format } => {
            let verdict = cannabis_api::Verdict::Accept { part_ppm: part };
            let job = ApiClient::from_data_dir(&data_dir()?)?.judge_job(&id, &verdict)?;
            if format.json {
                return output::json(&job);
            }
            out!(
                "accepted {}.{:04}% of what job {} delivered: each delivered rank is paid from \
                 its escrow once a block holds the acceptance",
                part / 10_000,
                part % 10_000,
                job.summary.job_id
            )?;
            print_escrow(&job)
        }
        JobCommand::Dispute { id, reason, format } => {
            let verdict = cannabis_api::Verdict::Dispute { reason };
            let job = ApiClient::from_data_dir(&data_dir()?)?.judge_job(&id, &verdict)?;
            if format.json {
                return output::json(&job);
            }
            out!(
                "disputed what job {} delivered: the money stays in escrow until the \
                 resolver settles it",
                job.summary.job_id
            )?;
            print_escrow(&job)
        }
        JobCommand::Evaluate { id, format } => {
            let client = ApiClient::from_data_dir(&data_dir()?)?;
            let asked = client.judge_job(&id, &cannabis_api::Verdict::Evaluate)?;
            let run = asked.evaluation.as_ref().map_or(0, |e| e.run);
            let limit = asked
                .evaluation_terms
                .as_ref()
                .map_or(0, |t| t.limits.wall_ms)
                .saturating_add(60_000);
            let until = std::time::Instant::now() + std::time::Duration::from_millis(limit);
            let bar = output::spinner(format.json);
            let job = loop {
                let job = client.job(&id)?;
                if job
                    .evaluation
                    .as_ref()
                    .is_some_and(|e| e.run > run || (e.run == run && !e.running))
                {
                    break job;
                }
                bar.set_message(format!("evaluation run {} running", run.max(1)));
                bar.tick();
                if std::time::Instant::now() > until {
                    bar.finish_and_clear();
                    anyhow::bail!(
                        "evaluation run {run} of job {id} has not reported yet: see `cannabis job status {id}`"
                    );
                }
                std::thread::sleep(std::time::Duration::from_millis(250));
            };
            bar.finish_and_clear();
            if format.json {
                return output::json(&job.evaluation);
            }
            print_evaluation(&job)?;
            print_escrow(&job)
        }
        JobCommand::Results {
            id,
            task,
            out: dir,
            wait,
            format,
        } => {
            let api = ApiClient::from_data_dir(&data_dir()?)?;
            let job = if wait {
                wait_delivered(&api, &id, task, format.json)?
            } else {
                api.job(&id)?
            };
            let written = results(&job, task, &dir)?;
            if format.json {
                return output::json(&written);
            }
            for w in &written {
                out!("{}  {}  {} bytes", w.digest, w.path, w.size_bytes)?;
            }
            out!(
                "{} outputs written to {}, each matching its signed digest",
                written.len(),
                dir.display()
            )?;
            Ok(())
        }
    }
}

/// One output `job results` wrote.
#[derive(serde::Serialize)]
struct Written {
    task: u32,
    rank: u32,
    name: String,
    digest: String,
    size_bytes: u64,
    path: String,
}

/// The tasks `job results` works on: all, or the one chosen.
fn chosen_tasks(job: &JobDetail, only: Option<u32>) -> anyhow::Result<Vec<usize>> {
    Ok(match only {
        Some(t) if (t as usize) < job.tasks.len() => vec![t as usize],
        Some(t) => anyhow::bail!(
            "job {} has no task {t} (it has {})",
            job.summary.job_id,
            job.tasks.len()
        ),
        None => (0..job.tasks.len()).collect(),
    })
}

/// The ranks of `tasks` whose outputs are not here yet, named for the user.
fn undelivered(job: &JobDetail, tasks: &[usize]) -> Vec<String> {
    let mut missing = Vec::new();
    for &i in tasks {
        let t = &job.tasks[i];
        for rank in 0..t.group_size {
            let done = t
                .ranks
                .iter()
                .any(|r| r.rank == rank && r.state == LeaseState::Done);
            if !done {
                missing.push(format!("task {i} ({}) rank {rank}", t.name));
            }
        }
    }
    missing
}

/// Where the first task still to deliver stands, for a progress line: its bids while it
/// takes them, then its worker and what the worker last reported.
fn awaiting(job: &JobDetail, tasks: &[usize], now_ms: u64) -> String {
    let Some(&i) = tasks.iter().find(|&&i| {
        let t = &job.tasks[i];
        (0..t.group_size).any(|r| {
            !t.ranks
                .iter()
                .any(|a| a.rank == r && a.state == LeaseState::Done)
        })
    }) else {
        return "fetching the outputs".into();
    };
    let t = &job.tasks[i];
    let live: Vec<_> = t
        .ranks
        .iter()
        .filter(|a| a.state != LeaseState::Done && a.state != LeaseState::Ended)
        .collect();
    if live.is_empty() {
        let left = job.summary.bids_until_ms.saturating_sub(now_ms) / 1000;
        let window = if left > 0 {
            format!(", placed in {left} s at the latest")
        } else {
            String::new()
        };
        return format!(
            "task {}: waiting for bids ({} in{window})",
            t.name,
            t.bids.len()
        );
    }
    let a = live[0];
    let worker = a.worker.to_string();
    let worker = worker.get(..16).unwrap_or(&worker);
    match &a.progress {
        None if a.state == LeaseState::Offered => {
            format!(
                "task {}: awarded to {worker}..., waiting for its acceptance",
                t.name
            )
        }
        None => format!("task {}: leased to {worker}... (epoch {})", t.name, a.epoch),
        Some(p) => format!(
            "task {}: {} on {worker}... (epoch {})",
            t.name,
            p.stage.name(),
            a.epoch
        ),
    }
}

/// How often `job results --wait` asks the node.
const WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// Polls the node until every rank of the chosen tasks delivered and its outputs are here,
/// drawing progress on standard error: a bar over the bytes on their way while outputs
/// travel, else a spinner naming what is awaited. Nothing is drawn when `quiet` or when
/// standard error is not a terminal. Fails as soon as the job ends without them (it ends
/// by its deadline at the latest).
fn wait_delivered(
    api: &ApiClient,
    id: &str,
    only: Option<u32>,
    quiet: bool,
) -> anyhow::Result<JobDetail> {
    use indicatif::{ProgressBar, ProgressStyle};
    use std::io::IsTerminal as _;
    let bar = if quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    let waiting = ProgressStyle::with_template("{spinner} {elapsed} {msg}")?;
    let moving = ProgressStyle::with_template(
        "{spinner} {elapsed} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
    )?
    .progress_chars("=> ");
    bar.set_style(waiting.clone());
    loop {
        let job = api.job(id)?;
        let tasks = chosen_tasks(&job, only)?;
        let missing = undelivered(&job, &tasks);
        if missing.is_empty() {
            bar.finish_and_clear();
            return Ok(job);
        }
        if job.summary.state != cannabis_market::job::JobState::Open {
            bar.finish_and_clear();
            anyhow::bail!(
                "job {id} is {:?} and will not deliver {} (see `cannabis job status {id}`)",
                job.summary.state,
                missing.join(", ")
            );
        }
        let (bytes, total) = tasks
            .iter()
            .flat_map(|&i| &job.tasks[i].transfers)
            .fold((0, 0), |(b, t), x| (b + x.bytes, t + x.total));
        if total > 0 {
            bar.set_style(moving.clone());
            bar.set_length(total);
            bar.set_position(bytes);
            bar.set_message("outputs on their way");
        } else {
            bar.set_style(waiting.clone());
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            bar.set_message(awaiting(&job, &tasks, now_ms));
        }
        bar.tick();
        std::thread::sleep(WAIT_POLL);
    }
}

/// Copies a job's delivered outputs into `dir`, each checked against its signed digest
/// (on the copy), after checking every rank of the chosen tasks delivered.
fn results(job: &JobDetail, only: Option<u32>, dir: &Path) -> anyhow::Result<Vec<Written>> {
    let tasks = chosen_tasks(job, only)?;
    // Every rank of every chosen task must have delivered: name those that did not.
    let missing = undelivered(job, &tasks);
    if !missing.is_empty() {
        anyhow::bail!(
            "not delivered yet: {} (wait with `cannabis job results {} --wait`, or see \
             `cannabis job status {}`)",
            missing.join(", "),
            job.summary.job_id,
            job.summary.job_id
        );
    }
    let mut written = Vec::new();
    for &i in &tasks {
        let t = &job.tasks[i];
        let mut base = dir.to_path_buf();
        if tasks.len() > 1 {
            base.push(&t.name);
        }
        for o in t.delivered.iter().filter(|o| o.fetched) {
            let mut to = base.clone();
            if t.group_size > 1 {
                to.push(format!("rank-{}", o.rank));
            }
            std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
            to.push(&o.name);
            let tmp = to.with_extension("partial");
            std::fs::copy(&o.path, &tmp).with_context(|| {
                format!("copying {} (kept by the node) to {}", o.path, tmp.display())
            })?;
            let (digest, size) = hash_file(&tmp)?;
            if digest.to_string() != o.digest || size != o.size_bytes {
                let _ = std::fs::remove_file(&tmp);
                anyhow::bail!(
                    "{}: {size} bytes with digest {digest}, the worker signed {} bytes with {}: not written",
                    o.path,
                    o.size_bytes,
                    o.digest
                );
            }
            std::fs::rename(&tmp, &to).with_context(|| format!("writing {}", to.display()))?;
            written.push(Written {
                task: i as u32,
                rank: o.rank,
                name: o.name.clone(),
                digest: o.digest.clone(),
                size_bytes: size,
                path: to.display().to_string(),
            });
        }
    }
    Ok(written)
}

/// Every bundle and staged input the workers will fetch must be in the node's package
/// store (a file given by path was copied there; one pinned by digest must be put there).
fn check_packages_kept(
    template: &cannabis_market::OfferTemplate,
    data_dir: &Path,
) -> anyhow::Result<()> {
    for (i, t) in template.tasks.iter().enumerate() {
        let mut needed = Vec::new();
        if t.workload.adapter.runs_a_bundle() {
            needed.push(("workload.digest".to_string(), t.workload.digest));
        }
        for input in &t.inputs {
            if let cannabis_protocol::TaskInput::Staged(r) = input {
                needed.push((format!("input {:?}", r.name), r.digest));
            }
        }
        for (what, digest) in needed {
            let path = cannabis_node::delivery::package_path(data_dir, &digest);
            if !path.exists() {
                anyhow::bail!(
                    "task[{i}] {what}: this node holds no copy of {digest} for workers to fetch: \
                     give a path (bundle = \"...\" or path = \"...\"), or put the file at {}",
                    path.display()
                );
            }
        }
    }
    Ok(())
}

/// SHA-256 and size of a local file, streamed.
pub(super) fn hash_file(path: &Path) -> anyhow::Result<(Digest, u64)> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let size = std::io::copy(&mut f, &mut hasher)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok((Digest(hasher.finalize().into()), size))
}

fn submit(
    file: &Path,
    yes: bool,
    dry_run: bool,
    json: bool,
    data_dir: &Path,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the job file {}", file.display()))?;
    let spec = JobSpec::parse(&text).with_context(|| format!("in {}", file.display()))?;
    // Local paths are relative to the job file. A job that is published keeps a copy of
    // each in the node's package store, where workers fetch them from.
    let base = file.parent().unwrap_or(Path::new("."));
    let template = spec
        .resolve(|p| {
            if dry_run {
                hash_file(&base.join(p))
            } else {
                cannabis_node::delivery::keep_package(data_dir, &base.join(p))
                    .map_err(anyhow::Error::msg)
            }
        })
        .map_err(|(field, e)| e.context(format!("{}: {field}", file.display())))?;
    if !dry_run {
        check_packages_kept(&template, data_dir)
            .with_context(|| format!("in {}", file.display()))?;
    }
    let client = ApiClient::from_data_dir(data_dir)?;
    // The fee terms and gas price are the network's (its genesis), not this binary's.
    let ledger = client.ledger().ok();
    let fee_bps = ledger.as_ref().map_or(FOUNDER_FEE_BPS, |l| l.fee_rate_bps);
    let quote = Quote::for_budget(spec.budget, fee_bps)?;
    let groups = template.tasks.iter().map(|t| u64::from(t.group_size));
    let network_fee = ledger.as_ref().map(|l| {
        Amount(
            l.min_gas_price
                .saturating_mul(cannabis_market::ledger::Ledger::settlement_gas(groups)),
        )
    });
    let explained = client.explain(&template)?;
    if json && dry_run {
        return output::json(&serde_json::json!({
            "quote": quote,
            "network_fee": network_fee,
            "review_window_ms": template.review_window_ms,
            "fee_recipient": ledger.as_ref().map(|l| &l.fee_recipient),
            "tasks": explained,
        }));
    }
    if !json {
        out!("job {:?}: {} task(s)", spec.name, spec.tasks.len())?;
        print_quote(&quote)?;
        match (&ledger, network_fee) {
            (Some(l), Some(fee)) => {
                output::table(&[
                    ("fee recipient", l.fee_recipient.clone()),
                    (
                        "network fee",
                        format!("{fee}  (charged apart from the budget)"),
                    ),
                    (
                        "review window",
                        format!(
                            "{} s after each delivery is committed (undisputed: paid when it ends)",
                            template.review_window_ms / 1000
                        ),
                    ),
                ])?;
                out!(
                    "the budget is locked in escrow on {} before any award",
                    l.network
                )?;
            }
            _ => out!(
                "this node keeps no ledger: the job is not settled (nothing is locked or paid)"
            )?,
        }
        if template.spot_check_ppm > 0 {
            let checkable: u64 = template
                .tasks
                .iter()
                .filter(|t| cannabis_market::spot::checkable(t))
                .map(|t| t.budget.0)
                .sum();
            let expected = u128::from(checkable) * u128::from(template.spot_check_ppm)
                / u128::from(cannabis_market::spot::PPM);
            out!(
                "spot checks: {:.1}% of delivered tasks re-run on another worker (a third when \
                 they disagree), each a job of its own: about {expected} more on average, at \
                 most {} (two re-runs of every checkable task), beyond this budget",
                f64::from(template.spot_check_ppm) / 10_000.0,
                2 * u128::from(checkable)
            )?;
        }
        if let Some(terms) = &template.evaluation {
            out!(
                "evaluated on this node once delivered: {} on {} held-out file(s) (never sent \
                 to workers), {} artifact check(s), {} metric(s); a pass {}, anything else \
                 disputes",
                terms.entrypoint.join(" "),
                terms.held_out.len(),
                terms.artifacts.len(),
                template.acceptance.len(),
                if terms.confirm {
                    "waits for `cannabis job accept`"
                } else {
                    "accepts"
                }
            )?;
        }
        print_explanations(&explained)?;
    }
    if dry_run {
        return Ok(());
    }
    if !yes {
        if json {
            anyhow::bail!("--json submits only with --yes (there is no one to ask)");
        }
        eprint!("publish this job? [y/N] ");
        std::io::stderr().flush().ok();
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            out!("not published")?;
            return Ok(());
        }
    }
    let job = client.submit_job(&template)?;
    if json {
        return output::json(&job);
    }
    out!(
        "published job {}; bids until the window ends, then placement.\n\
         Watch it with `cannabis job status {}`.",
        job.job_id,
        job.job_id
    )?;
    Ok(())
}

fn print_explanations(tasks: &[TaskExplanation]) -> anyhow::Result<()> {
    for t in tasks {
        let e = &t.explanation;
        out!(
            "task {}: {} of {} known workers qualify ({} needed){}",
            t.task,
            e.qualified.len(),
            e.considered,
            e.needed,
            if e.feasible() { "" } else { ": not enough" }
        )?;
        for x in &e.excluded {
            out!("  {}: {} excluded", x.text, x.excluded)?;
        }
    }
    Ok(())
}

/// An amount, or the note that a job's sums do not add up (a defect the node reports).
fn money(a: Option<cannabis_protocol::Amount>) -> String {
    a.map_or_else(|| "accounting error".to_string(), |a| a.to_string())
}

fn print_job(job: &JobDetail) -> anyhow::Result<()> {
    let s = &job.summary;
    output::table(&[
        ("job", s.job_id.clone()),
        ("name", s.name.clone()),
        ("state", format!("{:?}", s.state).to_lowercase()),
        (
            "budget",
            format!(
                "{} (used {}, refund {})",
                s.budget,
                money(s.used),
                money(job.refund)
            ),
        ),
    ])?;
    for (i, t) in job.tasks.iter().enumerate() {
        let status = t.status.to_string();
        out!(
            "\ntask {i} {}: {status}  (group {}, budget {}, committed {}, spent {}, {} bids, {} declined, attempt {})",
            t.name,
            t.group_size,
            t.budget,
            t.committed,
            t.spent,
            t.bids.len(),
            t.declines.len(),
            t.attempts
        )?;
        if t.confidential {
            out!(
                "  requires confidential execution: placed only on workers whose evidence \
                 verifies here (on a testnet, a dev attestation: INSECURE, it proves nothing)"
            )?;
        }
        for r in &t.ranks {
            let state = match r.state {
                LeaseState::Offered => "awarded",
                LeaseState::Current => "current",
                LeaseState::Done => "delivered",
                LeaseState::Ended => "ended",
            };
            let work = r.progress.as_ref().map_or(String::new(), |p| {
                if p.detail.is_empty() {
                    format!(", work {}", p.stage.name())
                } else {
                    format!(", work {}: {}", p.stage.name(), p.detail)
                }
            });
            let mut product = match &r.product {
                None => String::new(),
                Some(cannabis_market::job::ProductVerdict::Passed) => ", product checked".into(),
                Some(cannabis_market::job::ProductVerdict::Failed(why)) => {
                    format!(", product WRONG ({why}): disputed")
                }
            };
            if r.caught.is_some() {
                product.push_str(", WRONG by spot check: disputed");
            }
            let resumed = r.resume.as_ref().map_or(String::new(), |c| {
                format!(", resumed from a {}-byte checkpoint", c.size_bytes)
            });
            out!(
                "  rank {} {} epoch {} price {} {}{work}{product}{resumed}",
                r.rank,
                r.worker,
                r.epoch,
                r.price,
                state
            )?;
        }
        for (rank, c) in &t.checkpoints {
            out!(
                "  rank {rank} checkpoint kept: number {} of epoch {}, {} bytes, sha256 {}",
                c.seq,
                c.epoch,
                c.size_bytes,
                c.digest
            )?;
        }
        for x in &t.transfers {
            let eta = x.eta_secs.map_or("?".into(), |s| format!("{s} s"));
            out!(
                "  rank {} outputs arriving: {} of {} bytes, {} KiB/s, {eta} left",
                x.rank,
                x.bytes,
                x.total,
                x.rate_bps / 1024
            )?;
        }
        if let Some(check) = job.spot.checks.get(&(i as u32)) {
            use cannabis_market::spot::{RunResult, SpotVerdict};
            let verdict = match &check.verdict {
                None => "under way".to_string(),
                Some(SpotVerdict::Agreed) => "passed".to_string(),
                Some(SpotVerdict::Caught { run }) => format!("run {run} caught and disputed"),
                Some(SpotVerdict::Undecided(why)) => format!("undecided: {why}"),
            };
            out!("  spot check: {verdict}")?;
            for (n, r) in check.runs.iter().enumerate() {
                let what = match &r.result {
                    None => "running".to_string(),
                    Some(RunResult::Delivered { worker, .. }) => format!("delivered by {worker}"),
                    Some(RunResult::Failed(why)) => format!("failed: {why}"),
                };
                out!("    run {n} (job {}): {what}", r.job)?;
            }
        }
        if let Some(of) = &job.spot.of
            && i == 0
        {
            out!(
                "  a spot check of job {}'s task {} (run {})",
                of.job,
                of.task,
                of.run
            )?;
        }
        let mut ranks_told = Vec::new();
        for o in &t.delivered {
            // The run's figures are the rank's, told once before its outputs.
            if !ranks_told.contains(&o.rank) {
                ranks_told.push(o.rank);
                out!(
                    "  rank {} ran {:.1} s, cpu {:.1} s, peak memory {} MiB, exit {}",
                    o.rank,
                    o.wall_ms as f64 / 1000.0,
                    o.cpu_ms as f64 / 1000.0,
                    o.peak_memory_bytes >> 20,
                    o.exit_code
                        .map_or_else(|| "none".to_string(), |c| c.to_string())
                )?;
            }
            let state = if o.fetched { "here" } else { "fetching" };
            out!(
                "  rank {} output {} {} bytes sha256 {} ({state})",
                o.rank,
                o.name,
                o.size_bytes,
                o.digest
            )?;
        }
        for (w, why) in &t.declines {
            out!("  declined by {w}: {why}")?;
        }
        if let Some(e) = &t.explanation {
            out!(
                "  {} of {} known workers match ({} needed)",
                e.qualified.len(),
                e.considered,
                e.needed
            )?;
            for x in &e.excluded {
                out!("    {}: {} excluded", x.text, x.excluded)?;
            }
        }
    }
    print_evaluation(job)?;
    print_escrow(job)?;
    // Times relative to publication, then the last 30 events.
    let start = job.history.first().map(|e| e.at).unwrap_or_default();
    out!("\nhistory (seconds after publication):")?;
    for e in job.history.iter().rev().take(30).rev() {
        let task = e.task.map(|t| format!("task {t}: ")).unwrap_or_default();
        let ms = e.at.ms_since(start);
        out!("  {:>9}.{:03} {task}{}", ms / 1000, ms % 1000, e.text)?;
    }
    Ok(())
}

/// The job's evaluation: its terms, then the last run's report, criterion by criterion.
fn print_evaluation(job: &JobDetail) -> anyhow::Result<()> {
    let Some(terms) = &job.evaluation_terms else {
        return Ok(());
    };
    out!(
        "\nevaluation: evaluator {} ({}), {} held-out file(s), {} artifact check(s){}",
        terms.evaluator,
        terms.entrypoint.join(" "),
        terms.held_out.len(),
        terms.artifacts.len(),
        if terms.confirm {
            "; a pass waits for your confirmation"
        } else {
            ""
        }
    )?;
    let Some(e) = &job.evaluation else {
        out!("  not started: it runs once every task delivered")?;
        return Ok(());
    };
    if e.running {
        out!("  run {}: running", e.run)?;
        return Ok(());
    }
    let Some(r) = &e.report else {
        out!("  run {}: its report cannot be read", e.run)?;
        return Ok(());
    };
    let outcome = match r.outcome {
        cannabis_protocol::EvaluationOutcome::Passed => "passed",
        cannabis_protocol::EvaluationOutcome::Failed => "failed",
        cannabis_protocol::EvaluationOutcome::NotEvaluated => "not evaluated",
    };
    out!("  run {}: {outcome}: {}", e.run, r.reason)?;
    for c in &r.criteria {
        let (sign, value) = match c.value {
            Some(v) => (
                match c.comparison {
                    cannabis_protocol::Comparison::AtLeast => ">=",
                    cannabis_protocol::Comparison::AtMost => "<=",
                },
                v.to_string(),
            ),
            None => ("vs", "not reported".into()),
        };
        let mark = if c.passed { "pass" } else { "FAIL" };
        out!("    {mark}  {} {value} {sign} {}", c.metric, c.required)?;
    }
    if let Some(id) = &e.report_id {
        out!("  signed report {id} (the evidence of any dispute it opened; `--json` shows it)")?;
    }
    Ok(())
}

/// The job's escrow as the node's ledger holds it: the lock, each assignment's stage with
/// its review window's end, what was paid and refunded.
fn print_escrow(job: &JobDetail) -> anyhow::Result<()> {
    use cannabis_market::job::Escrowed;
    use cannabis_market::ledger::Stage;
    let Some(e) = &job.escrow else {
        let text = match job.escrowed {
            Escrowed::Unsettled => "not settled (this node keeps no ledger)",
            Escrowed::Locking => "the lock is on its way to a block; nothing is awarded before",
            Escrowed::Locked => "locked (the node's ledger has not applied it yet)",
        };
        out!("\nescrow: {text}")?;
        return Ok(());
    };
    let state = match e.refunded {
        Some(r) => format!("closed, {r} refunded"),
        None if e.cancelled => "cancelled, open until the delivered ranks settle".into(),
        None => "open".into(),
    };
    out!(
        "\nescrow: {} locked, {state}; paid {} to workers and {} in fees ({} to {})",
        e.locked,
        e.paid_worker,
        e.paid_fee,
        percent(e.fee.rate_bps),
        e.fee.recipient
    )?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    for ((task, rank), a) in &e.assignments {
        let stage = match &a.stage {
            Stage::Assigned => "assigned".to_string(),
            Stage::Delivered { at, .. } => {
                let ends = at.plus_ms(e.review_window_ms);
                let left = ends.0.saturating_sub(now) / 1000;
                format!("delivered; review window ends in {left} s, then it is paid")
            }
            Stage::Disputed { .. } => "disputed; frozen until the resolver settles it".into(),
            Stage::Settled {
                outcome,
                worker_paid,
                fee_paid,
            } => format!("settled ({outcome:?}): {worker_paid} to the worker, {fee_paid} fee"),
        };
        out!(
            "  task {task} rank {rank} epoch {} {} at {}: {stage}",
            a.epoch,
            a.worker,
            a.price
        )?;
    }
    Ok(())
}

/// The three lines a requester sees before accepting.
pub(super) fn print_quote(q: &Quote) -> std::io::Result<()> {
    let width = q.total.to_string().len();
    output::table(&[
        ("total budget", format!("{:>width$}", q.total)),
        ("worker share", format!("{:>width$}", q.worker_share)),
        (
            "service fee",
            format!("{:>width$}  ({})", q.fee, percent(q.fee_rate_bps)),
        ),
    ])
}

/// `100` bps -> `1.00%`.
pub(super) fn percent(bps: u16) -> String {
    format!("{}.{:02}%", bps / 100, bps % 100)
}
