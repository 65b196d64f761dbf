//! `JobOffer`: a requester's budgeted offer, gossiped to every node.

use serde::{Deserialize, Serialize};

use super::{AdapterKind, Collective, GpuVendor, IsolationLayer, wire};
use crate::{
    Address, Amount, BPS_DENOMINATOR, DeliveryRecipient, Digest, FeeTerms, Fixed, Invalid, Message,
    Timestamp, Uuid,
};

/// Most tasks one offer may hold.
pub const MAX_TASKS: usize = 256;
/// Most ranks of one group task.
pub const MAX_GROUP_SIZE: u32 = 1024;

/// The most restarts a task may ask for.
pub const MAX_RESTARTS: u32 = 16;

/// A job's id: the first 16 bytes of `SHA-256("cannabis/job-id/v1" || 0x00 || the
/// requester's 32-byte public key || nonce)`, with the version 4 and variant bits set. A
/// job id names one requester's job: another key cannot sign an offer carrying it.
pub fn job_id_of(requester: &Address, nonce: &Uuid) -> Uuid {
    let d = Digest::of_parts(&[
        b"cannabis/job-id/v1",
        &[0],
        requester.public_key(),
        &nonce.0,
    ]);
    let mut id = [0u8; 16];
    id.copy_from_slice(&d.0[..16]);
    Uuid::from_random(id)
}

/// A budgeted job offer. A single job is one task; several tasks form a task graph whose
/// dependencies point only to earlier tasks (so it is acyclic by construction).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct JobOffer {
    /// The job's id: [`job_id_of`] the requester and the nonce, so that nobody but the
    /// requester can make an offer with it.
    pub job_id: Uuid,
    /// The requester's nonce, chosen at random.
    pub nonce: Uuid,
    /// The requester; must be the signer.
    pub requester: Address,
    /// Per-requester sequence number (replay protection).
    pub seq: u64,
    /// When the offer was made.
    pub issued_at: Timestamp,
    /// Bids are taken until then; the offer is dropped after.
    pub expires_at: Timestamp,
    /// Results are due by then.
    pub deadline: Timestamp,
    /// The requester's age recipient: outputs are encrypted to it.
    pub delivery: DeliveryRecipient,
    /// Total budget in base units, fee included. Equals the sum of the task budgets.
    pub budget: Amount,
    /// Fee terms pinned for this job.
    pub fee: FeeTerms,
    /// How long the requester has to accept or dispute a delivery, in milliseconds;
    /// undisputed deliveries become payable when it ends.
    pub review_window_ms: u64,
    /// Metrics a delivery must meet to be accepted.
    pub acceptance: Vec<AcceptanceMetric>,
    /// How the requester evaluates the deliveries against `acceptance`, if it does.
    pub evaluation: Option<super::EvaluationTerms>,
    /// The tasks, in an order where every dependency comes first.
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<TaskSpec>(), 0..4)"
        )
    )]
    pub tasks: Vec<TaskSpec>,
    /// How each task calls for bids (one per task, in task order): which matching workers
    /// are drawn to bid. See [`crate::draw`].
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<crate::draw::BidCall>(), 0..4)"
        )
    )]
    pub calls: Vec<crate::draw::BidCall>,
}

/// One task of a job: placed, leased and paid on its own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct TaskSpec {
    /// Name, unique within the job.
    pub name: String,
    /// What to run.
    pub workload: Workload,
    /// Inputs, staged read-only.
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<TaskInput>(), 0..8)"
        )
    )]
    pub inputs: Vec<TaskInput>,
    /// Declared outputs; nothing else can be read back.
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<OutputDecl>(), 0..8)"
        )
    )]
    pub outputs: Vec<OutputDecl>,
    /// Resources each rank needs.
    pub resources: Resources,
    /// Hardware and runtime requirements each rank's worker must meet.
    pub requirements: Requirements,
    /// Number of workers that run the task together (1 for a single worker).
    pub group_size: u32,
    /// Indices of earlier tasks this one needs.
    pub depends_on: Vec<u32>,
    /// This task's share of the budget.
    pub budget: Amount,
    /// How often its ranks may be restarted, all together, after one fails (0 to 16):
    /// each restart resumes from what the ranks left in their work directories. Left out
    /// of the encoding when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restarts: u32,
    /// A file each rank keeps its progress in, in its work directory, which the worker
    /// sends the requester, encrypted, whenever it changes, and which a rank placed again
    /// (on any worker) finds where it left it. Left out of the encoding when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<OutputDecl>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The workload of a task, pinned by digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Workload {
    /// Executor adapter.
    pub adapter: AdapterKind,
    /// SHA-256 of the program bundle or image; checked before anything runs.
    pub digest: Digest,
    /// Command and arguments inside the bundle.
    pub entrypoint: Vec<String>,
}

