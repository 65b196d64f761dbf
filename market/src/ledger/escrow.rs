//! One job's escrow: locked, assigned, delivered, accepted or disputed, released or
//! refunded, with deadlines.
//!
//! Every method first checks, then changes: one that returns an error has changed nothing.
//! Money leaves an escrow only as [`Movement`]s, and for every escrow
//! `paid_worker + paid_fee + refunded == locked` once it is closed (and `<=` before).
#![deny(clippy::arithmetic_side_effects)]

use std::collections::BTreeMap;

use cannabis_protocol::{
    Address, Amount, Digest, EscrowLock, FeeTerms, MoneyError, Outcome, Split, Timestamp, Uuid,
};
use serde::{Deserialize, Serialize};

/// Why an escrow operation was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EscrowRefusal {
    /// Only the named party may do this.
    #[error("only {who} may {what}")]
    NotAllowed {
        /// Who may.
        who: String,
        /// What.
        what: &'static str,
    },
    /// The escrow is closed.
    #[error("the escrow of job {0} is closed")]
    Closed(Uuid),
    /// The requester cancelled the job.
    #[error("job {0} was cancelled: no new assignments")]
    Cancelled(Uuid),
    /// Past the job's deadline.
    #[error("the deadline {deadline} has passed (block time {now})")]
    PastDeadline {
        /// The deadline.
        deadline: Timestamp,
        /// The block's time.
        now: Timestamp,
    },
    /// No such assignment.
    #[error("no assignment task {task} rank {rank}")]
    NoAssignment {
        /// Task.
        task: u32,
        /// Rank.
        rank: u32,
    },
    /// A message for another epoch than the assignment's.
    #[error("stale epoch {got}: the assignment is at epoch {current}")]
    StaleEpoch {
        /// The message's.
        got: u64,
        /// The assignment's.
        current: u64,
    },
    /// The assignment is not in a state that allows this.
    #[error("task {task} rank {rank} is {state}: cannot {what}")]
    State {
        /// Task.
        task: u32,
        /// Rank.
        rank: u32,
        /// Its state.
        state: &'static str,
        /// What was asked.
        what: &'static str,
    },
    /// The review window has ended.
    #[error("the review window ended at {0}")]
    WindowOver(Timestamp),
    /// More assignments than the lock's ranks.
    #[error("the job has {0} ranks, all assigned")]
    TooManyRanks(u32),
    /// Prices beyond what is locked.
    #[error("price {price} is over what is left of the lock ({left})")]
    OverBudget {
        /// The price asked for.
        price: Amount,
        /// What the lock has left.
        left: Amount,
    },
    /// An outcome a transaction may not ask for.
    #[error("{0}")]
    Outcome(String),
    /// The money does not work out.
    #[error(transparent)]
    Money(#[from] MoneyError),
}

/// Where one assignment stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state")]
pub enum Stage {
    /// Awarded, not delivered yet.
    Assigned,
    /// The worker committed its delivery at `at`: the review window runs.
    Delivered {
        /// The block time of the commitment.
        at: Timestamp,
        /// The delivery manifest's id.
        manifest: Digest,
    },
    /// The requester disputed the delivery: frozen until the resolver settles it.
    Disputed {
        /// When the delivery was committed.
        at: Timestamp,
        /// The delivery manifest's id.
        manifest: Digest,
    },
    /// Settled: paid (or not) and final.
    Settled {
        /// How it ended.
        outcome: Outcome,
        /// Paid to the worker.
        worker_paid: Amount,
        /// Paid to the fee recipient.
        fee_paid: Amount,
    },
}

impl Stage {
    fn name(&self) -> &'static str {
        match self {
            Stage::Assigned => "assigned",
            Stage::Delivered { .. } => "delivered",
            Stage::Disputed { .. } => "disputed",
            Stage::Settled { .. } => "settled",
        }
    }
}

