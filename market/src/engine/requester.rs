//! The requester's side of the engine: publishing offers, taking bids (admission is checked
//! here and only here), running jobs, widening calls that drew too few bids.

use cannabis_protocol::{
    AdapterKind, Amount, Assigned, Bid, Decline, DeliveryManifest, EscrowAssignMany, EscrowCancel,
    EscrowLock, EscrowSettle, EvaluationOutcome, JobOffer, LeaseAccept, MAX_ASSIGNED, Message as _,
    NamedDigest, Outcome, Received, Uuid, draw, message_id,
};

use super::{
    Bare, CommandError, CommandOk, Market, MarketEvent, Outbound, Output, ProductCheck, Publish,
    Purpose, RecordKey, RunOrder, Settle,
};
use crate::fanin;
use crate::job::{Action, Bidding, Escrowed, Job, JobState, LeaseState, ProductVerdict};
use crate::matching;
use crate::placement::Class;
use crate::{OfferTemplate, Refusal};

/// The lock of a job's budget: the offer's budget under its pinned terms, one assignment
/// per rank of every task.
pub(super) fn lock_of(
    offer: &JobOffer,
    id: cannabis_protocol::Digest,
    resolver: cannabis_protocol::Address,
) -> Settle {
    Settle::Lock(EscrowLock {
        job_id: offer.job_id,
        offer: id,
        amount: offer.budget,
        fee: offer.fee.clone(),
        deadline: offer.deadline,
        review_window_ms: offer.review_window_ms,
        resolver,
        ranks: offer.tasks.iter().map(|t| t.group_size.max(1)).sum(),
    })
}

impl Market {
    /// Makes the offer of a template (and its job, when `run_job`), and asks for it to be
    /// published once the job is durable.
    pub(super) fn submit(
        &mut self,
        t: OfferTemplate,
        nonce: [u8; 16],
        run_job: bool,
    ) -> Result<CommandOk, CommandError> {
        let now = self.now;
        let me = self.me.address;
        let nonce = t.nonce.unwrap_or_else(|| Uuid::from_random(nonce));
        let job_id = cannabis_protocol::job_id_of(&me, &nonce);
        if self.jobs.contains_key(&job_id)
            || self.bare.contains_key(&job_id)
            || self.view.offer(&job_id).is_some()
        {
            return Err(CommandError::JobIdTaken(job_id));
        }
        let fee = self.config.fee.clone().ok_or(CommandError::NoFeeTerms)?;
        let policy = self.config.attestation;
        if let Some(task) = t.tasks.iter().position(|t| t.requirements.confidential)
            && !policy.verifies_any()
        {
            return Err(CommandError::NoConfidentialVerifier {
                task: task as u32,
                why: policy.why_none(),
            });
        }
        if let Some(rate) = self.config.view.offer_rate
            && !self.view.offer_rate_allows(&me, now)
        {
            return Err(CommandError::OverRate(rate));
        }
        let budget = Amount::sum(t.tasks.iter().map(|t| &t.budget))?;
        let ctx = self.context();
        let sized: Vec<fanin::Sized> = t
            .tasks
            .iter()
            .map(|task| {
                fanin::size_call(
                    &self.config.fanin,
                    &self.view,
                    &me,
                    &job_id,
                    task,
                    t.deadline_ms,
                    &ctx,
                )
            })
            .collect();
        let calls = sized.iter().map(|s| s.call).collect();
        let mut offer = JobOffer {
            job_id,
            nonce,
            requester: me,
            seq: 0,
            issued_at: now,
            expires_at: now.plus_ms(t.ttl_ms),
            deadline: now.plus_ms(t.deadline_ms),
            delivery: self.me.delivery,
            budget,
            fee,
            review_window_ms: t.review_window_ms,
            acceptance: t.acceptance.clone(),
            evaluation: t.evaluation.clone(),
            tasks: t.tasks.clone(),
            calls,
        };
        offer.validate()?;
        if t.ttl_ms > self.config.view.max_offer_ttl_ms {
            return Err(CommandError::NotKept(crate::Verdict::Reject(
                crate::RejectReason::TooLongLived {
                    expires_at: offer.expires_at,
                },
            )));
        }
        offer.seq = self.next_seq("offer", now.0);
        let id = message_id(&offer);
        let keep = offer
            .tasks
            .iter()
            .map(|task| self.config.fanin.keep(task.group_size))
            .max()
            .unwrap_or(1);
        if run_job {
            let name = t
                .name
                .clone()
                .or_else(|| t.tasks.first().map(|t| t.name.clone()))
                .unwrap_or_default();
            let bidding = Bidding {
                early: t.early,
                keep,
            };
            let mut job = Job::new(
                offer.clone(),
                id,
                name,
                self.config.leases.clone(),
                bidding,
                now,
            );
            job.spot_mut().rate_ppm = t.spot_check_ppm.min(crate::spot::PPM);
            for (i, s) in sized.iter().enumerate() {
                job.known_workers(i, s.qualified);
            }
            if let Some(resolver) = self.config.resolver {
                // No lock, no award: the job places nothing until the lock is in a block.
                job.lock_asked(now);
                self.out
                    .fenced(Output::Settle(lock_of(&offer, id, resolver)));
            }
            self.jobs.insert(job_id, job);
            self.out.dirty(RecordKey::Job(job_id));
            self.rewake(job_id);
        } else {
            self.bare.insert(
                job_id,
                Bare {
                    offer: id,
                    keep,
                    bids: Default::default(),
                },
            );
        }
        self.out.fenced(Output::Publish(Publish::Offer(offer)));
        Ok(CommandOk::Submitted {
            job: job_id,
            offer: id,
        })
    }

