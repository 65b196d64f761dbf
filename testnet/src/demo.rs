//! `cannabis testnet demo`: jobs going through the real system on a testnet of real node
//! processes, step by step, each step checked. A ledger sequencer, workers that differ in
//! cores and prices, and a requester (the last node) start in fresh data
//! directories; the requester takes a faucet grant and publishes: a synthetic job (offers,
//! bids, placement and why, the lease and its epoch, the run, the delivery and its
//! transfer, Freivalds' check of the product, acceptance and settlement with every balance
//! before and after), a rewarded proof-of-compute result proved in its block's
//! `compute_root`, the worked training example (trained on a worker, scored by the
//! requester's evaluator on held-out data, accepted and paid), a 3-rank group whose ranks
//! sum over their private channel, and a job whose worker is killed mid-run (its lease
//! lapses and the job is placed again, resuming from the checkpoint the requester kept,
//! paid once). Users' commands run as a user runs
//! them (the `cannabis` binary against a node's data directory) and their output is shown;
//! each step ends with checks of what the nodes hold, and the first that fails stops the
//! demo with an error naming it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use cannabis_api::{ApiClient, JobDetail};
use cannabis_market::job::{JobState, ProductVerdict};
use cannabis_market::ledger::{Escrow, Stage};
use cannabis_protocol::{EvaluationOutcome, Outcome, RunStage};

use crate::launcher::{self, Fault, Testnet, TestnetOptions};
use crate::scenario::wait;

/// How to run the demo.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// The `cannabis` binary.
    pub binary: PathBuf,
    /// A fresh directory for the testnet's data and the jobs' files.
    pub dir: PathBuf,
    /// Nodes (at least 5: the sequencer, the requester, and workers enough for a group of
    /// three and for a job to move when its worker is killed).
    pub nodes: usize,
}

/// The steps, in order.
pub const STEPS: [&str; 8] = [
    "a testnet of real node processes",
    "the requester's funds, from the faucet",
    "a synthetic job: bids, placement, lease, run, delivery, check, settlement",
    "a proof-of-compute result in a block, its inclusion proof checked",
    "the training example: trained on a worker, evaluated, accepted, paid",
    "a 3-rank group job over its private channel",
    "a worker killed mid-run: the lease lapses, the job is placed again and resumes from its checkpoint",
    "every node's ledger agrees",
];

/// The sandbox's `PATH`: where a job's `python3` is found.
const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

const SYNTHETIC: &str = r#"# The built-in synthetic task (seeded int8 matrix products), checked by the
# requester with Freivalds' method; accepted by hand.
name = "synthetic"
deadline = "5m"
bid_window = "2s"
review_window = "10m"

[[task]]
name = "matmul"
budget = 200_000
[task.workload]
adapter = "synthetic"
[task.resources]
cpu = 1
memory = "256MiB"
"#;

const GROUP: &str = r#"# Three ranks on three workers, started together, summing over their channel.
name = "all-reduce"
deadline = "5m"
bid_window = "3s"
review_window = "10s"

[early]
first_bids = 3

[[task]]
name = "sum"
budget = 900_000
group_size = 3
[task.workload]
adapter = "process"
bundle = "group.tar"
entrypoint = ["python3", "allreduce.py"]
[task.resources]
cpu = 1
memory = "128MiB"
storage = "8MiB"
[[task.outputs]]
name = "sum.txt"
max_size = "1KiB"
"#;

const COUNTER: &str = r#"# Counts to 16, a second a step: long enough to kill its worker mid-run.
# The count is its checkpoint, which the requester keeps; placed again, it goes on from it.
name = "counter"
deadline = "5m"
bid_window = "2s"
review_window = "5s"

[[task]]
name = "count"
budget = 100_000
checkpoint = { name = "count", max_size = "1KiB" }
[task.workload]
adapter = "process"
bundle = "counter.tar"
entrypoint = ["sh", "count.sh", "16"]
[task.resources]
cpu = 1
memory = "64MiB"
storage = "16MiB"
[[task.outputs]]
name = "out.txt"
max_size = "4KiB"
"#;