/// One (task, rank) of the job, at its latest epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The worker paid on acceptance.
    pub worker: Address,
    /// The lease epoch.
    pub epoch: u64,
    /// The agreed price.
    pub price: Amount,
    /// Where it stands.
    pub stage: Stage,
}

impl Assignment {
    /// What this assignment holds of the lock: its price until it settles, then what it
    /// paid.
    fn held(&self) -> Amount {
        match self.stage {
            Stage::Settled {
                worker_paid,
                fee_paid,
                ..
            } => Amount(worker_paid.0.saturating_add(fee_paid.0)),
            _ => self.price,
        }
    }
}

/// Why money moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Why {
    /// A worker's share of an accepted assignment.
    WorkerShare,
    /// The fee on an accepted assignment.
    Fee,
    /// What is left of the lock, back to the requester.
    Refund,
}

/// Money leaving the escrow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Movement {
    /// The receiver.
    pub to: Address,
    /// How much.
    pub amount: Amount,
    /// Why.
    pub why: Why,
}

/// A job's escrow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Escrow {
    /// The job.
    pub job_id: Uuid,
    /// Who locked it (and gets the refund).
    pub requester: Address,
    /// The offer whose terms are locked.
    pub offer: Digest,
    /// The amount locked.
    pub locked: Amount,
    /// The pinned fee terms.
    pub fee: FeeTerms,
    /// Deliveries after it are refused, and undelivered assignments expire at it.
    pub deadline: Timestamp,
    /// How long after a delivery the requester may dispute it.
    pub review_window_ms: u64,
    /// Who settles disputes.
    pub resolver: Address,
    /// How many assignments the job has.
    pub ranks: u32,
    /// Each (task, rank) at its latest epoch. (Serialized as a list of entries with
    /// `task` and `rank`: JSON keys are strings.)
    #[serde(with = "by_task_rank")]
    pub assignments: BTreeMap<(u32, u32), Assignment>,
    /// Paid to workers so far.
    pub paid_worker: Amount,
    /// Paid to the fee recipient so far.
    pub paid_fee: Amount,
    /// The requester cancelled the job.
    pub cancelled: bool,
    /// Refunded when it closed; `None` while open.
    pub refunded: Option<Amount>,
}

impl Escrow {
    /// A new escrow for `lock`, by `requester`.
    pub fn open(requester: Address, lock: &EscrowLock) -> Self {
        Self {
            job_id: lock.job_id,
            requester,
            offer: lock.offer,
            locked: lock.amount,
            fee: lock.fee.clone(),
            deadline: lock.deadline,
            review_window_ms: lock.review_window_ms,
            resolver: lock.resolver,
            ranks: lock.ranks,
            assignments: BTreeMap::new(),
            paid_worker: Amount::ZERO,
            paid_fee: Amount::ZERO,
            cancelled: false,
            refunded: None,
        }
    }

    /// Whether it is closed (all its money out).
    pub fn is_closed(&self) -> bool {
        self.refunded.is_some()
    }

    fn only(&self, who: &Address, allowed: &Address, name: &str, what: &'static str) -> R<()> {
        if who == allowed {
            Ok(())
        } else {
            Err(EscrowRefusal::NotAllowed {
                who: format!("the {name} ({allowed})"),
                what,
            })
        }
    }

    fn open_now(&self) -> R<()> {
        if self.is_closed() {
            return Err(EscrowRefusal::Closed(self.job_id));
        }
        Ok(())
    }

    fn assignment(&self, task: u32, rank: u32, epoch: u64) -> R<&Assignment> {
        let a = self
            .assignments
            .get(&(task, rank))
            .ok_or(EscrowRefusal::NoAssignment { task, rank })?;
        if a.epoch != epoch {
            return Err(EscrowRefusal::StaleEpoch {
                got: epoch,
                current: a.epoch,
            });
        }
        Ok(a)
    }