    /// One of this node's jobs, to change.
    pub(super) fn job_mut(&mut self, job: Uuid) -> Result<&mut Job, CommandError> {
        self.jobs.get_mut(&job).ok_or(CommandError::UnknownJob(job))
    }

    pub(super) fn cancel(&mut self, job: Uuid) -> Result<CommandOk, CommandError> {
        let now = self.now;
        let j = self.job_mut(job)?;
        if j.state() != JobState::Open {
            return Err(CommandError::JobOver {
                job,
                state: j.state(),
            });
        }
        let settled = *j.escrow() != Escrowed::Unsettled;
        let actions = j.cancel(now);
        self.job_changed(job, actions);
        if settled {
            self.out
                .fenced(Output::Settle(Settle::Cancel(EscrowCancel { job_id: job })));
        }
        Ok(CommandOk::Done)
    }

    /// The requester accepts (`part_ppm`) or disputes (`reason`) every delivered rank of a
    /// job: one escrow operation each, at the rank's delivered epoch. Settlement refuses
    /// what no longer applies (a rank already paid, a window that ended), so asking twice
    /// moves no money twice.
    pub(super) fn settle_delivered(
        &mut self,
        job: Uuid,
        part_ppm: Option<u32>,
        reason: Option<String>,
        hold_checked: bool,
    ) -> Result<CommandOk, CommandError> {
        let now = self.now;
        let j = self.job_mut(job)?;
        if *j.escrow() == Escrowed::Unsettled {
            return Err(CommandError::Unsettled(job));
        }
        let outcome = match part_ppm {
            Some(p) if p > cannabis_protocol::PPM_DENOMINATOR => {
                return Err(CommandError::BadPart(p));
            }
            Some(cannabis_protocol::PPM_DENOMINATOR) => Outcome::Accepted,
            Some(p) => Outcome::PartiallyAccepted { accepted_ppm: p },
            None => Outcome::Rejected,
        };
        let dispute = reason.is_some();
        let spot = j.spot();
        let delivered: Vec<EscrowSettle> = j
            .tasks()
            .iter()
            .enumerate()
            .flat_map(|(i, t)| {
                t.ranks()
                    .iter()
                    .filter(|a| a.state == LeaseState::Done)
                    // A delivery found wrong is disputed already: never accepted with the
                    // rest. One under a spot check waits for it when the evaluation
                    // accepts (the check accepts it when it passes).
                    .filter(move |a| dispute || !a.found_wrong())
                    .filter(move |_| dispute || !(hold_checked && spot.pending(i as u32)))
                    .map(move |a| EscrowSettle {
                        job_id: job,
                        task: i as u32,
                        rank: a.rank,
                        epoch: a.epoch,
                        outcome,
                    })
            })
            .collect();
        if delivered.is_empty() {
            return Err(CommandError::NothingDelivered(job));
        }
        let text = match (&reason, outcome) {
            (Some(r), _) => format!("disputed {} deliveries: {r}", delivered.len()),
            (None, Outcome::Accepted) => format!("accepted {} deliveries", delivered.len()),
            (None, _) => format!(
                "accepted {:.1}% of {} deliveries",
                f64::from(part_ppm.unwrap_or(0)) / 10_000.0,
                delivered.len()
            ),
        };
        j.note(now, text);
        self.out.dirty(RecordKey::Job(job));
        for s in delivered {
            let op = if reason.is_some() {
                Settle::Dispute(s)
            } else {
                Settle::Accept(s)
            };
            self.out.fenced(Output::Settle(op));
        }
        Ok(CommandOk::Done)
    }

