//! The worker's side of the engine: answering offers (bid, signed decline or silence, and
//! only when the offer's call draws this worker), taking awards within the owner's limit
//! of leases, renewals and cancellations, and the end of leases.

use std::sync::Arc;

use cannabis_protocol::{
    Address, Award, Cancel, CheckpointNote, DeliveryManifest, Hardware, JobOffer, LeaseAccept,
    LeaseRenewal, NamedDigest, OutputDigest, Received, ResourceUsage, Resources, ResultCommit,
    RunReport, RunStage, TaskInput, message_id,
};

use super::{
    Capacity, KEEP_ENDED_MS, Market, MarketEvent, Outbound, Output, Purpose, RecordKey, RunOrder,
    Settle,
};
use crate::Refusal;
use crate::lease::{AssignmentKey, Lease, SentBid, Stopped};
use crate::quote::{self, Answer};

impl Market {
    /// A new offer (or a new version of one) this node holds now: answer each task it does
    /// not hold a live lease of. A bid for an earlier version is no reason to stay silent:
    /// a requester publishes a new version when it lacks bids (a wider call, or the bids
    /// called for again), and the bid it lacks may be this one (lost on the way, or let go
    /// with a refused award); the requester keeps the newer bid. Nor is a decline: a later
    /// version leaves less time to the deadline, so a price or a longest run that did not
    /// fit may fit now. A task is declined once, however many versions decline it.
    pub(super) fn answer_offer(&mut self, item: &Arc<Received<JobOffer>>) {
        let me = self.me.address;
        let offer = &item.body;
        if offer.requester == me {
            return;
        }
        let now = self.now;
        if self.leases.live_count(now) >= self.config.worker.max_leases as usize {
            // Full: no quotes until a lease ends.
            self.withheld = true;
            return;
        }
        let Some(own) = self.view.ad(&me).map(|e| e.ad()) else {
            return;
        };
        let free = self.free(&own.hardware, None);
        let ctx = self.context();
        let mut withheld = false;
        let answers: Vec<(u32, Answer)> = (0..offer.tasks.len() as u32)
            .filter(|&t| {
                let answered = self
                    .leases
                    .bid_for(&offer.job_id, t)
                    .is_some_and(|(_, sent)| sent.bid.offer == item.id);
                let running = self.leases.iter().any(|((job, task, _), l)| {
                    *job == offer.job_id && *task == t && l.is_live() && l.expires_at > now
                });
                !answered && !running
            })
            .filter(|&t| {
                // What its leases leave free does not fit the task: silent until one ends
                // (the executor would refuse the run as busy).
                let fits = offer
                    .tasks
                    .get(t as usize)
                    .is_some_and(|spec| free.short_of(&spec.resources).is_none());
                withheld |= !fits;
                fits
            })
            .filter_map(|t| {
                let terms = self.config.fee.as_ref();
                quote::answer(&self.config.worker, terms, own, offer, item.id, t, &ctx)
                    .map(|a| (t, a))
            })
            .collect();
        self.withheld |= withheld;
        let requester = offer.requester;
        let job = offer.job_id;
        for (task, answer) in answers {
            match answer {
                Answer::Bid(bid) => {
                    if let Some(d) = self.declined.get_mut(&job) {
                        d.remove(&task);
                    }
                    let id = message_id(&bid);
                    let price = bid.price;
                    self.leases.on_bid_sent(
                        id,
                        SentBid {
                            bid: bid.clone(),
                            requester,
                            task: offer.tasks.get(task as usize).cloned().map(Box::new),
                            deliver_to: Some(offer.delivery),
                        },
                    );
                    // Kept before it is sent: an award for it is recognised after a restart.
                    self.out.dirty(RecordKey::SentBid(id));
                    self.event(MarketEvent::BidSent { job, task, price });
                    self.send(
                        requester,
                        Outbound::Bid(bid.clone()),
                        Purpose::Bid(bid, requester, 1),
                    );
                }
                Answer::Decline(decline) => {
                    if !self.declined.entry(job).or_default().insert(task) {
                        // Said already, to this requester.
                        continue;
                    }
                    self.event(MarketEvent::Declined {
                        job,
                        task,
                        reason: decline.reason.clone(),
                    });
                    let purpose = Purpose::Other("decline", requester);
                    self.send(requester, Outbound::Decline(decline), purpose);
                }
                Answer::Silent(_) | Answer::NotDrawn => {}
            }
        }
    }

