//! [`Market`]: the whole market of one node as one sans-IO state machine, for the node and
//! the simulator alike.
//!
//! It owns both roles: the live [`View`], the requester's [`Job`]s, the worker's quotes,
//! bids and leases, and the challenge passes. It holds no clock, socket, key, random
//! source or store. Every input carries `now`; what it wants done comes out of
//! [`Market::poll_output`] in order, and [`Market::poll_timeout`] says when to call
//! [`Market::handle`] with [`Input::Tick`] next.
//!
//! **Durable before sent.** Records that changed are written out as one
//! [`Output::Persist`] per drain. Outputs that commit this node to something (a bid, an
//! award, a renewal, a countersignature, an acknowledgment, a published offer) are held
//! back until the driver calls [`Market::persisted`] for that batch. Verdicts on others'
//! gossip, refusals, penalties and events pass at once: forwarding gossip does not wait
//! for a disk. If a write fails, the driver drops the `Market` and [`Market::restore`]s it
//! from the store, which is then still the truth.
//!
//! **Signatures.** The driver signs what the engine sends; the engine checks the
//! signatures of what it receives, after the cheap checks (unless configured to assume
//! them, which only simulations do).
//!
//! See `docs/architecture.md` for the driver loop and ENGINE notes.

mod outbox;
mod requester;
mod spot;
mod worker;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use cannabis_protocol::{
    Address, Amount, Award, Bid, Cancel, CapabilityAd, ChallengePass, CheckpointNote, Decline,
    DeliveryManifest, DeliveryRecipient, Digest, EscrowAssign, EscrowAssignMany, EscrowCancel,
    EscrowLock, EscrowSettle, FeeTerms, Invalid, JobOffer, LeaseAccept, LeaseRenewal,
    MAX_AD_PASSES, MoneyError, NamedDigest, OutputDigest, Received, Rendezvous, ResourceUsage,
    ResultCommit, Resume, RunReport, RunStage, Signed, TaskSpec, Timestamp, TxPayload, Uuid,
};

use crate::attest::AttestationPolicy;
use crate::fanin::FaninConfig;
use crate::job::{Job, JobState, LeaseConfig, ProductVerdict};
use crate::lease::{AssignmentKey, EndReason, Lease, Leases, SentBid};
use crate::matching::{self, Context, Explanation};
use crate::quote::WorkerPolicy;
use crate::view::Signatures;
use crate::{OfferTemplate, Refusal, Verdict, View, ViewConfig};

use outbox::Outbox;

/// Settings of the engine.
#[derive(Clone, Debug, Default)]
pub struct MarketConfig {
    /// Limits of the live view.
    pub view: ViewConfig,
    /// Lease timing of the jobs this node publishes.
    pub leases: LeaseConfig,
    /// What this node takes as a worker.
    pub worker: WorkerPolicy,
    /// How this node calls for bids as a requester.
    pub fanin: FaninConfig,
    /// Whether signatures are checked (always, on a node).
    pub signatures: Signatures,
    /// The network's fee terms (rate and recipient), a network parameter: this node's
    /// offers carry them, and as a worker it declines offers that carry others. `None`:
    /// this node's network pins none, so it publishes no offer and takes none.
    pub fee: Option<FeeTerms>,
    /// Who resolves disputes on the ledger this node settles through (the genesis names
    /// it). `Some`: every job's budget is locked before any award, awards are assigned in
    /// its escrow, and this node's deliveries are committed there ([`Output::Settle`]).
    /// `None`: this node keeps no ledger and settles nothing.
    pub resolver: Option<Address>,
    /// Which confidential-execution evidence counts (a network setting): a job that
    /// requires confidential execution goes only to workers whose evidence does, and is
    /// refused at once where none can.
    pub attestation: AttestationPolicy,
    /// A secret of this node's that draws which delivered tasks are spot-checked
    /// ([`crate::spot::drawn`]): workers cannot predict the draw, and a restart draws the
    /// same.
    pub spot_secret: [u8; 32],
}

/// Who this node is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Its address (signing key).
    pub address: Address,
    /// Its age recipient, for outputs encrypted to it.
    pub delivery: DeliveryRecipient,
}

/// How long ended leases stay listed.
const KEEP_ENDED_MS: u64 = 3_600_000;

/// How long a finished job stays in the store.
const KEEP_JOBS_MS: u64 = 7 * 86_400_000;

macro_rules! ids {
    ($($(#[$m:meta])* $name:ident),*) => {$(
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);
    )*};
}

ids!(
    /// A gossip message the driver received, to report a verdict on.
    GossipId,
    /// An item of a sync page the driver received.
    SyncId,
    /// A request from a peer that the engine answers exactly once.
    InboundId,
    /// A request the engine sent.
    OutboundId,
    /// A batch of records to persist.
    BatchId
);

/// Where a gossiped kind of message came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Gossip: the driver reports the verdict to gossipsub.
    Gossip(GossipId),
    /// A sync page: the driver counts the verdicts.
    Sync(SyncId),
}

/// A gossiped ad or offer, decoded (see [`crate::decode_gossip`]) but not yet believed.
#[derive(Clone, Debug)]
pub struct Heard<T> {
    /// Where it came from.
    pub origin: Origin,
    /// When it was received, µs since the epoch.
    pub received_us: u64,
    /// The message.
    pub item: Arc<Received<T>>,
}

/// A directed market message from a peer.
#[derive(Clone, Debug)]
pub enum Inbound {
    /// A worker's bid.
    Bid(Received<Bid>),
    /// A worker's decline.
    Decline(Received<Decline>),
    /// A requester's award.
    Award(Received<Award>),
    /// A worker's countersignature.
    Accept(Received<LeaseAccept>),
    /// A requester's renewal.
    Renewal(Received<LeaseRenewal>),
    /// A requester's cancellation.
    Cancel(Received<Cancel>),
    /// A verifier's challenge pass for this node.
    Pass(Received<ChallengePass>),
    /// A worker's report on the work of a lease.
    RunReport(Received<RunReport>),
    /// A worker's delivery manifest.
    Deliver(Received<DeliveryManifest>),
    /// A worker's note that a rank's checkpoint changed.
    Checkpoint(Received<CheckpointNote>),
}

/// A peer's answer to a request the engine sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Taken.
    Ack,
    /// Refused, with the peer's reason.
    Refused(String),
}

/// What happens to the engine. (Passed by value and consumed at once, never stored: the
/// size of the largest variant costs nothing worth an allocation per message.)
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Input {
    /// A capability ad.
    Ad(Heard<CapabilityAd>),
    /// A job offer.
    Offer(Heard<JobOffer>),
    /// A directed request from `from` (the peer's address, from its connection).
    Request {
        /// Answered once, with [`Output::Reply`].
        req: InboundId,
        /// Who sent it.
        from: Address,
        /// What.
        msg: Inbound,
    },
    /// The answer to [`Output::Send`], or why none came.
    Response {
        /// The request.
        req: OutboundId,
        /// The answer, or the failure.
        result: Result<Answer, String>,
    },
    /// Time passed (wake at [`Market::poll_timeout`]; an early tick does nothing).
    Tick,
}

/// A message for the driver to sign and send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outbound {
    /// To a requester.
    Bid(Bid),
    /// To a requester.
    Decline(Decline),
    /// To a worker.
    Award(Award),
    /// To a requester.
    Accept(LeaseAccept),
    /// To a worker.
    Renewal(LeaseRenewal),
    /// To a worker.
    Cancel(Cancel),
    /// To a requester.
    RunReport(RunReport),
    /// To a requester.
    Deliver(DeliveryManifest),
    /// To a requester.
    Checkpoint(CheckpointNote),
}