/// The counter's program: its count kept in `count`, written aside and renamed into place.
const COUNT_SH: &str = r#"n=0
if [ -f "$CANNABIS_WORK/count" ]; then
  n=$(cat "$CANNABIS_WORK/count")
  echo "resumed at $n on attempt $CANNABIS_ATTEMPT" >> "$CANNABIS_WORK/out.txt"
fi
while [ "$n" -lt "$1" ]; do
  n=$((n + 1))
  echo "$n" > "$CANNABIS_WORK/.count"
  mv "$CANNABIS_WORK/.count" "$CANNABIS_WORK/count"
  sleep 1
done
echo "counted to $n on attempt $CANNABIS_ATTEMPT" >> "$CANNABIS_WORK/out.txt"
"#;

/// What the demo checks before it starts anything: it runs requesters' programs in the
/// sandbox (root) and the training example needs numpy.
pub fn prerequisites() -> anyhow::Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "the demo runs requesters' programs in each worker's sandbox, which needs root \
         (per-attempt users, cgroups, namespaces): run it as root"
    );
    let numpy = Command::new("python3")
        .args(["-c", "import numpy"])
        .env("PATH", SANDBOX_PATH)
        .output()
        .is_ok_and(|o| o.status.success());
    ensure!(
        numpy,
        "the training example needs python3 with numpy on {SANDBOX_PATH} (Debian: apt-get \
         install python3-numpy)"
    );
    Ok(())
}

struct Demo<'a> {
    opts: &'a DemoOptions,
    net: Testnet,
    work: PathBuf,
    requester: usize,
    say: &'a mut dyn FnMut(&str),
}