    /// What the lock holds for assignments now (prices of the open ones, payments of the
    /// settled).
    fn held(&self, except: Option<(u32, u32)>) -> Amount {
        let held = self
            .assignments
            .iter()
            .filter(|(k, _)| Some(**k) != except)
            .map(|(_, a)| u128::from(a.held().0))
            .sum::<u128>();
        Amount(u64::try_from(held).unwrap_or(u64::MAX))
    }

    /// The requester binds `worker` at `epoch` to (task, rank) for `price`. A newer epoch
    /// replaces an undelivered assignment (which pays nothing) or one settled without pay.
    #[allow(clippy::too_many_arguments)]
    pub fn assign(
        &mut self,
        from: &Address,
        now: Timestamp,
        task: u32,
        rank: u32,
        worker: Address,
        epoch: u64,
        price: Amount,
    ) -> R<()> {
        self.only(from, &self.requester, "requester", "assign its job")?;
        self.open_now()?;
        if self.cancelled {
            return Err(EscrowRefusal::Cancelled(self.job_id));
        }
        if now >= self.deadline {
            return Err(EscrowRefusal::PastDeadline {
                deadline: self.deadline,
                now,
            });
        }
        match self.assignments.get(&(task, rank)) {
            Some(a) if epoch <= a.epoch => {
                return Err(EscrowRefusal::StaleEpoch {
                    got: epoch,
                    current: a.epoch,
                });
            }
            Some(a) => match &a.stage {
                Stage::Assigned => {}
                Stage::Settled {
                    worker_paid,
                    fee_paid,
                    ..
                } if *worker_paid == Amount::ZERO && *fee_paid == Amount::ZERO => {}
                s => {
                    return Err(EscrowRefusal::State {
                        task,
                        rank,
                        state: s.name(),
                        what: "be assigned again",
                    });
                }
            },
            None => {
                if self.assignments.len() >= self.ranks as usize {
                    return Err(EscrowRefusal::TooManyRanks(self.ranks));
                }
            }
        }
        let left = self
            .locked
            .checked_sub(self.held(Some((task, rank))))
            .unwrap_or(Amount::ZERO);
        if price > left {
            return Err(EscrowRefusal::OverBudget { price, left });
        }
        self.assignments.insert(
            (task, rank),
            Assignment {
                worker,
                epoch,
                price,
                stage: Stage::Assigned,
            },
        );
        Ok(())
    }

    /// The assigned worker commits its delivery (before the deadline).
    pub fn commit(
        &mut self,
        from: &Address,
        now: Timestamp,
        task: u32,
        rank: u32,
        epoch: u64,
        manifest: Digest,
    ) -> R<()> {
        self.open_now()?;
        let a = self.assignment(task, rank, epoch)?;
        self.only(from, &a.worker, "assigned worker", "commit a delivery")?;
        if a.stage != Stage::Assigned {
            return Err(self.state_refusal(task, rank, "commit a delivery"));
        }
        if now >= self.deadline {
            return Err(EscrowRefusal::PastDeadline {
                deadline: self.deadline,
                now,
            });
        }
        self.set_stage(task, rank, Stage::Delivered { at: now, manifest });
        Ok(())
    }

    /// The requester disputes a delivery inside its review window.
    pub fn dispute(
        &mut self,
        from: &Address,
        now: Timestamp,
        task: u32,
        rank: u32,
        epoch: u64,
    ) -> R<()> {
        self.only(from, &self.requester, "requester", "dispute a delivery")?;
        self.open_now()?;
        let a = self.assignment(task, rank, epoch)?;
        let Stage::Delivered { at, manifest } = a.stage else {
            return Err(self.state_refusal(task, rank, "be disputed"));
        };
        let ends = at.plus_ms(self.review_window_ms);
        if now >= ends {
            return Err(EscrowRefusal::WindowOver(ends));
        }
        self.set_stage(task, rank, Stage::Disputed { at, manifest });
        Ok(())
    }

