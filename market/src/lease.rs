//! The worker's side of leases: which awards it countersigns, which renewals and
//! cancellations it takes, and when a lease it holds has run out.
//!
//! An award is taken only for a bid this worker sent, at no more than the quoted price,
//! from the requester the bid went to, and only with an epoch higher than any it saw for
//! that assignment: a stale epoch is refused here as everywhere. A renewal must carry the
//! current epoch and arrive before the lease ran out. There is no total duration limit.

use std::collections::BTreeMap;

use cannabis_protocol::{
    Address, Amount, Award, Bid, Cancel, DeliveryRecipient, Digest, LeaseAccept, LeaseRenewal,
    NamedDigest, Rendezvous, TaskSpec, Timestamp, Uuid,
};
use serde::{Deserialize, Serialize};

use crate::Refusal;

/// An assignment: job, task, rank.
pub type AssignmentKey = (Uuid, u32, u32);

/// Why a lease this worker held ended; its workload stops with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "kebab-case")]
pub enum EndReason {
    /// It was not renewed in time.
    #[error("the lease expired (not renewed in time)")]
    Expired,
    /// The requester cancelled it.
    #[error("cancelled by the requester: {0}")]
    Cancelled(String),
    /// An award with a newer epoch for the same assignment replaced it.
    #[error("superseded by epoch {0}")]
    Superseded(u64),
}

/// Where a lease this worker holds stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state", content = "reason")]
pub enum WorkerLeaseState {
    /// Countersigned; current until the lease's `expires_at` unless renewed.
    Current,
    /// Over.
    Ended(EndReason),
}

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
    /// Where it stands.
    pub state: WorkerLeaseState,
    /// The task it is for, as the offer published it: what the executor runs (the offer
    /// may leave the view before the lease ends).
    #[serde(default)]
    pub task: Option<Box<TaskSpec>>,
    /// The offer's delivery recipient: the outputs are encrypted to it.
    #[serde(default)]
    pub deliver_to: Option<DeliveryRecipient>,
    /// The award's pinned digests of inputs that earlier tasks delivered.
    #[serde(default)]
    pub inputs: Vec<NamedDigest>,
    /// The group attempt this rank belongs to (a group task's award names it): who the
    /// other ranks are, for the group's private channel.
    #[serde(default)]
    pub rendezvous: Option<Box<Rendezvous>>,
    /// A rank of a group waiting for its first renewal, which the requester sends once
    /// every rank holds its lease: its work is not prepared before (no package fetched,
    /// no sandbox made for a group that may never be whole).
    #[serde(default)]
    pub assembling: bool,
    /// The checkpoint the award pins for this rank to resume from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Box<cannabis_protocol::Resume>>,
}

impl Lease {
    /// Whether it still holds (it may still have run out by the clock: see
    /// [`Leases::is_current`]).
    pub fn is_live(&self) -> bool {
        self.state == WorkerLeaseState::Current
    }
}

/// A lease this worker held ended; the workload stops with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stopped {
    /// The assignment.
    pub key: AssignmentKey,
    /// Its epoch.
    pub epoch: u64,
    /// Why.
    pub reason: EndReason,
}

fn end(key: &AssignmentKey, lease: &mut Lease, reason: EndReason) -> Stopped {
    lease.state = WorkerLeaseState::Ended(reason.clone());
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

/// A bid this worker sent, with the requester it went to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentBid {
    /// The bid.
    pub bid: Bid,
    /// Its requester.
    pub requester: Address,
    /// The task it is for, as the offer published it (the offer may leave the view
    /// before the award comes): what the lease will run.
    #[serde(default)]
    pub task: Option<Box<TaskSpec>>,
    /// The offer's delivery recipient.
    #[serde(default)]
    pub deliver_to: Option<DeliveryRecipient>,
}

/// The leases of one worker, and the bids it sent.
#[derive(Clone, Debug)]
pub struct Leases {
    me: Address,
    bids: BTreeMap<Digest, SentBid>,
    /// The bid sent for each (job, task).
    by_task: BTreeMap<(Uuid, u32), Digest>,
    leases: BTreeMap<AssignmentKey, Lease>,
}

impl Leases {
    /// The leases of worker `me`.
    pub fn new(me: Address) -> Self {
        Self {
            me,
            bids: BTreeMap::new(),
            by_task: BTreeMap::new(),
            leases: BTreeMap::new(),
        }
    }

    /// Remembers a bid this worker sent (message id `id`).
    pub fn on_bid_sent(&mut self, id: Digest, sent: SentBid) {
        self.by_task.insert((sent.bid.job_id, sent.bid.task), id);
        self.bids.insert(id, sent);
    }

    /// The bid this worker sent for a task, if it still holds.
    pub fn bid_for(&self, job: &Uuid, task: u32) -> Option<(&Digest, &SentBid)> {
        let id = self.by_task.get(&(*job, task))?;
        self.bids.get(id).map(|b| (id, b))
    }