    /// An award: taken within the owner's limit of leases, for a bid this worker sent.
    pub(super) fn on_award(&mut self, from: Address, r: Received<Award>) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let now = self.now;
        let award = &r.body;
        let key = (award.job_id, award.task, award.rank);
        // A newer epoch of an assignment this worker holds replaces its lease: no new slot.
        let held = self.leases.live_count(now);
        let replaces = self.leases.get(&key).is_some_and(|l| l.is_live());
        let busy = if held >= self.config.worker.max_leases as usize && !replaces {
            Some(Refusal::Busy { held: held as u32 })
        } else {
            // What the other leases leave free must fit the task the bid quoted for.
            let spec = self
                .leases
                .bid_for(&award.job_id, award.task)
                .and_then(|(_, s)| s.task.as_deref());
            let own = self.view.ad(&self.me.address).map(|e| &e.ad().hardware);
            match (spec, own) {
                (Some(spec), Some(own)) => self.free(own, Some(&key)).short_of(&spec.resources),
                _ => None,
            }
        };
        if let Some(busy) = busy {
            // The quote is withdrawn, so that this worker quotes again on the next version
            // of the offer (the requester calls for bids again when they run out) once a
            // lease ends: only for a signed award that names it, from its requester.
            let named = self
                .leases
                .bid_for(&award.job_id, award.task)
                .is_some_and(|(id, s)| *id == award.bid && s.requester == award.requester);
            if named
                && self.check_signature(&r).is_ok()
                && let Some(id) = self.leases.withdraw(&award.job_id, award.task)
            {
                self.out.dirty(RecordKey::SentBid(id));
                self.withheld = true;
            }
            return Err(busy);
        }
        self.check_signature(&r)?;
        if let Some(held) = self.leases.get(&key)
            && held.award == r.id
            && held.is_live()
        {
            // The same award again: the requester had no answer to it (its connection
            // closed first). The lease stands; its acceptance goes again.
            let accept = LeaseAccept {
                award: r.id,
                job_id: award.job_id,
                task: award.task,
                rank: award.rank,
                worker: award.worker,
                epoch: held.epoch,
                issued_at: now,
            };
            let requester = held.requester;
            let purpose = Purpose::Accept(accept.clone(), requester, 1);
            self.send(requester, Outbound::Accept(accept), purpose);
            return Ok(());
        }
        let (accept, superseded) = self.leases.on_award(award, r.id, now)?;
        let requester = award.requester;
        self.out.dirty(RecordKey::Lease(key));
        if let Some(s) = superseded {
            self.lease_ended(s);
        }
        self.event(MarketEvent::LeaseTaken {
            key,
            epoch: accept.epoch,
        });
        let purpose = Purpose::Accept(accept.clone(), requester, 1);
        self.send(requester, Outbound::Accept(accept), purpose);
        if let Some(lease) = self.leases.get(&key).cloned()
            && !lease.assembling
        {
            self.run_start(key, &lease);
        }
        Ok(())
    }

    /// The lease an executor request id names, while it is current at that epoch.
    fn current_lease_of(&self, request_id: &str) -> Result<(AssignmentKey, Lease), Refusal> {
        let (key, lease) = self
            .leases
            .iter()
            .find(|(k, l)| RunOrder::request_id(k, l.epoch) == request_id)
            .map(|(k, l)| (*k, l.clone()))
            .ok_or(Refusal::NoLease)?;
        if !self.leases.is_current(&key, lease.epoch, self.now) {
            return Err(Refusal::LeaseEnded);
        }
        Ok((key, lease))
    }

    /// The executor's attempt for a lease changed stage: the requester is told, signed,
    /// while the lease is current at that epoch (a stale epoch's attempt reports nothing).
    pub(super) fn report_run(
        &mut self,
        request_id: &str,
        stage: RunStage,
        mut detail: String,
    ) -> Result<(), Refusal> {
        let now = self.now;
        let (key, lease) = self.current_lease_of(request_id)?;
        if detail.len() > RunReport::MAX_DETAIL {
            let mut end = RunReport::MAX_DETAIL;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        let report = RunReport {
            job_id: key.0,
            task: key.1,
            rank: key.2,
            requester: lease.requester,
            worker: self.me.address,
            epoch: lease.epoch,
            stage,
            detail,
            issued_at: now,
        };
        let purpose = Purpose::Other("run report", lease.requester);
        self.send(lease.requester, Outbound::RunReport(report), purpose);
        Ok(())
    }

    /// Asks the executor to run the work of a current lease (once the lease is durable).
    pub(super) fn run_start(&mut self, key: AssignmentKey, lease: &Lease) {
        self.out.fenced(Output::Run(RunOrder::Start {
            request_id: RunOrder::request_id(&key, lease.epoch),
            key,
            epoch: lease.epoch,
            task: lease.task.clone(),
            seed: RunOrder::seed(&lease.award),
            until: lease.expires_at,
            requester: lease.requester,
            deliver_to: lease.deliver_to,
            inputs: lease.inputs.clone(),
            group: lease.rendezvous.clone(),
            resume: lease.resume.clone(),
        }));
    }

    /// A current lease's attempt has a new checkpoint, sealed for the requester: it gets a
    /// signed note, and fetches it (a stale epoch's attempt sends nothing).
    pub(super) fn send_checkpoint(
        &mut self,
        request_id: &str,
        seq: u64,
        checkpoint: OutputDigest,
    ) -> Result<(), Refusal> {
        let (key, lease) = self.current_lease_of(request_id)?;
        let note = CheckpointNote {
            job_id: key.0,
            task: key.1,
            rank: key.2,
            epoch: lease.epoch,
            worker: self.me.address,
            requester: lease.requester,
            seq,
            checkpoint,
            issued_at: self.now,
        };
        let purpose = Purpose::Other("checkpoint note", lease.requester);
        self.send(lease.requester, Outbound::Checkpoint(note), purpose);
        Ok(())
    }

    /// The outputs of a current lease's completed attempt are sealed: the requester gets
    /// the signed manifest (a stale epoch's attempt delivers nothing).
    pub(super) fn deliver(
        &mut self,
        request_id: &str,
        outputs: Vec<OutputDigest>,
        usage: ResourceUsage,
        exit_code: Option<i32>,
        hardware: String,
    ) -> Result<(), Refusal> {
        let now = self.now;
        let (key, lease) = self.current_lease_of(request_id)?;
        let task = lease.task.as_deref().ok_or(Refusal::NoSuchTask {
            job: key.0,
            task: key.1,
        })?;
        let mut inputs: Vec<NamedDigest> = task
            .inputs
            .iter()
            .filter_map(|i| match i {
                TaskInput::Staged(r) => Some(NamedDigest {
                    name: r.name.clone(),
                    digest: r.digest,
                }),
                TaskInput::FromTask { .. } => None,
            })
            .collect();
        inputs.extend(lease.inputs.iter().cloned());
        let manifest = DeliveryManifest {
            job_id: key.0,
            task: key.1,
            rank: key.2,
            epoch: lease.epoch,
            worker: self.me.address,
            requester: lease.requester,
            adapter: task.workload.adapter,
            bundle: task.workload.digest,
            inputs,
            exit_code,
            outputs,
            configuration: Vec::new(),
            datasets: Vec::new(),
            models: Vec::new(),
            dependencies: Vec::new(),
            hardware,
            usage,
            evaluation: None,
            issued_at: now,
        };
        let purpose = Purpose::Other("delivery", lease.requester);
        let commit = ResultCommit {
            job_id: key.0,
            task: key.1,
            rank: key.2,
            epoch: lease.epoch,
            manifest: message_id(&manifest),
        };
        self.send(lease.requester, Outbound::Deliver(manifest), purpose);
        if self.config.resolver.is_some() {
            // Committed on the ledger: the review window runs from its block, and the
            // escrow pays it when the window ends undisputed.
            self.out.fenced(Output::Settle(Settle::Commit(commit)));
        }
        Ok(())
    }

    pub(super) fn on_renewal(
        &mut self,
        from: Address,
        r: Received<LeaseRenewal>,
    ) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        self.check_signature(&r)?;
        let now = self.now;
        let assembled = self.leases.on_renewal(&r.body, now)?;
        let b = &r.body;
        let key = (b.job_id, b.task, b.rank);
        self.out.dirty(RecordKey::Lease(key));
        if let Some(lease) = self.leases.get(&key).cloned()
            && assembled
        {
            // The group is whole (or the requester stopped waiting for it): the work
            // starts now.
            self.run_start(key, &lease);
        } else if let Some(lease) = self.leases.get(&key) {
            let order = RunOrder::Renew {
                request_id: RunOrder::request_id(&key, lease.epoch),
                until: lease.expires_at,
            };
            self.out.fenced(Output::Run(order));
        }
        Ok(())
    }

    pub(super) fn on_cancel(&mut self, from: Address, r: Received<Cancel>) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        self.check_signature(&r)?;
        let now = self.now;
        let s = self.leases.on_cancel(&r.body, now)?;
        self.out.dirty(RecordKey::Lease(s.key));
        self.lease_ended(s);
        Ok(())
    }

    fn lease_ended(&mut self, s: Stopped) {
        self.out.fenced(Output::Run(RunOrder::Stop {
            request_id: RunOrder::request_id(&s.key, s.epoch),
            why: s.reason.to_string(),
        }));
        self.event(MarketEvent::LeaseEnded {
            key: s.key,
            epoch: s.epoch,
            reason: s.reason,
        });
        if std::mem::take(&mut self.withheld) {
            // It stayed silent on offers for want of a free slot or resources: it answers
            // them now, rather than waiting for their next versions (if any come).
            let held: Vec<_> = self.view.offers().map(|e| e.item().clone()).collect();
            for item in held {
                self.answer_offer(&item);
            }
        }
    }

    /// What this worker's executor admits ([`super::Capacity`], else what its own ad
    /// offers) less what its live leases hold (`except` one, whose newer epoch is what is
    /// asked for), counted as the executor admits them: every lease holds at least one
    /// millicore.
    fn free(&self, own: &Hardware, except: Option<&AssignmentKey>) -> Capacity {
        let now = self.now;
        let mut free = self.capacity.unwrap_or(Capacity {
            cpu_millicores: u64::from(own.cpu_cores) * 1000,
            memory_bytes: own.memory_bytes,
            storage_bytes: own.storage_bytes,
            gpus: own.gpus.iter().filter(|g| g.allowed).count() as u64,
        });
        let held = self
            .leases
            .iter()
            .filter(|(k, l)| Some(*k) != except && l.is_live() && l.expires_at > now);
        for (_, lease) in held {
            let r = lease.task.as_ref().map(|t| &t.resources);
            let cpu = r.map_or(0, |r| u64::from(r.cpu_millicores)).max(1);
            free.cpu_millicores = free.cpu_millicores.saturating_sub(cpu);
            if let Some(r) = r {
                free.memory_bytes = free.memory_bytes.saturating_sub(r.memory_bytes);
                free.storage_bytes = free.storage_bytes.saturating_sub(r.storage_bytes);
                free.gpus = free.gpus.saturating_sub(u64::from(r.gpus));
            }
        }
        free
    }

    /// Ends leases that ran out; forgets bids whose quote ran out and leases long over.
    pub(super) fn tick_leases(&mut self) {
        let now = self.now;
        for s in self.leases.tick(now) {
            self.out.dirty(RecordKey::Lease(s.key));
            self.lease_ended(s);
        }
        let pruned = self.leases.prune(now, KEEP_ENDED_MS);
        for id in pruned.bids {
            self.out.dirty(RecordKey::SentBid(id));
        }
        for key in pruned.leases {
            self.out.dirty(RecordKey::Lease(key));
        }
    }
}

impl Capacity {
    /// The first resource of one rank of a task that does not fit in this, as a refusal.
    fn short_of(&self, r: &Resources) -> Option<Refusal> {
        [
            (
                "millicores",
                u64::from(r.cpu_millicores).max(1),
                self.cpu_millicores,
            ),
            ("bytes of memory", r.memory_bytes, self.memory_bytes),
            ("bytes of storage", r.storage_bytes, self.storage_bytes),
            ("GPUs", u64::from(r.gpus), self.gpus),
        ]
        .into_iter()
        .find(|(_, asked, free)| asked > free)
        .map(|(what, asked, free)| Refusal::Short { what, asked, free })
    }
}
