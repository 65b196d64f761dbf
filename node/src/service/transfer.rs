//! The transfer protocol on the node: serving sealed outputs to their requester (off the
//! driver: file reads block), asking peers for chunks on behalf of fetches, and the
//! fetches the engine orders, each a task that reports back once the outputs are kept
//! (or cannot be had).

use std::time::Duration;

use cannabis_market::Command as MarketCommand;
use cannabis_market::job::{LeaseState, ProductVerdict};
use cannabis_protocol::{
    CheckpointNote, DeliveryManifest, ObjectKind, ObjectRef, Signed, TaskInput, TransferRequest,
    TransferResponse,
};
use libp2p::PeerId;
use libp2p::request_response::{Event, Message, ResponseChannel};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{Command, Node, now};
use crate::delivery;
use crate::swarm;
use cannabis_api as api;

/// How long a fetch keeps trying a worker that cannot be reached before the rank counts
/// as failed (and is placed again).
const FETCH_PATIENCE: Duration = Duration::from_secs(120);

/// How long a checkpoint's fetch keeps trying its worker; then the one kept before stays.
const CHECKPOINT_PATIENCE: Duration = Duration::from_secs(30);

/// What a transfer request is answered from.
enum Serve {
    /// A worker's sealed output, for the requester of its delivery.
    Output,
    /// A worker's sealed checkpoint, for the requester of its lease.
    Checkpoint,
    /// A requester's package, for the worker a rank is awarded to.
    Package(delivery::PackageServe),
}

/// Most transfer requests of one peer answered at once. A fetch keeps 16 chunks in
/// flight; this allows several fetches of one requester from one worker at once, and caps
/// what a peer that floods requests makes this node read.
const MAX_SERVING_PER_PEER: u32 = 64;

/// Asks `peer` for one chunk through the node's driver (what every fetch's transport is).
pub(super) async fn ask_peer(
    node: tokio::sync::mpsc::Sender<Command>,
    peer: PeerId,
    request: TransferRequest,
) -> Result<TransferResponse, String> {
    let stopping = |_| "the node is stopping".to_string();
    let (reply, answer) = oneshot::channel();
    node.send(Command::Transfer {
        peer,
        request,
        reply,
    })
    .await
    .map_err(|e: tokio::sync::mpsc::error::SendError<Command>| stopping(e.to_string()))?;
    answer.await.map_err(|e| stopping(e.to_string()))?
}

/// Each running fetch's progress, by (job, task, rank).
pub(crate) type Progresses = std::sync::Arc<
    std::sync::Mutex<std::collections::HashMap<(cannabis_protocol::Uuid, u32, u32), FetchProgress>>,
>;

/// A fetch's progress, for `job status`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FetchProgress {
    pub bytes: u64,
    pub total: u64,
    pub started: Option<std::time::Instant>,
}