    pub(super) fn delivered(
        &mut self,
        job: Uuid,
        task: u32,
        rank: u32,
        epoch: u64,
        outputs: &[NamedDigest],
    ) -> Result<CommandOk, CommandError> {
        let now = self.now;
        let j = self.job_mut(job)?;
        let actions = j.on_delivered(task, rank, epoch, outputs, now)?;
        let checks = product_checks_due(j);
        self.job_changed(job, actions);
        for check in checks {
            self.out.fenced(Output::CheckProduct(check));
        }
        self.spot_delivered(job, task, rank, epoch, outputs);
        // The last delivery starts the evaluation, when the terms name one.
        self.evaluate(job, false)?;
        Ok(CommandOk::Done)
    }

    /// Starts an evaluation run of a job's deliveries: by hand whatever came before, or
    /// once, when every task delivered. `false` when none is due.
    pub(super) fn evaluate(&mut self, job: Uuid, by_hand: bool) -> Result<bool, CommandError> {
        let now = self.now;
        let j = self.job_mut(job)?;
        if by_hand {
            if j.offer().evaluation.is_none() {
                return Err(CommandError::NoEvaluation(job));
            }
            if j.state() != JobState::Completed {
                return Err(CommandError::NotDelivered(job));
            }
        }
        let Some(run) = j.start_evaluation(by_hand, now) else {
            return Ok(false);
        };
        let order = evaluation_order(j, run);
        self.out.dirty(RecordKey::Job(job));
        if let Some(order) = order {
            self.out.fenced(Output::Evaluate(Box::new(order)));
        }
        Ok(true)
    }