/// The engine's answer to an inbound request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Taken (sent only once what it changed is durable).
    Ack,
    /// Refused.
    Refused(Refusal),
}

/// A message for the driver to sign, give back with [`Command::KeepOwnOffer`], and gossip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Publish {
    /// A job offer (new, or a new version with a wider call).
    Offer(JobOffer),
}

/// A record the engine keeps durably.
#[derive(Clone, Debug)]
pub enum Record {
    /// A live capability ad.
    Ad {
        /// The node (the key).
        node: Address,
        /// The signed ad.
        signed: Signed<CapabilityAd>,
        /// When it was received, µs since the epoch.
        received_us: u64,
    },
    /// An open offer.
    Offer {
        /// The job (the key).
        job: Uuid,
        /// The signed offer.
        signed: Signed<JobOffer>,
        /// When it was received, µs since the epoch.
        received_us: u64,
    },
    /// A job this node published (key: the job).
    Job(Box<Job>),
    /// A bid this node sent (key: its message id).
    SentBid(Digest, SentBid),
    /// A lease this node holds as a worker (key: the assignment).
    Lease(AssignmentKey, Lease),
    /// A challenge pass a verifier signed for this node.
    Pass {
        /// The verifier (the key).
        verifier: Address,
        /// The signed pass.
        signed: Signed<ChallengePass>,
    },
    /// A sequence counter (key: its name).
    Counter(String, u64),
}

/// The key of a [`Record`].
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RecordKey {
    /// An ad.
    Ad(Address),
    /// An offer.
    Offer(Uuid),
    /// A job.
    Job(Uuid),
    /// A sent bid.
    SentBid(Digest),
    /// A worker lease.
    Lease(AssignmentKey),
    /// A challenge pass.
    Pass(Address),
    /// A counter.
    Counter(String),
}

impl Record {
    /// Its key.
    pub fn key(&self) -> RecordKey {
        match self {
            Record::Ad { node, .. } => RecordKey::Ad(*node),
            Record::Offer { job, .. } => RecordKey::Offer(*job),
            Record::Job(j) => RecordKey::Job(j.id()),
            Record::SentBid(id, _) => RecordKey::SentBid(*id),
            Record::Lease(k, _) => RecordKey::Lease(*k),
            Record::Pass { verifier, .. } => RecordKey::Pass(*verifier),
            Record::Counter(name, _) => RecordKey::Counter(name.clone()),
        }
    }
}

/// A change to the store.
#[derive(Clone, Debug)]
pub enum RecordOp {
    /// Write (or replace) a record.
    Put(Record),
    /// Delete the record under a key.
    Delete(RecordKey),
}

/// What happened, for logs, metrics and the driver's own follow-ups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MarketEvent {
    /// This node bid on a task.
    BidSent {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The quote.
        price: cannabis_protocol::Amount,
    },
    /// This node declined a task, with its reason.
    Declined {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// Why.
        reason: String,
    },
    /// A bid for one of this node's jobs was kept.
    BidTaken {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The worker.
        worker: Address,
        /// Its quote.
        price: cannabis_protocol::Amount,
    },
    /// One of this node's jobs sent an award.
    Awarded {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The rank.
        rank: u32,
        /// The epoch.
        epoch: u64,
        /// The worker.
        worker: Address,
    },
    /// Every rank of a task of one of this node's jobs holds a current lease.
    TaskLeased {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
    },
    /// A job's offer was published again with a wider call.
    Widened {
        /// The job.
        job: Uuid,
    },
    /// A job ended (completed, failed or cancelled).
    JobEnded {
        /// The job.
        job: Uuid,
        /// How.
        state: JobState,
    },
    /// This node countersigned an award: it holds the lease.
    LeaseTaken {
        /// The assignment.
        key: AssignmentKey,
        /// The epoch.
        epoch: u64,
    },
    /// A lease this node held ended: its workload stops.
    LeaseEnded {
        /// The assignment.
        key: AssignmentKey,
        /// The epoch.
        epoch: u64,
        /// Why.
        reason: EndReason,
    },
    /// A verifier's challenge pass was kept: the next ad should carry it.
    PassKept {
        /// The verifier.
        verifier: Address,
    },
    /// A request from a peer was refused.
    Refused {
        /// The peer.
        from: Address,
        /// What it sent (`bid`, `award`, ...).
        what: &'static str,
        /// Why.
        why: Refusal,
    },
    /// A peer answered a request of this node (only logged: the lease timers cover
    /// answers that never came).
    Answered {
        /// What was sent.
        what: &'static str,
        /// To whom.
        to: Address,
        /// The answer, or why none came.
        result: Result<Answer, String>,
    },
    /// An ad or offer expired from the view.
    Expired {
        /// Nodes whose ad expired.
        ads: usize,
        /// Jobs whose offer expired.
        offers: Vec<Uuid>,
    },
}

/// What the engine asks the driver to do, in order.
#[derive(Clone, Debug)]
pub enum Output {
    /// Write these records in one durable transaction, then call [`Market::persisted`].
    Persist {
        /// The batch.
        batch: BatchId,
        /// The changes.
        ops: Vec<RecordOp>,
    },
    /// Report a verdict on a gossiped message or sync item.
    Validate {
        /// Which.
        origin: Origin,
        /// Accept (forward), ignore, or reject (and penalize).
        verdict: Verdict,
    },
    /// Sign `msg` and send it to `to`; give the answer back as [`Input::Response`].
    Send {
        /// The request.
        req: OutboundId,
        /// To whom.
        to: Address,
        /// What.
        msg: Outbound,
    },
    /// Answer an inbound request.
    Reply {
        /// Which.
        req: InboundId,
        /// The answer.
        answer: Reply,
    },
    /// Sign, keep ([`Command::KeepOwnOffer`]) and gossip.
    Publish(Publish),
    /// Lower a peer's score: it sent what no honest node sends.
    Penalize {
        /// The peer.
        peer: Address,
        /// What it did.
        why: Refusal,
    },
    /// Something happened.
    Event(MarketEvent),
    /// Run, extend or stop work on this node's executor for a lease it holds. Fenced: it
    /// comes only once the lease behind it is durable.
    Run(RunOrder),
    /// Fetch a delivered rank's outputs from its worker, check them against its signed
    /// manifest, keep them, then give back [`Command::Delivered`] (or
    /// [`Command::RankFailed`] if they cannot be had). Fenced: it comes once the manifest
    /// is durable; it comes again after a restart while the rank is still not done.
    Fetch(Box<Signed<DeliveryManifest>>),
    /// Fetch a rank's checkpoint from its worker (the [`ObjectKind::Checkpoint`] named by
    /// the note's `seq`), check it against the note, keep it, then give back
    /// [`Command::CheckpointKept`]. A checkpoint that cannot be had is let go: the one
    /// kept before stays. Comes for each note newer than the checkpoint kept for that rank.
    ///
    /// [`ObjectKind::Checkpoint`]: cannabis_protocol::ObjectKind::Checkpoint
    FetchCheckpoint(Box<CheckpointNote>),
    /// Check a delivered synthetic product against its task without recomputing it (the
    /// rank's `product.i32` and `result.json` as the fetch kept them: the result's seed and
    /// size, the product's hash, Freivalds' method), then give back
    /// [`Command::ProductChecked`]. Comes once the rank is done, and again after a restart
    /// until a verdict is kept.
    CheckProduct(ProductCheck),
    /// Evaluate what a job delivered against its offer's evaluation terms: check the
    /// artifacts, run the evaluator in the sandbox on the delivered outputs and the
    /// held-out data, sign the report, then give back [`Command::Evaluated`]. Comes once
    /// every task delivered (and on [`Command::Evaluate`]), and again after a restart
    /// until the run's report is kept.
    Evaluate(Box<EvaluationOrder>),
    /// Ask settlement for this (sign it as a transaction of this node's and submit it
    /// once the ledger's state lets it apply). Fenced: it comes once the job or lease
    /// behind it is durable. A lock is answered with [`Command::Locked`].
    Settle(Settle),
}