    /// Settles one assignment by a transaction: the requester accepts (whole or part) a
    /// delivered or disputed assignment, or cancels an undelivered one; the resolver settles
    /// a disputed one. Timeouts (the review window, the deadline) settle by themselves in
    /// [`Escrow::tick`].
    pub fn settle(
        &mut self,
        from: &Address,
        now: Timestamp,
        task: u32,
        rank: u32,
        epoch: u64,
        outcome: Outcome,
    ) -> R<Vec<Movement>> {
        self.open_now()?;
        let a = self.assignment(task, rank, epoch)?;
        let allowed = match (&a.stage, outcome) {
            (
                Stage::Delivered { .. } | Stage::Disputed { .. },
                Outcome::Accepted | Outcome::PartiallyAccepted { .. },
            ) => self.only(from, &self.requester, "requester", "accept a delivery"),
            (Stage::Assigned, Outcome::Cancelled) => {
                self.only(from, &self.requester, "requester", "cancel an assignment")
            }
            (Stage::Disputed { .. }, Outcome::DisputeResolved { .. } | Outcome::Rejected) => {
                self.only(from, &self.resolver, "resolver", "resolve a dispute")
            }
            (_, Outcome::ReviewWindowElapsed | Outcome::Expired) => Err(EscrowRefusal::Outcome(
                "the review window and the deadline settle by themselves, at the block that passes them"
                    .into(),
            )),
            (s, _) => Err(EscrowRefusal::State {
                task,
                rank,
                state: s.name(),
                what: "be settled so",
            }),
        };
        allowed?;
        let moves = self.pay(task, rank, outcome)?;
        self.close_if_done(now);
        Ok(moves.into_iter().chain(self.refund_if_closed()).collect())
    }

    /// The requester ends the job early: undelivered assignments are cancelled, nothing
    /// new is assigned, and the rest is refunded once the delivered ones settle.
    pub fn cancel(&mut self, from: &Address, now: Timestamp) -> R<Vec<Movement>> {
        self.only(from, &self.requester, "requester", "cancel its job")?;
        self.open_now()?;
        if self.cancelled {
            return Err(EscrowRefusal::Cancelled(self.job_id));
        }
        self.cancelled = true;
        let undelivered: Vec<(u32, u32)> = self
            .assignments
            .iter()
            .filter(|(_, a)| a.stage == Stage::Assigned)
            .map(|(k, _)| *k)
            .collect();
        for (task, rank) in undelivered {
            // Pays nothing: cannot fail.
            let _ = self.pay(task, rank, Outcome::Cancelled);
        }
        self.close_if_done(now);
        Ok(self.refund_if_closed().into_iter().collect())
    }

    /// The timeouts due at `now`: a delivery whose review window ended undisputed is paid;
    /// at the deadline, undelivered assignments expire; a job with nothing left pending
    /// closes and refunds the rest.
    pub fn tick(&mut self, now: Timestamp) -> Vec<Movement> {
        if self.is_closed() {
            return Vec::new();
        }
        let window = self.review_window_ms;
        let due: Vec<((u32, u32), Outcome)> = self
            .assignments
            .iter()
            .filter_map(|(k, a)| match a.stage {
                Stage::Delivered { at, .. } if now >= at.plus_ms(window) => {
                    Some((*k, Outcome::ReviewWindowElapsed))
                }
                Stage::Assigned if now >= self.deadline => Some((*k, Outcome::Expired)),
                _ => None,
            })
            .collect();
        let mut moves = Vec::new();
        for ((task, rank), outcome) in due {
            // The price is within the lock (checked at assignment): cannot fail.
            if let Ok(m) = self.pay(task, rank, outcome) {
                moves.extend(m);
            }
        }
        self.close_if_done(now);
        moves.extend(self.refund_if_closed());
        moves
    }