    /// An evaluation run's signed report: kept, then a pass accepts every delivery (unless
    /// the terms ask for the requester's confirmation) and anything else disputes them,
    /// naming the report. Without a ledger the report is kept and nothing is settled.
    pub(super) fn evaluated(
        &mut self,
        job: Uuid,
        run: u32,
        report: cannabis_protocol::Signed<cannabis_protocol::Evaluation>,
    ) -> Result<CommandOk, CommandError> {
        let now = self.now;
        let me = self.me.address;
        let opened = report
            .verify_from(&me)
            .map_err(|e| CommandError::BadReport(e.to_string()))?;
        let body = opened.body;
        let j = self.job_mut(job)?;
        if body.job_id != job {
            return Err(CommandError::BadReport("it is of another job".into()));
        }
        if !j.on_evaluated(run, report, &body, now) {
            return Ok(CommandOk::Done);
        }
        let confirm = j.offer().evaluation.as_ref().is_some_and(|t| t.confirm);
        let settled = *j.escrow() != Escrowed::Unsettled;
        let settle = match body.outcome {
            EvaluationOutcome::Passed if confirm => {
                j.note(
                    now,
                    "the evaluation passed; the terms ask for the requester's confirmation: \
                     `cannabis job accept` pays, `cannabis job dispute` disputes"
                        .into(),
                );
                None
            }
            EvaluationOutcome::Passed => Some((Some(cannabis_protocol::PPM_DENOMINATOR), None)),
            EvaluationOutcome::Failed | EvaluationOutcome::NotEvaluated => Some((
                None,
                Some(format!(
                    "evaluation run {run} (report {}): {}",
                    opened.id, body.reason
                )),
            )),
        };
        self.out.dirty(RecordKey::Job(job));
        if let Some((part, reason)) = settle
            && settled
        {
            match self.settle_delivered(job, part, reason, true) {
                Ok(_) | Err(CommandError::NothingDelivered(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(CommandOk::Done)
    }

    /// A delivered synthetic product's verdict: kept, and a wrong product's delivery is
    /// disputed at once (the escrow then holds its price until the resolver decides), so
    /// that the review window can never pay for it.
    pub(super) fn product_checked(
        &mut self,
        job: Uuid,
        task: u32,
        rank: u32,
        epoch: u64,
        verdict: ProductVerdict,
    ) -> Result<CommandOk, CommandError> {
        let now = self.now;
        let j = self.job_mut(job)?;
        let failed = j.on_product_checked(task, rank, epoch, verdict, now)?;
        let locked = *j.escrow() == Escrowed::Locked;
        self.out.dirty(RecordKey::Job(job));
        if failed && locked {
            self.out
                .fenced(Output::Settle(Settle::Dispute(EscrowSettle {
                    job_id: job,
                    task,
                    rank,
                    epoch,
                    outcome: Outcome::Rejected,
                })));
        }
        Ok(CommandOk::Done)
    }

    /// A worker's signed delivery: checked against the task's terms and the rank's current
    /// lease, kept, and its outputs fetched (once it is durable).
    pub(super) fn on_delivery(
        &mut self,
        from: cannabis_protocol::Address,
        r: Received<DeliveryManifest>,
    ) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let job_id = r.body.job_id;
        let signed = r.signed();
        let now = self.now;
        let job = self.signed_for_job(from, &r, job_id)?;
        let new = job.on_manifest(&signed, &r.body, now)?;
        self.job_changed(job_id, Vec::new());
        if new {
            self.out.fenced(Output::Fetch(Box::new(signed)));
        }
        Ok(())
    }

    /// A worker's note that a rank's checkpoint changed: checked against the task's terms
    /// and the rank's current lease; a checkpoint newer than the one kept is fetched.
    pub(super) fn on_checkpoint(
        &mut self,
        from: cannabis_protocol::Address,
        r: Received<cannabis_protocol::CheckpointNote>,
    ) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let job_id = r.body.job_id;
        let job = self.signed_for_job(from, &r, job_id)?;
        if job.on_checkpoint_note(&r.body)? {
            self.out.fenced(Output::FetchCheckpoint(Box::new(r.body)));
        }
        Ok(())
    }

    /// A bid: cheap checks first (the job, the offer version, the quote's life, the task,
    /// the price, the draw), then the signature, then the worker's ad. The one place where
    /// bid admission is decided.
    pub(super) fn on_bid(
        &mut self,
        from: cannabis_protocol::Address,
        r: Received<Bid>,
    ) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let now = self.now;
        let bid = &r.body;
        if self.bare.contains_key(&bid.job_id) {
            return self.on_bare_bid(r);
        }
        let Some(job) = self.jobs.get(&bid.job_id) else {
            return Err(match self.view.offer(&bid.job_id) {
                Some(_) => Refusal::NotMine(bid.job_id),
                None => Refusal::UnknownJob(bid.job_id),
            });
        };
        match job.admit_bid(bid, now) {
            Err(Refusal::Equivocation) => {
                // Evidence only once the signature holds: anyone can forge an unsigned lie.
                self.check_signature(&r)?;
                let job = bid.job_id;
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.equivocated(r.signed(), &r.body, now);
                    self.out.dirty(RecordKey::Job(job));
                }
                return Err(Refusal::Equivocation);
            }
            // Sent again after a connection dropped under the first send: taken already.
            Err(Refusal::SameBid) => return Ok(()),
            other => other?,
        }
        let call = job.offer().calls[bid.task as usize];
        if !draw::drawn(&call, &bid.job_id, bid.task, &bid.worker, bid.price) {
            return Err(Refusal::NotDrawn);
        }
        self.check_signature(&r)?;
        let spec = &job.offer().tasks[bid.task as usize];
        let ad = self.view.ad(&bid.worker).ok_or(Refusal::NoAd)?.ad();
        let unmet = matching::unmet(spec, ad, &self.context());
        if !unmet.is_empty() {
            return Err(Refusal::Unmet(unmet));
        }
        let class = Class::of(spec, ad);
        let (job_id, task, worker, price) = (bid.job_id, bid.task, bid.worker, bid.price);
        let signature = *r.signature();
        let strikes = self.strikes_of(&worker);
        let actions = self
            .jobs
            .get_mut(&job_id)
            .ok_or(Refusal::UnknownJob(job_id))?
            .on_bid(r.body, r.id, signature, class, strikes, now)?;
        self.event(MarketEvent::BidTaken {
            job: job_id,
            task,
            worker,
            price,
        });
        self.job_changed(job_id, actions);
        Ok(())
    }

