//! The requester's side of one job: bids in, placement, leases out, renewals, retries,
//! cancellation and the task graph, with the budget tracked per task.
//!
//! [`Job`] is a sans-IO state machine: every input carries the time, and it answers with
//! [`Action`]s (awards, renewals and cancellations for the node to sign and send, and when
//! to call [`Job::tick`] next). It holds these invariants, which the property tests and the
//! testnet simulation check:
//!
//! - each assignment (task, rank) has at most one live lease, and every award for it
//!   carries a higher epoch than the one before (the fencing token);
//! - a task never commits or spends more than its budget: a retry re-places only within
//!   `budget - spent - committed`, and every change of those sums is checked arithmetic;
//! - every job ends in a defined state, at the latest at its deadline.
//!
//! A lease starts short: an award expires `award_timeout_ms` after it is issued unless the
//! worker countersigns and the requester renews it. So a worker that never answered holds
//! nothing by the time the assignment is retried elsewhere. The requester counts a lease
//! as extended only when the worker acknowledged the renewal ([`Job::on_renewed`]): a
//! worker that went away lets its lease run out on both sides, and the task is retried.
//! A group's first renewals wait until every rank holds its lease (at most
//! [`GROUP_RENEWAL_WAIT_MS`], and never more than a third of the award's time): while the
//! group assembles, the requester's work goes to the awards and acceptances still open, and
//! the renewals then go out together.
//!
//! Placement waits for the end of the bid window unless the job asks to be placed early
//! ([`Early`]): as soon as enough acceptable bids are in.

use std::collections::{BTreeMap, BTreeSet};

use cannabis_protocol::{
    Address, Amount, Award, Bid, Cancel, Decline, DeliveryManifest, Digest, Evaluation,
    EvaluationOutcome, JobOffer, LeaseAccept, LeaseRenewal, MoneyError, NamedDigest,
    PublicKeyBytes, Received, Rendezvous, Resume, RosterEntry, RunReport, RunStage, SignatureBytes,
    Signed, TaskInput, Timestamp, Uuid, message_id,
};
use serde::{Deserialize, Serialize};

use crate::spot::SpotChecks;

mod parts;

pub use parts::{Head, Part, PartsError};

use crate::Refusal;
use crate::placement::{self, Candidate, Class, Infeasible, Slot};

/// How long a rank of a group that is still assembling waits for its first renewal.
pub const GROUP_RENEWAL_WAIT_MS: u64 = 2_000;

/// Most times a task's bids are called for again, its call already open to every worker,
/// once its window ended without a whole placement: no worker answered at all though the
/// requester knew of enough that qualify (a late bid still counts), or the bids ran out
/// after an attempt (every bidder refused as busy, failed or never countersigned). A task
/// whose workers answered only by declining, or that too few known workers could take,
/// fails at once, saying why. Each such version's window is twice the one before (while
/// the deadline allows), and the task is placed as soon as a whole placement is in.
pub const MAX_RECALLS: u32 = 5;

/// Timing of leases.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeaseConfig {
    /// How long a worker has to countersign an award.
    pub award_timeout_ms: u64,
    /// How far each renewal extends a lease.
    pub lease_ms: u64,
    /// Renew when this little is left.
    pub renew_margin_ms: u64,
    /// Most runs of one task that may fail after their leases became current. Awards a
    /// worker refused or never countersigned do not count: each sets that worker aside,
    /// so they end when the bids run out (and the bids are called for again at most
    /// [`MAX_RECALLS`] times).
    pub max_attempts: u32,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            award_timeout_ms: 15_000,
            lease_ms: 60_000,
            renew_margin_ms: 30_000,
            max_attempts: 3,
        }
    }
}

/// When a task is placed before its bid window ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Early {
    /// As soon as this many valid bids are in (at least the group size): the cheapest
    /// placement among them is taken.
    FirstBids(u32),
    /// As soon as a whole placement can be made of bids at or below this price per rank.
    PriceAtMost(Amount),
}

/// What the node does for a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Sign and send this award to its worker.
    Award(Award),
    /// Sign and send this renewal to its worker.
    Renew(LeaseRenewal),
    /// Sign and send this cancellation to its worker.
    Cancel(Cancel),
}

/// Why a task failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "kebab-case")]
pub enum Failure {
    /// No placement could be made from the bids.
    #[error("cannot be placed: {why}{}", declined_note(*.declined))]
    Unplaceable {
        /// Why.
        why: Infeasible,
        /// Workers that declined, with a signed reason.
        declined: usize,
    },
    /// Too many runs failed after their leases became current.
    #[error("gave up after {failures} failed runs")]
    GaveUp {
        /// Runs that failed.
        failures: u32,
    },
    /// The deadline passed.
    #[error("the deadline passed")]
    DeadlinePassed,
    /// The money of the task did not add up (a defect; the task stops rather than pay).
    #[error("accounting: {0}")]
    Money(MoneyError),
    /// The job's budget could not be locked in escrow, so nothing was awarded.
    #[error("the budget was not locked: {0}")]
    NotLocked(String),
}

/// Where a job's budget stands with settlement. No award goes out while it is
/// [`Escrowed::Locking`]: no lock, no award.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Escrowed {
    /// This node settles through no ledger (it has no genesis): nothing is locked or paid.
    #[default]
    Unsettled,
    /// The lock was asked for and is not in a block yet.
    Locking,
    /// The budget is locked in the job's escrow.
    Locked,
}

fn declined_note(declined: usize) -> String {
    if declined > 0 {
        format!(" ({declined} declined)")
    } else {
        String::new()
    }
}

/// Why a task was cancelled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "kebab-case")]
pub enum Cancellation {
    /// The requester cancelled the job.
    #[error("cancelled by the requester")]
    ByRequester,
    /// A task it depends on failed.
    #[error("a task it depends on ({task}) failed")]
    DependencyFailed {
        /// That task's name.
        task: String,
    },
}

/// Where a task stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state", content = "reason")]
pub enum TaskStatus {
    /// Waiting for the tasks it depends on.
    Waiting,
    /// Taking bids until the bid window ends.
    Bidding,
    /// Awards sent; waiting for every rank to countersign.
    Leasing,
    /// Every rank holds a current lease.
    Running,
    /// Every rank delivered.
    Done,
    /// It cannot complete.
    Failed(Failure),
    /// The requester cancelled it, or a task it depends on failed.
    Cancelled(Cancellation),
}

impl TaskStatus {
    /// Whether nothing more happens to the task.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            TaskStatus::Done | TaskStatus::Failed(_) | TaskStatus::Cancelled(_)
        )
    }

    /// One word for tables: `running`, `bidding`, ...
    pub fn word(&self) -> &'static str {
        match self {
            TaskStatus::Waiting => "waiting",
            TaskStatus::Bidding => "bidding",
            TaskStatus::Leasing => "leasing",
            TaskStatus::Running => "running",
            TaskStatus::Done => "done",
            TaskStatus::Failed(_) => "failed",
            TaskStatus::Cancelled(_) => "cancelled",
        }
    }
}

impl std::fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TaskStatus::Failed(why) => write!(f, "failed: {why}"),
            TaskStatus::Cancelled(why) => write!(f, "cancelled: {why}"),
            other => f.write_str(other.word()),
        }
    }
}

/// Where one rank's lease stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseState {
    /// Awarded; the worker has until `expires_at` to countersign.
    Offered,
    /// Countersigned and renewed; current until `expires_at`.
    Current,
    /// Delivered.
    Done,
    /// Ended without delivering: it expired, failed, or was cancelled.
    Ended,
}

/// One rank's assignment in the current attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The rank.
    pub rank: u32,
    /// The checkpoint its award pins for it to resume from: what the requester serves its
    /// worker as the rank's checkpoint at this epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
    /// The worker.
    pub worker: Address,
    /// The fencing token.
    pub epoch: u64,
    /// The bid taken.
    pub bid: Digest,
    /// The award's message id.
    pub award: Digest,
    /// Agreed price.
    pub price: Amount,
    /// Lease state.
    pub state: LeaseState,
    /// The lease ends then unless renewed (for an offer: the deadline to countersign).
    /// Moves only when the worker acknowledged a renewal.
    pub expires_at: Timestamp,
    /// When the last renewal not yet acknowledged was sent.
    pub renewal_sent: Option<Timestamp>,
    /// The worker's signed acceptance, once it countersigned: the evidence if it signs
    /// another for the same epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted: Option<Signed<LeaseAccept>>,
    /// While its group assembles, a current lease's first renewal waits until then (or
    /// until every rank holds its lease).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_renewal_at: Option<Timestamp>,
    /// Where the worker says its attempt stands (its latest signed report at this epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The worker's signed delivery at this epoch, once taken: its outputs are fetched
    /// and checked against it before the rank is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Box<Signed<DeliveryManifest>>>,
    /// For a synthetic task: the delivered product's check, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<ProductVerdict>,
    /// A spot check's finding that this delivery is wrong (two other workers' runs of the
    /// task agree against it), once made ([`crate::spot`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caught: Option<String>,
}

