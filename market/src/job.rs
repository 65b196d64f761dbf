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
//!   `budget - spent - committed`;
//! - every job ends in a defined state, at the latest at its deadline.
//!
//! A lease starts short: an award expires `award_timeout_ms` after it is issued unless the
//! worker countersigns and the requester renews it. So a worker that never answered holds
//! nothing by the time the assignment is retried elsewhere. The requester counts a lease
//! as extended only when the worker acknowledged the renewal ([`Job::on_renewed`]): a
//! worker that went away lets its lease run out on both sides, and the task is retried.

use std::collections::{BTreeMap, BTreeSet};

use cannabis_protocol::{
    Address, Amount, Award, Bid, Cancel, Decline, Digest, JobOffer, LeaseAccept, LeaseRenewal,
    NamedDigest, Rendezvous, RosterEntry, TaskInput, Timestamp, Uuid, message_id,
};
use serde::{Deserialize, Serialize};

use crate::placement::{self, Candidate, Class, Slot};

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
    /// worker refused or never countersigned do not count: each excludes that worker, so
    /// they end when the bids run out.
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

/// What the node does for a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Sign and send this award to its worker.
    Award(Award),
    /// Sign and send this renewal to its worker.
    Renew(LeaseRenewal),
    /// Sign and send this cancellation to each worker.
    Cancel {
        /// Who gets it.
        to: Vec<Address>,
        /// The cancellation.
        cancel: Cancel,
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
    Failed(String),
    /// The requester cancelled it, or a task it depends on failed.
    Cancelled(String),
}

impl TaskStatus {
    /// Whether nothing more happens to the task.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            TaskStatus::Done | TaskStatus::Failed(_) | TaskStatus::Cancelled(_)
        )
    }
}

/// Where one rank's lease stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseState {
    /// Awarded; the worker has until `until` to countersign.
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
}

/// One task's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// Status.
    pub status: TaskStatus,
    /// Valid bids, newest per worker.
    pub bids: BTreeMap<Address, Candidate>,
    /// Signed reasons of workers that declined.
    pub declines: BTreeMap<Address, String>,
    /// Workers whose assignment ended without delivering; not placed again.
    pub excluded: BTreeSet<Address>,
    /// The current attempt, one per rank.
    pub ranks: Vec<Assignment>,
    /// Placements made.
    pub attempts: u32,
    /// Runs that failed after their leases became current.
    pub failures: u32,
    /// Prices of live assignments.
    pub committed: Amount,
    /// Prices of delivered assignments.
    pub spent: Amount,
    /// The task's budget.
    pub budget: Amount,
    /// Digests of the outputs it delivered, by name.
    pub outputs: BTreeMap<String, Digest>,
    /// The last epoch issued per rank.
    epochs: Vec<u64>,
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

/// The requester's state machine for one job.
///
/// It serializes (serde) so the node can keep it durably: the node saves a job before it
/// sends any award the job asked for, so an epoch is never issued twice, even across a
/// crash.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    /// The offer as published.
    pub offer: JobOffer,
    /// Its message id.
    pub offer_id: Digest,
    /// Lease timing.
    pub config: LeaseConfig,
    /// Per task, in the offer's order.
    pub tasks: Vec<Task>,
    /// What happened, in order.
    pub history: Vec<Event>,
    cancelled: bool,
}

/// Most history lines kept per job.
const MAX_HISTORY: usize = 1000;