    /// A bid for an offer published without a job: checked the same way, kept to list.
    fn on_bare_bid(&mut self, r: Received<Bid>) -> Result<(), Refusal> {
        let now = self.now;
        let bid = &r.body;
        let offer = self
            .view
            .offer(&bid.job_id)
            .map(|e| e.offer())
            .ok_or(Refusal::UnknownJob(bid.job_id))?;
        let bare = self
            .bare
            .get(&bid.job_id)
            .ok_or(Refusal::UnknownJob(bid.job_id))?;
        if bid.offer != bare.offer {
            return Err(Refusal::OtherVersion);
        }
        if bid.valid_until <= now {
            return Err(Refusal::BidExpired);
        }
        let no_task = Refusal::NoSuchTask {
            job: bid.job_id,
            task: bid.task,
        };
        let spec = offer.tasks.get(bid.task as usize).ok_or(no_task)?;
        let share = Amount(spec.budget.0 / u64::from(spec.group_size.max(1)));
        if bid.price > share {
            return Err(Refusal::AboveShare {
                price: bid.price,
                share,
            });
        }
        let call = offer.calls[bid.task as usize];
        if !draw::drawn(&call, &bid.job_id, bid.task, &bid.worker, bid.price) {
            return Err(Refusal::NotDrawn);
        }
        let key = (bid.task, bid.worker);
        if let Some((held, _)) = bare.bids.get(&key) {
            if held == bid {
                return Ok(());
            }
            if held.issued_at >= bid.issued_at {
                return Err(Refusal::DuplicateBid);
            }
        }
        if !bare.bids.contains_key(&key) && bare.bids.len() >= bare.keep as usize {
            return Err(Refusal::Outbid {
                task: bid.task,
                kept: bare.bids.len(),
            });
        }
        self.check_signature(&r)?;
        let (job, task, worker, price) = (bid.job_id, bid.task, bid.worker, bid.price);
        if let Some(bare) = self.bare.get_mut(&job) {
            bare.bids.insert(key, (r.body, r.id));
        }
        self.event(MarketEvent::BidTaken {
            job,
            task,
            worker,
            price,
        });
        Ok(())
    }

