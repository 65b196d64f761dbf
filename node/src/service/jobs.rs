//! The market on a running node: as requester, the jobs it published (bids in, awards,
//! renewals and cancellations out, driven by `cannabis_market::job::Job`); as worker, its
//! answers to offers (bid, signed decline or silence) and its leases
//! (`cannabis_market::lease::Leases`). The state machines decide; this module signs,
//! sends, and feeds answers back.

use cannabis_api::{self as api, OfferTemplate};
use cannabis_market::job::{Action, Job, TaskStatus};
use cannabis_market::lease::AssignmentKey;
use cannabis_market::matching;
use cannabis_market::placement::Class;
use cannabis_market::quote::{self, Answer};
use cannabis_protocol::{
    Award, Cancel, Decline, Digest, JobOffer, LeaseAccept, LeaseRenewal, MarketRequest,
    MarketResponse, Signed, Timestamp, Uuid,
};
use libp2p::PeerId;
use tracing::{debug, info, warn};

use super::{Node, now};
use crate::store::Records;
use crate::swarm;

/// A job this node published, with what only the requester's node keeps. Saved in the
/// store (JSON) after every change and before any award it asks for is sent.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Tracked {
    pub(crate) job: Job,
    pub(crate) name: String,
}

/// A bid this node sent as a worker, as kept in the store.
#[derive(serde::Serialize, serde::Deserialize)]
struct SentBid {
    bid: cannabis_protocol::Bid,
    requester: cannabis_protocol::Address,
}

fn assignment_key(key: &AssignmentKey) -> Vec<u8> {
    let mut k = key.0.0.to_vec();
    k.extend_from_slice(&key.1.to_le_bytes());
    k.extend_from_slice(&key.2.to_le_bytes());
    k
}

fn parse_assignment_key(k: &[u8]) -> Option<AssignmentKey> {
    let uuid: [u8; 16] = k.get(..16)?.try_into().ok()?;
    let task = u32::from_le_bytes(k.get(16..20)?.try_into().ok()?);
    let rank = u32::from_le_bytes(k.get(20..24)?.try_into().ok()?);
    Some((Uuid(uuid), task, rank))
}

/// What one of this node's own market requests was for.
#[derive(Clone)]
pub(crate) enum Purpose {
    /// An award; a refusal ends the assignment.
    Award {
        job: Uuid,
        task: u32,
        rank: u32,
        epoch: u64,
    },
    /// A renewal; the acknowledgment extends the lease.
    Renew(LeaseRenewal),
    /// Anything else whose answer is only logged.
    Other(&'static str),
}

impl Purpose {
    fn label(&self) -> &'static str {
        match self {
            Purpose::Award { .. } => "award",
            Purpose::Renew(_) => "renewal",
            Purpose::Other(what) => what,
        }
    }
}

impl Node {
    /// Publishes an offer and starts its job.
    pub(super) fn submit_job(
        &mut self,
        template: OfferTemplate,
    ) -> anyhow::Result<api::JobSummary> {
        let name = template
            .name
            .clone()
            .or_else(|| template.tasks.first().map(|t| t.name.clone()))
            .unwrap_or_default();
        let (_, offer, id) = self.publish_offer(template)?;
        let job = Job::new(offer, id, self.config.leases.clone(), now().0);
        let tracked = Tracked { job, name };
        let summary = self.job_summary(&tracked);
        let id = tracked.job.id();
        self.jobs.insert(id, tracked);
        self.save_job(&id)?;
        Ok(summary)
    }

    /// Writes a job's state to the store; durable when this returns.
    fn save_job(&mut self, id: &Uuid) -> anyhow::Result<()> {
        if let Some(t) = self.jobs.get(id) {
            let state = serde_json::to_vec(t)?;
            self.store.put_record(Records::Jobs, &id.0, &state)?;
        }
        Ok(())
    }

    /// A job changed: save it, then carry out what it asked for. Nothing is sent for a job
    /// whose state could not be saved (an epoch must never be issued twice); its timers
    /// retry.
    fn job_changed(&mut self, id: &Uuid, actions: Vec<Action>) {
        match self.save_job(id) {
            Ok(()) => self.perform(actions),
            Err(e) => {
                warn!(job = %id, error = %format!("{e:#}"), "cannot save the job; holding its messages");
            }
        }
    }

