//! Directed market messages: bids, declines, awards (leases), lease acceptance, renewals and
//! cancellation. They travel between two peers, never on gossip.

use serde::{Deserialize, Serialize};

use super::wire;
use crate::{Address, Amount, Digest, Invalid, Message, Timestamp, Uuid};

/// A worker's signed quote for one task of an offer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Bid {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task in the offer.
    pub task: u32,
    /// Id of the signed offer this bid answers.
    pub offer: Digest,
    /// The bidding worker; must be the signer.
    pub worker: Address,
    /// Price for the task (for one rank of a group task), fee included.
    pub price: Amount,
    /// Earliest time the worker can start.
    pub earliest_start: Timestamp,
    /// When the bid was made.
    pub issued_at: Timestamp,
    /// The quote holds until then.
    pub valid_until: Timestamp,
}

/// A worker's signed reason for not bidding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Decline {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task in the offer.
    pub task: u32,
    /// Id of the signed offer.
    pub offer: Digest,
    /// The declining worker; must be the signer.
    pub worker: Address,
    /// Why, for the requester's eyes: at most [`Cancel::MAX_REASON`] bytes.
    #[cfg_attr(feature = "arbitrary", proptest(regex = "[ -~]{0,64}"))]
    pub reason: String,
    /// When.
    pub issued_at: Timestamp,
}

/// A requester's grant of an expiring lease on one assignment (a task's rank) to a worker.
/// It becomes current when the worker countersigns it with a [`LeaseAccept`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Award {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// Rank within the group (0 for a single worker).
    pub rank: u32,
    /// The requester; must be the signer.
    pub requester: Address,
    /// The worker the lease is for.
    pub worker: Address,
    /// Fencing token: increases with every retry of the assignment. Anything carrying an
    /// older epoch is refused everywhere.
    pub epoch: u64,
    /// Id of the accepted bid.
    pub bid: Digest,
    /// Agreed price for this assignment.
    pub price: Amount,
    /// When granted.
    pub issued_at: Timestamp,
    /// The lease ends then unless renewed.
    pub expires_at: Timestamp,
    /// The requester renews at least this often while the work runs (milliseconds).
    pub renew_every_ms: u64,
    /// For group tasks: the private rendezvous of the ranks.
    pub rendezvous: Option<Rendezvous>,
    /// The digests of the inputs that are outputs of earlier tasks, by the input's name,
    /// pinned from what those tasks delivered.
    pub inputs: Vec<super::NamedDigest>,
    /// The rank's latest checkpoint the requester holds (from an earlier epoch of this
    /// assignment), which the worker fetches and puts in the work directory under the
    /// task's `checkpoint` name before the workload starts. Left out of the encoding when
    /// `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
}

/// A checkpoint a rank resumes from, pinned by the award.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Resume {
    /// SHA-256 of the checkpoint's plaintext.
    pub digest: Digest,
    /// Its size in bytes.
    pub size_bytes: u64,
}

/// The private rendezvous of a group: its id and who holds each rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Rendezvous {
    /// Unique rendezvous id of this group attempt.
    pub id: Uuid,
    /// Every rank, in rank order from 0.
    pub roster: Vec<RosterEntry>,
}

/// One rank of a group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct RosterEntry {
    /// The rank.
    pub rank: u32,
    /// Its worker.
    pub worker: Address,
}

/// The worker's countersignature that makes an [`Award`] the current lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct LeaseAccept {
    /// Id of the signed award accepted.
    pub award: Digest,
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// The worker; must be the signer.
    pub worker: Address,
    /// The award's epoch.
    pub epoch: u64,
    /// When accepted.
    pub issued_at: Timestamp,
}

/// A worker's report on the work of a lease it holds, to the requester: where its attempt
/// stands. A requester takes it only from the rank's worker at the rank's current epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct RunReport {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// The requester.
    pub requester: Address,
    /// The worker; must be the signer.
    pub worker: Address,
    /// The lease's epoch.
    pub epoch: u64,
    /// Where the attempt stands.
    pub stage: RunStage,
    /// Why, for a refusal or a failure (at most 256 bytes; empty otherwise).
    pub detail: String,
    /// When reported.
    pub issued_at: Timestamp,
}

impl RunReport {
    /// The longest `detail`, in bytes.
    pub const MAX_DETAIL: usize = 256;
}

/// Where a leased attempt stands, as its worker reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum RunStage {
    /// The executor admitted it: capacity reserved.
    Admitted,
    /// Its package and inputs are being staged and the sandbox set up.
    Preparing,
    /// The workload is running.
    Running,
    /// It exited 0 and its outputs were kept.
    Completed,
    /// It failed (the detail says why).
    Failed,
    /// The executor refused it (the detail says why); it never ran.
    Refused,
    /// It was stopped (the lease ended, or the requester cancelled).
    Cancelled,
    /// Nobody can say what happened to it (the sandbox and the executor died together).
    Unknown,
}