    /// A decline: for a job of this node, from a worker the call drew.
    pub(super) fn on_decline(
        &mut self,
        from: cannabis_protocol::Address,
        r: Received<Decline>,
    ) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let d = &r.body;
        if self.bare.contains_key(&d.job_id) {
            // Nobody places a bare offer: a decline changes nothing.
            return self.check_signature(&r);
        }
        let job = self
            .jobs
            .get(&d.job_id)
            .ok_or(Refusal::UnknownJob(d.job_id))?;
        let call = job
            .offer()
            .calls
            .get(d.task as usize)
            .copied()
            .ok_or(Refusal::NoSuchTask {
                job: d.job_id,
                task: d.task,
            })?;
        if !draw::drawn(&call, &d.job_id, d.task, &d.worker, call.ref_price) {
            return Err(Refusal::NotDrawn);
        }
        self.check_signature(&r)?;
        let now = self.now;
        let job_id = d.job_id;
        self.jobs
            .get_mut(&job_id)
            .ok_or(Refusal::UnknownJob(job_id))?
            .on_decline(r.body, now)?;
        self.job_changed(job_id, Vec::new());
        Ok(())
    }

    /// The job of this node that a message names, once the message came from its signer
    /// and (for a job this node has) its signature verifies.
    fn signed_for_job<T: cannabis_protocol::Message>(
        &mut self,
        from: cannabis_protocol::Address,
        r: &Received<T>,
        job_id: cannabis_protocol::Uuid,
    ) -> Result<&mut crate::job::Job, Refusal> {
        Self::from_signer(from, r)?;
        if !self.jobs.contains_key(&job_id) {
            return Err(Refusal::UnknownJob(job_id));
        }
        self.check_signature(r)?;
        self.jobs
            .get_mut(&job_id)
            .ok_or(Refusal::UnknownJob(job_id))
    }

    /// A worker's countersignature of an award of this node.
    pub(super) fn on_accept(
        &mut self,
        from: cannabis_protocol::Address,
        r: Received<LeaseAccept>,
    ) -> Result<(), Refusal> {
        let (job_id, task, now) = (r.body.job_id, r.body.task, self.now);
        let job = self.signed_for_job(from, &r, job_id)?;
        let actions = job.on_accept(&r, now)?;
        if job.tasks()[task as usize].status() == &crate::job::TaskStatus::Running {
            self.event(MarketEvent::TaskLeased { job: job_id, task });
        }
        self.job_changed(job_id, actions);
        Ok(())
    }

    /// A worker's report on the work of a lease of one of this node's jobs.
    pub(super) fn on_run_report(
        &mut self,
        from: cannabis_protocol::Address,
        r: Received<cannabis_protocol::RunReport>,
    ) -> Result<(), Refusal> {
        let (job_id, now) = (r.body.job_id, self.now);
        let job = self.signed_for_job(from, &r, job_id)?;
        job.on_run_report(&r.body, now)?;
        self.job_changed(job_id, Vec::new());
        // A run that failed, was refused or was lost is a failed attempt: the task is
        // placed again within its budget and attempts, as when a worker stops renewing.
        let b = &r.body;
        if matches!(
            b.stage,
            cannabis_protocol::RunStage::Failed
                | cannabis_protocol::RunStage::Refused
                | cannabis_protocol::RunStage::Unknown
        ) {
            let why = if b.detail.is_empty() {
                format!("the worker reports the run {}", b.stage.name())
            } else {
                format!(
                    "the worker reports the run {}: {}",
                    b.stage.name(),
                    b.detail
                )
            };
            self.job_failed(job_id, b.task, b.rank, b.epoch, &why);
        }
        Ok(())
    }

    /// An assignment failed (its worker refused an award or a renewal).
    pub(super) fn job_failed(&mut self, job: Uuid, task: u32, rank: u32, epoch: u64, why: &str) {
        let now = self.now;
        if let Some(j) = self.jobs.get_mut(&job)
            && let Ok(actions) = j.on_failed(task, rank, epoch, why, now)
        {
            self.job_changed(job, actions);
        }
    }

    pub(super) fn tick_job(&mut self, job: Uuid) {
        let now = self.now;
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        let before = (j.state(), j.history().len());
        let actions = j.tick(now);
        let after = (j.state(), j.history().len());
        if !actions.is_empty() || before != after || self.wants_widening(job) {
            self.job_changed(job, actions);
        } else {
            self.rewake(job);
        }
    }

    fn wants_widening(&self, job: Uuid) -> bool {
        self.jobs
            .get(&job)
            .is_some_and(|j| (0..j.tasks().len()).any(|i| j.wants_wider_call(i, self.now)))
    }

    /// A job changed: it is written out, and what it asked for is sent once it is durable.
    pub(super) fn job_changed(&mut self, job: Uuid, actions: Vec<Action>) {
        self.out.dirty(RecordKey::Job(job));
        // The awards made together go to the escrow together: a group of 99 ranks is one
        // transaction (one signature for every node to check), not 99.
        if self.jobs.get(&job).map(Job::escrow) == Some(&Escrowed::Locked) {
            let assigned: Vec<Assigned> = actions
                .iter()
                .filter_map(|a| match a {
                    Action::Award(award) => Some(Assigned {
                        task: award.task,
                        rank: award.rank,
                        worker: award.worker,
                        epoch: award.epoch,
                        price: award.price,
                    }),
                    _ => None,
                })
                .collect();
            for chunk in assigned.chunks(MAX_ASSIGNED) {
                let many = EscrowAssignMany {
                    job_id: job,
                    assignments: chunk.to_vec(),
                };
                // One award alone keeps the plain ESCROW_ASSIGN.
                let single = (chunk.len() == 1).then(|| many.each().next()).flatten();
                let settle = match single {
                    Some(one) => Settle::Assign(one),
                    None => Settle::AssignMany(many),
                };
                self.out.fenced(Output::Settle(settle));
            }
        }
        for action in actions {
            match action {
                Action::Award(award) => {
                    self.event(MarketEvent::Awarded {
                        job,
                        task: award.task,
                        rank: award.rank,
                        epoch: award.epoch,
                        worker: award.worker,
                    });
                    let to = award.worker;
                    let purpose = Purpose::Award(Box::new(award.clone()), 1);
                    self.send(to, Outbound::Award(award), purpose);
                }
                Action::Renew(renewal) => {
                    let to = renewal.worker;
                    self.send(
                        to,
                        Outbound::Renewal(renewal.clone()),
                        Purpose::Renew(renewal),
                    );
                }
                Action::Cancel(cancel) => {
                    let worker = cancel.worker;
                    let purpose = Purpose::Other("cancellation", worker);
                    self.send(worker, Outbound::Cancel(cancel), purpose);
                }
            }
        }
        self.widen(job);
        let was_open = self.wake_of.contains_key(&job);
        self.rewake(job);
        if let Some(j) = self.jobs.get(&job)
            && was_open
            && j.state() != JobState::Open
        {
            let state = j.state();
            // A failed job gives its budget back at once: its escrow is cancelled (what
            // was delivered still settles), rather than waiting for the deadline.
            if state == JobState::Failed && *j.escrow() != Escrowed::Unsettled {
                self.out
                    .fenced(Output::Settle(Settle::Cancel(EscrowCancel { job_id: job })));
            }
            self.event(MarketEvent::JobEnded { job, state });
            self.spot_job_ended(job);
        }
    }

    /// Publishes a new version of a job's offer for the tasks whose window ended with too
    /// few bids: better odds (or, for a call open to all whose bids ran out after an
    /// attempt, the same odds: a new call for bids), a new bid window, the same deadline.
    fn widen(&mut self, job: Uuid) {
        let now = self.now;
        let factor = self.config.fanin.widen_factor;
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        let wide: Vec<usize> = (0..j.tasks().len())
            .filter(|&i| j.wants_wider_call(i, now))
            .collect();
        if wide.is_empty() {
            return;
        }
        let window = j.next_window(now);
        let mut offer = j.offer().clone();
        for i in wide {
            offer.calls[i] = fanin::widened(&offer.calls[i], factor);
        }
        offer.seq = self.next_seq("offer", now.0);
        offer.issued_at = now;
        offer.expires_at = now.plus_ms(window);
        let id = message_id(&offer);
        if let Some(j) = self.jobs.get_mut(&job) {
            j.republished(offer.clone(), id, now);
        }
        self.out.dirty(RecordKey::Job(job));
        self.out.fenced(Output::Publish(Publish::Offer(offer)));
        self.event(MarketEvent::Widened { job });
    }

    /// Files the job under the time it next needs a tick.
    pub(super) fn rewake(&mut self, job: Uuid) {
        if let Some(t) = self.wake_of.remove(&job) {
            self.wakes.remove(&(t, job));
        }
        if let Some(t) = self.jobs.get(&job).and_then(Job::next_wake) {
            self.wake_of.insert(job, t);
            self.wakes.insert((t, job));
        }
    }
}