    /// Loads the jobs kept in the store. A job over for a week is forgotten.
    pub(super) fn restore_jobs(&mut self) -> anyhow::Result<()> {
        let now_ms = now().0;
        for (_, bytes) in self.store.records(Records::Jobs)? {
            match serde_json::from_slice::<Tracked>(&bytes) {
                Ok(t)
                    if t.job.state() != cannabis_market::job::JobState::Open
                        && now_ms.ms_since(t.job.offer.deadline) > 7 * 86_400_000 =>
                {
                    self.store.remove_record(Records::Jobs, &t.job.id().0)?;
                }
                Ok(t) => {
                    self.jobs.insert(t.job.id(), t);
                }
                Err(e) => warn!(error = %e, "a kept job does not load; left in the store"),
            }
        }
        if !self.jobs.is_empty() {
            info!(jobs = self.jobs.len(), "jobs restored from the store");
        }
        Ok(())
    }

    pub(super) fn job_summary(&self, t: &Tracked) -> api::JobSummary {
        let job = &t.job;
        api::JobSummary {
            job_id: job.id().to_string(),
            name: t.name.clone(),
            state: job.state(),
            tasks: job.tasks.iter().map(|t| status_word(&t.status)).collect(),
            budget: job.offer.budget,
            used: job.used(),
            bids: job.tasks.iter().map(|t| t.bids.len()).sum(),
            bids_until_ms: job.offer.expires_at.0,
            deadline_ms: job.offer.deadline.0,
        }
    }

    pub(super) fn job_detail(&self, id: &Uuid) -> anyhow::Result<api::JobDetail> {
        let t = self
            .jobs
            .get(id)
            .ok_or_else(|| anyhow::anyhow!("this node published no job {id}"))?;
        let job = &t.job;
        let ctx = self.matching_context();
        let tasks = job
            .tasks
            .iter()
            .zip(&job.offer.tasks)
            .map(|(task, spec)| {
                let mut bids: Vec<(String, cannabis_protocol::Amount)> = task
                    .bids
                    .values()
                    .map(|c| (c.bid.worker.to_string(), c.bid.price))
                    .collect();
                bids.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
                // Nobody bid, or nobody could be placed: say how the known ads match.
                let unplaced =
                    matches!(&task.status, TaskStatus::Failed(r) if r.contains("cannot be placed"));
                let explanation = (task.bids.is_empty() || unplaced)
                    .then(|| matching::explain(spec, self.worker_ads(), &ctx));
                api::TaskDetail {
                    name: spec.name.clone(),
                    status: task.status.clone(),
                    group_size: spec.group_size,
                    budget: task.budget,
                    committed: task.committed,
                    spent: task.spent,
                    bids,
                    declines: task
                        .declines
                        .iter()
                        .map(|(w, r)| (w.to_string(), r.clone()))
                        .collect(),
                    ranks: task.ranks.clone(),
                    attempts: task.attempts,
                    failures: task.failures,
                    explanation,
                }
            })
            .collect();
        Ok(api::JobDetail {
            summary: self.job_summary(t),
            tasks,
            history: job.history.clone(),
            refund: job.refund(),
        })
    }

    pub(super) fn cancel_job(&mut self, id: &Uuid) -> anyhow::Result<api::JobSummary> {
        let now_ms = now().0;
        let t = self
            .jobs
            .get_mut(id)
            .ok_or_else(|| anyhow::anyhow!("this node published no job {id}"))?;
        if t.job.state() != cannabis_market::job::JobState::Open {
            anyhow::bail!("job {id} is already over ({:?})", t.job.state());
        }
        let actions = t.job.cancel("cancelled by the requester", now_ms);
        self.job_changed(id, actions);
        let t = &self.jobs[id];
        Ok(self.job_summary(t))
    }

    /// The ads of the nodes that could work for this node: every known ad but its own (a
    /// node does not bid on its own offers).
    fn worker_ads(&self) -> impl Iterator<Item = &cannabis_protocol::CapabilityAd> {
        let me = self.address;
        self.view
            .ads()
            .map(|e| &e.ad)
            .filter(move |ad| ad.node != me)
    }

    /// How each task of a template matches the ads this node knows (`job submit --dry-run`).
    pub(super) fn explain(&self, t: &OfferTemplate) -> anyhow::Result<Vec<api::TaskExplanation>> {
        let ctx = self.matching_context();
        Ok(t.tasks
            .iter()
            .map(|task| api::TaskExplanation {
                task: task.name.clone(),
                explanation: matching::explain(task, self.worker_ads(), &ctx),
            })
            .collect())
    }