/// A job's deliveries to evaluate ([`Output::Evaluate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvaluationOrder {
    /// The job.
    pub job: Uuid,
    /// The run: the same run asked again (after a restart) is the same evaluation.
    pub run: u32,
    /// The terms, as the offer pinned them.
    pub terms: cannabis_protocol::EvaluationTerms,
    /// The metrics the report judges.
    pub acceptance: Vec<cannabis_protocol::AcceptanceMetric>,
    /// Every delivered rank, with what its signed manifest says it delivered.
    pub deliveries: Vec<(cannabis_protocol::EvaluatedDelivery, Vec<OutputDigest>)>,
}

/// A delivered synthetic product to check ([`Output::CheckProduct`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProductCheck {
    /// The job.
    pub job: Uuid,
    /// The task.
    pub task: u32,
    /// The rank.
    pub rank: u32,
    /// The epoch that delivered it.
    pub epoch: u64,
    /// The task's seed at that epoch ([`RunOrder::seed`] of the award).
    pub seed: Digest,
    /// The task's dimension.
    pub n: u32,
}

/// What the engine asks of settlement: the [`crate::ledger`]'s escrow operations. The
/// embedded ledger carries them as transactions; an adapter to another chain would map
/// them to its own. Releases and refunds are the ledger's own doing (timeouts at block
/// time, the escrow closing once every assignment settled); queries go to the ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Lock a job's budget with its pinned terms (before any award).
    Lock(EscrowLock),
    /// Bind an award (worker, epoch, price) to the job's escrow.
    Assign(EscrowAssign),
    /// Bind awards made together (a group's ranks) to the job's escrow, in one operation.
    AssignMany(EscrowAssignMany),
    /// This node, as worker, commits what it delivered.
    Commit(ResultCommit),
    /// The requester accepts a delivery, whole or in part.
    Accept(EscrowSettle),
    /// The requester disputes a delivery inside its review window.
    Dispute(EscrowSettle),
    /// The requester ends the job: undelivered assignments are cancelled, the rest of the
    /// lock refunded once the delivered ones settle.
    Cancel(EscrowCancel),
}

impl Settle {
    /// The job it is about.
    pub fn job(&self) -> Uuid {
        match self {
            Settle::Lock(l) => l.job_id,
            Settle::Assign(a) => a.job_id,
            Settle::AssignMany(a) => a.job_id,
            Settle::Commit(c) => c.job_id,
            Settle::Accept(s) | Settle::Dispute(s) => s.job_id,
            Settle::Cancel(c) => c.job_id,
        }
    }

    /// The amount the transaction moves (a lock's budget; nothing for the rest) and its
    /// payload.
    pub fn into_payload(self) -> (Amount, TxPayload) {
        match self {
            Settle::Lock(l) => (l.amount, TxPayload::EscrowLock(l)),
            Settle::Assign(a) => (Amount::ZERO, TxPayload::EscrowAssign(a)),
            Settle::AssignMany(a) => (Amount::ZERO, TxPayload::EscrowAssignMany(a)),
            Settle::Commit(c) => (Amount::ZERO, TxPayload::ResultCommit(c)),
            Settle::Accept(s) => (Amount::ZERO, TxPayload::EscrowSettle(s)),
            Settle::Dispute(s) => (Amount::ZERO, TxPayload::EscrowDispute(s)),
            Settle::Cancel(c) => (Amount::ZERO, TxPayload::EscrowCancel(c)),
        }
    }
}

/// What the worker's executor must do for a lease this node holds. Each names its attempt
/// by a request id made of job, task, rank and epoch, so a repeated order (a restart, an
/// award seen twice) never runs the work twice, and a stale epoch is another request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunOrder {
    /// The lease is current: admit and run the task (or, when the executor already has
    /// this request, find it again and extend it).
    Start {
        /// The executor's request id.
        request_id: String,
        /// The assignment.
        key: AssignmentKey,
        /// Its epoch.
        epoch: u64,
        /// The task as the offer published it (`None`: the offer is gone; only an attempt
        /// the executor already has can go on).
        task: Option<Box<TaskSpec>>,
        /// The synthetic task's seed, from the award (unknown before it).
        seed: Digest,
        /// The lease's end.
        until: Timestamp,
        /// The requester, to which the outputs go.
        requester: Address,
        /// The offer's delivery recipient, to which the outputs are encrypted (`None`:
        /// a lease taken before it was kept; its outputs cannot be delivered).
        deliver_to: Option<DeliveryRecipient>,
        /// The award's pinned digests of the inputs that earlier tasks delivered.
        inputs: Vec<NamedDigest>,
        /// The group attempt this rank belongs to, for a group task: the ranks that reach
        /// each other through the group's channel while the lease holds.
        group: Option<Box<Rendezvous>>,
        /// The checkpoint the award pins for the rank to resume from, fetched from the
        /// requester ([`cannabis_protocol::ObjectKind::Checkpoint`]).
        resume: Option<Box<Resume>>,
    },
    /// The lease was renewed: the attempt may run until `until`.
    Renew {
        /// The executor's request id.
        request_id: String,
        /// The lease's new end.
        until: Timestamp,
    },
    /// The lease ended: stop the attempt (the stop recorded first).
    Stop {
        /// The executor's request id.
        request_id: String,
        /// Why.
        why: String,
    },
}

impl RunOrder {
    /// The executor's request id for an assignment at an epoch.
    pub fn request_id(key: &AssignmentKey, epoch: u64) -> String {
        format!("lease/{}/{}/{}/{epoch}", key.0, key.1, key.2)
    }

    /// The synthetic task's seed for the award with message id `award`.
    pub fn seed(award: &Digest) -> Digest {
        let mut bytes = b"cannabis/synthetic-seed/v1/".to_vec();
        bytes.extend_from_slice(&award.0);
        Digest::of(&bytes)
    }
}

