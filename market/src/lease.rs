//! The worker's side of leases: which awards it countersigns, which renewals and
//! cancellations it takes, and when a lease it holds has run out.
//!
//! An award is taken only for a bid this worker sent, at no more than the quoted price,
//! from the requester the bid went to, and only with an epoch higher than any it saw for
//! that assignment: a stale epoch is refused here as everywhere. A renewal must carry the
//! current epoch and arrive before the lease ran out. There is no total duration limit.

use std::collections::BTreeMap;

use cannabis_protocol::{
    Address, Amount, Award, Bid, Cancel, Digest, LeaseAccept, LeaseRenewal, Timestamp, Uuid,
};
use serde::{Deserialize, Serialize};

/// An assignment: job, task, rank.
pub type AssignmentKey = (Uuid, u32, u32);

/// A lease this worker holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The award's message id.
    pub award: Digest,
    /// Who granted it.
    pub requester: Address,
    /// Fencing token.
    pub epoch: u64,
    /// Agreed price.
    pub price: Amount,
    /// Current until then.
    pub expires_at: Timestamp,
    /// Whether it still holds.
    pub live: bool,
    /// Why it stopped, when it did.
    pub ended: Option<String>,
}

/// Why a lease this worker held stopped; the workload stops with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stopped {
    /// The assignment.
    pub key: AssignmentKey,
    /// Its epoch.
    pub epoch: u64,
    /// Why.
    pub reason: String,
}

/// Ends a live lease for `reason`; its workload stops.
fn end(key: &AssignmentKey, lease: &mut Lease, reason: String) -> Stopped {
    lease.live = false;
    lease.ended = Some(reason.clone());
    Stopped {
        key: *key,
        epoch: lease.epoch,
        reason,
    }
}

/// What [`Leases::prune`] forgot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Bids, by message id.
    pub bids: Vec<Digest>,
    /// Leases.
    pub leases: Vec<AssignmentKey>,
}

/// The leases of one worker.
#[derive(Clone, Debug, Default)]
pub struct Leases {
    me: Option<Address>,
    /// Bids sent, by message id, with the requester they went to.
    bids: BTreeMap<Digest, (Bid, Address)>,
    leases: BTreeMap<AssignmentKey, Lease>,
}

impl Leases {
    /// The leases of worker `me`.
    pub fn new(me: Address) -> Self {
        Self {
            me: Some(me),
            ..Self::default()
        }
    }

    /// Remembers a bid this worker sent to `requester`.
    pub fn on_bid_sent(&mut self, id: Digest, bid: Bid, requester: Address) {
        self.bids.insert(id, (bid, requester));
    }

    /// Forgets bids whose quote ran out and leases over for long enough.
    /// Returns what was forgotten, so a durable copy can forget it too.
    pub fn prune(&mut self, now: Timestamp, keep_ended_ms: u64) -> Pruned {
        let mut pruned = Pruned::default();
        self.bids.retain(|id, (b, _)| {
            let keep = b.valid_until > now;
            if !keep {
                pruned.bids.push(*id);
            }
            keep
        });
        self.leases.retain(|key, l| {
            let keep = l.live || now.ms_since(l.expires_at) < keep_ended_ms;
            if !keep {
                pruned.leases.push(*key);
            }
            keep
        });
        pruned
    }

    /// Rebuilds the leases of worker `me` from a durable copy.
    pub fn restore(
        me: Address,
        bids: impl IntoIterator<Item = (Digest, Bid, Address)>,
        leases: impl IntoIterator<Item = (AssignmentKey, Lease)>,
    ) -> Self {
        Self {
            me: Some(me),
            bids: bids.into_iter().map(|(id, b, r)| (id, (b, r))).collect(),
            leases: leases.into_iter().collect(),
        }
    }

    /// The lease on an assignment, live or not.
    pub fn get(&self, key: &AssignmentKey) -> Option<&Lease> {
        self.leases.get(key)
    }

    /// Every lease held or recently ended.
    pub fn iter(&self) -> impl Iterator<Item = (&AssignmentKey, &Lease)> {
        self.leases.iter()
    }