impl Node {
    pub(super) fn on_transfer(&mut self, event: Event<TransferRequest, TransferResponse>) {
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.serve_transfer(peer, request, channel),
            Event::Message {
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let Some(reply) = self.transfers.remove(&request_id) {
                    let _ = reply.send(Ok(response));
                }
            }
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                if let Some(reply) = self.transfers.remove(&request_id) {
                    let _ = reply.send(Err(format!("transfer request to {peer} failed: {error}")));
                }
            }
            Event::InboundFailure { peer, error, .. } => {
                debug!(%peer, %error, "transfer request failed");
            }
            Event::ResponseSent { .. } => {}
        }
    }

    fn serve_transfer(
        &mut self,
        peer: PeerId,
        request: TransferRequest,
        channel: ResponseChannel<TransferResponse>,
    ) {
        let refuse = |reason: &str| TransferResponse::Refused {
            reason: reason.into(),
        };
        let from = match swarm::address_of(&peer) {
            Some(a) if !self.graylisted(&peer) => a,
            Some(_) => return self.answer_transfer(channel, refuse("graylisted")),
            None => return self.answer_transfer(channel, refuse("no market identity")),
        };
        // What a peer may ask for is decided here, from memory: nothing is read from disk
        // for a peer that holds no lease here (packages) or granted none (outputs).
        let o = &request.object;
        // A checkpoint goes both ways: a requester serves one of its jobs' to the rank's
        // next worker; a worker serves its lease's to that lease's requester.
        let mine = self.market.job(&o.job_id).is_some();
        let serve = match o.kind {
            ObjectKind::Output => self.delivery_for(&from, o).map(|()| Serve::Output),
            ObjectKind::Checkpoint if !mine => {
                self.delivery_for(&from, o).map(|()| Serve::Checkpoint)
            }
            ObjectKind::Bundle | ObjectKind::Input | ObjectKind::Checkpoint => {
                self.package_for(&from, o).map(Serve::Package)
            }
        };
        let serve = match serve {
            Ok(s) => s,
            Err(why) => return self.answer_transfer(channel, refuse(&why)),
        };
        let in_flight = self.serving.entry(peer).or_default();
        if *in_flight >= MAX_SERVING_PER_PEER {
            let why = format!("busy: {MAX_SERVING_PER_PEER} of your requests are being answered");
            return self.answer_transfer(channel, refuse(&why));
        }
        *in_flight += 1;
        let data_dir = self.data_dir.clone();
        let tell = self.self_tx.clone();
        let lock = self.sealing.clone();
        let trees = self.trees.clone();
        tokio::spawn(async move {
            let response = tokio::task::spawn_blocking(move || match serve {
                Serve::Output => delivery::serve(&data_dir, &from, &request, &trees),
                Serve::Checkpoint => delivery::serve_checkpoint(&data_dir, &request, &trees),
                Serve::Package(p) => {
                    delivery::serve_package(&data_dir, &p, &request, &lock, &trees)
                }
            })
            .await
            .unwrap_or_else(|e| TransferResponse::Refused {
                reason: e.to_string(),
            });
            let _ = tell
                .send(Command::TransferServed(peer, channel, response))
                .await;
        });
    }

    /// A transfer request of `peer` was answered.
    pub(super) fn served_transfer(&mut self, peer: PeerId) {
        if let Some(n) = self.serving.get_mut(&peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.serving.remove(&peer);
            }
        }
    }

    /// Whether `from` may fetch an output of the assignment `o` names from this worker:
    /// it is the requester that awarded this worker the lease at that epoch (current, or
    /// ended lately: a delivered rank's lease ends once its outputs are fetched).
    fn delivery_for(&self, from: &cannabis_protocol::Address, o: &ObjectRef) -> Result<(), String> {
        let lease = self.market.leases().get(&(o.job_id, o.task, o.rank));
        match lease {
            Some(l) if l.requester == *from && l.epoch == o.epoch => Ok(()),
            Some(l) if l.requester == *from => Err(format!(
                "no delivery of job {} task {} rank {} at epoch {} here (the lease is at epoch {})",
                o.job_id, o.task, o.rank, o.epoch, l.epoch
            )),
            _ => Err(format!(
                "no delivery of job {} task {} rank {} at epoch {} here for you",
                o.job_id, o.task, o.rank, o.epoch
            )),
        }
    }

    /// A package of one of this node's jobs, for the worker a rank is awarded to at that
    /// epoch (and only for it): where its plaintext is, its pin, and the worker's key.
    fn package_for(
        &self,
        from: &cannabis_protocol::Address,
        o: &ObjectRef,
    ) -> Result<delivery::PackageServe, String> {
        let job = self
            .market
            .job(&o.job_id)
            .ok_or_else(|| format!("this node published no job {}", o.job_id))?;
        let spec = job
            .offer()
            .tasks
            .get(o.task as usize)
            .ok_or_else(|| format!("job {} has no task {}", o.job_id, o.task))?;
        let holder = job.tasks()[o.task as usize]
            .ranks()
            .iter()
            .find(|a| a.rank == o.rank)
            .filter(|a| {
                a.worker == *from
                    && a.epoch == o.epoch
                    && matches!(a.state, LeaseState::Offered | LeaseState::Current)
            });
        let Some(holder) = holder else {
            return Err(format!(
                "you hold no lease on task {} rank {} at epoch {}",
                o.task, o.rank, o.epoch
            ));
        };
        let (source, digest) = match o.kind {
            ObjectKind::Bundle if o.name == "bundle" => (
                delivery::package_path(&self.data_dir, &spec.workload.digest),
                spec.workload.digest,
            ),
            ObjectKind::Input => {
                let input = spec
                    .inputs
                    .iter()
                    .find(|i| match i {
                        TaskInput::Staged(r) => r.name == o.name,
                        TaskInput::FromTask { name, .. } => *name == o.name,
                    })
                    .ok_or_else(|| format!("task {} has no input {:?}", o.task, o.name))?;
                match input {
                    TaskInput::Staged(r) => {
                        (delivery::package_path(&self.data_dir, &r.digest), r.digest)
                    }
                    TaskInput::FromTask { task, output, .. } => {
                        let digest = job
                            .tasks()
                            .get(*task as usize)
                            .and_then(|t| t.outputs().get(output).copied())
                            .ok_or_else(|| format!("task {task} has not delivered {output:?}"))?;
                        let path =
                            delivery::rank_dir(&self.data_dir, &o.job_id, *task, 0).join(output);
                        (path, digest)
                    }
                }
            }
            ObjectKind::Checkpoint
                if spec.checkpoint.as_ref().is_some_and(|c| c.name == o.name) =>
            {
                let pin = holder
                    .resume
                    .as_ref()
                    .ok_or("your award pins no checkpoint to resume from")?;
                (
                    delivery::checkpoint_path(
                        &self.data_dir,
                        &o.job_id,
                        o.task,
                        o.rank,
                        &pin.digest,
                    ),
                    pin.digest,
                )
            }
            _ => return Err("no such package".into()),
        };
        if !source.exists() {
            return Err(format!(
                "this node holds no copy of {:?} (digest {digest})",
                o.name
            ));
        }
        let to = self
            .market
            .view()
            .ad(from)
            .map(|e| e.ad().delivery)
            .ok_or("this node holds no ad of yours: publish one first")?;
        Ok(delivery::PackageServe {
            request_id: cannabis_market::RunOrder::request_id(&(o.job_id, o.task, o.rank), o.epoch),
            source,
            digest,
            to,
        })
    }

    /// The engine asks for a rank's checkpoint: one fetch per rank at a time; a note that
    /// comes meanwhile waits for it, replacing any note that waited before (only the
    /// newest checkpoint is worth having).
    pub(super) fn start_checkpoint_fetch(&mut self, note: Box<CheckpointNote>) {
        let key = (note.job_id, note.task, note.rank);
        if let Some(next) = self.checkpoint_fetching.get_mut(&key) {
            *next = Some(note);
            return;
        }
        let Some(peer) = swarm::peer_of(&note.worker) else {
            return;
        };
        self.checkpoint_fetching.insert(key, None);
        let data_dir = self.data_dir.clone();
        let identity = self.keys.delivery.clone();
        let tell = self.self_tx.clone();
        tokio::spawn(async move {
            let fetched = delivery::patiently(
                CHECKPOINT_PATIENCE,
                Duration::from_millis(500),
                Duration::from_secs(4),
                || {
                    let ask = |request| ask_peer(tell.clone(), peer, request);
                    delivery::fetch_checkpoint(&data_dir, &identity, &note, ask)
                },
            )
            .await;
            let result = fetched
                .map(|_| ())
                .map_err(|e| e.after(CHECKPOINT_PATIENCE, "not fetched"));
            let _ = tell.send(Command::CheckpointFetched(note, result)).await;
        });
    }

    /// A checkpoint fetch ended: a checked one is kept by the engine (and the rank's older
    /// files that no award pins are removed); then the note that waited, if any, is
    /// fetched.
    pub(super) fn checkpoint_fetched(&mut self, note: CheckpointNote, result: Result<(), String>) {
        let key = (note.job_id, note.task, note.rank);
        let next = self.checkpoint_fetching.remove(&key).flatten();
        match result {
            Ok(()) => {
                let c = &note.checkpoint;
                let kept = MarketCommand::CheckpointKept {
                    job: note.job_id,
                    task: note.task,
                    rank: note.rank,
                    epoch: note.epoch,
                    seq: note.seq,
                    digest: c.digest,
                    size_bytes: c.size_bytes,
                };
                match self.market.command(now().0, kept) {
                    Ok(_) => {
                        info!(job = %note.job_id, task = note.task, rank = note.rank, epoch = note.epoch, seq = note.seq, bytes = c.size_bytes, "checkpoint kept");
                    }
                    Err(e) => debug!(error = %e, "checkpoint not kept"),
                }
                self.prune_checkpoints(note.job_id, note.task, note.rank);
                self.drain();
            }
            Err(why) => {
                debug!(job = %note.job_id, task = note.task, rank = note.rank, seq = note.seq, reason = %why, "checkpoint not fetched; the one kept before stays");
            }
        }
        if let Some(next) = next {
            self.start_checkpoint_fetch(next);
        }
    }

    /// Removes a rank's checkpoint files other than the one kept and the one its current
    /// award pins.
    fn prune_checkpoints(&self, job: cannabis_protocol::Uuid, task: u32, rank: u32) {
        let Some(j) = self.market.job(&job) else {
            return;
        };
        let Some(t) = j.tasks().get(task as usize) else {
            return;
        };
        let mut keep: Vec<String> = t
            .checkpoints()
            .get(&rank)
            .map(|k| k.digest.to_string())
            .into_iter()
            .collect();
        keep.extend(
            t.ranks()
                .iter()
                .filter(|a| a.rank == rank)
                .filter_map(|a| a.resume.as_ref().map(|r| r.digest.to_string())),
        );
        let dir = delivery::checkpoint_dir(&self.data_dir, &job, task, rank);
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !name.starts_with('.') && !keep.contains(&name) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    pub(super) fn answer_transfer(
        &mut self,
        channel: ResponseChannel<TransferResponse>,
        response: TransferResponse,
    ) {
        if let TransferResponse::Chunk { data, .. } = &response {
            self.metrics
                .transfer_bytes
                .get_or_create(&crate::metrics::label("direction", "served"))
                .inc_by(data.len() as u64);
        }
        if let Err(e) = self
            .swarm
            .behaviour_mut()
            .transfer
            .send_response(channel, response)
        {
            debug!(?e, "the fetcher went away before the chunk");
        }
    }

    pub(super) fn ask_transfer(
        &mut self,
        peer: PeerId,
        request: TransferRequest,
        reply: oneshot::Sender<Result<TransferResponse, String>>,
    ) {
        let id = self
            .swarm
            .behaviour_mut()
            .transfer
            .send_request(&peer, request);
        self.transfers.insert(id, reply);
    }

    /// The engine asks for a delivery's outputs: one task fetches them (a second order
    /// for the same rank and epoch, while it runs, is the same fetch).
    pub(super) fn start_fetch(&mut self, signed: Signed<DeliveryManifest>) {
        let Ok(m) = signed.open().map(|r| r.body) else {
            return;
        };
        let key = (m.job_id, m.task, m.rank, m.epoch);
        if !self.fetching.insert(key) {
            return;
        }
        let Some(peer) = swarm::peer_of(&m.worker) else {
            return;
        };
        let data_dir = self.data_dir.clone();
        let identity = self.keys.delivery.clone();
        let tell = self.self_tx.clone();
        let progress = self.fetch_progress.clone();
        info!(job = %m.job_id, task = m.task, rank = m.rank, epoch = m.epoch, "fetching outputs");
        tokio::spawn(async move {
            let k = (m.job_id, m.task, m.rank);
            let fetched = delivery::patiently(
                FETCH_PATIENCE,
                Duration::from_millis(500),
                Duration::from_secs(8),
                || {
                    let ask = |request| ask_peer(tell.clone(), peer, request);
                    let shown = progress.clone();
                    let at = std::time::Instant::now();
                    delivery::fetch(&data_dir, &identity, &m, ask, move |bytes, total| {
                        if let Ok(mut p) = shown.lock() {
                            let e = p.entry(k).or_default();
                            e.started.get_or_insert(at);
                            e.bytes = bytes;
                            e.total = total;
                        }
                    })
                },
            )
            .await;
            let result =
                fetched.map_err(|e| e.after(FETCH_PATIENCE, "the outputs could not be fetched"));
            let _ = tell.send(Command::Fetched(Box::new(m), result)).await;
        });
    }

    /// A fetch ended: the rank is delivered, or failed.
    pub(super) fn fetched(
        &mut self,
        m: DeliveryManifest,
        result: Result<Vec<cannabis_protocol::NamedDigest>, String>,
    ) {
        self.fetching.remove(&(m.job_id, m.task, m.rank, m.epoch));
        if result.is_ok() {
            let bytes: u64 = m.outputs.iter().map(|o| o.cipher_size).sum();
            self.metrics
                .transfer_bytes
                .get_or_create(&crate::metrics::label("direction", "fetched"))
                .inc_by(bytes);
        }
        // The packages sealed for that worker at that epoch are not needed any more.
        delivery::unseal_packages(
            &self.data_dir,
            &cannabis_market::RunOrder::request_id(&(m.job_id, m.task, m.rank), m.epoch),
        );
        if let Ok(mut p) = self.fetch_progress.lock() {
            p.remove(&(m.job_id, m.task, m.rank));
        }
        let command = match result {
            Ok(outputs) => {
                info!(job = %m.job_id, task = m.task, rank = m.rank, "outputs delivered and checked");
                MarketCommand::Delivered {
                    job: m.job_id,
                    task: m.task,
                    rank: m.rank,
                    epoch: m.epoch,
                    outputs,
                }
            }
            Err(reason) => {
                warn!(job = %m.job_id, task = m.task, rank = m.rank, %reason, "delivery refused");
                MarketCommand::RankFailed {
                    job: m.job_id,
                    task: m.task,
                    rank: m.rank,
                    epoch: m.epoch,
                    reason: format!("delivery refused: {reason}"),
                }
            }
        };
        if let Err(e) = self.market.command(now().0, command) {
            debug!(error = %e, "delivery outcome not taken");
        }
        self.drain();
    }
}