/// What the node's owner or requester asks of the engine. (Consumed at once, never
/// stored.)
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Publish an offer from a template and run its job (bids, placement, leases).
    Submit {
        /// The job.
        template: OfferTemplate,
        /// Random bytes for the job id, when the template has none.
        nonce: [u8; 16],
    },
    /// Publish an offer without running a job for it: its bids are only listed.
    PublishOffer {
        /// The offer.
        template: OfferTemplate,
        /// Random bytes for the job id, when the template has none.
        nonce: [u8; 16],
    },
    /// This node's own ad, signed: keep it in the view (the driver then gossips it).
    KeepOwnAd(Received<CapabilityAd>, u64),
    /// This node's own offer as asked by [`Output::Publish`], signed: keep it in the view.
    KeepOwnOffer(Received<JobOffer>, u64),
    /// Cancel a job: every live lease gets a cancellation.
    Cancel(Uuid),
    /// This node answered a capability challenge that `verifier` set with `seed`: a pass
    /// for it will be kept.
    ChallengeAnswered {
        /// Who set it.
        verifier: Address,
        /// Its seed.
        seed: Digest,
    },
    /// A node passed a challenge this node set: matching counts it.
    ChallengePassed {
        /// The node.
        worker: Address,
        /// When.
        at: Timestamp,
    },
    /// A rank of one of this node's jobs delivered, checked by the delivery path.
    Delivered {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The rank.
        rank: u32,
        /// Its epoch.
        epoch: u64,
        /// Output digests by name.
        outputs: Vec<NamedDigest>,
    },
    /// A delivered synthetic product was checked ([`Output::CheckProduct`]): a failed
    /// check disputes that rank's delivery. Once per rank and epoch; a repeat changes
    /// nothing.
    ProductChecked {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The rank.
        rank: u32,
        /// Its epoch.
        epoch: u64,
        /// The verdict.
        verdict: ProductVerdict,
    },
    /// Evaluate a delivered job again, by hand ([`Output::Evaluate`] with a new run).
    Evaluate(Uuid),
    /// The signed report of an evaluation run ([`Output::Evaluate`]): a pass accepts every
    /// delivery (or waits for the requester's confirmation when the terms say so); a
    /// failure, or an evaluation that could not be made, disputes them with the report as
    /// evidence. A report of a run no longer asked changes nothing.
    Evaluated {
        /// The job.
        job: Uuid,
        /// The run.
        run: u32,
        /// The requester's signed report.
        report: Box<Signed<cannabis_protocol::Evaluation>>,
    },
    /// The executor's attempt for a lease this node holds changed stage: the requester is
    /// told (only while the lease is current at that epoch).
    Ran {
        /// The executor's request id ([`RunOrder::request_id`]).
        request_id: String,
        /// Where the attempt stands.
        stage: RunStage,
        /// Why, for a refusal or a failure (cut to 256 bytes).
        detail: String,
    },
    /// The outputs of a completed leased attempt are sealed (encrypted to the requester
    /// and ready to serve): the requester gets the signed manifest (only while the lease
    /// is current at that epoch).
    Prepared {
        /// The executor's request id ([`RunOrder::request_id`]).
        request_id: String,
        /// Every output the task delivers, in the order of
        /// [`cannabis_protocol::TaskSpec::delivered_outputs`].
        outputs: Vec<OutputDigest>,
        /// What the run used.
        usage: ResourceUsage,
        /// The workload's exit code.
        exit_code: Option<i32>,
        /// The machine, as the probe describes it.
        hardware: String,
    },
    /// A leased attempt's checkpoint changed and is sealed (encrypted to the requester and
    /// ready to serve as [`cannabis_protocol::ObjectKind::Checkpoint`] named `seq`): the
    /// requester gets a signed note (only while the lease is current at that epoch).
    CheckpointSealed {
        /// The executor's request id ([`RunOrder::request_id`]).
        request_id: String,
        /// Counts the attempt's checkpoints from 1.
        seq: u64,
        /// The checkpoint's digests and sizes.
        checkpoint: OutputDigest,
    },
    /// A rank's checkpoint was fetched and checked ([`Output::FetchCheckpoint`]): an award
    /// of that rank at a later epoch pins it, and its worker resumes from it. An older
    /// one than the checkpoint kept changes nothing.
    CheckpointKept {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The rank.
        rank: u32,
        /// The epoch it was made under.
        epoch: u64,
        /// Its number within that epoch's attempt.
        seq: u64,
        /// SHA-256 of its plaintext.
        digest: Digest,
        /// Its size.
        size_bytes: u64,
    },
    /// What this node's executor admits at most (the owner's limits): a worker quotes and
    /// takes awards only for tasks that fit in what its live leases leave of it. Until
    /// it is given, the node's own ad counts (its whole cores, memory, storage and GPUs).
    Capacity(Capacity),
    /// The workers with strikes on the ledger this node keeps, and how many each (all of
    /// them: the map replaces the last one). Placement weighs a bid by its price times one
    /// more than its worker's strikes (see [`crate::placement`]); bids held are weighed
    /// again.
    Strikes(BTreeMap<Address, u64>),
    /// The lock of a job's budget ([`Settle::Lock`]) is in a block (`refused: None`), or
    /// it was refused: the job's tasks fail.
    Locked {
        /// The job.
        job: Uuid,
        /// Why it was refused.
        refused: Option<String>,
    },
    /// The requester accepts what a job delivered: `part_ppm` of each delivered rank's
    /// price is paid (1,000,000: all of it).
    Accept {
        /// The job.
        job: Uuid,
        /// The part accepted, in parts per million.
        part_ppm: u32,
    },
    /// The requester disputes what a job delivered: the money stays in escrow until the
    /// resolver settles it.
    Dispute {
        /// The job.
        job: Uuid,
        /// Why (kept in the job's history, for the resolver).
        reason: String,
    },
    /// A rank of one of this node's jobs failed, as its worker reported it.
    RankFailed {
        /// The job.
        job: Uuid,
        /// The task.
        task: u32,
        /// The rank.
        rank: u32,
        /// Its epoch.
        epoch: u64,
        /// Why.
        reason: String,
    },
}

/// What a worker's executor admits at most, across all its leases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    /// CPU in thousandths of a core.
    pub cpu_millicores: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Work-directory bytes.
    pub storage_bytes: u64,
    /// Whole GPUs.
    pub gpus: u64,
}

/// What a command did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandOk {
    /// A job was created; its offer follows as [`Output::Publish`].
    Submitted {
        /// The job.
        job: Uuid,
        /// The offer's message id.
        offer: Digest,
    },
    /// An offer was kept in the view.
    Kept(Digest),
    /// Done.
    Done,
}

/// Why a command was not carried out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// The offer breaks a rule of its type.
    #[error("invalid offer: {0}")]
    Invalid(#[from] Invalid),
    /// The view did not take the message.
    #[error("not published: {0:?}")]
    NotKept(Verdict),
    /// No job of this node has that id.
    #[error("this node published no job {0}")]
    UnknownJob(Uuid),
    /// The job is over.
    #[error("job {job} is already over ({state:?})")]
    JobOver {
        /// The job.
        job: Uuid,
        /// Its state.
        state: JobState,
    },
    /// The job id is taken.
    #[error("job id {0} is already used")]
    JobIdTaken(Uuid),
    /// Money that does not add up.
    #[error("money: {0}")]
    Money(#[from] MoneyError),
    /// The state machine refused.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// This node has published as many offers as every node takes from one requester in
    /// this time: another now would be dropped by them all.
    #[error(
        "this node is past the rate at which nodes take one requester's offers \
         ({} at once, then {} a minute): wait and publish again",
        .0.burst,
        .0.per_minute
    )]
    OverRate(crate::rate::Rate),
    /// The network's fee terms are not configured, and an offer must carry them.
    #[error(
        "this node's network pins no fee terms: set the fee rate and recipient \
         (`gossip.fee` in the node's configuration)"
    )]
    NoFeeTerms,
    /// A task requires confidential execution, and no evidence can verify on this node's
    /// network: it could go nowhere, and never to an ordinary host.
    #[error("task {task} requires confidential execution, but {why}")]
    NoConfidentialVerifier {
        /// The task's index.
        task: u32,
        /// Why no evidence can count.
        why: &'static str,
    },
    /// The job settles through no ledger: there is nothing to accept or dispute.
    #[error("job {0} is not settled through a ledger (this node has no genesis)")]
    Unsettled(Uuid),
    /// No rank of the job has delivered.
    #[error("job {0} has no delivery to settle yet")]
    NothingDelivered(Uuid),
    /// The job's offer names no evaluation.
    #[error("job {0} has no evaluation terms (its job file has no [evaluation])")]
    NoEvaluation(Uuid),
    /// An evaluation report not signed by this node, or not of its job.
    #[error("an evaluation report not taken: {0}")]
    BadReport(String),
    /// The job has not delivered everything yet.
    #[error("job {0} is evaluated once every task delivered")]
    NotDelivered(Uuid),
    /// A part outside 0..=100%.
    #[error("a part of {0} ppm is not between 0 and 1,000,000")]
    BadPart(u32),
}