impl Assignment {
    /// Whether this delivery was found wrong (its synthetic product, or by a spot check):
    /// it is disputed, never accepted with the rest.
    pub fn found_wrong(&self) -> bool {
        matches!(self.product, Some(ProductVerdict::Failed(_))) || self.caught.is_some()
    }
}

/// How a delivered synthetic product fared against its task (checked by the requester,
/// without recomputing it: the result's hash and Freivalds' method).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProductVerdict {
    /// It is the task's product (a wrong one passes with probability below `2^-30`).
    Passed,
    /// It is not; why.
    Failed(String),
}

/// A worker's latest report on the work of a lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Where the attempt stands.
    pub stage: RunStage,
    /// Why, for a refusal or a failure.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// When the worker reported it.
    pub at: Timestamp,
}

impl Assignment {
    /// The renewal of this lease up to `expires_at`, marked as sent `now`.
    fn renew(
        &mut self,
        job_id: Uuid,
        task: u32,
        requester: Address,
        now: Timestamp,
        expires_at: Timestamp,
    ) -> Action {
        self.first_renewal_at = None;
        self.renewal_sent = Some(now);
        Action::Renew(LeaseRenewal {
            job_id,
            task,
            rank: self.rank,
            requester,
            worker: self.worker,
            epoch: self.epoch,
            issued_at: now,
            expires_at,
        })
    }
}

/// A rank's checkpoint, fetched from its worker and checked, that the requester keeps for
/// the rank's next epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptCheckpoint {
    /// The epoch whose attempt made it.
    pub epoch: u64,
    /// Its number within that attempt.
    pub seq: u64,
    /// SHA-256 of its plaintext.
    pub digest: Digest,
    /// Its size in bytes.
    pub size_bytes: u64,
}

/// One task's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    status: TaskStatus,
    /// Valid bids, newest per worker.
    #[serde(default)]
    bids: BTreeMap<Address, Candidate>,
    /// The signatures of the bids held, by worker: with the bid, the signed message, to
    /// show as evidence if the worker signs a conflicting one.
    #[serde(default)]
    signatures: BTreeMap<Address, SignatureBytes>,
    /// Signed reasons of workers that declined.
    #[serde(default)]
    declines: BTreeMap<Address, String>,
    /// Workers whose assignment ended without delivering; not placed again.
    excluded: BTreeSet<Address>,
    /// Workers that refused an award (busy, as a rule), with the version of the offer
    /// current then: excluded too, until they bid on a later version, which says they
    /// would take the work now.
    #[serde(default)]
    refused: BTreeMap<Address, Digest>,
    /// Versions of the offer published because the window ended without a whole
    /// placement, with the call already open to every worker (see [`MAX_RECALLS`]).
    #[serde(default)]
    recalls: u32,
    /// Workers that qualified for the task among the ads its requester held when the job
    /// was submitted: enough of them for a whole placement is a reason to call for bids
    /// again when none came.
    #[serde(default)]
    known: u32,
    /// The current attempt, one per rank.
    ranks: Vec<Assignment>,
    attempts: u32,
    failures: u32,
    committed: Amount,
    spent: Amount,
    budget: Amount,
    outputs: BTreeMap<String, Digest>,
    /// The last epoch issued per rank.
    epochs: Vec<u64>,
    /// The latest checkpoint kept of each rank (a task that declares one), pinned by the
    /// rank's next award.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    checkpoints: BTreeMap<u32, KeptCheckpoint>,
    /// When its bid window opened (for tasks of a graph, when their dependencies ended).
    bidding_since: Option<Timestamp>,
}

impl Task {
    /// Status.
    pub fn status(&self) -> &TaskStatus {
        &self.status
    }
    /// Valid bids held, one per worker.
    pub fn bids(&self) -> impl Iterator<Item = &Candidate> {
        self.bids.values()
    }
    /// Number of bids held.
    /// The latest checkpoint kept of each rank.
    pub fn checkpoints(&self) -> &BTreeMap<u32, KeptCheckpoint> {
        &self.checkpoints
    }

    pub fn bid_count(&self) -> usize {
        self.bids.len()
    }
    /// Signed reasons of workers that declined, by worker.
    pub fn declines(&self) -> &BTreeMap<Address, String> {
        &self.declines
    }
    /// The current attempt, one assignment per rank.
    pub fn ranks(&self) -> &[Assignment] {
        &self.ranks
    }
    /// Placements made.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
    /// Runs that failed after their leases became current.
    pub fn failures(&self) -> u32 {
        self.failures
    }
    /// Prices of live assignments.
    pub fn committed(&self) -> Amount {
        self.committed
    }
    /// Prices of delivered assignments.
    pub fn spent(&self) -> Amount {
        self.spent
    }
    /// The task's budget.
    pub fn budget(&self) -> Amount {
        self.budget
    }
    /// Digests of the outputs it delivered, by name.
    pub fn outputs(&self) -> &BTreeMap<String, Digest> {
        &self.outputs
    }
}

/// A line of the job's history, for `cannabis job status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// When.
    pub at: Timestamp,
    /// Task index, if about one task.
    pub task: Option<u32>,
    /// What happened.
    pub text: String,
}

/// The overall state of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    /// Some task is still to finish.
    Open,
    /// Every task delivered.
    Completed,
    /// Some task failed (its dependants were cancelled).
    Failed,
    /// The requester cancelled it.
    Cancelled,
}

/// How a job takes bids: when it places, and how many bids per task it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bidding {
    /// Place before the window ends, when this says so.
    pub early: Option<Early>,
    /// Most bids kept per task: a cheaper bid pushes out the dearest, a dearer one is
    /// refused.
    pub keep: u32,
}

impl Default for Bidding {
    fn default() -> Self {
        Self {
            early: None,
            keep: 64,
        }
    }
}

/// The requester's state machine for one job.
///
/// It serializes (serde) so the node can keep it durably: the node saves a job before it
/// sends any award the job asked for, so an epoch is never issued twice, even across a
/// crash.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    offer: JobOffer,
    /// The message id of the offer as last published.
    offer_id: Digest,
    /// Earlier versions of the offer (a widened call is a new version): bids for them count.
    earlier: Vec<Digest>,
    name: String,
    config: LeaseConfig,
    bidding: Bidding,
    tasks: Vec<Task>,
    history: Vec<Event>,
    cancelled: bool,
    /// Conflicting signed messages of workers, kept as evidence.
    #[serde(default)]
    evidence: Vec<Equivocation>,
    /// Conflicting signed lease acceptances of workers, kept as evidence.
    #[serde(default)]
    accept_evidence: Vec<AcceptEquivocation>,
    /// History lines dropped to keep it within its bound (the oldest after the first).
    #[serde(default)]
    history_dropped: u64,
    /// For a job placed early: when the tasks still without a placeable set of bids get a
    /// wider call, before their bid window ends ([`EARLY_LOOK_MS`] after the offer's
    /// version was published). `None` once that look was taken.
    #[serde(default)]
    early_look_at: Option<Timestamp>,
    /// Where the budget stands with settlement.
    #[serde(default)]
    escrow: Escrowed,
    /// Where the requester's evaluation of the deliveries stands (for an offer with
    /// evaluation terms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    evaluation: Option<Evaluating>,
    /// Spot checks: the rate, what this job checks (for a check job), and the checks of
    /// its tasks.
    #[serde(default, skip_serializing_if = "SpotChecks::is_empty")]
    spot: SpotChecks,
}

/// Where a job's evaluation stands.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Evaluating {
    /// Asked of the node and not answered yet; `run` counts the runs asked (each one by
    /// hand is a new run).
    Running {
        /// The run.
        run: u32,
        /// When it was asked.
        since: Timestamp,
    },
    /// The node's signed report of a run.
    Done {
        /// The run.
        run: u32,
        /// The signed report.
        report: Box<Signed<Evaluation>>,
    },
}

impl Evaluating {
    /// The run asked last.
    pub fn run(&self) -> u32 {
        match self {
            Self::Running { run, .. } | Self::Done { run, .. } => *run,
        }
    }
}

/// How long after an early-placed job's offer (or a widened version of it) is published
/// its tasks that still lack a placeable set of bids get a wider call, instead of waiting
/// for the window's end: the bids of drawn workers arrive within a few hundred
/// milliseconds, so a draw that picked too few shows by then. A window-long wait for a job
/// meant to start at once is what the draw's bad luck would otherwise cost.
pub const EARLY_LOOK_MS: u64 = 2_000;