impl Job {
    /// A job for a published offer. Tasks with no dependencies take bids at once.
    pub fn new(offer: JobOffer, offer_id: Digest, config: LeaseConfig, now: Timestamp) -> Self {
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
                declines: BTreeMap::new(),
                excluded: BTreeSet::new(),
                ranks: Vec::new(),
                attempts: 0,
                failures: 0,
                committed: Amount(0),
                spent: Amount(0),
                budget: t.budget,
                outputs: BTreeMap::new(),
                epochs: vec![0; t.group_size.max(1) as usize],
            })
            .collect();
        let mut job = Self {
            offer,
            offer_id,
            config,
            tasks,
            history: Vec::new(),
            cancelled: false,
        };
        job.log(now, None, "offer published; taking bids".into());
        job
    }

    /// The job id.
    pub fn id(&self) -> Uuid {
        self.offer.job_id
    }

    fn log(&mut self, at: Timestamp, task: Option<u32>, text: String) {
        if self.history.len() == MAX_HISTORY {
            self.history.remove(1);
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
    pub fn used(&self) -> Amount {
        Amount(
            self.tasks
                .iter()
                .map(|t| t.committed.0.saturating_add(t.spent.0))
                .fold(0u64, u64::saturating_add),
        )
    }

    /// What goes back to the requester once the job is over: the budget not spent.
    pub fn refund(&self) -> Amount {
        let spent = self
            .tasks
            .iter()
            .map(|t| t.spent.0)
            .fold(0u64, u64::saturating_add);
        Amount(self.offer.budget.0.saturating_sub(spent))
    }

    /// A verified bid, with the worker's compatibility class for the task (from its ad).
    pub fn on_bid(
        &mut self,
        bid: Bid,
        id: Digest,
        class: Class,
        now: Timestamp,
    ) -> Result<(), String> {
        if bid.job_id != self.offer.job_id {
            return Err(format!("bid for another job {}", bid.job_id));
        }
        if bid.offer != self.offer_id {
            return Err("the bid answers another version of the offer".into());
        }
        if bid.valid_until <= now {
            return Err("the bid has expired".into());
        }
        let spec = self
            .offer
            .tasks
            .get(bid.task as usize)
            .ok_or_else(|| format!("the offer has no task {}", bid.task))?;
        let share = spec.budget.0 / u64::from(spec.group_size.max(1));
        if bid.price.0 > share {
            return Err(format!(
                "price {} is above the task's budget of {share} per worker",
                bid.price
            ));
        }
        let task = &mut self.tasks[bid.task as usize];
        if task.status.is_final() {
            return Err(format!("task {} is over", bid.task));
        }
        if let Some(held) = task.bids.get(&bid.worker)
            && held.bid.issued_at >= bid.issued_at
        {
            return Err("an equal or newer bid from this worker is held".into());
        }
        let (index, worker, price) = (bid.task, bid.worker, bid.price);
        task.bids.insert(bid.worker, Candidate { bid, id, class });
        self.log(now, Some(index), format!("bid {price} from {worker}"));
        Ok(())
    }

    /// A verified decline.
    pub fn on_decline(&mut self, decline: Decline, now: Timestamp) -> Result<(), String> {
        if decline.job_id != self.offer.job_id || decline.offer != self.offer_id {
            return Err("the decline names another job or offer".into());
        }
        let Some(task) = self.tasks.get_mut(decline.task as usize) else {
            return Err(format!("the offer has no task {}", decline.task));
        };
        task.declines.insert(decline.worker, decline.reason.clone());
        self.log(
            now,
            Some(decline.task),
            format!("{} declined: {}", decline.worker, decline.reason),
        );
        Ok(())
    }

    /// A verified countersignature. It makes the lease current only for the rank's current
    /// epoch, from its worker, for the award sent, while the award is still open.
    pub fn on_accept(
        &mut self,
        accept: &LeaseAccept,
        now: Timestamp,
    ) -> Result<Vec<Action>, String> {
        if accept.job_id != self.offer.job_id {
            return Err("acceptance for another job".into());
        }
        let renew_to = now.plus_ms(self.config.lease_ms).min(self.offer.deadline);
        let (requester, job_id) = (self.offer.requester, self.offer.job_id);
        let task = self
            .tasks
            .get_mut(accept.task as usize)
            .ok_or("no such task")?;
        let a = task
            .ranks
            .get_mut(accept.rank as usize)
            .ok_or("no such rank")?;
        if accept.epoch != a.epoch {
            return Err(format!(
                "stale epoch {} (the assignment is at epoch {})",
                accept.epoch, a.epoch
            ));
        }
        if accept.worker != a.worker || accept.award != a.award {
            return Err("the acceptance does not match the award".into());
        }
        match a.state {
            LeaseState::Offered if now < a.expires_at => {}
            LeaseState::Current => return Err("already accepted".into()),
            _ => return Err("the award is no longer open".into()),
        }
        a.state = LeaseState::Current;
        // Renew at once: the award's own expiry is short on purpose.
        a.renewal_sent = Some(now);
        let renewal = LeaseRenewal {
            job_id,
            task: accept.task,
            rank: accept.rank,
            requester,
            worker: a.worker,
            epoch: a.epoch,
            issued_at: now,
            expires_at: renew_to,
        };
        let all_current = task.ranks.iter().all(|r| r.state == LeaseState::Current);
        if all_current {
            task.status = TaskStatus::Running;
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
        Ok(vec![Action::Renew(renewal)])
    }

    /// The assignment of `rank` of task `task_index`, if it is at `epoch` (the fencing check).
    fn at_epoch(
        &mut self,
        task_index: u32,
        rank: u32,
        epoch: u64,
    ) -> Result<&mut Assignment, String> {
        let a = self
            .tasks
            .get_mut(task_index as usize)
            .and_then(|t| t.ranks.get_mut(rank as usize))
            .ok_or("no such assignment")?;
        if a.epoch != epoch {
            return Err(format!("stale epoch {epoch} (current {})", a.epoch));
        }
        Ok(a)
    }

    /// The worker acknowledged a renewal up to `expires_at`: the lease is extended.
    pub fn on_renewed(
        &mut self,
        task_index: u32,
        rank: u32,
        epoch: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<(), String> {
        let deadline = self.offer.deadline;
        let a = self.at_epoch(task_index, rank, epoch)?;
        if a.state != LeaseState::Current || now >= a.expires_at {
            return Err("the lease is not current".into());
        }
        a.expires_at = a.expires_at.max(expires_at.min(deadline));
        a.renewal_sent = None;
        Ok(())
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
    ) -> Result<Vec<Action>, String> {
        let task = self
            .tasks
            .get_mut(task_index as usize)
            .ok_or("no such task")?;
        let a = task.ranks.get_mut(rank as usize).ok_or("no such rank")?;
        if a.epoch != epoch {
            return Err(format!("stale epoch {epoch} (current {})", a.epoch));
        }
        if a.state != LeaseState::Current {
            return Err("the lease is not current".into());
        }
        a.state = LeaseState::Done;
        let price = a.price;
        // Rank 0 speaks for a group's outputs.
        if rank == 0 {
            for o in outputs {
                task.outputs.insert(o.name.clone(), o.digest);
            }
        }
        task.committed = Amount(task.committed.0.saturating_sub(price.0));
        task.spent = Amount(task.spent.0.saturating_add(price.0));
        let done = task.ranks.iter().all(|r| r.state == LeaseState::Done);
        self.log(now, Some(task_index), format!("rank {rank} delivered"));
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
                    self.log(now, Some(i as u32), "dependencies done".into());
                }
            }
        }
        Ok(self.tick(now))
    }

    /// A rank failed (reported by its worker, or found out by the requester).
    pub fn on_failed(
        &mut self,
        task_index: u32,
        rank: u32,
        epoch: u64,
        reason: &str,
        now: Timestamp,
    ) -> Result<Vec<Action>, String> {
        let a = self.at_epoch(task_index, rank, epoch)?;
        if !matches!(a.state, LeaseState::Offered | LeaseState::Current) {
            return Err("the lease is not live".into());
        }
        let mut actions = Vec::new();
        self.attempt_failed(
            task_index as usize,
            rank as usize,
            reason,
            now,
            &mut actions,
        );
        actions.extend(self.tick(now));
        Ok(actions)
    }

    /// The requester cancels the whole job: every live lease gets a cancellation.
    pub fn cancel(&mut self, reason: &str, now: Timestamp) -> Vec<Action> {
        let mut actions = Vec::new();
        for i in 0..self.tasks.len() {
            if !self.tasks[i].status.is_final() {
                self.end_task(i, TaskStatus::Cancelled(reason.into()), now, &mut actions);
            }
        }
        self.cancelled = true;
        self.log(now, None, format!("cancelled: {reason}"));
        actions
    }

    /// Moves time on: places tasks whose bid window is over, expires awards nobody
    /// countersigned and leases nobody renewed, renews leases about to end, and fails
    /// what the deadline overtook.
    pub fn tick(&mut self, now: Timestamp) -> Vec<Action> {
        let mut actions = Vec::new();
        for i in 0..self.tasks.len() {
            if self.tasks[i].status.is_final() {
                continue;
            }
            if now >= self.offer.deadline {
                self.fail_task(i, "the deadline passed".into(), now, &mut actions);
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
            if self.tasks[i].status == TaskStatus::Bidding && now >= self.offer.expires_at {
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
                    && a.renewal_sent.is_none_or(|t| now.ms_since(t) >= resend_ms);
                if due {
                    a.renewal_sent = Some(now);
                    actions.push(Action::Renew(LeaseRenewal {
                        job_id,
                        task: i as u32,
                        rank: a.rank,
                        requester,
                        worker: a.worker,
                        epoch: a.epoch,
                        issued_at: now,
                        expires_at: renew_to,
                    }));
                }
            }
        }
        actions
    }

    /// When [`Job::tick`] next has something to do, if ever.
    pub fn next_wake(&self) -> Option<Timestamp> {
        if self.state() != JobState::Open {
            return None;
        }
        let margin = self.config.renew_margin_ms;
        let mut at = vec![self.offer.deadline];
        for t in &self.tasks {
            match t.status {
                TaskStatus::Bidding => at.push(self.offer.expires_at),
                TaskStatus::Leasing | TaskStatus::Running => {
                    for a in &t.ranks {
                        match a.state {
                            LeaseState::Offered => at.push(a.expires_at),
                            // A lease that already runs to the deadline is not renewed.
                            LeaseState::Current if a.expires_at < self.offer.deadline => {
                                let renew = Timestamp(a.expires_at.0.saturating_sub(margin));
                                let resend = a
                                    .renewal_sent
                                    .map_or(renew, |t| t.plus_ms((margin / 3).max(1)));
                                at.push(renew.max(resend).min(a.expires_at));
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        at.into_iter().min()
    }

    /// Places task `i` from its bids within what is left of its budget, and awards it.
    fn place(&mut self, i: usize, now: Timestamp, actions: &mut Vec<Action>) {
        let spec = &self.offer.tasks[i];
        let task = &self.tasks[i];
        let left = Amount(
            task.budget
                .0
                .saturating_sub(task.spent.0)
                .saturating_sub(task.committed.0),
        );
        if task.failures >= self.config.max_attempts {
            let why = format!("gave up after {} failed runs", task.failures);
            self.fail_task(i, why, now, actions);
            return;
        }
        match placement::place(spec, task.bids.values(), &task.excluded, left, now) {
            Ok(slots) => self.award(i, slots, now, actions),
            Err(why) => {
                let declined = task.declines.len();
                let text = if declined > 0 {
                    format!("cannot be placed: {why} ({declined} declined)")
                } else {
                    format!("cannot be placed: {why}")
                };
                self.fail_task(i, text, now, actions);
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
        let expires_at = now
            .plus_ms(self.config.award_timeout_ms)
            .min(self.offer.deadline);
        let inputs = self.pinned_inputs(i);
        let group = slots.len() > 1 || self.offer.tasks[i].group_size > 1;
        let task = &mut self.tasks[i];
        task.attempts += 1;
        let rendezvous = group.then(|| Rendezvous {
            id: rendezvous_id(&self.offer_id, i, &task.epochs),
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
            });
            task.committed = Amount(task.committed.0.saturating_add(s.price.0));
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
        self.end_attempt(i, reason, now, actions);
        self.tasks[i].status = TaskStatus::Bidding;
        if now >= self.offer.expires_at {
            self.place(i, now, actions);
        }
    }

    /// Ends every live lease of task `i`'s attempt, telling the workers.
    fn end_attempt(&mut self, i: usize, reason: &str, now: Timestamp, actions: &mut Vec<Action>) {
        let task = &mut self.tasks[i];
        let mut to = Vec::new();
        for a in &mut task.ranks {
            if matches!(a.state, LeaseState::Offered | LeaseState::Current) {
                a.state = LeaseState::Ended;
                task.committed = Amount(task.committed.0.saturating_sub(a.price.0));
                to.push(a.worker);
            }
        }
        if !to.is_empty() {
            actions.push(Action::Cancel {
                to,
                cancel: Cancel {
                    job_id: self.offer.job_id,
                    requester: self.offer.requester,
                    task: Some(i as u32),
                    reason: reason.into(),
                    issued_at: now,
                },
            });
        }
    }

    fn end_task(
        &mut self,
        i: usize,
        status: TaskStatus,
        now: Timestamp,
        actions: &mut Vec<Action>,
    ) {
        let reason = match &status {
            TaskStatus::Failed(r) | TaskStatus::Cancelled(r) => r.clone(),
            _ => String::new(),
        };
        self.end_attempt(i, &reason, now, actions);
        self.tasks[i].status = status;
    }

    /// Task `i` fails; everything that depends on it, directly or not, is cancelled and its
    /// budget refunded.
    fn fail_task(&mut self, i: usize, reason: String, now: Timestamp, actions: &mut Vec<Action>) {
        self.log(now, Some(i as u32), format!("failed: {reason}"));
        let name = self.offer.tasks[i].name.clone();
        self.end_task(i, TaskStatus::Failed(reason), now, actions);
        let mut stopped: BTreeSet<usize> = BTreeSet::from([i]);
        for j in i + 1..self.tasks.len() {
            let hit = self.offer.tasks[j]
                .depends_on
                .iter()
                .any(|d| stopped.contains(&(*d as usize)));
            if hit && !self.tasks[j].status.is_final() {
                stopped.insert(j);
                let why = format!("a task it depends on ({name}) failed");
                self.end_task(j, TaskStatus::Cancelled(why.clone()), now, actions);
                self.log(now, Some(j as u32), format!("cancelled: {why}"));
            }
        }
    }
}

/// A fresh rendezvous id per group attempt, derived so every node can recompute it.
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