    /// Withdraws the bid this worker sent for a task (it refused the award as busy, and
    /// quotes again on a later version of the offer): its message id, if one was held.
    pub fn withdraw(&mut self, job: &Uuid, task: u32) -> Option<Digest> {
        let id = self.by_task.remove(&(*job, task))?;
        self.bids.remove(&id).map(|_| id)
    }

    /// Bids sent that still hold.
    pub fn bids(&self) -> impl Iterator<Item = (&Digest, &SentBid)> {
        self.bids.iter()
    }

    /// Forgets bids whose quote ran out and leases over for long enough.
    /// Returns what was forgotten, so a durable copy can forget it too.
    pub fn prune(&mut self, now: Timestamp, keep_ended_ms: u64) -> Pruned {
        let mut pruned = Pruned::default();
        let by_task = &mut self.by_task;
        self.bids.retain(|id, s| {
            let keep = s.bid.valid_until > now;
            if !keep {
                pruned.bids.push(*id);
                by_task.remove(&(s.bid.job_id, s.bid.task));
            }
            keep
        });
        self.leases.retain(|key, l| {
            let keep = l.is_live() || now.ms_since(l.expires_at) < keep_ended_ms;
            if !keep {
                pruned.leases.push(*key);
            }
            keep
        });
        pruned
    }

    /// When [`Leases::prune`] or [`Leases::tick`] next has something to do.
    pub fn next_wake(&self, keep_ended_ms: u64) -> Option<Timestamp> {
        let bids = self.bids.values().map(|s| s.bid.valid_until);
        let leases = self.leases.values().map(|l| {
            if l.is_live() {
                l.expires_at
            } else {
                l.expires_at.plus_ms(keep_ended_ms)
            }
        });
        bids.chain(leases).min()
    }

    /// Rebuilds the leases of worker `me` from a durable copy.
    pub fn restore(
        me: Address,
        bids: impl IntoIterator<Item = (Digest, SentBid)>,
        leases: impl IntoIterator<Item = (AssignmentKey, Lease)>,
    ) -> Self {
        let mut out = Self::new(me);
        for (id, sent) in bids {
            out.on_bid_sent(id, sent);
        }
        out.leases = leases.into_iter().collect();
        out
    }

    /// The lease on an assignment, live or not.
    pub fn get(&self, key: &AssignmentKey) -> Option<&Lease> {
        self.leases.get(key)
    }

    /// Every lease held or recently ended.
    pub fn iter(&self) -> impl Iterator<Item = (&AssignmentKey, &Lease)> {
        self.leases.iter()
    }

    /// Leases current at `now`.
    pub fn live_count(&self, now: Timestamp) -> usize {
        self.leases
            .values()
            .filter(|l| l.is_live() && l.expires_at > now)
            .count()
    }