    /// When [`Escrow::tick`] next has something to do.
    pub fn next_due(&self) -> Option<Timestamp> {
        if self.is_closed() {
            return None;
        }
        let windows = self.assignments.values().filter_map(|a| match a.stage {
            Stage::Delivered { at, .. } => Some(at.plus_ms(self.review_window_ms)),
            _ => None,
        });
        let deadline = (!self.cancelled).then_some(self.deadline);
        windows.chain(deadline).min()
    }

    fn state_refusal(&self, task: u32, rank: u32, what: &'static str) -> EscrowRefusal {
        let state = self
            .assignments
            .get(&(task, rank))
            .map_or("unassigned", |a| a.stage.name());
        EscrowRefusal::State {
            task,
            rank,
            state,
            what,
        }
    }

    fn set_stage(&mut self, task: u32, rank: u32, stage: Stage) {
        if let Some(a) = self.assignments.get_mut(&(task, rank)) {
            a.stage = stage;
        }
    }

    /// Settles (task, rank) with `outcome`: its split of its price, paid out.
    fn pay(&mut self, task: u32, rank: u32, outcome: Outcome) -> R<Vec<Movement>> {
        let a = self
            .assignments
            .get(&(task, rank))
            .ok_or(EscrowRefusal::NoAssignment { task, rank })?;
        let split = Split::settle(a.price, a.price, outcome, self.fee.rate_bps)?;
        let worker = a.worker;
        let paid_worker = self.paid_worker.checked_add(split.worker_paid)?;
        let paid_fee = self.paid_fee.checked_add(split.fee_paid)?;
        self.paid_worker = paid_worker;
        self.paid_fee = paid_fee;
        self.set_stage(
            task,
            rank,
            Stage::Settled {
                outcome,
                worker_paid: split.worker_paid,
                fee_paid: split.fee_paid,
            },
        );
        let moves = [
            (worker, split.worker_paid, Why::WorkerShare),
            (self.fee.recipient, split.fee_paid, Why::Fee),
        ];
        Ok(moves
            .into_iter()
            .filter(|(_, amount, _)| *amount > Amount::ZERO)
            .map(|(to, amount, why)| Movement { to, amount, why })
            .collect())
    }

    fn close_if_done(&mut self, now: Timestamp) {
        let pending = self
            .assignments
            .values()
            .any(|a| !matches!(a.stage, Stage::Settled { .. }));
        let all_settled = self.assignments.len() >= self.ranks as usize;
        if !pending && (self.cancelled || now >= self.deadline || all_settled) {
            let paid = self.paid_worker.0.saturating_add(self.paid_fee.0);
            self.refunded = Some(Amount(self.locked.0.saturating_sub(paid)));
        }
    }

    /// The refund, the moment the escrow closed.
    fn refund_if_closed(&self) -> Option<Movement> {
        self.refunded
            .filter(|r| *r > Amount::ZERO)
            .map(|amount| Movement {
                to: self.requester,
                amount,
                why: Why::Refund,
            })
    }
}

type R<T> = Result<T, EscrowRefusal>;

/// An escrow's assignments as a list of `{task, rank, ...}` entries.
mod by_task_rank {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::Assignment;

    #[derive(Serialize, Deserialize)]
    struct Entry {
        task: u32,
        rank: u32,
        #[serde(flatten)]
        assignment: Assignment,
    }

    #[derive(Serialize)]
    struct EntryRef<'a> {
        task: u32,
        rank: u32,
        #[serde(flatten)]
        assignment: &'a Assignment,
    }

    pub(super) fn serialize<S: Serializer>(
        map: &BTreeMap<(u32, u32), Assignment>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(map.iter().map(|(&(task, rank), assignment)| EntryRef {
            task,
            rank,
            assignment,
        }))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<(u32, u32), Assignment>, D::Error> {
        let entries = Vec::<Entry>::deserialize(d)?;
        Ok(entries
            .into_iter()
            .map(|e| ((e.task, e.rank), e.assignment))
            .collect())
    }
}