/// A staged input, pinned by digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct InputRef {
    /// File name inside the input directory.
    pub name: String,
    /// SHA-256 of the content.
    pub digest: Digest,
    /// Size in bytes.
    pub size_bytes: u64,
}

/// Where a task input comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum TaskInput {
    /// Supplied by the requester, pinned by digest.
    Staged(InputRef),
    /// An output of an earlier task; its digest is pinned in the lease once that task
    /// delivered.
    FromTask {
        /// Index of the producing task (must be in `depends_on`).
        task: u32,
        /// The output's declared name there.
        output: String,
        /// File name inside this task's input directory.
        name: String,
    },
}

/// A declared output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct OutputDecl {
    /// File name in the work directory.
    pub name: String,
    /// Largest accepted size in bytes.
    pub max_bytes: u64,
    /// Rights the requester gets.
    pub rights: OutputRights,
}

/// The output every synthetic task delivers besides any it declares: its result, as
/// JSON (seed, dimension and the product's digest), at most 4 KiB.
pub const SYNTHETIC_RESULT: &str = "result.json";
/// The other output every synthetic task delivers: the product `C` itself, its entries as
/// little-endian `i32`, row-major (`4 n^2` bytes), so that the requester checks it against
/// the result's hash and with Freivalds' method instead of recomputing it.
pub const SYNTHETIC_PRODUCT: &str = "product.i32";
/// A synthetic task's dimension when its entrypoint names none.
pub const SYNTHETIC_DEFAULT_N: u32 = 256;

impl TaskSpec {
    /// The outputs a rank of this task delivers, with their size caps: the declared ones
    /// in order, then, for a synthetic task, [`SYNTHETIC_RESULT`] (4,096 bytes) and
    /// [`SYNTHETIC_PRODUCT`] (`4 n^2` bytes), each unless declared.
    pub fn delivered_outputs(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .outputs
            .iter()
            .map(|o| (o.name.clone(), o.max_bytes))
            .collect();
        if self.workload.adapter == AdapterKind::Synthetic {
            let product = self.synthetic_n().map_or(0, |n| 4 * u64::from(n).pow(2));
            for (name, max) in [(SYNTHETIC_RESULT, 4096), (SYNTHETIC_PRODUCT, product)] {
                if !out.iter().any(|(n, _)| n == name) {
                    out.push((name.into(), max));
                }
            }
        }
        out
    }

    /// The dimension a synthetic task asks for: `entrypoint = ["<n>"]`, or
    /// [`SYNTHETIC_DEFAULT_N`].
    pub fn synthetic_n(&self) -> Result<u32, String> {
        match self.workload.entrypoint.as_slice() {
            [] => Ok(SYNTHETIC_DEFAULT_N),
            [n] => {
                let n: u32 = n
                    .parse()
                    .map_err(|_| format!("synthetic entrypoint {n:?} is not a matrix size"))?;
                crate::synthetic::SyntheticTask::new(crate::Digest([0; 32]), n)
                    .map(|t| t.n)
                    .map_err(|e| e.to_string())
            }
            more => Err(format!(
                "the synthetic adapter takes at most one argument, the matrix size; got {more:?}"
            )),
        }
    }
}