/// Two different bids one worker signed for one version of an offer: either alone is a
/// valid quote, together they show the worker said two things. Anyone can check both
/// signatures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Equivocation {
    /// The worker.
    pub worker: Address,
    /// The bid held first.
    pub first: Signed<Bid>,
    /// The conflicting one.
    pub second: Signed<Bid>,
    /// When the second arrived.
    pub at: Timestamp,
}

/// Two different lease acceptances one worker signed for one assignment and epoch (an
/// epoch is awarded once, so one of them names an award the requester never sent).
/// Anyone can check both signatures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AcceptEquivocation {
    /// The worker.
    pub worker: Address,
    /// The acceptance of the award sent, taken first.
    pub first: Signed<LeaseAccept>,
    /// The conflicting one.
    pub second: Signed<LeaseAccept>,
    /// When the second arrived.
    pub at: Timestamp,
}

/// Most pieces of evidence kept per job (each worker is excluded after its first).
const MAX_EVIDENCE: usize = 64;

/// Most history lines kept per job.
const MAX_HISTORY: usize = 1000;

/// Longest decline reason kept, in bytes.
const MAX_REASON: usize = 200;

impl Job {
    /// A job for a published offer. Tasks with no dependencies take bids at once.
    pub fn new(
        offer: JobOffer,
        offer_id: Digest,
        name: String,
        config: LeaseConfig,
        bidding: Bidding,
        now: Timestamp,
    ) -> Self {
        let tasks = offer
            .tasks
            .iter()
            .map(|t| Task {
                status: if t.depends_on.is_empty() {
                    TaskStatus::Bidding
                } else {
                    TaskStatus::Waiting
                },
                bids: BTreeMap::new(),
                signatures: BTreeMap::new(),
                declines: BTreeMap::new(),
                excluded: BTreeSet::new(),
                refused: BTreeMap::new(),
                recalls: 0,
                known: 0,
                ranks: Vec::new(),
                attempts: 0,
                failures: 0,
                committed: Amount(0),
                spent: Amount(0),
                budget: t.budget,
                outputs: BTreeMap::new(),
                epochs: vec![0; t.group_size.max(1) as usize],
                checkpoints: BTreeMap::new(),
                bidding_since: t.depends_on.is_empty().then_some(now),
            })
            .collect();
        let mut job = Self {
            offer,
            offer_id,
            earlier: Vec::new(),
            name,
            config,
            bidding,
            tasks,
            history: Vec::new(),
            cancelled: false,
            evidence: Vec::new(),
            accept_evidence: Vec::new(),
            history_dropped: 0,
            early_look_at: None,
            escrow: Escrowed::Unsettled,
            evaluation: None,
            spot: SpotChecks::default(),
        };
        job.early_look_at = job.early_look_after(now);
        job.log(now, None, "offer published; taking bids".into());
        job
    }

    /// Where the budget stands with settlement.
    pub fn escrow(&self) -> &Escrowed {
        &self.escrow
    }

    /// The budget's lock was asked for: nothing is awarded until [`Job::on_locked`].
    pub fn lock_asked(&mut self, now: Timestamp) {
        self.escrow = Escrowed::Locking;
        self.log(
            now,
            None,
            format!("locking the budget {} in escrow", self.offer.budget),
        );
    }