/// What evaluation run `run` of `job` takes: its terms and every delivered rank (`None`
/// when the offer has no terms).
pub(super) fn evaluation_order(job: &Job, run: u32) -> Option<super::EvaluationOrder> {
    let terms = job.offer().evaluation.clone()?;
    let deliveries = job
        .tasks()
        .iter()
        .enumerate()
        .flat_map(|(i, t)| t.ranks().iter().map(move |a| (i as u32, a)))
        .filter(|(_, a)| a.state == LeaseState::Done)
        .filter_map(|(task, a)| {
            let signed = a.delivery.as_ref()?;
            let opened = signed.verify().ok()?;
            Some((
                cannabis_protocol::EvaluatedDelivery {
                    task,
                    rank: a.rank,
                    epoch: a.epoch,
                    manifest: opened.id,
                },
                opened.body.outputs,
            ))
        })
        .collect();
    Some(super::EvaluationOrder {
        job: job.id(),
        run,
        terms,
        acceptance: job.offer().acceptance.clone(),
        deliveries,
    })
}

/// The synthetic products of `job` delivered and not yet checked.
pub(super) fn product_checks_due(job: &Job) -> Vec<ProductCheck> {
    job.tasks()
        .iter()
        .zip(&job.offer().tasks)
        .enumerate()
        .filter(|(_, (_, spec))| spec.workload.adapter == AdapterKind::Synthetic)
        .flat_map(|(i, (t, spec))| {
            let n = spec.synthetic_n().ok();
            t.ranks()
                .iter()
                .filter(|a| a.state == LeaseState::Done && a.product.is_none())
                .filter_map(move |a| {
                    Some(ProductCheck {
                        job: job.id(),
                        task: i as u32,
                        rank: a.rank,
                        epoch: a.epoch,
                        seed: RunOrder::seed(&a.award),
                        n: n?,
                    })
                })
        })
        .collect()
}
