//! Scenarios: a file of steps and assertions run against a testnet of real processes
//! (`cannabis testnet scenario FILE`). Steps act as a user and a researcher would: submit a
//! job from a node (the `cannabis` binary, as a requester runs it), kill, restart, pause
//! or resume a node, split and heal the network, wait. Assertions wait up to their
//! `within` for what they name to hold, and each prints pass or fail. The format is in
//! docs/testnet-guide.md.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use cannabis_api::{ApiClient, JobDetail};
use cannabis_market::job::JobState;
use cannabis_market::ledger::Stage;
use cannabis_protocol::RunStage;
use cannabis_protocol::units::parse_duration_ms;
use serde::Deserialize;

use crate::launcher::{self, Fault};

/// A scenario file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// What it shows.
    pub name: String,
    /// Nodes of the testnet it runs on.
    #[serde(default = "four")]
    pub nodes: usize,
    /// The steps, in order.
    #[serde(rename = "step")]
    pub steps: Vec<Step>,
}

fn four() -> usize {
    4
}

/// A node, by index, as the worker holding a job's first rank (`"worker of NAME"`), or
/// as the node a `kill` (`pause`) step acted on last (`"last killed"`, `"last paused"`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum NodeRef {
    /// By index.
    Index(usize),
    /// `"worker of NAME"`.
    Named(String),
}

/// One step.
#[derive(Debug, Deserialize)]
#[serde(tag = "do", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Step {
    /// Wait until `node` knows `count` nodes that take work.
    WaitWorkers {
        /// The node.
        node: usize,
        /// How many.
        count: usize,
    },
    /// `cannabis job submit FILE --yes` on `node`; the job is then called `name`.
    Submit {
        /// The node.
        node: usize,
        /// The job file, relative to the scenario file.
        job: PathBuf,
        /// The job's name in later steps.
        name: String,
        /// Directories (relative to the scenario file) packed first into `DIR.tar` beside
        /// them, for the job file's `bundle = "DIR.tar"`.
        #[serde(default)]
        tar: Vec<PathBuf>,
    },
    /// Kill a node (`testnet kill`).
    Kill {
        /// The node.
        node: NodeRef,
    },
    /// Start a node again (`testnet restart`).
    Restart {
        /// The node.
        node: NodeRef,
    },
    /// Pause a node (`testnet pause`).
    Pause {
        /// The node.
        node: NodeRef,
    },
    /// Resume a paused node (`testnet resume`).
    Resume {
        /// The node.
        node: NodeRef,
    },
    /// Split the network (`testnet partition`).
    Partition {
        /// The groups of node indices.
        groups: Vec<Vec<usize>>,
    },
    /// Heal the network (`testnet heal`).
    Heal,
    /// Make a node deliver wrong outputs, or right ones again with `off` (`testnet
    /// corrupt`).
    Corrupt {
        /// The node.
        node: NodeRef,
        /// Honest again.
        #[serde(default)]
        off: bool,
    },
    /// Make a node's links slow and lossy (`testnet slow`); zero for both: plain again.
    Slow {
        /// The node.
        node: NodeRef,
        /// Added delay (`300ms`; default none).
        #[serde(default)]
        delay: Option<String>,
        /// Share of the received data lost, 0 to 1 (default 0).
        #[serde(default)]
        loss: f64,
    },
    /// Wait.
    Sleep {
        /// How long (`2s`).
        #[serde(rename = "for")]
        time: String,
    },
    /// Assert that job `name`, as its requester sees it, reaches `state` within `within`.
    ExpectJob {
        /// The job.
        job: String,
        /// `placed`, `running`, `completed`, `failed`, `settled` (its escrow closed),
        /// `paid` (every rank settled with a payment), `disputed`, `replaced` (a rank's
        /// epoch above 1: it was placed again).
        state: String,
        /// How long it may take (default 60s).
        #[serde(default)]
        within: Option<String>,
    },
    /// Assert that `node` is connected to `peers` peers within `within`.
    ExpectPeers {
        /// The node.
        node: usize,
        /// How many.
        peers: usize,
        /// How long it may take (default 30s).
        #[serde(default)]
        within: Option<String>,
    },
    /// Assert that every node's ledger reaches the same height, at least `at_least`,
    /// within `within`.
    ExpectLedger {
        /// The least height.
        #[serde(default)]
        at_least: u64,
        /// How long it may take (default 30s).
        #[serde(default)]
        within: Option<String>,
    },
}

