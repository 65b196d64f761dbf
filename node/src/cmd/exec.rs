//! `cannabis exec` (local runs, the benchmark, the synthetic task) and the owner's
//! `cannabis node jobs | pause | drain | stop | resume | cancel | retry | clear | output`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_api::ApiClient;
use cannabis_market::spec::{JobSpec, Source};
use cannabis_node::api::exec::{ControlBody, ExecStatus, RetryBody};
use cannabis_node::store::Store;
use cannabis_protocol::{Digest, TaskInput};
use cannabis_runtime::exec::{
    Attempt, AttemptRequest, AttemptState, Chunk, Cleanup, Control, Executor, LimitsFile, Renewal,
    describe_exit, layer_name,
};

use crate::cli::{ExecCommand, ExecRunArgs};
use crate::output::{self, out};

mod bench;

pub(super) fn run(
    command: ExecCommand,
    data_dir: impl Fn() -> anyhow::Result<PathBuf>,
) -> anyhow::Result<()> {
    match command {
        ExecCommand::Run(args) => exec_run(&args, data_dir),
        ExecCommand::Bench { runs, size, format } => bench::run(runs, size, format.json),
        ExecCommand::BenchSynthetic {
            sizes,
            runs,
            format,
        } => bench::synthetic(&sizes, runs, format.json),
        ExecCommand::Synthetic {
            seed,
            size,
            out,
            product,
        } => {
            let seed: Digest = seed.parse().context("--seed")?;
            let (result, bytes) = cannabis_runtime::exec::run_synthetic(seed, size)
                .map_err(|e| anyhow::anyhow!(e))?;
            if let Some(product) = product {
                std::fs::write(&product, bytes)
                    .with_context(|| format!("writing {}", product.display()))?;
            }
            std::fs::write(&out, serde_json::to_vec_pretty(&result)?)
                .with_context(|| format!("writing {}", out.display()))?;
            Ok(())
        }
        ExecCommand::Rank { restarts, command } => {
            let var = |name: &str| std::env::var(name).ok();
            let number = |name: &str, default: u32| -> anyhow::Result<u32> {
                var(name).map_or(Ok(default), |v| {
                    v.parse()
                        .with_context(|| format!("{name} {v:?} is not a number"))
                })
            };
            let ranks = cannabis_runtime::restart::Ranks {
                rank: number("RANK", 0)?,
                world: number("WORLD_SIZE", 1)?,
                master: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                restarts,
                command,
            };
            std::process::exit(cannabis_runtime::restart::supervise(&ranks))
        }
    }
}

/// Where attempts and their outputs come from: a private executor or the node's API.
trait AttemptSource {
    fn attempt(&self, id: &str) -> anyhow::Result<Attempt>;
    fn chunk(&self, id: &str, name: &str, offset: u64) -> anyhow::Result<Chunk>;
}

impl AttemptSource for Executor {
    fn attempt(&self, id: &str) -> anyhow::Result<Attempt> {
        Ok(self.get(id)?)
    }
    fn chunk(&self, id: &str, name: &str, offset: u64) -> anyhow::Result<Chunk> {
        Ok(self.read_output(id, name, offset, cannabis_runtime::exec::MAX_CHUNK)?)
    }
}

impl AttemptSource for ApiClient {
    fn attempt(&self, id: &str) -> anyhow::Result<Attempt> {
        self.get(&format!("/v1/exec/attempts/{id}"))
    }
    fn chunk(&self, id: &str, name: &str, offset: u64) -> anyhow::Result<Chunk> {
        self.get(&format!(
            "/v1/exec/attempts/{id}/output/{name}?offset={offset}"
        ))
    }
}