/// Runs the demo: starts the testnet in `opts.dir`, runs every step (each line of what it
/// shows goes to `say`), and stops every node, whether the steps passed or not. Returns
/// how long each step took; fails at the first step that did not happen.
pub fn run(opts: &DemoOptions, say: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Duration>> {
    ensure!(opts.nodes >= 5, "the demo needs at least 5 nodes");
    prerequisites()?;
    let started = Instant::now();
    say(&format!(
        "\n== 1/{}: {} ({} nodes in {})",
        STEPS.len(),
        STEPS[0],
        opts.nodes,
        opts.dir.display()
    ));
    let net = Testnet::up(&TestnetOptions {
        binary: opts.binary.clone(),
        dir: opts.dir.join("net"),
        nodes: opts.nodes,
        ready_timeout: Duration::from_secs(60),
    })
    .context("step 1: starting the testnet")?;
    let work = opts.dir.join("jobs");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let mut demo = Demo {
        opts,
        // The last node: on a small machine it offers less than a core, so the workers
        // with a whole one (1 to 3) take the work.
        requester: opts.nodes - 1,
        net,
        work,
        say,
    };
    let mut took = Vec::new();
    for (i, title) in STEPS.iter().enumerate() {
        if i > 0 {
            (demo.say)(&format!("\n== {}/{}: {title}", i + 1, STEPS.len()));
        }
        let step = Instant::now();
        let r = match i {
            0 => demo.testnet(),
            1 => demo.funds(),
            2 => demo.synthetic(),
            3 => demo.proof_of_compute(),
            4 => demo.training(),
            5 => demo.group(),
            6 => demo.killed_worker(),
            _ => demo.ledgers_agree(),
        };
        r.with_context(|| format!("step {} ({title}) did not happen", i + 1))?;
        let took_s = if i == 0 { started } else { step }.elapsed();
        (demo.say)(&format!(
            "   ok: step {} in {:.1} s",
            i + 1,
            took_s.as_secs_f64()
        ));
        took.push(took_s);
    }
    demo.net.stop();
    Ok(took)
}

/// The escrow's own sums: what left it is what was locked.
fn balanced(e: &Escrow) -> anyhow::Result<u64> {
    let refunded = e.refunded.context("the escrow is still open")?.0;
    let out = e.paid_worker.0 + e.paid_fee.0 + refunded;
    ensure!(
        out == e.locked.0,
        "the escrow does not balance: {} to workers + {} in fees + {refunded} refunded != {} \
         locked",
        e.paid_worker.0,
        e.paid_fee.0,
        e.locked.0
    );
    Ok(refunded)
}

fn short(address: &str) -> String {
    if address.len() > 18 {
        format!("{}..{}", &address[..10], &address[address.len() - 6..])
    } else {
        address.to_string()
    }
}

impl Demo<'_> {
    fn data_dir(&self, node: usize) -> anyhow::Result<&Path> {
        self.net
            .nodes
            .get(node)
            .map(|n| n.data_dir.as_path())
            .with_context(|| format!("no node {node}"))
    }

    fn client(&self, node: usize) -> anyhow::Result<ApiClient> {
        ApiClient::from_data_dir(self.data_dir(node)?)
    }

    fn address(&self, node: usize) -> anyhow::Result<String> {
        Ok(self.client(node)?.status()?.address)
    }

    /// The node of the testnet whose account is `address`.
    fn node_of(&self, address: &str) -> anyhow::Result<usize> {
        (0..self.net.nodes.len())
            .find(|i| self.address(*i).is_ok_and(|a| a == address))
            .with_context(|| format!("{address} is no running node of the testnet"))
    }

    /// `cannabis --data-dir NODE ARGS`, run in the jobs' folder as a user runs it; shows
    /// the command and its output (unless `quiet`) and returns the output.
    fn cli(&mut self, node: usize, args: &[&str], quiet: bool) -> anyhow::Result<String> {
        let out = Command::new(&self.opts.binary)
            .arg("--data-dir")
            .arg(self.data_dir(node)?)
            .args(args)
            .current_dir(&self.work)
            .output()
            .context("running cannabis")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !quiet {
            (self.say)(&format!("   node-{node}$ cannabis {}", args.join(" ")));
            for line in text.lines() {
                (self.say)(&format!("     {line}"));
            }
        }
        ensure!(
            out.status.success(),
            "cannabis {} on node {node}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(text)
    }

    /// Publishes `file` (in the jobs' folder) from the requester, showing what `job
    /// submit` says: its id.
    fn submit(&mut self, file: &str) -> anyhow::Result<String> {
        self.cli(self.requester, &["job", "submit", file, "--dry-run"], false)?;
        let out = self.cli(
            self.requester,
            &["job", "submit", file, "--yes", "--json"],
            true,
        )?;
        let published: serde_json::Value =
            serde_json::from_str(&out).context("reading job submit's JSON")?;
        let id = published["job_id"]
            .as_str()
            .context("job submit printed no job id")?
            .to_string();
        (self.say)(&format!("   published {file} as job {id}"));
        Ok(id)
    }

    fn job(&self, id: &str) -> anyhow::Result<JobDetail> {
        self.client(self.requester)?.job(id)
    }

    /// Waits up to `secs` for the requester's view of job `id` to satisfy `holds`.
    fn wait_job(
        &self,
        id: &str,
        secs: u64,
        what: &str,
        holds: impl Fn(&JobDetail) -> bool,
    ) -> anyhow::Result<JobDetail> {
        let mut seen = String::new();
        wait(Duration::from_secs(secs), what, || {
            let j = self.job(id)?;
            if j.summary.state == JobState::Failed && !holds(&j) {
                let why = j.history.last().map(|e| e.text.clone()).unwrap_or_default();
                bail!("the job failed: {why}");
            }
            seen = j.history.last().map(|e| e.text.clone()).unwrap_or_default();
            Ok(holds(&j).then_some(j))
        })
        .map_err(|e| e.context(format!("last: {seen}")))
    }

    /// Balances of `who` (label, address) as the requester's node holds them.
    fn balances(&self, who: &[(String, String)]) -> anyhow::Result<Vec<u64>> {
        let client = self.client(self.requester)?;
        who.iter()
            .map(|(_, a)| Ok(client.balance(Some(a))?.balance.0))
            .collect()
    }

    fn show_balances(&mut self, who: &[(String, String)], before: &[u64], after: &[u64]) {
        (self.say)(&format!(
            "   {:<28} {:>20} {:>20} {:>12}",
            "account", "before", "after", "change"
        ));
        for (((label, _), b), a) in who.iter().zip(before).zip(after) {
            let change = *a as i128 - *b as i128;
            (self.say)(&format!("   {label:<28} {b:>20} {a:>20} {change:>+12}"));
        }
    }

    fn testnet(&mut self) -> anyhow::Result<()> {
        let converged = self.net.wait_converged(Duration::from_secs(120))?;
        (self.say)(&format!(
            "   up; every node held every other's capability ad {:.1} s later",
            converged.as_secs_f64()
        ));
        (self.say)(&format!(
            "   {:<5} {:<26} {:>5} {:>12} {:>14}   data dir",
            "node", "role", "cores", "memory", "per core-hour"
        ));
        let ads = self.client(self.requester)?.ads()?;
        for i in 0..self.net.nodes.len() {
            let role = if i == 0 {
                "ledger sequencer, worker"
            } else if i == self.requester {
                "requester (and a worker)"
            } else {
                "worker"
            };
            // What the node offers, from the owner's settings the testnet gave it.
            let dir = self.data_dir(i)?.to_path_buf();
            let config: toml::Value = toml::from_str(
                &std::fs::read_to_string(dir.join("node.toml"))
                    .with_context(|| format!("reading node {i}'s node.toml"))?,
            )?;
            let cpu = &config["executor"]["cpu"];
            let cpu = cpu
                .as_float()
                .or(cpu.as_integer().map(|c| c as f64))
                .unwrap_or_default();
            let memory = config["executor"]["memory"].as_str().unwrap_or("-");
            let price = config["owner"]["prices"]["cpu_core_hour"]
                .as_integer()
                .unwrap_or_default();
            (self.say)(&format!(
                "   {i:<5} {role:<26} {cpu:>5} {memory:>12} {price:>14}   {}",
                dir.display()
            ));
            let address = self.address(i)?;
            ensure!(
                i == self.requester
                    || ads
                        .iter()
                        .any(|a| a.node == address && !a.adapters.is_empty()),
                "the requester holds no ad of node {i} that takes work"
            );
        }
        self.cli(self.requester, &["ledger", "status"], false)?;
        Ok(())
    }

    fn funds(&mut self) -> anyhow::Result<()> {
        let me = self.address(self.requester)?;
        let before = self.balances(&[("requester".into(), me.clone())])?[0];
        self.cli(self.requester, &["wallet", "faucet", "--wait", "60"], false)?;
        let after = self.balances(&[("requester".into(), me)])?[0];
        ensure!(
            after > before,
            "the requester's balance did not grow ({before} -> {after})"
        );
        self.cli(self.requester, &["wallet", "balance"], false)?;
        Ok(())
    }

    fn synthetic(&mut self) -> anyhow::Result<()> {
        std::fs::write(self.work.join("synthetic.toml"), SYNTHETIC)?;
        let id = self.submit("synthetic.toml")?;
        // The offer as the workers hold it, gossiped to every node.
        let offered = wait(Duration::from_secs(30), "node 2 holding the offer", || {
            let offers = self.client(2)?.offers()?;
            Ok(offers.iter().any(|o| o.job_id == id).then_some(()))
        });
        offered?;
        self.cli(2, &["market", "offers"], false)?;
        let done = self.wait_job(&id, 120, "the synthetic job checked", |j| {
            j.summary.state == JobState::Completed
                && j.tasks[0]
                    .ranks
                    .iter()
                    .all(|r| r.product == Some(ProductVerdict::Passed))
        })?;
        let task = &done.tasks[0];
        let rank = task.ranks.first().context("no rank was placed")?;
        ensure!(!task.bids.is_empty(), "no bids were recorded");
        let mut bids: Vec<_> = task.bids.iter().map(|(w, p)| (p.0, w.clone())).collect();
        bids.sort();
        (self.say)(&format!(
            "   {} bids; placement takes the cheapest valid one (each price weighed by its \
             worker's strikes):",
            bids.len()
        ));
        for (price, worker) in &bids {
            let chosen = if *worker == rank.worker.to_string() {
                "  <- placed, leased at epoch 1"
            } else {
                ""
            };
            (self.say)(&format!("     {price:>8}  {}{chosen}", short(worker)));
        }
        ensure!(
            bids[0].0 == rank.price.0,
            "the placed price {} is not the cheapest bid {}",
            rank.price.0,
            bids[0].0
        );
        ensure!(rank.epoch == 1, "the lease is at epoch {}", rank.epoch);
        self.cli(self.requester, &["job", "status", &id], false)?;
        self.cli(
            self.requester,
            &["job", "results", &id, "--out", "synthetic-out", "--wait"],
            false,
        )?;
        ensure!(
            self.work.join("synthetic-out").read_dir()?.next().is_some(),
            "job results wrote nothing"
        );

        // Settlement: the requester accepts; every balance moves by exactly what the
        // escrow says.
        let worker = rank.worker.to_string();
        let e = self.client(self.requester)?.escrow(&id)?;
        let recipient = e.fee.recipient.to_string();
        let sequencer = self.client(self.requester)?.ledger()?.sequencer;
        let who = vec![
            (
                format!("requester (node {})", self.requester),
                self.address(self.requester)?,
            ),
            (
                format!("worker (node {})", self.node_of(&worker)?),
                worker.clone(),
            ),
            ("fee recipient".into(), recipient.clone()),
            ("sequencer (network fees)".into(), sequencer.clone()),
        ];
        // Each account's change is checked on its own where the roles are apart (on a
        // bigger machine the cheapest worker may be the sequencer); the sum always.
        let apart = who
            .iter()
            .map(|w| &w.1)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            == who.len();
        wait(Duration::from_secs(60), "the delivery committed", || {
            let e = self.client(self.requester)?.escrow(&id)?;
            Ok(e.assignments
                .values()
                .all(|a| matches!(a.stage, Stage::Delivered { .. }))
                .then_some(()))
        })?;
        let before = self.balances(&who)?;
        self.cli(self.requester, &["job", "accept", &id], false)?;
        let settled = self.wait_job(&id, 60, "the escrow closed", |j| {
            j.escrow.as_ref().is_some_and(Escrow::is_closed)
        })?;
        let e = settled.escrow.context("no escrow")?;
        let refunded = balanced(&e)?;
        let after = self.balances(&who)?;
        self.show_balances(&who, &before, &after);
        // One change per distinct account (a shared one counted once).
        let mut delta: Vec<i128> = Vec::new();
        let mut counted = std::collections::BTreeSet::new();
        for ((w, b), a) in who.iter().zip(&before).zip(&after) {
            let first = counted.insert(w.1.clone());
            delta.push(if first { *a as i128 - *b as i128 } else { 0 });
        }
        let price = rank.price.0;
        let fee = price * u64::from(e.fee.rate_bps) / 10_000;
        ensure!(
            e.paid_fee.0 == fee && e.paid_worker.0 == price - fee,
            "price {price} paid as {} to the worker and {} in fees",
            e.paid_worker.0,
            e.paid_fee.0
        );
        ensure!(
            !apart
                || (delta[1] == i128::from(e.paid_worker.0)
                    && delta[2] == i128::from(e.paid_fee.0)),
            "the worker got {} and the fee recipient {}, the escrow says {} and {}",
            delta[1],
            delta[2],
            e.paid_worker.0,
            e.paid_fee.0
        );
        // The requester gets the refund less the network fee of its acceptance, which the
        // sequencer gets.
        ensure!(
            !apart || (delta[0] + delta[3] == i128::from(refunded) && delta[3] >= 0),
            "the refund {refunded} does not match the requester's {} and the sequencer's {}",
            delta[0],
            delta[3]
        );
        ensure!(
            delta.iter().sum::<i128>() == i128::from(e.locked.0),
            "the changes do not add up to the {} that left the escrow",
            e.locked.0
        );
        (self.say)(&format!(
            "   balanced to the base unit: {} locked = {} to the worker + {} fee ({}%) + {} \
             refunded (the requester paid {} of network fees to the sequencer)",
            e.locked.0,
            e.paid_worker.0,
            e.paid_fee.0,
            f64::from(e.fee.rate_bps) / 100.0,
            refunded,
            delta[3]
        ));
        Ok(())
    }

    fn proof_of_compute(&mut self) -> anyhow::Result<()> {
        // A worker computes the task the newest block seeds for it; another node proves the
        // result's place in its block, and the sequencer checks that proof.
        let out = self.cli(1, &["ledger", "compute", "--size", "256", "--json"], true)?;
        let computed: serde_json::Value =
            serde_json::from_str(&out).context("reading ledger compute's JSON")?;
        let result = computed["result_id"]
            .as_str()
            .context("ledger compute printed no result id")?
            .to_string();
        (self.say)(&format!(
            "   node-1$ cannabis ledger compute --size 256\n     result {result}, in a block"
        ));
        let proof = self.work.join("proof.json");
        wait(Duration::from_secs(30), "node 2 holding the result", || {
            Ok(self
                .cli(
                    2,
                    &["ledger", "prove", &result, "--out", "proof.json"],
                    true,
                )
                .is_ok()
                .then_some(()))
        })?;
        ensure!(proof.exists(), "ledger prove wrote no proof");
        let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&proof)?)?;
        (self.say)(&format!(
            "   node-2$ cannabis ledger prove {result} --out proof.json\n     block {}, \
             leaf {} of {}, {} hashes on the path",
            p["height"],
            p["index"],
            p["compute_count"],
            p["path"].as_array().map_or(0, Vec::len)
        ));
        self.cli(0, &["ledger", "verify-proof", "proof.json"], false)?;
        if let Some(h) = p["height"].as_u64() {
            self.cli(0, &["ledger", "block", &h.to_string()], false)?;
        }
        Ok(())
    }

    fn training(&mut self) -> anyhow::Result<()> {
        let dir = self.work.join("train");
        std::fs::create_dir_all(&dir)?;
        let files = [
            (
                "job.toml",
                include_str!("../../docs/examples/numpy-train/job.toml"),
            ),
            (
                "data.py",
                include_str!("../../docs/examples/numpy-train/data.py"),
            ),
            (
                "train.py",
                include_str!("../../docs/examples/numpy-train/train.py"),
            ),
            (
                "evaluate.py",
                include_str!("../../docs/examples/numpy-train/evaluate.py"),
            ),
            (
                "make.sh",
                include_str!("../../docs/examples/numpy-train/make.sh"),
            ),
        ];
        for (name, text) in files {
            std::fs::write(dir.join(name), text)?;
        }
        (self.say)(
            "   $ sh train/make.sh   (the bundles and the held-out set, as docs/examples/numpy-train)",
        );
        let made = Command::new("sh")
            .arg("make.sh")
            .current_dir(&dir)
            .env("PATH", SANDBOX_PATH)
            .output()
            .context("running make.sh")?;
        ensure!(
            made.status.success(),
            "make.sh: {}",
            String::from_utf8_lossy(&made.stderr).trim()
        );
        let id = self.submit("train/job.toml")?;
        let done = self.wait_job(&id, 240, "the trained model evaluated and paid", |j| {
            j.escrow.as_ref().is_some_and(Escrow::is_closed)
        })?;
        self.cli(self.requester, &["job", "status", &id], false)?;
        let report = done
            .evaluation
            .as_ref()
            .and_then(|e| e.report.as_ref())
            .context("no evaluation report")?;
        ensure!(
            report.outcome == EvaluationOutcome::Passed,
            "the evaluation did not pass: {}",
            report.reason
        );
        let e = done.escrow.as_ref().context("no escrow")?;
        balanced(e)?;
        let paid = e.assignments.values().all(|a| {
            matches!(a.stage, Stage::Settled { outcome: Outcome::Accepted, worker_paid, .. }
                if worker_paid.0 == a.price.0 - a.price.0 * u64::from(e.fee.rate_bps) / 10_000)
        });
        ensure!(paid, "the trained model was not paid as accepted: {e:?}");
        Ok(())
    }

    fn group(&mut self) -> anyhow::Result<()> {
        pack(
            &self.work.join("group.tar"),
            &[
                ("allreduce.py", include_str!("../demo/allreduce.py")),
                ("sum.py", include_str!("../demo/sum.py")),
            ],
        )?;
        std::fs::write(self.work.join("group.toml"), GROUP)?;
        let id = self.submit("group.toml")?;
        let done = self.wait_job(&id, 180, "the group's three ranks done", |j| {
            j.summary.state == JobState::Completed
        })?;
        self.cli(self.requester, &["job", "status", &id], false)?;
        self.cli(
            self.requester,
            &["job", "results", &id, "--out", "group-out", "--wait"],
            false,
        )?;
        let ranks = &done.tasks[0].ranks;
        ensure!(ranks.len() == 3, "{} ranks were placed", ranks.len());
        let workers: std::collections::BTreeSet<_> = ranks.iter().map(|r| r.worker).collect();
        ensure!(workers.len() == 3, "the ranks share workers");
        for r in 0..3 {
            let file = self
                .work
                .join("group-out")
                .join(format!("rank-{r}"))
                .join("sum.txt");
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            (self.say)(&format!("   group-out/rank-{r}/sum.txt: {}", text.trim()));
            ensure!(
                text.trim() == format!("rank {r} of 3, rendezvous 10.29.0.1: sum 60"),
                "rank {r} wrote {text:?}"
            );
        }
        Ok(())
    }

    fn killed_worker(&mut self) -> anyhow::Result<()> {
        pack(&self.work.join("counter.tar"), &[("count.sh", COUNT_SH)])?;
        std::fs::write(self.work.join("counter.toml"), COUNTER)?;
        let id = self.submit("counter.toml")?;
        // Killed once the requester keeps a checkpoint of a few steps.
        let running = self.wait_job(&id, 120, "a checkpoint of the running job", |j| {
            j.tasks[0].checkpoints.get(&0).is_some_and(|c| c.seq >= 2)
                && j.tasks[0].ranks.iter().any(|a| {
                    a.progress
                        .as_ref()
                        .is_some_and(|p| p.stage == RunStage::Running)
                })
        })?;
        let kept = &running.tasks[0].checkpoints[&0];
        (self.say)(&format!(
            "   running; the requester keeps its checkpoint number {} ({} bytes, sha256 {})",
            kept.seq, kept.size_bytes, kept.digest
        ));
        let first = running.tasks[0].ranks[0].worker.to_string();
        let victim = self.node_of(&first)?;
        ensure!(
            victim != self.requester,
            "the requester's own node ran the job"
        );
        let pid = launcher::fault(&self.net.dir, victim, Fault::Kill)?;
        (self.say)(&format!(
            "   $ cannabis testnet kill {victim}   (its worker, mid-run: pid {pid} killed)"
        ));
        (self.say)("   waiting for its lease to lapse (a lease runs 60 s between renewals) ...");
        let replaced = self.wait_job(&id, 150, "the job placed again", |j| {
            j.tasks[0].ranks.iter().any(|a| a.epoch > 1)
        })?;
        let second = replaced.tasks[0].ranks[0].worker.to_string();
        ensure!(second != first, "placed again on the killed worker");
        let now_on = self.node_of(&second)?;
        let pinned = replaced.tasks[0].ranks[0]
            .resume
            .clone()
            .context("the new award pins no checkpoint")?;
        (self.say)(&format!(
            "   placed again at epoch {} on node {now_on}, its award pinning checkpoint {}",
            replaced.tasks[0].ranks[0].epoch, pinned.digest
        ));
        let info = launcher::restart(
            &self.net.dir,
            &self.opts.binary,
            victim,
            Duration::from_secs(60),
        )?;
        (self.say)(&format!(
            "   $ cannabis testnet restart {victim}   (back as pid {}; its stale epoch 1 \
             delivers nothing)",
            info.pid
        ));
        let paid = self.wait_job(&id, 120, "the job completed and paid", |j| {
            j.escrow.as_ref().is_some_and(Escrow::is_closed)
        })?;
        self.cli(self.requester, &["job", "status", &id], false)?;
        let out = paid.tasks[0]
            .delivered
            .iter()
            .find(|d| d.name == "out.txt")
            .context("no out.txt delivered")?;
        let text =
            std::fs::read_to_string(&out.path).with_context(|| format!("reading {}", out.path))?;
        for line in text.lines() {
            (self.say)(&format!("   out.txt: {line}"));
        }
        let resumed: u32 = text
            .lines()
            .find_map(|l| l.strip_prefix("resumed at "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .context("the new worker did not resume from the checkpoint")?;
        ensure!(
            resumed >= 2 && text.contains("counted to 16"),
            "out.txt: {text:?}"
        );
        let e = paid.escrow.as_ref().context("no escrow")?;
        balanced(e)?;
        ensure!(
            e.assignments.len() == 1,
            "{} assignments in the escrow",
            e.assignments.len()
        );
        let a = e.assignments.values().next().context("no assignment")?;
        ensure!(
            a.epoch >= 2 && a.worker.to_string() == second,
            "the escrow paid epoch {} of {}",
            a.epoch,
            a.worker
        );
        ensure!(
            matches!(a.stage, Stage::Settled { worker_paid, .. } if worker_paid.0 > 0),
            "the new worker was not paid: {:?}",
            a.stage
        );
        ensure!(
            e.paid_worker.0 + e.paid_fee.0 <= a.price.0,
            "paid more than one price"
        );
        Ok(())
    }

    fn ledgers_agree(&mut self) -> anyhow::Result<()> {
        let height = wait(
            Duration::from_secs(60),
            "every ledger at one height",
            || {
                let mut tips = BTreeMap::new();
                for i in 0..self.net.nodes.len() {
                    let l = self.client(i)?.ledger()?;
                    tips.insert(i, (l.height, l.tip));
                }
                let first = tips.get(&0).cloned().context("no node 0")?;
                Ok(tips.values().all(|t| *t == first).then_some(first.0))
            },
        )?;
        (self.say)(&format!(
            "   all {} nodes hold the same chain: height {height}",
            self.net.nodes.len()
        ));
        self.cli(self.requester, &["ledger", "blocks", "--limit", "6"], false)?;
        Ok(())
    }
}

/// Writes `files` into a tar at `out` (each at the archive's root).
fn pack(out: &Path, files: &[(&str, &str)]) -> anyhow::Result<()> {
    let file = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut tar = tar::Builder::new(file);
    for (name, text) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(text.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, name, text.as_bytes())
            .with_context(|| format!("packing {name}"))?;
    }
    tar.into_inner()?.sync_all()?;
    Ok(())
}