/// What a request the engine sent was for.
#[derive(Clone, Debug)]
enum Purpose {
    /// An award, with the sends it has had: one whose connection dropped before an answer
    /// is sent again (at most [`BID_SENDS`] in all) while the worker may still countersign
    /// it, or a group waits for that rank until the award runs out.
    Award(Box<Award>, u8),
    Renew(LeaseRenewal),
    /// A bid, with the sends it has had: one whose connection dropped before an answer is
    /// sent again (at most [`BID_SENDS`] in all) while it is valid.
    Bid(Bid, Address, u8),
    /// A lease acceptance, with the sends it has had: one whose connection dropped before
    /// an answer is sent again (at most [`BID_SENDS`] in all) while the lease holds, or a
    /// group waits for that rank until the award runs out.
    Accept(LeaseAccept, Address, u8),
    Other(&'static str, Address),
}

/// How many times a bid is sent when no answer comes back (a connection closed under it,
/// a peer that restarted): without a second send, one dropped connection was enough to
/// leave a group one bid short.
const BID_SENDS: u8 = 3;

/// An offer published without a job: bids for it are kept and listed, nothing else.
#[derive(Clone, Debug)]
struct Bare {
    offer: Digest,
    keep: u32,
    bids: BTreeMap<(u32, Address), (Bid, Digest)>,
}

/// The market of one node.
pub struct Market {
    config: MarketConfig,
    me: Identity,
    now: Timestamp,
    view: View,
    jobs: BTreeMap<Uuid, Job>,
    /// When each open job next needs a tick.
    wakes: BTreeSet<(Timestamp, Uuid)>,
    wake_of: BTreeMap<Uuid, Timestamp>,
    bare: BTreeMap<Uuid, Bare>,
    leases: Leases,
    /// Tasks this node declined, so a widened offer is not declined again.
    declined: BTreeMap<Uuid, BTreeSet<u32>>,
    /// Whether this worker stayed silent on an offer it matches for want of a free slot or
    /// resources (or withdrew a quote for it): the offers held are answered again when a
    /// lease ends.
    withheld: bool,
    /// What this node's executor admits at most ([`Command::Capacity`]).
    capacity: Option<Capacity>,
    /// When each node last passed a challenge this node set.
    local_passes: BTreeMap<Address, Timestamp>,
    /// Workers' strikes on the ledger (disputes settled against them), which placement
    /// weighs ([`Command::Strikes`]).
    strikes: BTreeMap<Address, u64>,
    /// Passes other nodes signed for this one, by verifier.
    own_passes: BTreeMap<Address, (Signed<ChallengePass>, ChallengePass)>,
    /// Challenges this node answered lately: who set them, with which seed.
    answered: VecDeque<(Address, Digest)>,
    counters: BTreeMap<String, u64>,
    pending: BTreeMap<OutboundId, Purpose>,
    next_request: u64,
    out: Outbox,
}

/// How many answered challenges are remembered, waiting for their pass.
const ANSWERED_KEPT: usize = 8;

impl Market {
    /// An engine with nothing in it.
    pub fn new(config: MarketConfig, me: Identity, now: Timestamp) -> Self {
        Self {
            view: View::new(config.view.clone(), config.signatures),
            leases: Leases::new(me.address),
            config,
            me,
            now,
            jobs: BTreeMap::new(),
            wakes: BTreeSet::new(),
            wake_of: BTreeMap::new(),
            bare: BTreeMap::new(),
            declined: BTreeMap::new(),
            withheld: false,
            capacity: None,
            local_passes: BTreeMap::new(),
            strikes: BTreeMap::new(),
            own_passes: BTreeMap::new(),
            answered: VecDeque::new(),
            counters: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_request: 0,
            out: Outbox::default(),
        }
    }

    /// Rebuilds the engine from what the store kept. Ads, offers and passes are checked
    /// again (signatures included); what no longer holds, and jobs over for a week, are
    /// deleted by the first [`Output::Persist`].
    pub fn restore(
        config: MarketConfig,
        me: Identity,
        now: Timestamp,
        records: impl IntoIterator<Item = Record>,
    ) -> Self {
        let mut m = Self::new(config, me, now);
        let mut bids = Vec::new();
        let mut leases = Vec::new();
        // What the store kept was taken within the per-signer rates when it arrived: it is
        // loaded without them, and they apply from here on.
        let rates = (
            m.view.config.offer_rate.take(),
            m.view.config.ad_rate.take(),
        );
        for record in records {
            let key = record.key();
            match record {
                Record::Ad {
                    node,
                    signed,
                    received_us,
                } => {
                    let kept = signed.open().ok().is_some_and(|item| {
                        item.body.node == node
                            && matches!(
                                m.view.on_ad(Arc::new(item), now, received_us),
                                Verdict::Accept(_)
                            )
                    });
                    if !kept {
                        m.out.dirty(key);
                    }
                }
                Record::Offer {
                    job,
                    signed,
                    received_us,
                } => {
                    let kept = signed.open().ok().is_some_and(|item| {
                        item.body.job_id == job
                            && matches!(
                                m.view.on_offer(Arc::new(item), now, received_us),
                                Verdict::Accept(_)
                            )
                    });
                    if !kept {
                        m.out.dirty(key);
                    }
                }
                Record::Job(job) => {
                    let over = job.state() != JobState::Open
                        && now.ms_since(job.offer().deadline) > KEEP_JOBS_MS;
                    if over {
                        m.out.dirty(key);
                    } else {
                        let id = job.id();
                        // Outputs delivered but not yet fetched are fetched again.
                        for due in job.fetches_due() {
                            m.out.fenced(Output::Fetch(Box::new(due)));
                        }
                        // Products delivered but not yet checked are checked.
                        for check in requester::product_checks_due(&job) {
                            m.out.fenced(Output::CheckProduct(check));
                        }
                        // An evaluation asked and not answered is asked again.
                        if let Some(run) = job.evaluation_running()
                            && let Some(order) = requester::evaluation_order(&job, run)
                        {
                            m.out.fenced(Output::Evaluate(Box::new(order)));
                        }
                        // A lock asked for before a restart is asked for again (settlement
                        // answers at once if it is in a block already).
                        if let Some(resolver) = m.config.resolver
                            && *job.escrow() == crate::job::Escrowed::Locking
                            && job.state() == JobState::Open
                        {
                            let order = requester::lock_of(job.offer(), job.offer_id(), resolver);
                            m.out.fenced(Output::Settle(order));
                        }
                        m.jobs.insert(id, *job);
                        m.rewake(id);
                    }
                }
                Record::SentBid(id, sent) => bids.push((id, sent)),
                Record::Lease(k, lease) => leases.push((k, lease)),
                Record::Pass { verifier, signed } => {
                    let verified = signed
                        .verify()
                        .ok()
                        .filter(|v| v.body.worker == m.me.address && v.body.verifier == verifier);
                    match verified {
                        Some(v) => {
                            m.own_passes.insert(v.body.verifier, (signed, v.body));
                        }
                        None => m.out.dirty(key),
                    }
                }
                Record::Counter(name, value) => {
                    m.counters.insert(name, value);
                }
            }
        }
        (m.view.config.offer_rate, m.view.config.ad_rate) = rates;
        m.forget_evicted();
        m.leases = Leases::restore(m.me.address, bids, leases);
        // Work under leases still current goes on: the executor finds each attempt again
        // by its request id (or runs it, if it never got it).
        let current: Vec<(AssignmentKey, Lease)> = m
            .leases
            .iter()
            .filter(|(_, l)| l.is_live() && !l.assembling && l.expires_at > now)
            .map(|(k, l)| (*k, l.clone()))
            .collect();
        for (key, lease) in current {
            m.run_start(key, &lease);
        }
        // Offers it may have stayed silent on before the restart are answered again when
        // a lease ends.
        m.withheld = true;
        m.prune_passes();
        m
    }