/// Rights over an output, part of the accepted terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum OutputRights {
    /// The requester gets exclusive rights; the worker keeps no copy after delivery.
    Exclusive,
    /// The requester may use it; the worker may keep a copy but not publish it.
    Shared,
    /// Anyone may use it.
    Public,
}

/// Resources one rank requests; admission reserves them before anything runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Resources {
    /// CPU in thousandths of a core.
    pub cpu_millicores: u32,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Swap in bytes.
    pub swap_bytes: u64,
    /// Most processes (and threads) at once.
    pub processes: u32,
    /// Work-directory size in bytes.
    pub storage_bytes: u64,
    /// Whole GPUs.
    pub gpus: u32,
}

/// What a worker must have to take a task.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Requirements {
    /// GPU vendor, if GPUs are requested.
    pub gpu_vendor: Option<GpuVendor>,
    /// Least memory per GPU, in bytes.
    pub min_gpu_memory_bytes: u64,
    /// Runtimes with least versions.
    pub runtimes: Vec<RuntimeRequirement>,
    /// Collectives the group needs.
    pub collectives: Vec<Collective>,
    /// Isolation layers that must be enforced.
    pub isolation: Vec<IsolationLayer>,
    /// Whether verified confidential execution is required.
    pub confidential: bool,
    /// Oldest acceptable passed capability challenge, in milliseconds; `None` if not needed.
    pub max_challenge_age_ms: Option<u64>,
    /// Verifiers whose challenge passes count; empty means any node but the worker itself.
    pub challenge_verifiers: Vec<Address>,
}

/// A runtime and its least version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct RuntimeRequirement {
    /// Runtime name, as in [`super::Runtime::name`].
    pub name: String,
    /// Least version (dotted numbers compare numerically).
    pub min_version: String,
}

/// An acceptance metric from the agreed terms.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct AcceptanceMetric {
    /// Metric name as the evaluator reports it.
    pub name: String,
    /// How the value is compared with the threshold.
    pub comparison: Comparison,
    /// Threshold, fixed-point with six decimals; with a baseline, the improvement on it
    /// that is required.
    pub threshold: Fixed,
    /// The stated baseline the metric must improve on, if any
    /// ([`AcceptanceMetric::required`]).
    pub baseline: Option<Fixed>,
}

/// Comparison of a metric with its threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum Comparison {
    /// value >= threshold
    AtLeast,
    /// value <= threshold
    AtMost,
}

impl Comparison {
    /// Whether `value` passes against `threshold`.
    pub fn passes(self, value: Fixed, threshold: Fixed) -> bool {
        match self {
            Comparison::AtLeast => value >= threshold,
            Comparison::AtMost => value <= threshold,
        }
    }
}

/// Whether `name` is usable as a file name inside a sandbox directory: 1 to 255 bytes of
/// `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn is_safe_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn check_unique<'a>(
    field: &'static str,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<(), Invalid> {
    let mut seen = std::collections::BTreeSet::new();
    for n in names {
        if !is_safe_name(n) {
            return Err(Invalid::new(
                field,
                format!("{n:?} is not a safe name (use 1-255 of A-Z a-z 0-9 . _ -)"),
            ));
        }
        if !seen.insert(n) {
            return Err(Invalid::new(field, format!("{n:?} appears twice")));
        }
    }
    Ok(())
}