    /// An award whose signature and sender the caller checked (`id` is its message id).
    /// Returns the countersignature to sign and send, and the lease it replaces if a newer
    /// epoch superseded one this worker held.
    pub fn on_award(
        &mut self,
        award: &Award,
        id: Digest,
        now: Timestamp,
    ) -> Result<(LeaseAccept, Option<Stopped>), Refusal> {
        if award.worker != self.me {
            return Err(Refusal::NotForMe);
        }
        let sent = self.bids.get(&award.bid).ok_or(Refusal::NoSuchBid)?;
        if sent.bid.job_id != award.job_id || sent.bid.task != award.task {
            return Err(Refusal::BidMismatch);
        }
        if sent.requester != award.requester {
            return Err(Refusal::OtherRequester);
        }
        if award.price > sent.bid.price {
            return Err(Refusal::AboveQuote {
                award: award.price,
                quote: sent.bid.price,
            });
        }
        if award.expires_at <= now {
            return Err(Refusal::AwardExpired);
        }
        let key = (award.job_id, award.task, award.rank);
        let mut superseded = None;
        if let Some(held) = self.leases.get_mut(&key) {
            if award.epoch <= held.epoch {
                return Err(Refusal::StaleEpoch {
                    got: award.epoch,
                    current: held.epoch,
                });
            }
            if held.is_live() {
                superseded = Some(end(&key, held, EndReason::Superseded(award.epoch)));
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
                state: WorkerLeaseState::Current,
                task: sent.task.clone(),
                deliver_to: sent.deliver_to,
                inputs: award.inputs.clone(),
                rendezvous: award.rendezvous.clone().map(Box::new),
                assembling: award.rendezvous.is_some(),
                resume: award.resume.clone().map(Box::new),
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

    /// The lease a requester's message names: held here, granted by that requester to this
    /// worker, at that epoch.
    fn named(
        &mut self,
        key: &AssignmentKey,
        requester: &Address,
        worker: &Address,
        epoch: u64,
    ) -> Result<&mut Lease, Refusal> {
        let lease = self.leases.get_mut(key).ok_or(Refusal::NoLease)?;
        if *requester != lease.requester || *worker != self.me {
            return Err(Refusal::NotTheLease);
        }
        if epoch != lease.epoch {
            return Err(Refusal::StaleEpoch {
                got: epoch,
                current: lease.epoch,
            });
        }
        Ok(lease)
    }

    /// A renewal whose signature and sender the caller checked: extends the live lease of
    /// the same epoch. Whether it was the first of a rank whose group was assembling: its
    /// work is prepared now.
    pub fn on_renewal(&mut self, renewal: &LeaseRenewal, now: Timestamp) -> Result<bool, Refusal> {
        let key = (renewal.job_id, renewal.task, renewal.rank);
        let lease = self.named(&key, &renewal.requester, &renewal.worker, renewal.epoch)?;
        if !lease.is_live() || lease.expires_at <= now {
            return Err(Refusal::LeaseEnded);
        }
        lease.expires_at = lease.expires_at.max(renewal.expires_at);
        Ok(std::mem::take(&mut lease.assembling))
    }

    /// A cancellation whose signature and sender the caller checked: ends the live lease it
    /// names, at its epoch. One for another epoch (an earlier attempt's, replayed or late) or
    /// another requester is refused and changes nothing.
    pub fn on_cancel(&mut self, cancel: &Cancel, now: Timestamp) -> Result<Stopped, Refusal> {
        let key = (cancel.job_id, cancel.task, cancel.rank);
        let lease = self.named(&key, &cancel.requester, &cancel.worker, cancel.epoch)?;
        if !lease.is_live() {
            return Err(Refusal::LeaseEnded);
        }
        lease.expires_at = lease.expires_at.min(now);
        let reason = EndReason::Cancelled(cancel.reason.clone());
        Ok(end(&key, lease, reason))
    }

    /// Ends leases that ran out by `now`: their workloads stop.
    #[must_use]
    pub fn tick(&mut self, now: Timestamp) -> Vec<Stopped> {
        let mut stopped = Vec::new();
        for (key, lease) in &mut self.leases {
            if lease.is_live() && lease.expires_at <= now {
                stopped.push(end(key, lease, EndReason::Expired));
            }
        }
        stopped
    }

    /// Whether this worker holds the current lease at `epoch` for `key` at `now`: what a
    /// result or a settlement must show.
    pub fn is_current(&self, key: &AssignmentKey, epoch: u64, now: Timestamp) -> bool {
        self.leases
            .get(key)
            .is_some_and(|l| l.is_live() && l.epoch == epoch && l.expires_at > now)
    }
}

#[cfg(test)]
mod tests {
    use cannabis_protocol::Keypair;

    use super::*;

    #[test]
    fn a_cancel_ends_only_the_lease_of_its_epoch() {
        let (me, requester) = (
            Keypair::from_secret([1; 32]).address(),
            Keypair::from_secret([2; 32]).address(),
        );
        let t = Timestamp(1_000_000);
        let job = Uuid([7; 16]);
        let bid = Bid {
            job_id: job,
            task: 0,
            offer: Digest::of(b"offer"),
            worker: me,
            price: Amount(100),
            earliest_start: t,
            issued_at: t,
            valid_until: t.plus_ms(600_000),
        };
        let bid_id = Digest::of(b"bid");
        let mut leases = Leases::new(me);
        leases.on_bid_sent(
            bid_id,
            SentBid {
                bid,
                requester,
                task: None,
                deliver_to: None,
            },
        );
        let award = |epoch: u64| Award {
            job_id: job,
            task: 0,
            rank: 0,
            requester,
            worker: me,
            epoch,
            bid: bid_id,
            price: Amount(100),
            issued_at: t,
            expires_at: t.plus_ms(60_000),
            renew_every_ms: 20_000,
            rendezvous: None,
            inputs: Vec::new(),
            resume: None,
        };
        let cancel = |epoch: u64| Cancel {
            job_id: job,
            task: 0,
            rank: 0,
            requester,
            worker: me,
            epoch,
            reason: "rank failed".into(),
            issued_at: t.plus_ms(1),
        };
        leases.on_award(&award(1), Digest::of(b"a1"), t).unwrap();
        let first = cancel(1);
        let stopped = leases.on_cancel(&first, t.plus_ms(1)).unwrap();
        assert_eq!((stopped.key, stopped.epoch), ((job, 0, 0), 1));
        // The retry lands on the same worker at epoch 2; the first cancel, replayed or
        // late, does not end it.
        leases
            .on_award(&award(2), Digest::of(b"a2"), t.plus_ms(2))
            .unwrap();
        assert_eq!(
            leases.on_cancel(&first, t.plus_ms(3)),
            Err(Refusal::StaleEpoch { got: 1, current: 2 })
        );
        assert!(leases.is_current(&(job, 0, 0), 2, t.plus_ms(3)));
        // Nor does one for another worker or from another requester.
        let mut other = cancel(2);
        other.worker = requester;
        assert_eq!(leases.on_cancel(&other, t), Err(Refusal::NotTheLease));
        assert!(leases.is_current(&(job, 0, 0), 2, t.plus_ms(3)));
        // The cancel of epoch 2 ends it.
        leases.on_cancel(&cancel(2), t.plus_ms(4)).unwrap();
        assert!(!leases.is_current(&(job, 0, 0), 2, t.plus_ms(4)));
    }
}