    /// Forgets the offers the view pushed out to make room.
    fn forget_evicted(&mut self) {
        for job in self.view.take_evicted() {
            self.out.dirty(RecordKey::Offer(job));
            self.bare.remove(&job);
            self.declined.remove(&job);
        }
    }

    /// This node's identity.
    pub fn identity(&self) -> &Identity {
        &self.me
    }

    /// The engine's time: the latest `now` it was given.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    fn advance(&mut self, now: Timestamp) {
        // Time never goes back: an older `now` (a clock stepped back) counts as the last.
        self.now = self.now.max(now);
    }

    /// Feeds one input.
    pub fn handle(&mut self, now: Timestamp, input: Input) {
        self.advance(now);
        match input {
            Input::Ad(heard) => self.on_ad(heard),
            Input::Offer(heard) => self.on_offer(heard),
            Input::Request { req, from, msg } => self.on_request(req, from, msg),
            Input::Response { req, result } => self.on_response(req, result),
            Input::Tick => self.on_tick(),
        }
    }

    /// Carries out a command of the node's owner or requester.
    pub fn command(&mut self, now: Timestamp, command: Command) -> Result<CommandOk, CommandError> {
        self.advance(now);
        match command {
            Command::Submit { template, nonce } => self.submit(template, nonce, true),
            Command::PublishOffer { template, nonce } => self.submit(template, nonce, false),
            Command::KeepOwnAd(item, received_us) => {
                let id = item.id;
                match self.view.on_ad(Arc::new(item), self.now, received_us) {
                    Verdict::Accept(_) => {
                        self.out.dirty(RecordKey::Ad(self.me.address));
                        Ok(CommandOk::Kept(id))
                    }
                    other => Err(CommandError::NotKept(other)),
                }
            }
            Command::KeepOwnOffer(item, received_us) => {
                let (id, job) = (item.id, item.body.job_id);
                match self.view.on_offer(Arc::new(item), self.now, received_us) {
                    Verdict::Accept(_) => {
                        self.forget_evicted();
                        self.out.dirty(RecordKey::Offer(job));
                        Ok(CommandOk::Kept(id))
                    }
                    other => Err(CommandError::NotKept(other)),
                }
            }
            Command::Cancel(job) => self.cancel(job),
            Command::ChallengeAnswered { verifier, seed } => {
                if self.answered.len() == ANSWERED_KEPT {
                    self.answered.pop_front();
                }
                self.answered.push_back((verifier, seed));
                Ok(CommandOk::Done)
            }
            Command::ChallengePassed { worker, at } => {
                self.local_passes.insert(worker, at);
                Ok(CommandOk::Done)
            }
            Command::Delivered {
                job,
                task,
                rank,
                epoch,
                outputs,
            } => self.delivered(job, task, rank, epoch, &outputs),
            Command::ProductChecked {
                job,
                task,
                rank,
                epoch,
                verdict,
            } => self.product_checked(job, task, rank, epoch, verdict),
            Command::Capacity(c) => {
                let more = self.capacity.is_some_and(|old| {
                    c.cpu_millicores > old.cpu_millicores
                        || c.memory_bytes > old.memory_bytes
                        || c.storage_bytes > old.storage_bytes
                        || c.gpus > old.gpus
                });
                self.capacity = Some(c);
                if more {
                    // Offers it stayed silent on may fit now.
                    self.withheld = true;
                }
                Ok(CommandOk::Done)
            }
            Command::Strikes(strikes) => {
                for (id, job) in &mut self.jobs {
                    if job.set_strikes(&strikes) {
                        self.out.dirty(RecordKey::Job(*id));
                    }
                }
                self.strikes = strikes;
                Ok(CommandOk::Done)
            }
            Command::Locked { job, refused } => {
                let now = self.now;
                let j = self.job_mut(job)?;
                let actions = j.on_locked(refused.map_or(Ok(()), Err), now);
                self.job_changed(job, actions);
                Ok(CommandOk::Done)
            }
            Command::Evaluate(job) => self.evaluate(job, true).map(|_| CommandOk::Done),
            Command::Evaluated { job, run, report } => self.evaluated(job, run, *report),
            Command::Accept { job, part_ppm } => {
                self.settle_delivered(job, Some(part_ppm), None, false)
            }
            Command::Dispute { job, reason } => {
                self.settle_delivered(job, None, Some(reason), false)
            }
            Command::RankFailed {
                job,
                task,
                rank,
                epoch,
                reason,
            } => {
                let now = self.now;
                let j = self.job_mut(job)?;
                let actions = j.on_failed(task, rank, epoch, &reason, now)?;
                self.job_changed(job, actions);
                Ok(CommandOk::Done)
            }
            Command::Ran {
                request_id,
                stage,
                detail,
            } => {
                self.report_run(&request_id, stage, detail)?;
                Ok(CommandOk::Done)
            }
            Command::Prepared {
                request_id,
                outputs,
                usage,
                exit_code,
                hardware,
            } => {
                self.deliver(&request_id, outputs, usage, exit_code, hardware)?;
                Ok(CommandOk::Done)
            }
            Command::CheckpointSealed {
                request_id,
                seq,
                checkpoint,
            } => {
                self.send_checkpoint(&request_id, seq, checkpoint)?;
                Ok(CommandOk::Done)
            }
            Command::CheckpointKept {
                job,
                task,
                rank,
                epoch,
                seq,
                digest,
                size_bytes,
            } => {
                let j = self.job_mut(job)?;
                let kept = crate::job::KeptCheckpoint {
                    epoch,
                    seq,
                    digest,
                    size_bytes,
                };
                if j.keep_checkpoint(task, rank, kept)? {
                    self.out.dirty(RecordKey::Job(job));
                }
                Ok(CommandOk::Done)
            }
        }
    }