impl Node {
    /// The engine asks for a delivered synthetic product to be checked: off the driver
    /// (reading and hashing up to 256 MiB), the verdict comes back as a command.
    pub(super) fn check_product(&mut self, check: cannabis_market::ProductCheck) {
        let dir = delivery::rank_dir(&self.data_dir, &check.job, check.task, check.rank);
        let tell = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            let verdict = delivery::check_product(&dir, check.seed, check.n);
            let _ = tell.blocking_send(Command::ProductChecked(check, verdict));
        });
    }

    /// The engine asks for a job's deliveries to be evaluated: off the driver (the
    /// evaluator runs in the sandbox for up to the terms' time), once the executor has
    /// opened; the report comes back to be signed.
    pub(super) fn evaluate(&mut self, order: cannabis_market::EvaluationOrder) {
        info!(job = %order.job, run = order.run, "evaluating the deliveries");
        let data_dir = self.data_dir.clone();
        let tell = self.self_tx.clone();
        let mut slot = self.executor.clone();
        let me = self.keys.signing.address();
        tokio::spawn(async move {
            let executor = match slot.wait_for(Option::is_some).await {
                Ok(opened) => match opened.as_deref() {
                    Some(Ok(ex)) => Ok(ex.clone()),
                    Some(Err(why)) => Err(why.clone()),
                    None => Err("the executor did not open".to_string()),
                },
                Err(_) => return,
            };
            let run = order.run;
            let report = tokio::task::spawn_blocking(move || {
                crate::evaluate::evaluate(&data_dir, executor, &order, me)
            })
            .await;
            if let Ok(report) = report {
                let _ = tell.send(Command::Evaluated(run, Box::new(report))).await;
            }
        });
    }

    /// An evaluation run's report: signed, kept in the job, and acted on by the engine
    /// (a pass accepts, anything else disputes).
    pub(super) fn evaluated(&mut self, run: u32, report: cannabis_protocol::Evaluation) {
        match report.outcome {
            cannabis_protocol::EvaluationOutcome::Passed => {
                info!(job = %report.job_id, run, "evaluation passed");
            }
            _ => {
                warn!(job = %report.job_id, run, outcome = ?report.outcome, reason = %report.reason, "evaluation did not pass");
            }
        }
        let job = report.job_id;
        let signed = cannabis_protocol::Signed::sign(&self.keys.signing, &report);
        let command = MarketCommand::Evaluated {
            job,
            run,
            report: Box::new(signed),
        };
        if let Err(e) = self.market.command(now().0, command) {
            warn!(error = %e, "evaluation report not taken");
        }
        self.drain();
    }

    /// A synthetic product's verdict: the engine keeps it (and disputes a wrong one).
    pub(super) fn product_checked(
        &mut self,
        check: cannabis_market::ProductCheck,
        verdict: Result<(), String>,
    ) {
        let verdict = match verdict {
            Ok(()) => {
                info!(job = %check.job, task = check.task, rank = check.rank, "delivered product checked");
                ProductVerdict::Passed
            }
            Err(why) => {
                warn!(job = %check.job, task = check.task, rank = check.rank, reason = %why, "delivered product is wrong: disputing it");
                ProductVerdict::Failed(why)
            }
        };
        let command = MarketCommand::ProductChecked {
            job: check.job,
            task: check.task,
            rank: check.rank,
            epoch: check.epoch,
            verdict,
        };
        if let Err(e) = self.market.command(now().0, command) {
            debug!(error = %e, "product verdict not taken");
        }
        self.drain();
    }

    /// Fills a job's delivered outputs (from the ranks' signed manifests) and the fetches
    /// on their way.
    pub(super) fn add_deliveries(&self, id: &cannabis_protocol::Uuid, detail: &mut api::JobDetail) {
        let progress = self
            .fetch_progress
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default();
        for (i, t) in detail.tasks.iter_mut().enumerate() {
            let dir_of = |rank| delivery::rank_dir(&self.data_dir, id, i as u32, rank);
            for r in &t.ranks {
                let Some(m) = r.delivery.as_deref().and_then(|s| s.clone().open().ok()) else {
                    continue;
                };
                let m = m.body;
                for o in &m.outputs {
                    let path = dir_of(r.rank).join(&o.name);
                    t.delivered.push(api::DeliveredOutput {
                        rank: r.rank,
                        epoch: m.epoch,
                        name: o.name.clone(),
                        digest: o.digest.to_string(),
                        size_bytes: o.size_bytes,
                        fetched: r.state == cannabis_market::job::LeaseState::Done,
                        path: path.display().to_string(),
                        exit_code: m.exit_code,
                        wall_ms: m.usage.wall_ms,
                        cpu_ms: m.usage.cpu_ms,
                        peak_memory_bytes: m.usage.peak_memory_bytes,
                    });
                }
                if let Some(p) = progress.get(&(*id, i as u32, r.rank)) {
                    let secs = p.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
                    let rate = if secs > 0.0 {
                        (p.bytes as f64 / secs) as u64
                    } else {
                        0
                    };
                    t.transfers.push(api::Transfer {
                        rank: r.rank,
                        bytes: p.bytes,
                        total: p.total,
                        rate_bps: rate,
                        eta_secs: (rate > 0).then(|| p.total.saturating_sub(p.bytes) / rate),
                    });
                }
            }
        }
    }
}