/// What a run found: each step's line and whether it passed.
#[derive(Debug, Default, serde::Serialize)]
pub struct Report {
    /// `(step, passed, what)`, in order.
    pub steps: Vec<(usize, bool, String)>,
}

impl Report {
    /// Whether every step passed.
    pub fn passed(&self) -> bool {
        self.steps.iter().all(|s| s.1)
    }
}

impl Scenario {
    /// Reads a scenario file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let s: Scenario =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        anyhow::ensure!(s.nodes >= 1, "{}: nodes must be at least 1", path.display());
        Ok(s)
    }
}

struct Run<'a> {
    binary: &'a Path,
    dir: &'a Path,
    base: &'a Path,
    nodes: Vec<PathBuf>,
    jobs: BTreeMap<String, (usize, String)>,
    last_killed: Option<usize>,
    last_paused: Option<usize>,
}

/// Runs `scenario` (read from a file in `base`) on the testnet recorded in `dir`, calling
/// `print` with each step's line as it ends. Stops at the first step that fails.
pub fn run(
    scenario: &Scenario,
    base: &Path,
    binary: &Path,
    dir: &Path,
    nodes: Vec<PathBuf>,
    mut print: impl FnMut(usize, bool, &str),
) -> Report {
    let mut run = Run {
        binary,
        dir,
        base,
        nodes,
        jobs: BTreeMap::new(),
        last_killed: None,
        last_paused: None,
    };
    let mut report = Report::default();
    for (i, step) in scenario.steps.iter().enumerate() {
        let n = i + 1;
        let (ok, what) = match run.step(step) {
            Ok(what) => (true, what),
            Err(e) => (false, format!("{e:#}")),
        };
        print(n, ok, &what);
        report.steps.push((n, ok, what));
        if !ok {
            break;
        }
    }
    report
}

fn within(v: &Option<String>, default_s: u64) -> anyhow::Result<Duration> {
    Ok(match v {
        Some(v) => Duration::from_millis(parse_duration_ms(v).map_err(|e| anyhow::anyhow!("{e}"))?),
        None => Duration::from_secs(default_s),
    })
}