impl RunStage {
    /// Whether the attempt is over.
    pub fn is_final(self) -> bool {
        !matches!(self, Self::Admitted | Self::Preparing | Self::Running)
    }

    /// The name on the wire and in the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Preparing => "preparing",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Refused => "refused",
            Self::Cancelled => "cancelled",
            Self::Unknown => "unknown",
        }
    }
}

/// The requester's extension of a current lease. There is no total duration limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct LeaseRenewal {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// The requester; must be the signer.
    pub requester: Address,
    /// The worker holding the lease.
    pub worker: Address,
    /// The lease's epoch; a renewal for another epoch is refused.
    pub epoch: u64,
    /// When renewed.
    pub issued_at: Timestamp,
    /// New end of the lease.
    pub expires_at: Timestamp,
}

/// The requester's cancellation of one lease: one assignment at one epoch. A lease of a
/// later epoch (a retry) is not touched by it, wherever the message comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Cancel {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// The requester; must be the signer.
    pub requester: Address,
    /// The worker holding the lease.
    pub worker: Address,
    /// The lease's epoch; a cancellation for another epoch is refused.
    pub epoch: u64,
    /// Why, for the workers' records: at most [`Cancel::MAX_REASON`] bytes.
    #[cfg_attr(feature = "arbitrary", proptest(regex = "[ -~]{0,64}"))]
    pub reason: String,
    /// When.
    pub issued_at: Timestamp,
}

impl Cancel {
    /// Longest reason (of a cancellation or a decline), in bytes.
    pub const MAX_REASON: usize = 256;

    /// `reason` cut to [`Cancel::MAX_REASON`] bytes, at a character boundary.
    pub fn reason(reason: &str) -> String {
        let mut end = reason.len().min(Self::MAX_REASON);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason[..end].to_string()
    }
}

wire!(Bid, "bid", 2 * 1024);
wire!(Decline, "decline", 4 * 1024);
wire!(Award, "award", 32 * 1024);
wire!(LeaseAccept, "lease accept", 1024);
wire!(LeaseRenewal, "lease renewal", 1024);
wire!(Cancel, "cancel", 1024);
wire!(RunReport, "run report", 1024);

impl Message for Bid {
    const DOMAIN: &'static str = "cannabis/bid/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.worker)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if self.valid_until <= self.issued_at {
            return Err(Invalid::new("valid_until", "must be after issued_at"));
        }
        Ok(())
    }
}

impl Message for Decline {
    const DOMAIN: &'static str = "cannabis/decline/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.worker)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if self.reason.len() > Cancel::MAX_REASON {
            return Err(Invalid::new("reason", "longer than 256 bytes"));
        }
        Ok(())
    }
}

impl Message for Award {
    const DOMAIN: &'static str = "cannabis/award/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.requester)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if self.expires_at <= self.issued_at {
            return Err(Invalid::new("expires_at", "must be after issued_at"));
        }
        match &self.rendezvous {
            None if self.rank != 0 => Err(Invalid::new(
                "rank",
                "a single-worker award has rank 0 and no rendezvous",
            )),
            None => check_input_names(&self.inputs),
            Some(r) => {
                for (i, e) in r.roster.iter().enumerate() {
                    if e.rank as usize != i {
                        return Err(Invalid::new(
                            "rendezvous.roster",
                            "ranks must be 0, 1, 2, ... in order",
                        ));
                    }
                }
                match r.roster.get(self.rank as usize) {
                    Some(e) if e.worker == self.worker => check_input_names(&self.inputs),
                    _ => Err(Invalid::new(
                        "rendezvous.roster",
                        "must list this award's worker at its rank",
                    )),
                }
            }
        }
    }
}

fn check_input_names(inputs: &[super::NamedDigest]) -> Result<(), Invalid> {
    let mut seen = std::collections::BTreeSet::new();
    for i in inputs {
        if !super::is_safe_name(&i.name) || !seen.insert(i.name.as_str()) {
            return Err(Invalid::new(
                "inputs",
                format!("{:?} is not a safe, unique input name", i.name),
            ));
        }
    }
    Ok(())
}

impl Message for LeaseAccept {
    const DOMAIN: &'static str = "cannabis/lease-accept/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.worker)
    }
}

impl Message for RunReport {
    const DOMAIN: &'static str = "cannabis/run-report/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.worker)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if self.detail.len() > Self::MAX_DETAIL {
            return Err(Invalid::new("detail", "longer than 256 bytes"));
        }
        Ok(())
    }
}

impl Message for LeaseRenewal {
    const DOMAIN: &'static str = "cannabis/lease-renewal/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.requester)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if self.expires_at <= self.issued_at {
            return Err(Invalid::new("expires_at", "must be after issued_at"));
        }
        Ok(())
    }
}

impl Message for Cancel {
    const DOMAIN: &'static str = "cannabis/cancel/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.requester)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if self.reason.len() > Self::MAX_REASON {
            return Err(Invalid::new("reason", "longer than 256 bytes"));
        }
        Ok(())
    }
}