    /// A verified award (`id` is its message id). Returns the countersignature to sign and
    /// send, and the lease it replaces if a newer epoch superseded one this worker held.
    pub fn on_award(
        &mut self,
        award: &Award,
        id: Digest,
        now: Timestamp,
    ) -> Result<(LeaseAccept, Option<Stopped>), String> {
        if Some(award.worker) != self.me {
            return Err("the award names another worker".into());
        }
        let (bid, requester) = self
            .bids
            .get(&award.bid)
            .ok_or("no bid of this worker has that id")?;
        if bid.job_id != award.job_id || bid.task != award.task {
            return Err("the award is for another job or task than the bid".into());
        }
        if *requester != award.requester {
            return Err("the award comes from another requester than the offer's".into());
        }
        if award.price > bid.price {
            return Err(format!(
                "price {} is above the quote of {}",
                award.price, bid.price
            ));
        }
        if award.expires_at <= now {
            return Err("the award has expired".into());
        }
        let key = (award.job_id, award.task, award.rank);
        let mut superseded = None;
        if let Some(held) = self.leases.get(&key) {
            if award.epoch <= held.epoch {
                return Err(format!(
                    "stale epoch {} (this worker saw epoch {})",
                    award.epoch, held.epoch
                ));
            }
            if held.live {
                superseded = Some(Stopped {
                    key,
                    epoch: held.epoch,
                    reason: format!("superseded by epoch {}", award.epoch),
                });
            }
        }
        self.leases.insert(
            key,
            Lease {
                award: id,
                requester: award.requester,
                epoch: award.epoch,
                price: award.price,
                expires_at: award.expires_at,
                live: true,
                ended: None,
            },
        );
        let accept = LeaseAccept {
            award: id,
            job_id: award.job_id,
            task: award.task,
            rank: award.rank,
            worker: award.worker,
            epoch: award.epoch,
            issued_at: now,
        };
        Ok((accept, superseded))
    }

    /// A verified renewal: extends the live lease of the same epoch.
    pub fn on_renewal(&mut self, renewal: &LeaseRenewal, now: Timestamp) -> Result<(), String> {
        let key = (renewal.job_id, renewal.task, renewal.rank);
        let lease = self
            .leases
            .get_mut(&key)
            .ok_or("no lease on that assignment")?;
        if renewal.requester != lease.requester || Some(renewal.worker) != self.me {
            return Err("the renewal does not match the lease".into());
        }
        if renewal.epoch != lease.epoch {
            return Err(format!(
                "stale epoch {} (the lease is at epoch {})",
                renewal.epoch, lease.epoch
            ));
        }
        if !lease.live || lease.expires_at <= now {
            return Err("the lease already ended".into());
        }
        lease.expires_at = lease.expires_at.max(renewal.expires_at);
        Ok(())
    }

    /// A verified cancellation: ends every live lease of this worker it names.
    pub fn on_cancel(&mut self, cancel: &Cancel, now: Timestamp) -> Vec<Stopped> {
        let mut stopped = Vec::new();
        for (key, lease) in &mut self.leases {
            let named = key.0 == cancel.job_id && cancel.task.is_none_or(|t| t == key.1);
            if named && lease.live && lease.requester == cancel.requester {
                lease.expires_at = lease.expires_at.min(now);
                let reason = format!("cancelled by the requester: {}", cancel.reason);
                stopped.push(end(key, lease, reason));
            }
        }
        stopped
    }

    /// Ends leases that ran out by `now`: their workloads stop.
    pub fn tick(&mut self, now: Timestamp) -> Vec<Stopped> {
        let mut stopped = Vec::new();
        for (key, lease) in &mut self.leases {
            if lease.live && lease.expires_at <= now {
                let reason = "the lease expired (not renewed in time)".to_string();
                stopped.push(end(key, lease, reason));
            }
        }
        stopped
    }

    /// Whether this worker holds the current lease at `epoch` for `key` at `now`: what a
    /// result or a settlement must show.
    pub fn is_current(&self, key: &AssignmentKey, epoch: u64, now: Timestamp) -> bool {
        self.leases
            .get(key)
            .is_some_and(|l| l.live && l.epoch == epoch && l.expires_at > now)
    }
}