fn exec_run(
    args: &ExecRunArgs,
    data_dir: impl Fn() -> anyhow::Result<PathBuf>,
) -> anyhow::Result<()> {
    let request = build_request(args)?;
    // The node's key, when there is one, signs a synthetic task's ComputeResult.
    let keys = data_dir().ok().and_then(|d| {
        let paths = cannabis_node::keystore::KeyPaths::new(&d);
        paths
            .node
            .exists()
            .then(|| cannabis_node::keystore::load(&paths).ok())
            .flatten()
    });
    let signer = keys.as_ref().map(|k| &k.signing);
    if args.on_node {
        let client = ApiClient::from_data_dir(&data_dir()?)?;
        let attempt: Attempt = client.post("/v1/exec/attempts", &request)?;
        if args.detach || attempt.refused {
            return finish(&client, attempt, args, true, signer);
        }
        return follow(&client, &attempt.id, args, signer);
    }
    // A private executor with its own journal, in a scratch directory that sandbox users
    // can reach.
    // Created exclusively (mkdtemp): nobody can have planted it.
    let scratch = tempfile::Builder::new()
        .prefix("cannabis-exec-")
        .tempdir()
        .context("creating a scratch directory")?
        .keep();
    let result = (|| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o711))?;
        let store = Arc::new(Store::open(&scratch.join("exec.redb"))?);
        let (owner, cdi_map) = match &args.config {
            Some(path) => {
                let c = cannabis_node::NodeConfig::from_file(path)?;
                (c.executor, c.owner.cdi_map)
            }
            None => (LimitsFile::default(), None),
        };
        let gpus = cannabis_runtime::probe::gpus(&cannabis_runtime::gpu::Nvml, &[], None)
            .1
            .into_iter()
            .map(|g| g.uuid)
            .collect();
        let machine = cannabis_node::exec::machine_limits(&scratch, gpus);
        let ceilings = cannabis_node::exec::ceilings_path(args.ceilings.as_deref());
        let ex = cannabis_node::exec::open(
            &scratch.join("exec"),
            &machine,
            &ceilings,
            &owner,
            cdi_map.as_deref(),
            store,
            None,
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        if !args.format.json {
            let layers: Vec<String> = ex.layers().iter().map(|l| layer_name(*l)).collect();
            out!("sandbox layers in effect: {}", layers.join(", "))?;
            out!("cgroups: {}", ex.cgroups())?;
        }
        let attempt = ex.submit(request)?;
        let r = if attempt.refused {
            finish(&ex, attempt, args, true, signer)
        } else {
            follow(&ex, &attempt.id, args, signer)
        };
        ex.shutdown();
        r
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// Builds the request for one task of the job file: local files by path, a synthetic seed.
fn build_request(args: &ExecRunArgs) -> anyhow::Result<AttemptRequest> {
    let file = &args.file;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the job file {}", file.display()))?;
    let spec = JobSpec::parse(&text).with_context(|| format!("in {}", file.display()))?;
    let base = file.parent().unwrap_or(Path::new(".")).to_path_buf();
    let template = spec
        .resolve(|p| super::job::hash_file(&base.join(p)))
        .map_err(|(field, e)| e.context(format!("{}: {field}", file.display())))?;
    let index = match &args.task {
        Some(name) => spec
            .tasks
            .iter()
            .position(|d| &d.task.name == name)
            .with_context(|| format!("{} has no task {name:?}", file.display()))?,
        None if spec.tasks.len() == 1 => 0,
        None => anyhow::bail!(
            "{} has {} tasks; choose one with --task ({})",
            file.display(),
            spec.tasks.len(),
            spec.tasks
                .iter()
                .map(|d| d.task.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let draft = &spec.tasks[index];
    let task = template.tasks[index].clone();
    let bundle = match &draft.bundle {
        Source::Path(p) => Some(base.join(p)),
        Source::Digest { .. } if task.workload.adapter.runs_a_bundle() => {
            anyhow::bail!(
                "the bundle is pinned by digest only; exec run needs the file (bundle = \"path\")"
            )
        }
        Source::Digest { .. } => None,
    };
    let mut given = Vec::new();
    for pair in &args.inputs {
        let (name, path) = pair
            .split_once('=')
            .with_context(|| format!("--input {pair:?}: write NAME=PATH"))?;
        given.push((name.to_string(), PathBuf::from(path)));
    }
    let mut inputs = Vec::new();
    for (at, input) in task.inputs.iter().enumerate() {
        let name = match input {
            TaskInput::Staged(r) => r.name.clone(),
            TaskInput::FromTask { name, .. } => name.clone(),
        };
        let from_file = draft.inputs.iter().find_map(|(i, s)| match s {
            Source::Path(p) if *i == at => Some(base.join(p)),
            _ => None,
        });
        let path = given
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| p.clone())
            .or(from_file)
            .with_context(|| {
                format!("input {name:?} has no local file: pass --input {name}=PATH")
            })?;
        inputs.push((name, path));
    }
    let seed = match &args.seed {
        Some(s) => Some(s.parse::<Digest>().context("--seed")?),
        None => Some(Digest::of_parts(&[
            b"cannabis exec run",
            &super::now_ms().to_le_bytes(),
            &std::process::id().to_le_bytes(),
        ])),
    };
    let now = super::now_ms();
    Ok(AttemptRequest {
        request_id: args
            .request_id
            .clone()
            .unwrap_or_else(|| format!("local-{now}-{}", std::process::id())),
        task,
        bundle: bundle
            .map(|b| std::path::absolute(&b))
            .transpose()
            .context("resolving the bundle path")?,
        inputs: inputs
            .into_iter()
            .map(|(n, p)| std::path::absolute(&p).map(|p| (n, p)))
            .collect::<Result<_, _>>()
            .context("resolving input paths")?,
        seed,
        lease_until_ms: now + 15_000,
        renewal: Renewal::Local,
        env: Vec::new(),
        loopback: false,
        hold: false,
        resume: None,
        checkpoint_to: None,
    })
}

/// Prints the attempt's history as it happens, until its cleanup has ended.
fn follow(
    source: &dyn AttemptSource,
    id: &str,
    args: &ExecRunArgs,
    signer: Option<&cannabis_protocol::Keypair>,
) -> anyhow::Result<()> {
    let mut shown = 0;
    let started = Instant::now();
    loop {
        let a = source.attempt(id)?;
        if !args.format.json {
            for (at, what) in a.history.iter().skip(shown) {
                let t0 = a.history.first().map_or(*at, |h| h.0);
                out!("{:>8.3} s  {what}", at.saturating_sub(t0) as f64 / 1e3)?;
            }
        }
        shown = a.history.len();
        if a.state.is_final() && a.cleanup != Cleanup::Pending {
            return finish(source, a, args, false, signer);
        }
        let _ = started;
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn finish(
    source: &dyn AttemptSource,
    a: Attempt,
    args: &ExecRunArgs,
    history: bool,
    signer: Option<&cannabis_protocol::Keypair>,
) -> anyhow::Result<()> {
    let mut saved = Vec::new();
    if a.state.is_final() && !a.refused {
        let dir = args.out.join(&a.id);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut names = vec!["stdout".to_string(), "stderr".to_string()];
        if let Some(exit) = &a.exit {
            names.extend(exit.outputs.iter().map(|o| o.name.clone()));
        }
        for name in names {
            let path = dir.join(&name);
            if copy_output(source, &a.id, &name, &path).is_ok() {
                saved.push(path);
            }
        }
    }
    // A synthetic result goes into a ComputeResult, signed by this node's key if it has one.
    let compute = match (&a.result, signer) {
        (Some(r), Some(keys)) => {
            let task_id = cannabis_protocol::Uuid::from_random(
                Digest::of(a.request.request_id.as_bytes()).0[..16]
                    .try_into()
                    .unwrap_or([0; 16]),
            );
            let c =
                cannabis_protocol::ComputeResult::signed(keys, task_id, r.result_hash, None, None);
            c.verify().context("the compute result does not verify")?;
            Some(c)
        }
        _ => None,
    };
    if args.format.json {
        output::json(&serde_json::json!({ "attempt": a, "compute_result": compute }))?;
    } else {
        if history {
            for (_, what) in &a.history {
                out!("{what}")?;
            }
        }
        print_attempt(&a)?;
        match (&compute, &a.result) {
            (Some(c), _) => out!(
                "compute    result {} signed by {} (verifies)",
                c.result_hash,
                c.worker_address
            )?,
            (None, Some(_)) => out!("compute    unsigned: no node keys in the data directory")?,
            _ => {}
        }
        for p in &saved {
            out!("saved      {}", p.display())?;
        }
    }
    match a.state {
        AttemptState::Completed => Ok(()),
        AttemptState::Reserved | AttemptState::Preparing | AttemptState::Running => {
            out!(
                "attempt {} admitted; follow it with `cannabis node jobs {}`",
                a.id,
                a.id
            )?;
            Ok(())
        }
        s => anyhow::bail!(
            "attempt {} {}: {}",
            a.id,
            s.name(),
            a.reason.as_deref().unwrap_or("no reason recorded")
        ),
    }
}

/// Copies an output to `to` in bounded chunks, resuming at `to`'s current length.
fn copy_output(source: &dyn AttemptSource, id: &str, name: &str, to: &Path) -> anyhow::Result<u64> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(to)
        .with_context(|| format!("opening {}", to.display()))?;
    let mut offset = file.metadata()?.len();
    loop {
        let chunk = source.chunk(id, name, offset)?;
        file.write_all(&chunk.data)?;
        offset = chunk.next_offset;
        if chunk.data.is_empty() || offset >= chunk.size {
            return Ok(offset);
        }
    }
}

fn print_attempt(a: &Attempt) -> anyhow::Result<()> {
    let mut rows = vec![
        ("attempt", a.id.clone()),
        ("request", a.request.request_id.clone()),
        (
            "task",
            format!(
                "{} ({})",
                a.request.task.name,
                cannabis_runtime::exec::kind_name(a.request.task.workload.adapter)
            ),
        ),
        ("state", a.status_line()),
    ];
    if let Some(r) = &a.reason {
        rows.push(("reason", r.clone()));
    }
    if let Cleanup::Quarantined { why } = &a.cleanup {
        rows.push(("quarantined", why.clone()));
    }
    if let Some((_, why)) = &a.cancel {
        rows.push(("stop", why.clone()));
    }
    if !a.layers.is_empty() {
        let layers: Vec<String> = a.layers.iter().map(|l| layer_name(*l)).collect();
        rows.push(("sandbox", layers.join(", ")));
    }
    if let Some(exit) = &a.exit {
        rows.push(("exit", describe_exit(exit)));
        if exit.started {
            rows.push((
                "ran",
                format!("{} ms", exit.ended_at_ms.saturating_sub(exit.started_at_ms)),
            ));
        }
        rows.push((
            "stdout",
            format!(
                "{} bytes ({} dropped over the cap)",
                exit.stdout.kept, exit.stdout.dropped
            ),
        ));
        for o in &exit.outputs {
            rows.push((
                "output",
                format!("{} {} bytes sha256 {}", o.name, o.size, o.sha256),
            ));
        }
        for (name, why) in &exit.refused_outputs {
            rows.push(("refused", format!("{name}: {why}")));
        }
    }
    if let Some(r) = &a.result {
        rows.push((
            "result",
            format!("n = {}, seed {}, hash {}", r.n, r.seed, r.result_hash),
        ));
    }
    if let Some(r) = &a.reservation {
        rows.push((
            "reserved",
            format!(
                "{} millicores, {} MiB memory, {} processes, {} MiB storage, uid {}{}",
                r.cpu_millicores,
                r.memory_bytes >> 20,
                r.processes,
                r.storage_bytes >> 20,
                r.uid,
                if r.gpus.is_empty() {
                    String::new()
                } else {
                    format!(", GPUs {}", r.gpus.join(" "))
                }
            ),
        ));
    }
    if let Some(of) = &a.retry_of {
        rows.push(("retry of", of.clone()));
    }
    output::table(&rows)?;
    Ok(())
}

pub(super) fn jobs(data_dir: &Path, id: Option<&str>, json: bool) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    if let Some(id) = id {
        let a: Attempt = client.get(&format!("/v1/exec/attempts/{id}"))?;
        if json {
            return output::json(&a);
        }
        print_attempt(&a)?;
        for (at, what) in &a.history {
            out!("  {}  {what}", at)?;
        }
        return Ok(());
    }
    let status: ExecStatus = client.get("/v1/exec")?;
    if let Some(why) = &status.unavailable {
        if json {
            return output::json(&status);
        }
        out!("no executor: {why}")?;
        return Ok(());
    }
    let attempts: Vec<Attempt> = client.get("/v1/exec/attempts")?;
    let orphans: Vec<cannabis_runtime::exec::Orphan> = client.get("/v1/exec/orphans")?;
    if json {
        return output::json(&serde_json::json!({
            "executor": status,
            "attempts": attempts,
            "leftovers": orphans,
        }));
    }
    out!(
        "executor {} ({}); sandbox: {}",
        status.control.map_or("?", Control::name),
        status
            .mode
            .as_ref()
            .map_or_else(|| "?".to_string(), cannabis_node::exec::ExecMode::describe),
        status.layers.join(", ")
    )?;
    out!(
        "{:<12} {:<22} {:<10} {:<24} reason",
        "attempt",
        "request",
        "adapter",
        "state"
    )?;
    for a in &attempts {
        out!(
            "{:<12} {:<22} {:<10} {:<24} {}",
            a.id,
            truncate(&a.request.request_id, 22),
            cannabis_runtime::exec::kind_name(a.request.task.workload.adapter),
            a.status_line(),
            a.reason.as_deref().unwrap_or("")
        )?;
    }
    for o in &orphans {
        out!(
            "{:<12} {:<22} {:<10} {:<24} found {} with no journal record; clear after checking",
            o.name,
            "-",
            "-",
            "unknown, quarantined",
            o.found.join(" and ")
        )?;
    }
    out!("{} attempts", attempts.len())?;
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

/// `cannabis node limits FILE`: the owner's new limits, checked against the ceilings by
/// the executor (in the node or its supervisor).
pub(super) fn limits(data_dir: &Path, file: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let limits =
        LimitsFile::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let client = ApiClient::from_data_dir(data_dir)?;
    let status: ExecStatus = client.post("/v1/exec/limits", &limits)?;
    let Some(l) = status.limits else {
        anyhow::bail!("no executor: {}", status.unavailable.unwrap_or_default());
    };
    out!(
        "the owner's limits are now: cpu {} cores, memory {} MiB, processes {}, storage {} MiB, gpus [{}], custom code {} (kept across restarts)",
        l.cpu_millicores as f64 / 1000.0,
        l.memory_bytes >> 20,
        l.processes,
        l.storage_bytes >> 20,
        l.gpus.join(", "),
        if l.custom_code { "allowed" } else { "refused" }
    )?;
    Ok(())
}

pub(super) fn control(data_dir: &Path, control: Control) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    let status: ExecStatus = client.post("/v1/exec/control", &ControlBody { control })?;
    let what = match control {
        Control::Active => "resumed: taking work",
        Control::Paused => "paused: no new starts; running work goes on",
        Control::Draining => "draining: current work finishes, nothing new is taken",
        Control::Stopped => {
            "stopped: every stop recorded, current work killed; nothing new is taken"
        }
    };
    out!("{what} (kept across restarts)")?;
    if let Some(r) = status.reserved {
        out!(
            "held now: {} millicores, {} MiB memory, {} processes",
            r.cpu_millicores,
            r.memory_bytes >> 20,
            r.processes
        )?;
    }
    Ok(())
}

pub(super) fn cancel(data_dir: &Path, id: &str) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    let a: Attempt = client.post(&format!("/v1/exec/attempts/{id}/stop"), &())?;
    out!("{} {}", a.id, a.status_line())?;
    Ok(())
}

pub(super) fn retry(data_dir: &Path, id: &str) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    let request_id = format!("{id}-retry-{}", super::now_ms());
    let a: Attempt = client.post(
        &format!("/v1/exec/attempts/{id}/retry"),
        &RetryBody { request_id },
    )?;
    out!("retrying {id} as {} ({})", a.id, a.status_line())?;
    Ok(())
}

pub(super) fn clear(data_dir: &Path, id: &str) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    let _: serde_json::Value = client.post(&format!("/v1/exec/attempts/{id}/clear"), &())?;
    out!("{id}: no process left, storage removed; released")?;
    Ok(())
}

pub(super) fn output(
    data_dir: &Path,
    id: &str,
    name: &str,
    offset: u64,
    to: Option<&Path>,
) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    match to {
        Some(path) => {
            let end = copy_output(&client, id, name, path)?;
            out!("{} bytes of {name} in {}", end, path.display())?;
        }
        None => {
            let mut offset = offset;
            let mut stdout = std::io::stdout().lock();
            loop {
                let chunk = client.chunk(id, name, offset)?;
                stdout.write_all(&chunk.data)?;
                offset = chunk.next_offset;
                if chunk.data.is_empty() || offset >= chunk.size {
                    break;
                }
            }
        }
    }
    Ok(())
}