    /// When the earliest job next needs a tick, on the runtime's clock.
    pub(super) fn next_job_wake(&self) -> Option<tokio::time::Instant> {
        let at = self.jobs.values().filter_map(|t| t.job.next_wake()).min()?;
        // At least a few milliseconds: a job that has nothing to do at its wake time must
        // not spin the driver.
        let wait = at.0.saturating_sub(now().0.0).max(5);
        Some(tokio::time::Instant::now() + std::time::Duration::from_millis(wait))
    }

    /// Moves every open job and this node's leases on to now.
    pub(super) fn tick_jobs(&mut self) {
        let now_ms = now().0;
        let due: Vec<Uuid> = self
            .jobs
            .iter()
            .filter(|(_, t)| t.job.next_wake().is_some_and(|at| at <= now_ms))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            if let Some(t) = self.jobs.get_mut(&id) {
                let before = (t.job.state(), t.job.history.len());
                let actions = t.job.tick(now_ms);
                let after = (t.job.state(), t.job.history.len());
                if !actions.is_empty() || before != after {
                    self.job_changed(&id, actions);
                }
            }
        }
        for stopped in self.leases.tick(now_ms) {
            info!(job = %stopped.key.0, task = stopped.key.1, rank = stopped.key.2,
                  epoch = stopped.epoch, reason = %stopped.reason, "lease ended");
            self.save_lease(&stopped.key);
        }
        let pruned = self.leases.prune(now_ms, 3_600_000);
        for id in pruned.bids {
            self.forget(Records::WorkerBids, &id.0);
        }
        for key in pruned.leases {
            self.forget(Records::WorkerLeases, &assignment_key(&key));
        }
    }

    fn forget(&mut self, records: Records, key: &[u8]) {
        if let Err(e) = self.store.remove_record(records, key) {
            warn!(error = %format!("{e:#}"), "store");
        }
    }

    /// Writes one of this node's worker leases to the store.
    fn save_lease(&mut self, key: &AssignmentKey) {
        let Some(lease) = self.leases.get(key) else {
            return;
        };
        let saved = serde_json::to_vec(lease)
            .map_err(anyhow::Error::from)
            .and_then(|v| {
                self.store
                    .put_record(Records::WorkerLeases, &assignment_key(key), &v)
            });
        if let Err(e) = saved {
            warn!(error = %format!("{e:#}"), "cannot save a lease");
        }
    }

    /// Loads the bids and leases this node keeps as a worker.
    pub(super) fn restore_worker(&mut self) -> anyhow::Result<()> {
        let bids: Vec<_> = self
            .store
            .records(Records::WorkerBids)?
            .into_iter()
            .filter_map(|(k, v)| {
                let id = Digest(k.as_slice().try_into().ok()?);
                let sent: SentBid = serde_json::from_slice(&v).ok()?;
                Some((id, sent.bid, sent.requester))
            })
            .collect();
        let leases: Vec<_> = self
            .store
            .records(Records::WorkerLeases)?
            .into_iter()
            .filter_map(|(k, v)| {
                Some((parse_assignment_key(&k)?, serde_json::from_slice(&v).ok()?))
            })
            .collect();
        self.leases = cannabis_market::lease::Leases::restore(self.address, bids, leases);
        Ok(())
    }

    /// Signs and sends what the jobs asked for.
    fn perform(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Award(award) => {
                    let purpose = Purpose::Award {
                        job: award.job_id,
                        task: award.task,
                        rank: award.rank,
                        epoch: award.epoch,
                    };
                    let to = award.worker;
                    let signed = Signed::sign(&self.keys.signing, &award);
                    info!(job = %award.job_id, task = award.task, rank = award.rank,
                          epoch = award.epoch, worker = %to, price = %award.price, "award sent");
                    self.request(&to, MarketRequest::Award(signed), purpose);
                }
                Action::Renew(renewal) => {
                    let to = renewal.worker;
                    let signed = Signed::sign(&self.keys.signing, &renewal);
                    self.request(
                        &to,
                        MarketRequest::LeaseRenewal(signed),
                        Purpose::Renew(renewal),
                    );
                }
                Action::Cancel { to, cancel } => {
                    let signed = Signed::sign(&self.keys.signing, &cancel);
                    for worker in to {
                        self.request(
                            &worker,
                            MarketRequest::Cancel(signed.clone()),
                            Purpose::Other("cancellation"),
                        );
                    }
                }
            }
        }
    }

    fn request(
        &mut self,
        to: &cannabis_protocol::Address,
        request: MarketRequest,
        purpose: Purpose,
    ) {
        let Some(peer) = swarm::peer_of(to) else {
            warn!(%to, "no peer id for address");
            return;
        };
        let id = self
            .swarm
            .behaviour_mut()
            .market
            .send_request(&peer, request);
        self.requests.insert(id, purpose);
    }

    /// The answer to one of this node's own requests.
    pub(super) fn on_own_response(
        &mut self,
        purpose: Purpose,
        response: Result<MarketResponse, String>,
    ) {
        let now_ms = now().0;
        match (purpose, response) {
            (
                Purpose::Award {
                    job,
                    task,
                    rank,
                    epoch,
                },
                Ok(MarketResponse::Refused { reason }),
            ) => {
                let why = format!("the worker refused the award: {reason}");
                if let Some(t) = self.jobs.get_mut(&job)
                    && let Ok(actions) = t.job.on_failed(task, rank, epoch, &why, now_ms)
                {
                    self.job_changed(&job, actions);
                }
            }
            (Purpose::Renew(r), Ok(MarketResponse::Ack)) => {
                if let Some(t) = self.jobs.get_mut(&r.job_id) {
                    match t
                        .job
                        .on_renewed(r.task, r.rank, r.epoch, r.expires_at, now_ms)
                    {
                        Ok(()) => self.job_changed(&r.job_id, Vec::new()),
                        Err(e) => {
                            debug!(job = %r.job_id, error = %e, "renewal acknowledgment not used");
                        }
                    }
                }
            }
            (Purpose::Renew(r), Ok(MarketResponse::Refused { reason })) => {
                let why = format!("the worker refused the renewal: {reason}");
                if let Some(t) = self.jobs.get_mut(&r.job_id)
                    && let Ok(actions) = t.job.on_failed(r.task, r.rank, r.epoch, &why, now_ms)
                {
                    self.job_changed(&r.job_id, actions);
                }
            }
            (purpose, Err(e)) => {
                debug!(what = purpose.label(), error = %e, "market request failed; the lease timers handle it");
            }
            (purpose, Ok(answer)) => {
                debug!(what = purpose.label(), ?answer, "market request answered");
            }
        }
    }

    // ---- Worker side ----

    /// A new offer arrived: answer each task with a bid, a signed decline, or nothing.
    pub(super) fn answer_offer(&mut self, bytes: &[u8]) {
        let Ok(signed) = Signed::<JobOffer>::from_bytes(bytes) else {
            return;
        };
        let id = signed.id();
        let Ok(offer) = cannabis_protocol::decode::<JobOffer>(signed.payload()) else {
            return;
        };
        if offer.requester == self.address {
            return;
        }
        let Some(own) = self.view.ad(&self.address).map(|e| e.ad.clone()) else {
            debug!(job = %offer.job_id, "no own ad yet; not answering the offer");
            return;
        };
        let ctx = self.matching_context();
        for task in 0..offer.tasks.len() as u32 {
            match quote::answer(&self.config.worker, &own, &offer, id, task, &ctx) {
                Some(Answer::Bid(bid)) => {
                    let signed = Signed::sign(&self.keys.signing, &bid);
                    let sent = SentBid {
                        bid: bid.clone(),
                        requester: offer.requester,
                    };
                    // Kept before it is sent: an award for it must be recognised after a
                    // restart.
                    let kept = serde_json::to_vec(&sent)
                        .map_err(anyhow::Error::from)
                        .and_then(|v| {
                            self.store
                                .put_record(Records::WorkerBids, &signed.id().0, &v)
                        });
                    if let Err(e) = kept {
                        warn!(error = %format!("{e:#}"), "cannot keep the bid; not sending it");
                        continue;
                    }
                    self.leases
                        .on_bid_sent(signed.id(), bid.clone(), offer.requester);
                    info!(job = %offer.job_id, task, price = %bid.price, "bid sent");
                    self.request(
                        &offer.requester,
                        MarketRequest::Bid(signed),
                        Purpose::Other("bid"),
                    );
                }
                Some(Answer::Decline(decline)) => {
                    info!(job = %offer.job_id, task, reason = %decline.reason, "declined");
                    let signed = Signed::sign(&self.keys.signing, &decline);
                    self.request(
                        &offer.requester,
                        MarketRequest::Decline(signed),
                        Purpose::Other("decline"),
                    );
                }
                Some(Answer::Silent(unmet)) => {
                    debug!(job = %offer.job_id, task, ?unmet, "this node does not match the task");
                }
                None => {}
            }
        }
    }

    /// A bid for one of this node's jobs, verified: the worker's ad must meet the task.
    pub(super) fn bid_for_job(
        &mut self,
        bid: cannabis_protocol::Bid,
        id: Digest,
        now_ms: Timestamp,
    ) -> Result<(), String> {
        let Some(t) = self.jobs.get(&bid.job_id) else {
            return Ok(());
        };
        let spec = t
            .job
            .offer
            .tasks
            .get(bid.task as usize)
            .ok_or("no such task")?;
        let ad = self
            .view
            .ad(&bid.worker)
            .ok_or("this node has no capability ad from you; publish one first")?;
        let unmet = matching::unmet(spec, &ad.ad, &self.matching_context());
        if !unmet.is_empty() {
            let list: Vec<String> = unmet.iter().map(ToString::to_string).collect();
            return Err(format!("your ad does not meet: {}", list.join(", ")));
        }
        let class = Class::of(spec, &ad.ad);
        let job_id = bid.job_id;
        let t = self.jobs.get_mut(&job_id).ok_or("no such job")?;
        t.job.on_bid(bid, id, class, now_ms)?;
        self.job_changed(&job_id, Vec::new());
        Ok(())
    }

    pub(super) fn take_decline(&mut self, signed: &Signed<Decline>) -> Result<(), String> {
        let d = signed.verify().map_err(|e| e.to_string())?.body;
        let t = self
            .jobs
            .get_mut(&d.job_id)
            .ok_or("no such job of this node")?;
        let job_id = d.job_id;
        t.job.on_decline(d, now().0)?;
        self.job_changed(&job_id, Vec::new());
        Ok(())
    }

    pub(super) fn take_accept(&mut self, signed: &Signed<LeaseAccept>) -> Result<(), String> {
        let a = signed.verify().map_err(|e| e.to_string())?.body;
        let t = self
            .jobs
            .get_mut(&a.job_id)
            .ok_or("no such job of this node")?;
        let actions = t.job.on_accept(&a, now().0)?;
        self.job_changed(&a.job_id, actions);
        Ok(())
    }

    pub(super) fn take_award(
        &mut self,
        peer: PeerId,
        signed: &Signed<Award>,
    ) -> Result<(), String> {
        let verified = signed.verify().map_err(|e| e.to_string())?;
        if swarm::address_of(&peer) != Some(verified.signer) {
            return Err("an award is taken only from the requester itself".into());
        }
        let award = verified.body;
        let (accept, superseded) = self.leases.on_award(&award, verified.id, now().0)?;
        self.save_lease(&(award.job_id, award.task, award.rank));
        if let Some(s) = superseded {
            info!(job = %s.key.0, epoch = s.epoch, reason = %s.reason, "lease superseded");
        }
        info!(job = %award.job_id, task = award.task, rank = award.rank, epoch = award.epoch,
              price = %award.price, "award countersigned");
        let signed = Signed::sign(&self.keys.signing, &accept);
        self.request(
            &award.requester,
            MarketRequest::LeaseAccept(signed),
            Purpose::Other("lease acceptance"),
        );
        Ok(())
    }

    pub(super) fn take_renewal(&mut self, signed: &Signed<LeaseRenewal>) -> Result<(), String> {
        let r = signed.verify().map_err(|e| e.to_string())?.body;
        self.leases.on_renewal(&r, now().0)?;
        self.save_lease(&(r.job_id, r.task, r.rank));
        Ok(())
    }

    pub(super) fn take_cancel(&mut self, signed: &Signed<Cancel>) -> Result<(), String> {
        let c = signed.verify().map_err(|e| e.to_string())?.body;
        for s in self.leases.on_cancel(&c, now().0) {
            info!(job = %s.key.0, task = s.key.1, rank = s.key.2, reason = %s.reason, "lease cancelled");
            self.save_lease(&s.key);
        }
        Ok(())
    }
}

fn status_word(s: &TaskStatus) -> String {
    match s {
        TaskStatus::Waiting => "waiting",
        TaskStatus::Bidding => "bidding",
        TaskStatus::Leasing => "leasing",
        TaskStatus::Running => "running",
        TaskStatus::Done => "done",
        TaskStatus::Failed(_) => "failed",
        TaskStatus::Cancelled(_) => "cancelled",
    }
    .to_string()
}