    /// The lock is in a block (`Ok`), or it was refused: then every task fails, since
    /// nothing may be awarded without it. Tasks whose bid window ended are placed now.
    #[must_use]
    pub fn on_locked(&mut self, result: Result<(), String>, now: Timestamp) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.escrow != Escrowed::Locking {
            return actions;
        }
        match result {
            Ok(()) => {
                self.escrow = Escrowed::Locked;
                self.log(now, None, "budget locked in escrow".into());
                actions = self.tick(now);
            }
            Err(why) => {
                self.escrow = Escrowed::Unsettled;
                self.log(now, None, format!("the escrow lock was refused: {why}"));
                for i in 0..self.tasks.len() {
                    if !self.tasks[i].status.is_final() {
                        self.fail_task(i, Failure::NotLocked(why.clone()), now, &mut actions);
                    }
                }
            }
        }
        actions
    }

    /// Where the evaluation stands, for an offer with evaluation terms.
    pub fn evaluation(&self) -> Option<&Evaluating> {
        self.evaluation.as_ref()
    }

    /// Starts an evaluation run of what the job delivered and returns its number: when
    /// the offer has evaluation terms and every task delivered, and (unless `by_hand`)
    /// none was started before. A run by hand starts a new one whatever came before.
    pub fn start_evaluation(&mut self, by_hand: bool, now: Timestamp) -> Option<u32> {
        self.offer.evaluation.as_ref()?;
        if self.state() != JobState::Completed || (!by_hand && self.evaluation.is_some()) {
            return None;
        }
        let run = self.evaluation.as_ref().map_or(1, |e| e.run() + 1);
        self.evaluation = Some(Evaluating::Running { run, since: now });
        self.log(now, None, format!("evaluating the deliveries (run {run})"));
        Some(run)
    }

    /// The run being evaluated, if one is.
    pub fn evaluation_running(&self) -> Option<u32> {
        match self.evaluation {
            Some(Evaluating::Running { run, .. }) => Some(run),
            _ => None,
        }
    }

    /// The report of evaluation run `run`. `false` (and nothing changes) when that is not
    /// the run in progress.
    pub fn on_evaluated(
        &mut self,
        run: u32,
        report: Signed<Evaluation>,
        body: &Evaluation,
        now: Timestamp,
    ) -> bool {
        if self.evaluation_running() != Some(run) {
            return false;
        }
        let verdict = match body.outcome {
            EvaluationOutcome::Passed => "passed".to_string(),
            EvaluationOutcome::Failed => format!("failed: {}", body.reason),
            EvaluationOutcome::NotEvaluated => format!("could not evaluate: {}", body.reason),
        };
        let measured: Vec<String> = body
            .metrics
            .iter()
            .map(|m| format!("{} {}", m.name, m.value))
            .collect();
        let text = if measured.is_empty() {
            format!("evaluation run {run} {verdict}")
        } else {
            format!("evaluation run {run} {verdict} ({})", measured.join(", "))
        };
        self.log(now, None, text);
        self.evaluation = Some(Evaluating::Done {
            run,
            report: Box::new(report),
        });
        true
    }

    /// Adds a line to the job's history.
    pub fn note(&mut self, now: Timestamp, text: String) {
        self.log(now, None, text);
    }

    /// Adds a line about task `task` to the job's history.
    pub fn note_task(&mut self, now: Timestamp, task: u32, text: String) {
        self.log(now, Some(task), text);
    }

    /// Its spot checks ([`crate::spot`]).
    pub fn spot(&self) -> &SpotChecks {
        &self.spot
    }

    /// Its spot checks, to change.
    pub(crate) fn spot_mut(&mut self) -> &mut SpotChecks {
        &mut self.spot
    }

    /// Never places task `task` on `worker` (a check job excludes the workers it checks).
    pub(crate) fn exclude(&mut self, task: u32, worker: Address) {
        if let Some(t) = self.tasks.get_mut(task as usize) {
            t.excluded.insert(worker);
            t.bids.remove(&worker);
        }
    }

    /// A spot check found the delivery of `task`'s `rank` at `epoch` wrong: kept, so that
    /// it is disputed and never accepted. `false` when that delivery is not held (or was
    /// found wrong already).
    pub(crate) fn on_caught(
        &mut self,
        task: u32,
        rank: u32,
        epoch: u64,
        why: String,
        now: Timestamp,
    ) -> bool {
        let Ok(a) = self.assignment(task, rank, epoch) else {
            return false;
        };
        if a.state != LeaseState::Done || a.caught.is_some() {
            return false;
        }
        a.caught = Some(why.clone());
        self.log(
            now,
            Some(task),
            format!("rank {rank}'s delivery is wrong: {why}"),
        );
        true
    }

    /// The job id.
    pub fn id(&self) -> Uuid {
        self.offer.job_id
    }

    /// The offer as last published.
    pub fn offer(&self) -> &JobOffer {
        &self.offer
    }

    /// The message id of the offer as last published.
    pub fn offer_id(&self) -> Digest {
        self.offer_id
    }

    /// Whether `id` is a version of this job's offer.
    pub fn is_version(&self, id: &Digest) -> bool {
        self.offer_id == *id || self.earlier.contains(id)
    }

    /// A name for people.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How the job takes bids.
    pub fn bidding(&self) -> Bidding {
        self.bidding
    }

    /// Per task, in the offer's order.
    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }

    /// What happened, oldest first.
    pub fn history(&self) -> &[Event] {
        &self.history
    }

    fn log(&mut self, at: Timestamp, task: Option<u32>, text: String) {
        if self.history.len() == MAX_HISTORY {
            self.history.remove(1);
            self.history_dropped += 1;
        }
        self.history.push(Event { at, task, text });
    }

    /// The overall state.
    pub fn state(&self) -> JobState {
        if self.cancelled {
            return JobState::Cancelled;
        }
        if self.tasks.iter().all(|t| t.status == TaskStatus::Done) {
            JobState::Completed
        } else if self.tasks.iter().all(|t| t.status.is_final()) {
            JobState::Failed
        } else {
            JobState::Open
        }
    }

    /// Budget committed to live leases plus spent on deliveries, over all tasks.
    pub fn used(&self) -> Result<Amount, MoneyError> {
        let mut used = Amount(0);
        for t in &self.tasks {
            used = used.checked_add(t.committed)?.checked_add(t.spent)?;
        }
        Ok(used)
    }

    /// What goes back to the requester once the job is over: the budget not spent.
    pub fn refund(&self) -> Result<Amount, MoneyError> {
        let spent = Amount::sum(self.tasks.iter().map(|t| &t.spent))?;
        self.offer.budget.checked_sub(spent)
    }

    /// The budget one rank of task `task` may be paid.
    pub fn share(&self, task: u32) -> Option<Amount> {
        let spec = self.offer.tasks.get(task as usize)?;
        Some(Amount(spec.budget.0 / u64::from(spec.group_size.max(1))))
    }

    /// A bid whose signature, sender, draw and worker's ad the caller checked, with the
    /// worker's compatibility class for the task (from its ad). Returns what placing early
    /// asked for, if this bid completed an early placement.
    pub fn on_bid(
        &mut self,
        bid: Bid,
        id: Digest,
        signature: SignatureBytes,
        class: Class,
        strikes: u64,
        now: Timestamp,
    ) -> Result<Vec<Action>, Refusal> {
        self.admit_bid(&bid, now)?;
        let index = bid.task;
        let task = &mut self.tasks[index as usize];
        let keep = self.bidding.keep.max(1) as usize;
        if !task.bids.contains_key(&bid.worker) && task.bids.len() >= keep {
            // Full: a cheaper bid pushes out the dearest, anything else is refused.
            let dearest = task
                .bids
                .values()
                .max_by(|a, b| (a.bid.price, a.bid.worker).cmp(&(b.bid.price, b.bid.worker)))
                .map(|c| (c.bid.price, c.bid.worker));
            match dearest {
                Some((price, worker)) if bid.price < price => {
                    task.bids.remove(&worker);
                }
                _ => {
                    return Err(Refusal::Outbid {
                        task: index,
                        kept: task.bids.len(),
                    });
                }
            }
        }
        let (worker, price) = (bid.worker, bid.price);
        if bid.offer == self.offer_id
            && task
                .refused
                .get(&worker)
                .is_some_and(|&v| v != self.offer_id)
        {
            // It refused an award before this version was published: bidding on it says it
            // would take the work now.
            task.refused.remove(&worker);
            task.excluded.remove(&worker);
        }
        task.signatures.insert(worker, signature);
        task.bids.insert(
            bid.worker,
            Candidate {
                bid,
                id,
                class,
                strikes,
            },
        );
        let record = match strikes {
            0 => String::new(),
            n => format!(
                " ({n} strikes: weighed as {})",
                u128::from(price.0) * (u128::from(n) + 1)
            ),
        };
        self.log(
            now,
            Some(index),
            format!("bid {price} from {worker}{record}"),
        );
        let mut actions = Vec::new();
        if self.tasks[index as usize].status == TaskStatus::Bidding
            && self.early_ready(index as usize, now)
        {
            self.place(index as usize, now, &mut actions);
        }
        Ok(actions)
    }

    /// The workers' strikes changed (a block settled a dispute against one): the bids
    /// held are weighed again. Whether any bid changed.
    pub fn set_strikes(&mut self, strikes: &BTreeMap<Address, u64>) -> bool {
        let mut changed = false;
        for task in &mut self.tasks {
            for c in task.bids.values_mut() {
                let now = strikes.get(&c.bid.worker).copied().unwrap_or(0);
                if c.strikes != now {
                    c.strikes = now;
                    changed = true;
                }
            }
        }
        changed
    }

    /// The checks a bid must pass before it is kept, cheapest first: for this job, this
    /// offer, a live quote, a task that exists and is not over, within the share, newer
    /// than what the worker sent before. (The draw is checked by the engine, which knows
    /// the call.)
    pub fn admit_bid(&self, bid: &Bid, now: Timestamp) -> Result<(), Refusal> {
        if bid.job_id != self.offer.job_id {
            return Err(Refusal::UnknownJob(bid.job_id));
        }
        if !self.is_version(&bid.offer) {
            return Err(Refusal::OtherVersion);
        }
        if bid.valid_until <= now {
            return Err(Refusal::BidExpired);
        }
        let share = self.share(bid.task).ok_or(Refusal::NoSuchTask {
            job: bid.job_id,
            task: bid.task,
        })?;
        if bid.price > share {
            return Err(Refusal::AboveShare {
                price: bid.price,
                share,
            });
        }
        let task = &self.tasks[bid.task as usize];
        if task.status.is_final() {
            return Err(Refusal::TaskOver(bid.task));
        }
        if let Some(held) = task.bids.get(&bid.worker) {
            if held.bid == *bid {
                return Err(Refusal::SameBid);
            }
            if held.bid.offer == bid.offer {
                return Err(Refusal::Equivocation);
            }
            if held.bid.issued_at >= bid.issued_at {
                return Err(Refusal::DuplicateBid);
            }
        }
        Ok(())
    }

    /// A bid that [`Job::admit_bid`] found conflicting with the one held, its signature
    /// checked: both are kept as evidence, the held bid is dropped and the worker is not
    /// placed on the task.
    pub fn equivocated(&mut self, second: Signed<Bid>, bid: &Bid, now: Timestamp) {
        let i = bid.task as usize;
        let Some(task) = self.tasks.get_mut(i) else {
            return;
        };
        let (Some(held), Some(sig)) = (
            task.bids.remove(&bid.worker),
            task.signatures.remove(&bid.worker),
        ) else {
            return;
        };
        task.excluded.insert(bid.worker);
        let first = Signed::from_parts(
            cannabis_protocol::encode(&held.bid),
            PublicKeyBytes(*bid.worker.public_key()),
            sig,
        );
        if self.evidence.len() < MAX_EVIDENCE {
            self.evidence.push(Equivocation {
                worker: bid.worker,
                first,
                second,
                at: now,
            });
        }
        self.log(
            now,
            Some(bid.task),
            format!(
                "{} signed two different bids ({} and {}) for one version of the offer: \
                 kept as evidence, not placed",
                bid.worker, held.bid.price, bid.price
            ),
        );
    }

    /// Conflicting signed messages of workers, kept as evidence.
    pub fn evidence(&self) -> &[Equivocation] {
        &self.evidence
    }

    /// Conflicting signed lease acceptances of workers, kept as evidence.
    pub fn accept_evidence(&self) -> &[AcceptEquivocation] {
        &self.accept_evidence
    }

    /// Whether task `i`, still bidding, can be placed before its window ends.
    fn early_ready(&self, i: usize, now: Timestamp) -> bool {
        let spec = &self.offer.tasks[i];
        let task = &self.tasks[i];
        let Ok(left) = self.left(i) else {
            return false;
        };
        let valid = || {
            task.bids
                .values()
                .filter(|c| c.bid.valid_until > now && !task.excluded.contains(&c.bid.worker))
        };
        if task.recalls > 0 {
            // Its bids were called for again: the first whole placement is taken.
            return placement::place(spec, valid(), &task.excluded, left, now).is_ok();
        }
        let Some(early) = self.bidding.early else {
            return false;
        };
        match early {
            Early::FirstBids(n) => {
                valid().count() >= n.max(spec.group_size) as usize
                    && placement::place(spec, valid(), &task.excluded, left, now).is_ok()
            }
            Early::PriceAtMost(cap) => {
                let cheap = valid().filter(|c| c.bid.price <= cap);
                placement::place(spec, cheap, &task.excluded, left, now).is_ok()
            }
        }
    }

    /// A decline whose signature and sender the caller checked. A worker's first decline
    /// is logged; later ones only replace its reason.
    pub fn on_decline(&mut self, decline: Decline, now: Timestamp) -> Result<(), Refusal> {
        if decline.job_id != self.offer.job_id {
            return Err(Refusal::UnknownJob(decline.job_id));
        }
        if !self.is_version(&decline.offer) {
            return Err(Refusal::OtherVersion);
        }
        let task_index = decline.task;
        let Some(task) = self.tasks.get_mut(task_index as usize) else {
            return Err(Refusal::NoSuchTask {
                job: decline.job_id,
                task: task_index,
            });
        };
        let mut reason = decline.reason;
        if reason.len() > MAX_REASON {
            let mut cut = MAX_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        let first = task
            .declines
            .insert(decline.worker, reason.clone())
            .is_none();
        if first {
            self.log(
                now,
                Some(task_index),
                format!("{} declined: {reason}", decline.worker),
            );
        }
        Ok(())
    }

    /// A countersignature whose signature and sender the caller checked. It makes the lease
    /// current only for the rank's current epoch, from its worker, for the award sent,
    /// while the award is still open. An acceptance from the rank's worker naming another
    /// award, after it accepted the one sent, is kept with the first as evidence.
    pub fn on_accept(
        &mut self,
        signed: &Received<LeaseAccept>,
        now: Timestamp,
    ) -> Result<Vec<Action>, Refusal> {
        let accept = &signed.body;
        if accept.job_id != self.offer.job_id {
            return Err(Refusal::UnknownJob(accept.job_id));
        }
        let renew_to = now.plus_ms(self.config.lease_ms).min(self.offer.deadline);
        let wait = GROUP_RENEWAL_WAIT_MS.min(self.config.award_timeout_ms / 3);
        let (requester, job_id) = (self.offer.requester, self.offer.job_id);
        let a = self.assignment(accept.task, accept.rank, accept.epoch)?;
        if accept.worker != a.worker || accept.award != a.award {
            if let Some(first) = a.accepted.clone().filter(|_| accept.worker == a.worker)
                && self.accept_evidence.len() < MAX_EVIDENCE
            {
                self.accept_evidence.push(AcceptEquivocation {
                    worker: accept.worker,
                    first,
                    second: signed.signed(),
                    at: now,
                });
                self.log(
                    now,
                    Some(accept.task),
                    format!(
                        "{} signed a second acceptance of epoch {}, naming an award never \
                         sent: both kept as evidence",
                        accept.worker, accept.epoch
                    ),
                );
            }
            return Err(Refusal::NotTheAward);
        }
        match a.state {
            LeaseState::Offered if now < a.expires_at => {}
            LeaseState::Current => return Err(Refusal::AlreadyAccepted),
            _ => return Err(Refusal::AwardClosed),
        }
        a.state = LeaseState::Current;
        a.accepted = Some(signed.signed());
        a.first_renewal_at = Some(now.plus_ms(wait));
        let task = &mut self.tasks[accept.task as usize];
        let all_current = task.ranks.iter().all(|r| r.state == LeaseState::Current);
        // The award's own expiry is short on purpose: renew at once, or, in a group still
        // assembling, once it is whole (the tick renews a rank that waited too long).
        let mut actions = Vec::new();
        if all_current {
            task.status = TaskStatus::Running;
            for r in &mut task.ranks {
                if r.first_renewal_at.is_some() && r.renewal_sent.is_none() {
                    actions.push(r.renew(job_id, accept.task, requester, now, renew_to));
                }
            }
        }
        self.log(
            now,
            Some(accept.task),
            format!(
                "rank {} leased to {} (epoch {})",
                accept.rank, accept.worker, accept.epoch
            ),
        );
        if all_current {
            self.log(
                now,
                Some(accept.task),
                "every rank holds a current lease".into(),
            );
        }
        Ok(actions)
    }

    /// The assignment of `rank` of task `task`, if it is at `epoch` (the fencing check).
    /// The assignment at `epoch`, while its lease is current with `worker` for `requester`
    /// (this job's).
    fn current_lease(
        &mut self,
        task: u32,
        rank: u32,
        epoch: u64,
        worker: Address,
        requester: Address,
    ) -> Result<&mut Assignment, Refusal> {
        let ours = requester == self.offer.requester;
        let a = self.assignment(task, rank, epoch)?;
        if worker != a.worker || !ours {
            return Err(Refusal::NotTheLease);
        }
        if a.state != LeaseState::Current {
            return Err(Refusal::LeaseEnded);
        }
        Ok(a)
    }

    fn assignment(&mut self, task: u32, rank: u32, epoch: u64) -> Result<&mut Assignment, Refusal> {
        let job = self.offer.job_id;
        let a = self
            .tasks
            .get_mut(task as usize)
            .ok_or(Refusal::NoSuchTask { job, task })?
            .ranks
            .get_mut(rank as usize)
            .ok_or(Refusal::NoSuchRank { task, rank })?;
        if a.epoch != epoch {
            return Err(Refusal::StaleEpoch {
                got: epoch,
                current: a.epoch,
            });
        }
        Ok(a)
    }

    /// A worker's signed report on its attempt: taken from the rank's worker at its
    /// current epoch while the lease is current (an older epoch's, or another node's, is
    /// refused). A new stage goes into the history; a report older than the last is
    /// ignored.
    /// A worker's signed delivery for a current rank: checked against the task's terms
    /// (every output it delivers, in order, within its cap; an age file no larger than its
    /// plaintext allows) and kept. `Ok(true)`: new, fetch its outputs; `Ok(false)`: the
    /// same one again.
    /// A worker's signed note of a new checkpoint for a current rank: checked against the
    /// task's terms (the task declares a checkpoint of that name; its size within the cap;
    /// an age file no larger than its plaintext allows) and the rank's lease. `Ok(true)`:
    /// newer than the checkpoint kept for the rank, fetch it; `Ok(false)`: not newer.
    pub fn on_checkpoint_note(
        &mut self,
        note: &cannabis_protocol::CheckpointNote,
    ) -> Result<bool, Refusal> {
        if note.job_id != self.offer.job_id {
            return Err(Refusal::UnknownJob(note.job_id));
        }
        let spec = self
            .offer
            .tasks
            .get(note.task as usize)
            .ok_or(Refusal::NoSuchTask {
                job: note.job_id,
                task: note.task,
            })?;
        let bad = |why: String| Err(Refusal::BadManifest(why));
        let Some(decl) = &spec.checkpoint else {
            return bad("the task declares no checkpoint".into());
        };
        let c = &note.checkpoint;
        if c.name != decl.name {
            return bad(format!(
                "checkpoint {:?} where {:?} is declared",
                c.name, decl.name
            ));
        }
        let cap = decl.max_bytes.min(spec.resources.storage_bytes);
        sealed_within(c, cap).map_err(|why| Refusal::BadManifest(format!("checkpoint {why}")))?;
        self.current_lease(
            note.task,
            note.rank,
            note.epoch,
            note.worker,
            note.requester,
        )?;
        let kept = self.tasks[note.task as usize].checkpoints.get(&note.rank);
        Ok(kept.is_none_or(|k| (k.epoch, k.seq) < (note.epoch, note.seq)))
    }

    /// A rank's checkpoint, fetched and checked: kept if it is newer than the one held
    /// (an award of the rank at a later epoch pins it). Returns whether it was kept.
    pub fn keep_checkpoint(
        &mut self,
        task: u32,
        rank: u32,
        kept: KeptCheckpoint,
    ) -> Result<bool, Refusal> {
        let job = self.offer.job_id;
        let spec = self
            .offer
            .tasks
            .get(task as usize)
            .ok_or(Refusal::NoSuchTask { job, task })?;
        if rank >= spec.group_size || spec.checkpoint.is_none() {
            return Err(Refusal::NoSuchRank { task, rank });
        }
        let held = &mut self.tasks[task as usize].checkpoints;
        if held
            .get(&rank)
            .is_some_and(|k| (k.epoch, k.seq) >= (kept.epoch, kept.seq))
        {
            return Ok(false);
        }
        held.insert(rank, kept);
        Ok(true)
    }

    pub fn on_manifest(
        &mut self,
        signed: &Signed<DeliveryManifest>,
        m: &DeliveryManifest,
        now: Timestamp,
    ) -> Result<bool, Refusal> {
        if m.job_id != self.offer.job_id {
            return Err(Refusal::UnknownJob(m.job_id));
        }
        let spec = self
            .offer
            .tasks
            .get(m.task as usize)
            .ok_or(Refusal::NoSuchTask {
                job: m.job_id,
                task: m.task,
            })?;
        let expected = spec.delivered_outputs();
        let bad = |why: String| Err(Refusal::BadManifest(why));
        if m.adapter != spec.workload.adapter || m.bundle != spec.workload.digest {
            return bad("it names another workload than the task's".into());
        }
        if m.outputs.len() != expected.len() {
            return bad(format!(
                "{} outputs, the task delivers {}",
                m.outputs.len(),
                expected.len()
            ));
        }
        for (o, (name, cap)) in m.outputs.iter().zip(&expected) {
            if o.name != *name {
                return bad(format!("output {:?} where {name:?} is due", o.name));
            }
            sealed_within(o, *cap)
                .map_err(|why| Refusal::BadManifest(format!("output {name:?} {why}")))?;
        }
        let a = self.current_lease(m.task, m.rank, m.epoch, m.worker, m.requester)?;
        if let Some(held) = &a.delivery {
            return if held.payload() == signed.payload() {
                Ok(false)
            } else {
                bad("this rank already delivered another manifest at this epoch".into())
            };
        }
        a.delivery = Some(Box::new(signed.clone()));
        let bytes: u64 = m.outputs.iter().map(|o| o.cipher_size).sum();
        self.log(
            now,
            Some(m.task),
            format!(
                "rank {} (epoch {}) delivered a manifest: {} outputs, {bytes} bytes to fetch",
                m.rank,
                m.epoch,
                m.outputs.len()
            ),
        );
        Ok(true)
    }

    /// The delivered manifests of current ranks whose outputs are not fetched yet.
    pub fn fetches_due(&self) -> Vec<Signed<DeliveryManifest>> {
        self.tasks
            .iter()
            .flat_map(|t| &t.ranks)
            .filter(|a| a.state == LeaseState::Current)
            .filter_map(|a| a.delivery.as_deref().cloned())
            .collect()
    }

    pub fn on_run_report(&mut self, report: &RunReport, now: Timestamp) -> Result<(), Refusal> {
        if report.job_id != self.offer.job_id {
            return Err(Refusal::UnknownJob(report.job_id));
        }
        let (task, rank, epoch) = (report.task, report.rank, report.epoch);
        let a = self.current_lease(task, rank, epoch, report.worker, report.requester)?;
        if a.progress.as_ref().is_some_and(|p| p.at > report.issued_at) {
            return Ok(());
        }
        let changed = a.progress.as_ref().is_none_or(|p| p.stage != report.stage);
        a.progress = Some(Progress {
            stage: report.stage,
            detail: report.detail.clone(),
            at: report.issued_at,
        });
        let worker = a.worker;
        if changed {
            let detail = if report.detail.is_empty() {
                String::new()
            } else {
                format!(": {}", report.detail)
            };
            self.log(
                now,
                Some(report.task),
                format!(
                    "rank {} on {worker} (epoch {}): {}{detail}",
                    report.rank,
                    report.epoch,
                    report.stage.name()
                ),
            );
        }
        Ok(())
    }

    /// The worker acknowledged a renewal up to `expires_at`: the lease is extended.
    pub fn on_renewed(
        &mut self,
        task: u32,
        rank: u32,
        epoch: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), Refusal> {
        let deadline = self.offer.deadline;
        let a = self.assignment(task, rank, epoch)?;
        if a.state != LeaseState::Current || now >= a.expires_at {
            return Err(Refusal::NotCurrent);
        }
        a.expires_at = a.expires_at.max(expires_at.min(deadline));
        a.renewal_sent = None;
        Ok(())
    }

    /// The check of a delivered synthetic product: kept once per rank and epoch. Returns
    /// whether it is new and failed (the delivery is then disputed).
    pub fn on_product_checked(
        &mut self,
        task: u32,
        rank: u32,
        epoch: u64,
        verdict: ProductVerdict,
        now: Timestamp,
    ) -> Result<bool, Refusal> {
        let a = self.assignment(task, rank, epoch)?;
        if a.state != LeaseState::Done || a.product.is_some() {
            return Ok(false);
        }
        a.product = Some(verdict.clone());
        let text = match &verdict {
            ProductVerdict::Passed => format!(
                "rank {rank}'s product checked: it hashes to the result and passes Freivalds' check"
            ),
            ProductVerdict::Failed(why) => format!("rank {rank}'s product is wrong: {why}"),
        };
        self.log(now, Some(task), text);
        Ok(matches!(verdict, ProductVerdict::Failed(_)))
    }

    /// A rank delivered (reported by the delivery path, after its result verified), with
    /// the digests of its outputs by name. Tasks that read them get them pinned in their
    /// awards.
    pub fn on_delivered(
        &mut self,
        task_index: u32,
        rank: u32,
        epoch: u64,
        outputs: &[NamedDigest],
        now: Timestamp,
    ) -> Result<Vec<Action>, Refusal> {
        let a = self.assignment(task_index, rank, epoch)?;
        if a.state != LeaseState::Current {
            return Err(Refusal::NotCurrent);
        }
        let price = a.price;
        let worker = a.worker;
        let task = &mut self.tasks[task_index as usize];
        let committed = task.committed.checked_sub(price)?;
        let spent = task.spent.checked_add(price)?;
        task.ranks[rank as usize].state = LeaseState::Done;
        task.committed = committed;
        task.spent = spent;
        // Rank 0 speaks for a group's outputs.
        if rank == 0 {
            for o in outputs {
                task.outputs.insert(o.name.clone(), o.digest);
            }
        }
        let done = task.ranks.iter().all(|r| r.state == LeaseState::Done);
        self.log(now, Some(task_index), format!("rank {rank} delivered"));
        // The worker's lease is released at once: a delivered lease holds none of its
        // slots until it would have run out.
        let mut actions = vec![Action::Cancel(Cancel {
            job_id: self.offer.job_id,
            task: task_index,
            rank,
            requester: self.offer.requester,
            worker,
            epoch,
            reason: Cancel::reason("delivered"),
            issued_at: now,
        })];
        if done {
            self.tasks[task_index as usize].status = TaskStatus::Done;
            self.log(now, Some(task_index), "task done".into());
            // Dependants whose dependencies are all done take bids (or are placed at
            // the next tick if the bid window is over).
            for i in 0..self.tasks.len() {
                let ready = self.tasks[i].status == TaskStatus::Waiting
                    && self.offer.tasks[i]
                        .depends_on
                        .iter()
                        .all(|&d| self.tasks[d as usize].status == TaskStatus::Done);
                if ready {
                    self.tasks[i].status = TaskStatus::Bidding;
                    self.tasks[i].bidding_since = Some(now);
                    self.log(now, Some(i as u32), "dependencies done".into());
                }
            }
        }
        actions.extend(self.tick(now));
        Ok(actions)
    }

    /// A rank failed (reported by its worker, or found out by the requester).
    pub fn on_failed(
        &mut self,
        task: u32,
        rank: u32,
        epoch: u64,
        reason: &str,
        now: Timestamp,
    ) -> Result<Vec<Action>, Refusal> {
        let a = self.assignment(task, rank, epoch)?;
        if !matches!(a.state, LeaseState::Offered | LeaseState::Current) {
            return Err(Refusal::NotLive);
        }
        let mut actions = Vec::new();
        self.attempt_failed(task as usize, rank as usize, reason, now, &mut actions);
        actions.extend(self.tick(now));
        Ok(actions)
    }

    /// The worker of a rank refused its award (busy, as a rule). The attempt ends as for a
    /// failure, without counting as a failed run, and the worker is not placed on the task
    /// again until it bids on a later version of the offer.
    pub fn on_award_refused(
        &mut self,
        task: u32,
        rank: u32,
        epoch: u64,
        reason: &str,
        now: Timestamp,
    ) -> Result<Vec<Action>, Refusal> {
        let worker = self.assignment(task, rank, epoch)?.worker;
        let actions = self.on_failed(task, rank, epoch, reason, now)?;
        self.tasks[task as usize]
            .refused
            .insert(worker, self.offer_id);
        Ok(actions)
    }

    /// The requester cancels the whole job: every live lease gets a cancellation.
    #[must_use]
    pub fn cancel(&mut self, now: Timestamp) -> Vec<Action> {
        let mut actions = Vec::new();
        for i in 0..self.tasks.len() {
            if !self.tasks[i].status.is_final() {
                let why = TaskStatus::Cancelled(Cancellation::ByRequester);
                self.end_task(i, why, now, &mut actions);
            }
        }
        self.cancelled = true;
        self.log(now, None, "cancelled by the requester".into());
        actions
    }

    /// Whether the bid window of task `i` is over: it can be widened (a new version of the
    /// offer with better odds) when placement lacks bids and time allows.
    pub fn wants_wider_call(&self, i: usize, now: Timestamp) -> bool {
        let task = &self.tasks[i];
        let Some(call) = self.offer.calls.get(i) else {
            return false;
        };
        let looked = self.early_look_at.is_some_and(|t| now >= t);
        if task.status != TaskStatus::Bidding
            || (now < self.offer.expires_at && !looked)
            || (call.odds_ppb >= cannabis_protocol::draw::ODDS_ONE && !self.may_recall(i))
        {
            return false;
        }
        let window = self.offer.expires_at.ms_since(self.offer.issued_at);
        if now.plus_ms(window) >= self.offer.deadline {
            return false;
        }
        let Ok(left) = self.left(i) else {
            return false;
        };
        matches!(
            placement::place(
                &self.offer.tasks[i],
                task.bids.values(),
                &task.excluded,
                left,
                now
            ),
            Err(Infeasible::NoBids | Infeasible::TooFewCompatible { .. })
        )
    }

    /// Whether task `i`, its call open to every worker, may have its bids called for again
    /// once its window ended without a whole placement, at most [`MAX_RECALLS`] times:
    /// after an attempt, or when no worker answered at all though enough known workers
    /// qualify for a whole placement (on a busy network a bid can come after a short
    /// window). Workers that declined said why, and with too few known workers there is
    /// nobody to wait for: the requester hears that at once.
    fn may_recall(&self, i: usize) -> bool {
        let task = &self.tasks[i];
        let answered_by_nobody =
            task.declines.is_empty() && task.known >= self.offer.tasks[i].group_size.max(1);
        (task.attempts > 0 || answered_by_nobody) && task.recalls < MAX_RECALLS
    }

    /// `n` workers qualified for task `i` among the ads its requester held at submission
    /// (see [`Job::wants_wider_call`]).
    pub fn known_workers(&mut self, i: usize, n: u32) {
        if let Some(t) = self.tasks.get_mut(i) {
            t.known = n;
        }
    }

    /// The tasks [`Job::wants_wider_call`] names whose call is already open to every
    /// worker: their bids are called for again rather than widened.
    fn recalled(&self, now: Timestamp) -> Vec<usize> {
        (0..self.tasks.len())
            .filter(|&i| {
                self.offer.calls[i].odds_ppb >= cannabis_protocol::draw::ODDS_ONE
                    && self.wants_wider_call(i, now)
            })
            .collect()
    }

    /// The bid window of the next version of the offer: the same as this one's, or twice
    /// it when bids are called for again (a busy worker has longer to free a slot), while
    /// half the time to the deadline is left to run the work.
    pub fn next_window(&self, now: Timestamp) -> u64 {
        let window = self.offer.expires_at.ms_since(self.offer.issued_at);
        if self.recalled(now).is_empty() {
            return window;
        }
        let room = self.offer.deadline.ms_since(now) / 2;
        window.saturating_mul(2).min(room).max(window)
    }

    /// The job's offer was published again as `offer` (id `id`), with wider calls or a new
    /// call for bids and a new bid window; bids for earlier versions still count.
    pub fn republished(&mut self, offer: JobOffer, id: Digest, now: Timestamp) {
        let recalled = self.recalled(now);
        for &i in &recalled {
            self.tasks[i].recalls += 1;
        }
        let odds: Vec<String> = offer
            .calls
            .iter()
            .map(|c| format!("{:.6}", f64::from(c.odds_ppb) / 1e9))
            .collect();
        let window = offer.expires_at.ms_since(offer.issued_at);
        self.offer = offer;
        self.earlier.push(std::mem::replace(&mut self.offer_id, id));
        self.early_look_at = self.early_look_after(now);
        for i in recalled {
            let n = self.tasks[i].recalls;
            let why = if self.tasks[i].attempts > 0 {
                "no bids left"
            } else {
                "no whole placement in the window"
            };
            self.log(
                now,
                Some(i as u32),
                format!(
                    "{why}: bids called for again ({n} of {MAX_RECALLS}, a {} s window, \
                     placed at the first whole placement)",
                    window.div_ceil(1_000)
                ),
            );
        }
        if self
            .offer
            .calls
            .iter()
            .any(|c| c.odds_ppb < cannabis_protocol::draw::ODDS_ONE)
        {
            self.log(
                now,
                None,
                format!("too few bids: call widened (odds {})", odds.join(", ")),
            );
        }
    }

    /// When an early-placed job published at `now` looks at its bids ahead of the window.
    fn early_look_after(&self, now: Timestamp) -> Option<Timestamp> {
        let look = now.plus_ms(EARLY_LOOK_MS);
        (self.bidding.early.is_some() && look < self.offer.expires_at).then_some(look)
    }

    /// Moves time on: places tasks whose bid window is over, expires awards nobody
    /// countersigned and leases nobody renewed, renews leases about to end, and fails
    /// what the deadline overtook. (Tasks that want a wider call stay bidding: the engine
    /// widens them first.)
    #[must_use]
    pub fn tick(&mut self, now: Timestamp) -> Vec<Action> {
        let mut actions = Vec::new();
        for i in 0..self.tasks.len() {
            if self.tasks[i].status.is_final() {
                continue;
            }
            if now >= self.offer.deadline {
                self.fail_task(i, Failure::DeadlinePassed, now, &mut actions);
                continue;
            }
            // Expired awards and leases end the attempt.
            let lapsed = self.tasks[i].ranks.iter().position(|a| {
                matches!(a.state, LeaseState::Offered | LeaseState::Current) && now >= a.expires_at
            });
            if let Some(rank) = lapsed {
                let why = match self.tasks[i].ranks[rank].state {
                    LeaseState::Offered => "the worker did not countersign in time",
                    _ => "the lease expired",
                };
                self.attempt_failed(i, rank, why, now, &mut actions);
                continue;
            }
            if self.tasks[i].status == TaskStatus::Bidding
                && (now >= self.offer.expires_at || self.early_ready(i, now))
                && !self.wants_wider_call(i, now)
            {
                self.place(i, now, &mut actions);
                continue;
            }
            let renew_to = now.plus_ms(self.config.lease_ms).min(self.offer.deadline);
            let margin = self.config.renew_margin_ms;
            let (requester, job_id) = (self.offer.requester, self.offer.job_id);
            let resend_ms = (margin / 3).max(1);
            for a in &mut self.tasks[i].ranks {
                let due = a.state == LeaseState::Current
                    && a.expires_at.ms_since(now) <= margin
                    && renew_to > a.expires_at
                    && a.first_renewal_at.is_none_or(|t| now >= t)
                    && a.renewal_sent.is_none_or(|t| now.ms_since(t) >= resend_ms);
                if due {
                    actions.push(a.renew(job_id, i as u32, requester, now, renew_to));
                }
            }
        }
        // The early look is taken once per version: a task that wants a wider call keeps it
        // until the engine publishes one (which sets the next look).
        if self.early_look_at.is_some_and(|t| now >= t)
            && !(0..self.tasks.len()).any(|i| self.wants_wider_call(i, now))
        {
            self.early_look_at = None;
        }
        actions
    }

    /// When [`Job::tick`] next has something to do, if ever.
    pub fn next_wake(&self) -> Option<Timestamp> {
        if self.state() != JobState::Open {
            return None;
        }
        let margin = self.config.renew_margin_ms;
        let mut at = self.offer.deadline;
        for t in &self.tasks {
            match t.status {
                // Waiting for the lock: [`Job::on_locked`] places it.
                TaskStatus::Bidding if self.escrow == Escrowed::Locking => {}
                TaskStatus::Bidding => {
                    at = at.min(self.offer.expires_at);
                    if let Some(look) = self.early_look_at {
                        at = at.min(look);
                    }
                }
                TaskStatus::Leasing | TaskStatus::Running => {
                    for a in &t.ranks {
                        match a.state {
                            LeaseState::Offered => at = at.min(a.expires_at),
                            // A lease that already runs to the deadline is not renewed.
                            LeaseState::Current if a.expires_at < self.offer.deadline => {
                                let renew = Timestamp(a.expires_at.0.saturating_sub(margin));
                                let resend = a
                                    .renewal_sent
                                    .map_or(renew, |t| t.plus_ms((margin / 3).max(1)));
                                let first = a.first_renewal_at.unwrap_or(renew);
                                at = at.min(renew.max(resend).max(first).min(a.expires_at));
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        Some(at)
    }

    /// What is left of task `i`'s budget for a placement.
    fn left(&self, i: usize) -> Result<Amount, MoneyError> {
        let t = &self.tasks[i];
        t.budget.checked_sub(t.spent)?.checked_sub(t.committed)
    }

    /// Places task `i` from its bids within what is left of its budget, and awards it.
    fn place(&mut self, i: usize, now: Timestamp, actions: &mut Vec<Action>) {
        if self.escrow == Escrowed::Locking {
            // No lock, no award: placed once the lock holds.
            return;
        }
        let task = &self.tasks[i];
        if task.failures >= self.config.max_attempts {
            let why = Failure::GaveUp {
                failures: task.failures,
            };
            self.fail_task(i, why, now, actions);
            return;
        }
        let left = match self.left(i) {
            Ok(left) => left,
            Err(e) => return self.fail_task(i, Failure::Money(e), now, actions),
        };
        let spec = &self.offer.tasks[i];
        match placement::place(spec, task.bids.values(), &task.excluded, left, now) {
            Ok(slots) => self.award(i, slots, now, actions),
            // The bids ran out after an attempt: the engine calls for them again.
            Err(Infeasible::NoBids | Infeasible::TooFewCompatible { .. })
                if self.wants_wider_call(i, now) => {}
            Err(why) => {
                let declined = task.declines.len();
                self.fail_task(i, Failure::Unplaceable { why, declined }, now, actions);
            }
        }
    }

    /// The digests of task `i`'s inputs that earlier tasks produced.
    fn pinned_inputs(&self, i: usize) -> Vec<NamedDigest> {
        self.offer.tasks[i]
            .inputs
            .iter()
            .filter_map(|input| match input {
                TaskInput::FromTask { task, output, name } => {
                    let digest = self.tasks.get(*task as usize)?.outputs.get(output)?;
                    Some(NamedDigest {
                        name: name.clone(),
                        digest: *digest,
                    })
                }
                TaskInput::Staged(_) => None,
            })
            .collect()
    }

    fn award(&mut self, i: usize, slots: Vec<Slot>, now: Timestamp, actions: &mut Vec<Action>) {
        let total = match Amount::sum(slots.iter().map(|s| &s.price))
            .and_then(|p| self.tasks[i].committed.checked_add(p))
        {
            Ok(t) => t,
            Err(e) => return self.fail_task(i, Failure::Money(e), now, actions),
        };
        let expires_at = now
            .plus_ms(self.config.award_timeout_ms)
            .min(self.offer.deadline);
        let inputs = self.pinned_inputs(i);
        let group = slots.len() > 1 || self.offer.tasks[i].group_size > 1;
        let offer_id = self.offer_id();
        let task = &mut self.tasks[i];
        task.attempts += 1;
        task.committed = total;
        let rendezvous = group.then(|| Rendezvous {
            id: rendezvous_id(&offer_id, i, &task.epochs),
            roster: slots
                .iter()
                .map(|s| RosterEntry {
                    rank: s.rank,
                    worker: s.worker,
                })
                .collect(),
        });
        task.ranks.clear();
        for s in &slots {
            let r = s.rank as usize;
            task.epochs[r] += 1;
            let resume = task.checkpoints.get(&s.rank).map(|k| Resume {
                digest: k.digest,
                size_bytes: k.size_bytes,
            });
            let award = Award {
                job_id: self.offer.job_id,
                task: i as u32,
                rank: s.rank,
                requester: self.offer.requester,
                worker: s.worker,
                epoch: task.epochs[r],
                bid: s.bid,
                price: s.price,
                issued_at: now,
                expires_at,
                renew_every_ms: self
                    .config
                    .lease_ms
                    .saturating_sub(self.config.renew_margin_ms),
                rendezvous: rendezvous.clone(),
                inputs: inputs.clone(),
                resume: resume.clone(),
            };
            task.ranks.push(Assignment {
                rank: s.rank,
                worker: s.worker,
                epoch: award.epoch,
                bid: s.bid,
                award: message_id(&award),
                price: s.price,
                state: LeaseState::Offered,
                expires_at,
                renewal_sent: None,
                first_renewal_at: None,
                progress: None,
                delivery: None,
                accepted: None,
                product: None,
                caught: None,
                resume,
            });
            actions.push(Action::Award(award));
        }
        task.status = TaskStatus::Leasing;
        let attempt = task.attempts;
        let text = slots
            .iter()
            .map(|s| format!("rank {} -> {} at {}", s.rank, s.worker, s.price))
            .collect::<Vec<_>>()
            .join(", ");
        self.log(
            now,
            Some(i as u32),
            format!("placed (attempt {attempt}): {text}"),
        );
    }

    /// An assignment of task `i` ended without delivering: the whole attempt ends (a group
    /// is all-or-nothing), the worker is not placed again, and the task is re-placed if
    /// attempts and budget allow.
    fn attempt_failed(
        &mut self,
        i: usize,
        rank: usize,
        reason: &str,
        now: Timestamp,
        actions: &mut Vec<Action>,
    ) {
        let worker = self.tasks[i].ranks[rank].worker;
        self.tasks[i].excluded.insert(worker);
        if self.tasks[i].ranks[rank].state == LeaseState::Current {
            self.tasks[i].failures += 1;
        }
        self.log(
            now,
            Some(i as u32),
            format!("rank {rank} on {worker} ended: {reason}"),
        );
        if let Err(e) = self.end_attempt(i, reason, now, actions) {
            return self.fail_task(i, Failure::Money(e), now, actions);
        }
        self.tasks[i].status = TaskStatus::Bidding;
        if now >= self.offer.expires_at {
            self.place(i, now, actions);
        }
    }

    /// Ends every live lease of task `i`'s attempt, telling the workers.
    fn end_attempt(
        &mut self,
        i: usize,
        reason: &str,
        now: Timestamp,
        actions: &mut Vec<Action>,
    ) -> Result<(), MoneyError> {
        let task = &mut self.tasks[i];
        let mut committed = task.committed;
        for a in &mut task.ranks {
            if matches!(a.state, LeaseState::Offered | LeaseState::Current) {
                a.state = LeaseState::Ended;
                committed = committed.checked_sub(a.price)?;
                // One per lease, naming its epoch: it can never end a later attempt's.
                actions.push(Action::Cancel(Cancel {
                    job_id: self.offer.job_id,
                    task: i as u32,
                    rank: a.rank,
                    requester: self.offer.requester,
                    worker: a.worker,
                    epoch: a.epoch,
                    reason: Cancel::reason(reason),
                    issued_at: now,
                }));
            }
        }
        task.committed = committed;
        Ok(())
    }

    fn end_task(
        &mut self,
        i: usize,
        status: TaskStatus,
        now: Timestamp,
        actions: &mut Vec<Action>,
    ) {
        let reason = status.to_string();
        // A money error here leaves the live leases' prices committed: the task still ends,
        // and the sums show the defect instead of hiding it.
        let _ = self.end_attempt(i, &reason, now, actions);
        self.tasks[i].status = status;
    }

    /// Task `i` fails; everything that depends on it, directly or not, is cancelled and its
    /// budget refunded.
    fn fail_task(&mut self, i: usize, why: Failure, now: Timestamp, actions: &mut Vec<Action>) {
        self.log(now, Some(i as u32), format!("failed: {why}"));
        let name = self.offer.tasks[i].name.clone();
        self.end_task(i, TaskStatus::Failed(why), now, actions);
        let mut stopped: BTreeSet<usize> = BTreeSet::from([i]);
        for j in i + 1..self.tasks.len() {
            let hit = self.offer.tasks[j]
                .depends_on
                .iter()
                .any(|d| stopped.contains(&(*d as usize)));
            if hit && !self.tasks[j].status.is_final() {
                stopped.insert(j);
                let why = Cancellation::DependencyFailed { task: name.clone() };
                self.log(now, Some(j as u32), format!("cancelled: {why}"));
                self.end_task(j, TaskStatus::Cancelled(why), now, actions);
            }
        }
    }
}

/// A fresh rendezvous id per group attempt, derived so every node can recompute it.
/// Whether a sealed file's figures hold: its plaintext within `cap`, and an age file that
/// can hold that plaintext (above its size, at most the largest one of it).
fn sealed_within(o: &cannabis_protocol::OutputDigest, cap: u64) -> Result<(), String> {
    if o.size_bytes > cap {
        return Err(format!(
            "is {} bytes, over its max_size of {cap}",
            o.size_bytes
        ));
    }
    if o.cipher_size > cannabis_protocol::max_cipher_size(o.size_bytes)
        || o.cipher_size <= o.size_bytes
    {
        return Err(format!(
            "in an age file of {} bytes cannot be {} bytes",
            o.cipher_size, o.size_bytes
        ));
    }
    Ok(())
}

fn rendezvous_id(offer: &Digest, task: usize, epochs: &[u64]) -> Uuid {
    let mut parts: Vec<Vec<u8>> = vec![b"cannabis/rendezvous/v1".to_vec(), offer.0.to_vec()];
    parts.push((task as u64).to_le_bytes().to_vec());
    for e in epochs {
        parts.push(e.to_le_bytes().to_vec());
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let d = Digest::of_parts(&refs);
    let mut b = [0u8; 16];
    b.copy_from_slice(&d.0[..16]);
    Uuid::from_random(b)
}