/// Waits up to `limit` for `check` to say `Some`, polling every 200 ms; the last `Err`
/// or `None` explains a timeout.
pub(crate) fn wait<T>(
    limit: Duration,
    what: &str,
    mut check: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let until = Instant::now() + limit;
    loop {
        let last = match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => String::new(),
            Err(e) => format!(" ({e:#})"),
        };
        if Instant::now() > until {
            bail!("{what}: not within {limit:?}{last}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Run<'_> {
    fn client(&self, node: usize) -> anyhow::Result<ApiClient> {
        let dir = self
            .nodes
            .get(node)
            .with_context(|| format!("no node {node}"))?;
        ApiClient::from_data_dir(dir)
    }

    fn job(&self, name: &str) -> anyhow::Result<(JobDetail, usize)> {
        let (node, id) = self
            .jobs
            .get(name)
            .with_context(|| format!("no job called {name:?} was submitted before"))?;
        Ok((self.client(*node)?.job(id)?, *node))
    }

    fn node(&self, r: &NodeRef) -> anyhow::Result<usize> {
        match r {
            NodeRef::Index(i) => Ok(*i),
            NodeRef::Named(text) if text == "last killed" => {
                self.last_killed.context("no node was killed before")
            }
            NodeRef::Named(text) if text == "last paused" => {
                self.last_paused.context("no node was paused before")
            }
            NodeRef::Named(text) => {
                let name = text
                    .strip_prefix("worker of ")
                    .with_context(|| format!("{text:?}: a node index or \"worker of NAME\""))?;
                let (job, _) = self.job(name)?;
                let worker = job
                    .tasks
                    .first()
                    .and_then(|t| t.ranks.first())
                    .map(|a| a.worker.to_string())
                    .with_context(|| format!("job {name} has no worker yet"))?;
                (0..self.nodes.len())
                    .find(|i| {
                        self.client(*i)
                            .and_then(|c| c.status())
                            .is_ok_and(|s| s.address == worker)
                    })
                    .with_context(|| format!("{worker} is no running node of this testnet"))
            }
        }
    }

    fn step(&mut self, step: &Step) -> anyhow::Result<String> {
        match step {
            Step::WaitWorkers { node, count } => {
                let client = self.client(*node)?;
                wait(Duration::from_secs(60), "workers known", || {
                    let ads = client.get::<Vec<cannabis_api::Ad>>("/v1/market/ads")?;
                    Ok(
                        (ads.iter().filter(|a| !a.adapters.is_empty()).count() >= *count)
                            .then_some(()),
                    )
                })?;
                Ok(format!("node {node} knows {count} workers"))
            }
            Step::Submit {
                node,
                job,
                name,
                tar,
            } => {
                for dir in tar {
                    pack(&self.base.join(dir))?;
                }
                let file = self.base.join(job);
                let data_dir = self
                    .nodes
                    .get(*node)
                    .with_context(|| format!("no node {node}"))?;
                let out = Command::new(self.binary)
                    .arg("--data-dir")
                    .arg(data_dir)
                    .args(["job", "submit"])
                    .arg(&file)
                    .args(["--yes", "--json"])
                    .output()
                    .context("running cannabis job submit")?;
                if !out.status.success() {
                    bail!(
                        "job submit {}: {}",
                        file.display(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
                let published: serde_json::Value = serde_json::from_slice(&out.stdout)?;
                let id = published["job_id"]
                    .as_str()
                    .context("job submit printed no job id")?
                    .to_string();
                self.jobs.insert(name.clone(), (*node, id.clone()));
                Ok(format!("node {node} submitted {name:?} ({id})"))
            }
            Step::Kill { node } => {
                let i = self.node(node)?;
                let pid = launcher::fault(self.dir, i, Fault::Kill)?;
                self.last_killed = Some(i);
                Ok(format!("node {i} killed (pid {pid})"))
            }
            Step::Pause { node } => {
                let i = self.node(node)?;
                launcher::fault(self.dir, i, Fault::Pause)?;
                self.last_paused = Some(i);
                Ok(format!("node {i} paused"))
            }
            Step::Resume { node } => {
                let i = self.node(node)?;
                launcher::fault(self.dir, i, Fault::Resume)?;
                Ok(format!("node {i} resumed"))
            }
            Step::Restart { node } => {
                let i = self.node(node)?;
                let info = launcher::restart(self.dir, self.binary, i, Duration::from_secs(60))?;
                Ok(format!("node {i} started again (pid {})", info.pid))
            }
            Step::Partition { groups } => {
                launcher::partition(self.dir, groups)?;
                Ok(format!("partitioned {groups:?}"))
            }
            Step::Heal => {
                launcher::heal(self.dir)?;
                Ok("healed".into())
            }
            Step::Corrupt { node, off } => {
                let i = self.node(node)?;
                launcher::corrupt(self.dir, i, !off)?;
                Ok(if *off {
                    format!("node {i} delivers its real outputs again")
                } else {
                    format!("node {i} delivers wrong outputs")
                })
            }
            Step::Slow { node, delay, loss } => {
                let i = self.node(node)?;
                let ms = match delay {
                    Some(d) => parse_duration_ms(d).map_err(|e| anyhow::anyhow!("{e}"))?,
                    None => 0,
                };
                anyhow::ensure!((0.0..=1.0).contains(loss), "loss is a share from 0 to 1");
                launcher::slow(self.dir, i, ms, (loss * 1e6).round() as u32)?;
                Ok(format!(
                    "node {i}: {ms} ms of delay, {:.2}% loss",
                    loss * 100.0
                ))
            }
            Step::Sleep { time } => {
                let ms = parse_duration_ms(time).map_err(|e| anyhow::anyhow!("{e}"))?;
                std::thread::sleep(Duration::from_millis(ms));
                Ok(format!("slept {time}"))
            }
            Step::ExpectJob {
                job,
                state,
                within: w,
            } => {
                let limit = within(w, 60)?;
                let holds = job_holds(state)?;
                let mut seen = String::new();
                let r = wait(limit, &format!("job {job} {state}"), || {
                    let (j, _) = self.job(job)?;
                    let last = j.history.last().map(|e| e.text.as_str()).unwrap_or("");
                    seen = format!("{:?} ({last})", j.summary.state).to_lowercase();
                    Ok(holds(&j).then_some(()))
                });
                r.map_err(|e| e.context(format!("last seen {seen}")))?;
                Ok(format!("job {job:?} is {state}"))
            }
            Step::ExpectPeers {
                node,
                peers,
                within: w,
            } => {
                let client = self.client(*node)?;
                wait(
                    within(w, 30)?,
                    &format!("node {node} with {peers} peers"),
                    || Ok((client.status()?.connected_peers == *peers).then_some(())),
                )?;
                Ok(format!("node {node} has {peers} peers"))
            }
            Step::ExpectLedger {
                at_least,
                within: w,
            } => {
                let height = wait(within(w, 30)?, "the ledgers agree", || {
                    let heights = (0..self.nodes.len())
                        .map(|i| Ok(self.client(i)?.ledger()?.height))
                        .collect::<anyhow::Result<Vec<u64>>>()?;
                    let h = heights[0];
                    Ok((h >= *at_least && heights.iter().all(|x| *x == h)).then_some(h))
                })?;
                Ok(format!("every node's ledger is at block {height}"))
            }
        }
    }
}

/// Packs the files of `dir` into `dir.tar`, at the archive's root (where an entrypoint
/// finds them). Written beside it and renamed into place, so that scenarios run at once
/// never read a half-written archive (they write the same bytes).
fn pack(dir: &Path) -> anyhow::Result<()> {
    let out = dir.with_extension("tar");
    let tmp = dir.with_extension(format!("tar.{}.tmp", std::process::id()));
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut tar = tar::Builder::new(file);
    tar.append_dir_all(".", dir)
        .with_context(|| format!("packing {}", dir.display()))?;
    tar.into_inner()?.sync_all()?;
    std::fs::rename(&tmp, &out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// What `state` means of a job.
fn job_holds(state: &str) -> anyhow::Result<fn(&JobDetail) -> bool> {
    fn ranks(j: &JobDetail) -> impl Iterator<Item = &cannabis_market::job::Assignment> {
        j.tasks.iter().flat_map(|t| t.ranks.iter())
    }
    Ok(match state {
        "placed" => |j| ranks(j).next().is_some(),
        "running" => |j| {
            ranks(j).any(|a| {
                a.progress
                    .as_ref()
                    .is_some_and(|p| p.stage == RunStage::Running)
            })
        },
        "replaced" => |j| ranks(j).any(|a| a.epoch > 1),
        "completed" => |j| j.summary.state == JobState::Completed,
        "failed" => |j| j.summary.state == JobState::Failed,
        "settled" => |j| j.escrow.as_ref().is_some_and(|e| e.is_closed()),
        "paid" => |j| {
            j.escrow.as_ref().is_some_and(|e| {
                e.is_closed()
                    && !e.assignments.is_empty()
                    && e.assignments.values().all(|a| {
                        matches!(a.stage, Stage::Settled { worker_paid, .. } if worker_paid.0 > 0)
                    })
            })
        },
        "disputed" => |j| {
            j.escrow.as_ref().is_some_and(|e| {
                e.assignments
                    .values()
                    .any(|a| matches!(a.stage, Stage::Disputed { .. }))
            })
        },
        "caught" => |j| {
            j.spot.checks.values().any(|c| {
                matches!(
                    c.verdict,
                    Some(cannabis_market::spot::SpotVerdict::Caught { .. })
                )
            })
        },
        other => bail!(
            "{other:?} is not a job state a scenario knows: placed, running, replaced, \
             completed, failed, settled, paid, disputed, caught"
        ),
    })
}
