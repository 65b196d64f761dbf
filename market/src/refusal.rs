//! Why the market refuses a message from a peer: one typed enum for every rule, so the node
//! maps a refusal to an answer and a penalty without reading text.

use cannabis_protocol::{Address, Amount, MoneyError, OpenError, Uuid};

use crate::matching::Requirement;

/// Why a directed message (bid, decline, award, acceptance, renewal, cancellation,
/// challenge pass) was refused. Its text goes back to the sender.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No open offer or job with that id here.
    #[error("no open offer {0}")]
    UnknownJob(Uuid),
    /// The offer is someone else's.
    #[error("offer {0} is not this node's")]
    NotMine(Uuid),
    /// The message names a version of the offer this node never published.
    #[error("the message answers another version of the offer")]
    OtherVersion,
    /// The offer has no such task.
    #[error("offer {job} has no task {task}")]
    NoSuchTask {
        /// The job.
        job: Uuid,
        /// The task index.
        task: u32,
    },
    /// The task has no such rank.
    #[error("task {task} has no rank {rank}")]
    NoSuchRank {
        /// The task index.
        task: u32,
        /// The rank.
        rank: u32,
    },
    /// The bid's quote ran out.
    #[error("the bid has expired")]
    BidExpired,
    /// The worker was not drawn by the task's bid call, so may not bid on it.
    #[error("this worker was not drawn by the task's bid call")]
    NotDrawn,
    /// The quote is above what the task pays one worker.
    #[error("price {price} is above the task's budget of {share} per worker")]
    AboveShare {
        /// The quote.
        price: Amount,
        /// The task's budget per worker.
        share: Amount,
    },
    /// The task is over.
    #[error("task {0} is over")]
    TaskOver(u32),
    /// A newer bid of the worker is held.
    #[error("a newer bid from this worker is held")]
    DuplicateBid,
    /// This very bid is held already (sent again after a connection dropped): the
    /// requester acknowledges it and changes nothing.
    #[error("this bid is held already")]
    SameBid,
    /// The worker signed two different bids for one version of the offer: both are kept
    /// as evidence, and the worker is not placed on the task.
    #[error("two different signed bids for one version of the offer: kept as evidence")]
    Equivocation,
    /// The task holds as many bids as it keeps, all cheaper.
    #[error("task {task} keeps {kept} bids, all at or below this one")]
    Outbid {
        /// The task index.
        task: u32,
        /// Bids kept.
        kept: usize,
    },
    /// The requester holds no ad of the worker to match the bid against.
    #[error("this node has no capability ad from you; publish one first")]
    NoAd,
    /// The worker's ad does not meet the task.
    #[error("your ad does not meet: {}", list(.0))]
    Unmet(Vec<Requirement>),
    /// An epoch that is not the assignment's current one.
    #[error("stale epoch {got} (the assignment is at epoch {current})")]
    StaleEpoch {
        /// The epoch in the message.
        got: u64,
        /// The current epoch.
        current: u64,
    },
    /// The acceptance names another worker or award than the one sent: no honest worker
    /// signs one (an epoch is awarded once), so it counts against the sender.
    #[error("the acceptance does not match the award")]
    NotTheAward,
    /// The lease is already current.
    #[error("already accepted")]
    AlreadyAccepted,
    /// The award expired or ended before the countersignature came.
    #[error("the award is no longer open")]
    AwardClosed,
    /// The lease is not current.
    #[error("the lease is not current")]
    NotCurrent,
    /// The lease is neither offered nor current.
    #[error("the lease is not live")]
    NotLive,
    /// The award names another worker.
    #[error("the award names another worker")]
    NotForMe,
    /// The award names a bid this worker never sent.
    #[error("no bid of this worker has that id")]
    NoSuchBid,
    /// The award is for another job or task than its bid.
    #[error("the award is for another job or task than the bid")]
    BidMismatch,
    /// The award comes from another requester than the offer's.
    #[error("the award comes from another requester than the offer's")]
    OtherRequester,
    /// The award pays more than the worker quoted.
    #[error("price {award} is above the quote of {quote}")]
    AboveQuote {
        /// The award's price.
        award: Amount,
        /// The bid's price.
        quote: Amount,
    },
    /// The award expired before it arrived.
    #[error("the award has expired")]
    AwardExpired,
    /// The worker holds as many leases as its owner allows.
    #[error("this worker is busy ({held} leases held)")]
    Busy {
        /// Live leases held.
        held: u32,
    },
    /// The leases the worker holds leave too little of a resource free for the task.
    #[error("this worker is busy: the task asks {asked} {what}, {free} free now")]
    Short {
        /// The resource: "millicores", "bytes of memory", "bytes of storage", "GPUs".
        what: &'static str,
        /// What one rank of the task asks.
        asked: u64,
        /// What the worker's ad offers less what its live leases hold.
        free: u64,
    },
    /// No lease on that assignment.
    #[error("no lease on that assignment")]
    NoLease,
    /// The renewal names another requester or worker than the lease.
    #[error("the renewal does not match the lease")]
    NotTheLease,
    /// The lease ended before the renewal came.
    #[error("the lease already ended")]
    LeaseEnded,
    /// The message came from another peer than its signer.
    #[error("sent by {from}, signed by {signer}")]
    NotFromSigner {
        /// The peer it came from.
        from: Address,
        /// Its signer.
        signer: Address,
    },
    /// The signature does not verify.
    #[error("unverifiable: {0}")]
    BadSignature(OpenError),
    /// A challenge pass for another node.
    #[error("the pass names another worker")]
    PassForOther,
    /// A challenge pass for a challenge this node did not answer.
    #[error("this node answered no such challenge for you")]
    PassUnasked,
    /// A delivery manifest that does not describe what the task's terms say it delivers.
    #[error("bad delivery manifest: {0}")]
    BadManifest(String),
    /// Money arithmetic that would overflow or go negative.
    #[error("accounting: {0}")]
    Money(#[from] MoneyError),
}

impl Refusal {
    /// Whether the refusal lowers the sender's score: it sent something no honest node
    /// sends (a forged or misdirected message, or a bid the draw did not allow).
    pub fn penalized(&self) -> bool {
        matches!(
            self,
            Refusal::NotFromSigner { .. }
                | Refusal::BadSignature(_)
                | Refusal::NotDrawn
                | Refusal::Equivocation
                | Refusal::NotTheAward
        )
    }
}

fn list(reqs: &[Requirement]) -> String {
    reqs.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