impl JobOffer {
    fn validate_task(&self, index: usize, task: &TaskSpec) -> Result<(), Invalid> {
        if task.group_size == 0 || task.group_size > MAX_GROUP_SIZE {
            return Err(Invalid::new("tasks.group_size", "must be 1 to 1024"));
        }
        if task.restarts > MAX_RESTARTS {
            return Err(Invalid::new("tasks.restarts", "must be 0 to 16"));
        }
        let mut deps = std::collections::BTreeSet::new();
        for &d in &task.depends_on {
            if d as usize >= index {
                return Err(Invalid::new(
                    "tasks.depends_on",
                    format!("task {index} depends on task {d}, which does not come before it"),
                ));
            }
            if !deps.insert(d) {
                return Err(Invalid::new(
                    "tasks.depends_on",
                    format!("task {index} lists task {d} twice"),
                ));
            }
        }
        check_unique(
            "tasks.outputs.name",
            task.outputs.iter().map(|o| o.name.as_str()),
        )?;
        if let Some(c) = &task.checkpoint {
            if !is_safe_name(&c.name) {
                return Err(Invalid::new(
                    "tasks.checkpoint.name",
                    "not a plain file name",
                ));
            }
            let clash = task
                .outputs
                .iter()
                .map(|o| o.name.as_str())
                .chain(task.inputs.iter().map(|i| match i {
                    TaskInput::Staged(r) => r.name.as_str(),
                    TaskInput::FromTask { name, .. } => name.as_str(),
                }));
            for name in clash {
                if name == c.name {
                    return Err(Invalid::new(
                        "tasks.checkpoint.name",
                        format!("{name:?} names an output or an input of the task"),
                    ));
                }
            }
        }
        check_unique(
            "tasks.inputs.name",
            task.inputs.iter().map(|i| match i {
                TaskInput::Staged(r) => r.name.as_str(),
                TaskInput::FromTask { name, .. } => name.as_str(),
            }),
        )?;
        for input in &task.inputs {
            if let TaskInput::FromTask {
                task: from, output, ..
            } = input
            {
                if !deps.contains(from) {
                    return Err(Invalid::new(
                        "tasks.inputs",
                        format!("task {index} reads from task {from} without depending on it"),
                    ));
                }
                let producer = &self.tasks[*from as usize];
                if !producer.outputs.iter().any(|o| &o.name == output) {
                    return Err(Invalid::new(
                        "tasks.inputs",
                        format!("task {from} declares no output {output:?}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

wire!(JobOffer, "job offer", 60 * 1024);

impl Message for JobOffer {
    const DOMAIN: &'static str = "cannabis/job-offer/v1";

    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.requester)
    }

    fn validate(&self) -> Result<(), Invalid> {
        if self.job_id != job_id_of(&self.requester, &self.nonce) {
            return Err(Invalid::new(
                "job_id",
                "is not derived from the requester and the nonce",
            ));
        }
        if self.expires_at <= self.issued_at {
            return Err(Invalid::new("expires_at", "must be after issued_at"));
        }
        if self.deadline <= self.expires_at {
            return Err(Invalid::new("deadline", "must be after expires_at"));
        }
        if self.fee.rate_bps > BPS_DENOMINATOR {
            return Err(Invalid::new("fee.rate_bps", "must be at most 10000"));
        }
        if self.tasks.is_empty() || self.tasks.len() > MAX_TASKS {
            return Err(Invalid::new("tasks", "must hold 1 to 256 tasks"));
        }
        if self.calls.len() != self.tasks.len() {
            return Err(Invalid::new(
                "calls",
                format!(
                    "holds {} calls for {} tasks (one per task)",
                    self.calls.len(),
                    self.tasks.len()
                ),
            ));
        }
        if self.calls.iter().any(|c| c.odds_ppb == 0) {
            return Err(Invalid::new(
                "calls.odds_ppb",
                "must be above 0 (no worker could bid)",
            ));
        }
        check_unique("tasks.name", self.tasks.iter().map(|t| t.name.as_str()))?;
        if self.acceptance.len() > super::MAX_EVALUATION_ITEMS {
            return Err(Invalid::new(
                "acceptance",
                format!("more than {} metrics", super::MAX_EVALUATION_ITEMS),
            ));
        }
        if let Some(terms) = &self.evaluation {
            terms.validate(
                self.tasks
                    .iter()
                    .flat_map(|t| t.outputs.iter().map(|o| o.name.as_str())),
            )?;
        }
        for (i, task) in self.tasks.iter().enumerate() {
            self.validate_task(i, task)?;
        }
        let sum = Amount::sum(self.tasks.iter().map(|t| &t.budget))
            .map_err(|_| Invalid::new("tasks.budget", "task budgets overflow"))?;
        if sum != self.budget {
            return Err(Invalid::new(
                "budget",
                format!("is {} but the task budgets add up to {sum}", self.budget),
            ));
        }
        Ok(())
    }
}