    /// The next thing to do, in order; `None` when there is nothing (or when the rest waits
    /// for [`Market::persisted`]).
    pub fn poll_output(&mut self) -> Option<Output> {
        if let Some(o) = self.out.pop_free() {
            return Some(o);
        }
        if self.out.is_waiting() {
            return None;
        }
        if self.out.has_dirty() {
            let ops = self
                .out
                .take_dirty()
                .into_iter()
                .map(|key| match self.current(&key) {
                    Some(record) => RecordOp::Put(record),
                    None => RecordOp::Delete(key),
                })
                .collect();
            return Some(self.out.persist(ops));
        }
        self.out.pop_fenced()
    }

    /// A batch from [`Output::Persist`] is durable: what waited for it may go.
    pub fn persisted(&mut self, batch: BatchId) {
        self.out.persisted(batch);
    }

    /// When to feed [`Input::Tick`] next.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let jobs = self.wakes.first().map(|(t, _)| *t);
        let view = self.view.poll_timeout();
        let leases = self.leases.next_wake(KEEP_ENDED_MS);
        [jobs, view, leases].into_iter().flatten().min()
    }

    /// The record under `key` as it is now, or `None` if it is gone.
    fn current(&self, key: &RecordKey) -> Option<Record> {
        match key {
            RecordKey::Ad(node) => self.view.ad(node).map(|e| Record::Ad {
                node: *node,
                signed: e.signed(),
                received_us: e.received_at_us(),
            }),
            RecordKey::Offer(job) => self.view.offer(job).map(|e| Record::Offer {
                job: *job,
                signed: e.signed(),
                received_us: e.received_at_us(),
            }),
            RecordKey::Job(id) => self.jobs.get(id).map(|j| Record::Job(Box::new(j.clone()))),
            RecordKey::SentBid(id) => self
                .leases
                .bids()
                .find(|(b, _)| *b == id)
                .map(|(b, s)| Record::SentBid(*b, s.clone())),
            RecordKey::Lease(k) => self.leases.get(k).map(|l| Record::Lease(*k, l.clone())),
            RecordKey::Pass(v) => self.own_passes.get(v).map(|(s, _)| Record::Pass {
                verifier: *v,
                signed: s.clone(),
            }),
            RecordKey::Counter(name) => self
                .counters
                .get(name)
                .map(|v| Record::Counter(name.clone(), *v)),
        }
    }

    /// The next value of counter `name`: above every value it gave before, at least `floor`.
    fn next_seq(&mut self, name: &str, floor: u64) -> u64 {
        let last = self.counters.get(name).copied().unwrap_or(0);
        let next = last.saturating_add(1).max(floor);
        self.counters.insert(name.to_string(), next);
        self.out.dirty(RecordKey::Counter(name.to_string()));
        next
    }

    fn send(&mut self, to: Address, msg: Outbound, purpose: Purpose) {
        self.next_request += 1;
        let req = OutboundId(self.next_request);
        self.pending.insert(req, purpose);
        self.out.fenced(Output::Send { req, to, msg });
    }

    fn event(&mut self, e: MarketEvent) {
        self.out.free(Output::Event(e));
    }

    // ---- Gossip ----

    fn validate(&mut self, origin: Origin, verdict: Verdict) {
        self.out.free(Output::Validate { origin, verdict });
    }

    fn on_ad(&mut self, heard: Heard<CapabilityAd>) {
        let node = heard.item.body.node;
        let verdict = self.view.on_ad(heard.item, self.now, heard.received_us);
        if matches!(verdict, Verdict::Accept(_)) {
            self.out.dirty(RecordKey::Ad(node));
        }
        self.validate(heard.origin, verdict);
    }

    fn on_offer(&mut self, heard: Heard<JobOffer>) {
        let job = heard.item.body.job_id;
        let item = heard.item.clone();
        let verdict = self.view.on_offer(heard.item, self.now, heard.received_us);
        let accepted = matches!(verdict, Verdict::Accept(_));
        self.validate(heard.origin, verdict);
        if accepted {
            self.forget_evicted();
            self.out.dirty(RecordKey::Offer(job));
            self.answer_offer(&item);
        }
    }

    // ---- Directed ----

    fn on_request(&mut self, req: InboundId, from: Address, msg: Inbound) {
        let (what, outcome) = match msg {
            Inbound::Bid(r) => ("bid", self.on_bid(from, r)),
            Inbound::Decline(r) => ("decline", self.on_decline(from, r)),
            Inbound::Award(r) => ("award", self.on_award(from, r)),
            Inbound::Accept(r) => ("lease acceptance", self.on_accept(from, r)),
            Inbound::Renewal(r) => ("renewal", self.on_renewal(from, r)),
            Inbound::Cancel(r) => ("cancellation", self.on_cancel(from, r)),
            Inbound::Pass(r) => ("challenge pass", self.on_pass(from, r)),
            Inbound::RunReport(r) => ("run report", self.on_run_report(from, r)),
            Inbound::Deliver(r) => ("delivery", self.on_delivery(from, r)),
            Inbound::Checkpoint(r) => ("checkpoint note", self.on_checkpoint(from, r)),
        };
        match outcome {
            Ok(()) => self.out.fenced(Output::Reply {
                req,
                answer: Reply::Ack,
            }),
            Err(why) => {
                if why.penalized() {
                    self.out.free(Output::Penalize {
                        peer: from,
                        why: why.clone(),
                    });
                }
                self.event(MarketEvent::Refused {
                    from,
                    what,
                    why: why.clone(),
                });
                self.out.free(Output::Reply {
                    req,
                    answer: Reply::Refused(why),
                });
            }
        }
    }

    /// The checks every directed message passes first: it comes from its signer, and its
    /// signature holds (checked last, after the caller's cheap checks).
    fn from_signer<T>(from: Address, r: &Received<T>) -> Result<(), Refusal> {
        if r.signer != from {
            return Err(Refusal::NotFromSigner {
                from,
                signer: r.signer,
            });
        }
        Ok(())
    }

    fn check_signature<T: cannabis_protocol::Message>(
        &self,
        r: &Received<T>,
    ) -> Result<(), Refusal> {
        self.config
            .signatures
            .check(r)
            .map_err(Refusal::BadSignature)
    }

    /// Whether `award` is its rank's current offer, which the worker may still countersign.
    fn awaits_countersignature(&self, award: &Award) -> bool {
        self.jobs
            .get(&award.job_id)
            .and_then(|j| j.tasks().get(award.task as usize))
            .and_then(|t| t.ranks().iter().find(|a| a.rank == award.rank))
            .is_some_and(|a| {
                a.epoch == award.epoch
                    && a.worker == award.worker
                    && a.state == crate::job::LeaseState::Offered
                    && a.expires_at > self.now
            })
    }

    fn on_response(&mut self, req: OutboundId, result: Result<Answer, String>) {
        let Some(purpose) = self.pending.remove(&req) else {
            return;
        };
        match (purpose, result) {
            (Purpose::Award(award, _), Ok(Answer::Refused(reason))) => {
                let why = format!("the worker refused the award: {reason}");
                let now = self.now;
                let job = award.job_id;
                if let Some(j) = self.jobs.get_mut(&job)
                    && let Ok(actions) =
                        j.on_award_refused(award.task, award.rank, award.epoch, &why, now)
                {
                    self.job_changed(job, actions);
                }
            }
            (Purpose::Award(award, sends), Err(_))
                if sends < BID_SENDS && self.awaits_countersignature(&award) =>
            {
                let to = award.worker;
                self.send(
                    to,
                    Outbound::Award((*award).clone()),
                    Purpose::Award(award, sends + 1),
                );
            }
            (Purpose::Renew(r), Ok(Answer::Ack)) => {
                let now = self.now;
                if let Some(j) = self.jobs.get_mut(&r.job_id)
                    && j.on_renewed(r.task, r.rank, r.epoch, r.expires_at, now)
                        .is_ok()
                {
                    self.job_changed(r.job_id, Vec::new());
                }
            }
            (Purpose::Renew(r), Ok(Answer::Refused(reason))) => {
                let why = format!("the worker refused the renewal: {reason}");
                self.job_failed(r.job_id, r.task, r.rank, r.epoch, &why);
            }
            (Purpose::Award(..) | Purpose::Renew(_), Err(_)) => {
                // No answer: the lease timers decide.
            }
            (Purpose::Award(..), Ok(Answer::Ack)) => {}
            (Purpose::Bid(bid, to, sends), Err(_))
                if sends < BID_SENDS
                    && bid.valid_until > self.now
                    && self
                        .leases
                        .bid_for(&bid.job_id, bid.task)
                        .is_some_and(|(_, s)| s.bid == bid) =>
            {
                self.send(
                    to,
                    Outbound::Bid(bid.clone()),
                    Purpose::Bid(bid, to, sends + 1),
                );
            }
            (Purpose::Accept(accept, to, sends), Err(_))
                if sends < BID_SENDS
                    && self.leases.is_current(
                        &(accept.job_id, accept.task, accept.rank),
                        accept.epoch,
                        self.now,
                    ) =>
            {
                self.send(
                    to,
                    Outbound::Accept(accept.clone()),
                    Purpose::Accept(accept, to, sends + 1),
                );
            }
            (Purpose::Accept(_, to, _), result) => {
                self.event(MarketEvent::Answered {
                    what: "lease acceptance",
                    to,
                    result,
                });
            }
            (Purpose::Bid(bid, to, _), result) => {
                if let Ok(Answer::Refused(_)) = &result
                    && self
                        .leases
                        .bid_for(&bid.job_id, bid.task)
                        .is_some_and(|(_, s)| s.bid == bid)
                    && let Some(id) = self.leases.withdraw(&bid.job_id, bid.task)
                {
                    // Refused (its ad not held there yet, outbid, ...): forgotten, so that
                    // this worker quotes again on a later version of the offer.
                    self.out.dirty(RecordKey::SentBid(id));
                }
                self.event(MarketEvent::Answered {
                    what: "bid",
                    to,
                    result,
                });
            }
            (Purpose::Other(what, to), result) => {
                self.event(MarketEvent::Answered { what, to, result });
            }
        }
    }

    // ---- Time ----

    fn on_tick(&mut self) {
        let now = self.now;
        let expired = self.view.expire(now);
        if !expired.ads.is_empty() || !expired.offers.is_empty() {
            for node in &expired.ads {
                self.out.dirty(RecordKey::Ad(*node));
            }
            for job in &expired.offers {
                self.out.dirty(RecordKey::Offer(*job));
                self.bare.remove(job);
                self.declined.remove(job);
            }
            self.event(MarketEvent::Expired {
                ads: expired.ads.len(),
                offers: expired.offers,
            });
        }
        // Each due job is ticked once per tick: a job that wants waking again at once is
        // woken by the next tick, never in a loop here.
        let due: Vec<Uuid> = self
            .wakes
            .iter()
            .take_while(|(at, _)| *at <= now)
            .map(|(_, job)| *job)
            .collect();
        for job in due {
            self.tick_job(job);
        }
        self.tick_leases();
    }

    // ---- Queries ----

    /// The live view.
    pub fn view(&self) -> &View {
        &self.view
    }

    /// The jobs this node published.
    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.jobs.values()
    }

    /// One job.
    pub fn job(&self, id: &Uuid) -> Option<&Job> {
        self.jobs.get(id)
    }

    /// The leases this node holds (or held lately) as a worker.
    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// What matching needs besides the ads: now, this node, the checks it made.
    pub fn context(&self) -> Context<'_> {
        Context {
            now: self.now,
            me: Some(self.me.address),
            local_passes: &self.local_passes,
            attestation: self.config.attestation,
        }
    }

    /// Every worker's strikes, as last told ([`Command::Strikes`]).
    pub fn strikes(&self) -> &BTreeMap<Address, u64> {
        &self.strikes
    }

    /// A worker's strikes, as last told ([`Command::Strikes`]).
    pub fn strikes_of(&self, worker: &Address) -> u64 {
        self.strikes.get(worker).copied().unwrap_or(0)
    }

    /// When each node last passed a challenge this node set.
    pub fn local_passes(&self) -> &BTreeMap<Address, Timestamp> {
        &self.local_passes
    }

    /// The ads of the nodes that could work for this node: every known ad but its own.
    pub fn worker_ads(&self) -> impl Iterator<Item = &CapabilityAd> {
        let me = self.me.address;
        self.view
            .ads()
            .map(|e| e.ad())
            .filter(move |ad| ad.node != me)
    }

    /// How each task of a template matches the ads this node knows (`job submit --dry-run`).
    pub fn explain(&self, template: &OfferTemplate) -> Vec<(String, Explanation)> {
        let ctx = self.context();
        template
            .tasks
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    matching::explain(t, self.worker_ads(), &ctx),
                )
            })
            .collect()
    }

    /// Bids received for this node's offers (jobs and bare offers), not re-verified: each
    /// was checked on receipt.
    pub fn received_bids(&self) -> Vec<(Bid, Digest)> {
        let jobs = self
            .jobs
            .values()
            .flat_map(|j| j.tasks().iter().flat_map(|t| t.bids()))
            .map(|c| (c.bid.clone(), c.id));
        let bare = self.bare.values().flat_map(|b| b.bids.values().cloned());
        jobs.chain(bare).collect()
    }

    /// The passes this node's next ad carries: those sized for at least the cores it claims.
    pub fn passes_for_ad(&self, cpu_cores: u32) -> Vec<Signed<ChallengePass>> {
        self.own_passes
            .values()
            .filter(|(_, p)| p.claimed_cores >= cpu_cores)
            .map(|(s, _)| s.clone())
            .collect()
    }

    // ---- Challenge passes ----

    fn on_pass(&mut self, from: Address, r: Received<ChallengePass>) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let pass = &r.body;
        if pass.worker != self.me.address {
            return Err(Refusal::PassForOther);
        }
        if !self.answered.contains(&(from, pass.seed)) {
            return Err(Refusal::PassUnasked);
        }
        self.check_signature(&r)?;
        self.answered.retain(|a| a != &(from, pass.seed));
        let verifier = pass.verifier;
        self.own_passes.insert(verifier, (r.signed(), r.body));
        self.out.dirty(RecordKey::Pass(verifier));
        self.prune_passes();
        self.event(MarketEvent::PassKept { verifier });
        Ok(())
    }

    /// Keeps the newest [`MAX_AD_PASSES`] passes.
    fn prune_passes(&mut self) {
        while self.own_passes.len() > MAX_AD_PASSES {
            let oldest = self
                .own_passes
                .iter()
                .min_by_key(|(_, (_, p))| p.passed_at)
                .map(|(v, _)| *v);
            let Some(oldest) = oldest else { break };
            self.own_passes.remove(&oldest);
            self.out.dirty(RecordKey::Pass(oldest));
        }
    }
}
