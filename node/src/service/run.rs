//! Leased work on this node's executor: the engine's [`RunOrder`]s, carried out one after
//! another (a start before its renewal, a renewal before its stop) off the driver.

use cannabis_market::RunOrder;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cannabis_protocol::{
    AdapterKind, Address, DeliveryIdentity, DeliveryRecipient, ObjectKind, ObjectRef,
    ResourceUsage, RunStage, TaskInput, TaskSpec,
};
use cannabis_runtime::exec::{Attempt, AttemptRequest, AttemptState, ExecError, Renewal};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::Command;
use super::handle::ExecutorSlot;
use crate::delivery::{Check, Expect, FetchError, fetch_object, open_checked, patiently};
use crate::exec::ExecutorHandle;

/// What a leased attempt's packages became on this node: the bundle and inputs, fetched
/// from the requester, decrypted and checked, in the attempt's staging folder.
#[derive(Default)]
struct Staged {
    bundle: Option<PathBuf>,
    inputs: Vec<(String, PathBuf)>,
    /// The checkpoint the award pins for the rank to resume from.
    resume: Option<PathBuf>,
}

/// The staging folder of a leased attempt (plaintext packages; removed when it is over).
fn staging_dir(data_dir: &std::path::Path, request_id: &str) -> PathBuf {
    data_dir.join("staging").join(request_id.replace('/', "-"))
}

/// Whether a task needs packages from its requester before it can run.
fn needs_packages(task: &TaskSpec) -> bool {
    task.workload.adapter.runs_a_bundle() || !task.inputs.is_empty()
}

/// Starts the task that carries out run orders; orders sent before the executor opened
/// wait for it. A start whose task needs packages first fetches them (off the order loop,
/// so renewals and stops of other leases go on); a stop that comes meanwhile wins. The
/// task ends when the sender is dropped (the node waits for it: it holds the executor,
/// and the executor the store).
pub(super) fn spawn(
    slot: ExecutorSlot,
    node: mpsc::Sender<Command>,
    data_dir: PathBuf,
    identity: DeliveryIdentity,
    corrupt: Arc<AtomicBool>,
) -> (mpsc::UnboundedSender<RunOrder>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<RunOrder>();
    let (staged_tx, mut staged_rx) =
        mpsc::unbounded_channel::<(RunOrder, Result<Staged, String>)>();
    let task = tokio::spawn(async move {
        let mut watching = tokio::task::JoinSet::new();
        let mut fetching = std::collections::HashSet::<String>::new();
        let mut stopped = std::collections::HashSet::<String>::new();
        // Renewals that came while a start was fetching its packages (the requester renews
        // as soon as the award is countersigned): the start takes the latest when it runs,
        // or the attempt would keep the award's short expiry.
        let mut renewed = std::collections::HashMap::<String, cannabis_protocol::Timestamp>::new();
        loop {
            let (mut order, staged) = tokio::select! {
                o = rx.recv() => match o {
                    Some(o) => (o, None),
                    None => break,
                },
                Some((o, s)) = staged_rx.recv() => (o, Some(s)),
            };
            let mut slot = slot.clone();
            let Ok(opened) = slot.wait_for(Option::is_some).await.map(|o| o.clone()) else {
                return;
            };
            let ex = match opened.as_deref() {
                Some(Ok(ex)) => ex.clone(),
                Some(Err(why)) => {
                    warn!(?order, reason = %why, "leased work not run: this node has no executor");
                    continue;
                }
                None => continue,
            };
            let mut packages = None;
            match (&mut order, staged) {
                (
                    RunOrder::Start {
                        request_id, until, ..
                    },
                    Some(staged),
                ) => {
                    fetching.remove(request_id.as_str());
                    if let Some(later) = renewed.remove(request_id.as_str()) {
                        *until = (*until).max(later);
                    }
                    if stopped.contains(request_id.as_str()) {
                        let _ = std::fs::remove_dir_all(staging_dir(&data_dir, request_id));
                        continue;
                    }
                    match staged {
                        Ok(s) => packages = Some(s),
                        Err(why) => {
                            warn!(%request_id, reason = %why, "leased work not run: its packages");
                            let _ = std::fs::remove_dir_all(staging_dir(&data_dir, request_id));
                            let _ = node
                                .send(Command::Ran {
                                    request_id: request_id.clone(),
                                    stage: RunStage::Refused,
                                    detail: why,
                                })
                                .await;
                            continue;
                        }
                    }
                }
                (
                    RunOrder::Start {
                        request_id,
                        task: Some(task),
                        resume,
                        ..
                    },
                    None,
                ) if needs_packages(task) || resume.is_some() => {
                    let (ex2, id) = (ex.clone(), request_id.clone());
                    let known = tokio::task::spawn_blocking(move || attempt_for(&ex2, &id))
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .flatten()
                        .is_some();
                    if !known {
                        // Fetched first; the start comes back with them.
                        if fetching.insert(request_id.clone()) {
                            let fetch = PackageFetch {
                                data_dir: data_dir.clone(),
                                identity: identity.clone(),
                                node: node.clone(),
                            };
                            let back = staged_tx.clone();
                            let order = order.clone();
                            tokio::spawn(async move {
                                let staged = fetch.run(&order).await;
                                let _ = back.send((order, staged));
                            });
                        }
                        continue;
                    }
                }
                (RunOrder::Renew { request_id, until }, _)
                    if fetching.contains(request_id.as_str()) =>
                {
                    let later = renewed.entry(request_id.clone()).or_insert(*until);
                    *later = (*later).max(*until);
                    continue;
                }
                (RunOrder::Stop { request_id, .. }, _) => {
                    renewed.remove(request_id.as_str());
                    stopped.insert(request_id.clone());
                }
                _ => {}
            }
            let start = match &order {
                RunOrder::Start {
                    request_id,
                    key,
                    task,
                    requester,
                    deliver_to,
                    group,
                    ..
                } => Some(Delivery {
                    request_id: request_id.clone(),
                    outputs: task.as_ref().map_or(Vec::new(), |t| t.delivered_outputs()),
                    checkpoint: task
                        .as_ref()
                        .and_then(|t| t.checkpoint.as_ref().map(|c| c.name.clone())),
                    requester: *requester,
                    to: *deliver_to,
                    data_dir: data_dir.clone(),
                    corrupt: corrupt.clone(),
                    rank: group.is_some().then_some(key.2),
                }),
                _ => None,
            };
            let ended = match &order {
                RunOrder::Stop { request_id, .. } => Some(request_id.clone()),
                _ => None,
            };
            let runs = ex.clone();
            let done = tokio::task::spawn_blocking(move || carry_out(&runs, order, packages)).await;
            if let Err(e) = done {
                warn!(error = %e, "a run order failed");
            }
            // The lease ended: what was sealed for it is served no more.
            if let Some(request_id) = ended {
                crate::delivery::unseal(&data_dir, &request_id);
            }
            // Each attempt's stages go to its requester, from the node's engine.
            if let Some(delivery) = start {
                watching.spawn(watch(ex, delivery, node.clone()));
            }
        }
        watching.abort_all();
    });
    (tx, task)
}

/// How long a worker keeps trying a requester it cannot reach for a package.
const PACKAGE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Fetches a lease's bundle and inputs from its requester.
struct PackageFetch {
    data_dir: PathBuf,
    identity: DeliveryIdentity,
    node: mpsc::Sender<Command>,
}

impl PackageFetch {
    async fn run(&self, order: &RunOrder) -> Result<Staged, String> {
        let RunOrder::Start {
            request_id,
            key,
            epoch,
            task: Some(task),
            requester,
            inputs: pins,
            resume,
            ..
        } = order
        else {
            return Err("not a start".into());
        };
        let peer = crate::swarm::peer_of(requester).ok_or("the requester has no peer id")?;
        let dir = staging_dir(&self.data_dir, request_id);
        let ask = |request| super::transfer::ask_peer(self.node.clone(), peer, request);
        let object = |kind, name: &str| ObjectRef {
            job_id: key.0,
            task: key.1,
            rank: key.2,
            epoch: *epoch,
            kind,
            name: name.to_string(),
        };
        let storage = task.resources.storage_bytes;
        let mut wanted = Vec::new();
        if task.workload.adapter.runs_a_bundle() {
            wanted.push((
                object(ObjectKind::Bundle, "bundle"),
                Check {
                    name: "bundle".into(),
                    digest: task.workload.digest,
                    size: None,
                    max: storage,
                    content_rules: false,
                },
                dir.join("bundle.tar"),
            ));
        }
        for input in &task.inputs {
            let (name, digest, size) = match input {
                TaskInput::Staged(r) => (r.name.clone(), r.digest, Some(r.size_bytes)),
                TaskInput::FromTask { name, .. } => {
                    let pin = pins
                        .iter()
                        .find(|p| p.name == *name)
                        .ok_or_else(|| format!("the award pins no digest for input {name:?}"))?;
                    (name.clone(), pin.digest, None)
                }
            };
            wanted.push((
                object(ObjectKind::Input, &name),
                Check {
                    name: name.clone(),
                    digest,
                    size,
                    max: size.unwrap_or(storage),
                    content_rules: false,
                },
                dir.join("inputs").join(&name),
            ));
        }
        // A rank placed again resumes from the checkpoint its award pins.
        if let (Some(pin), Some(decl)) = (resume, &task.checkpoint) {
            wanted.push((
                object(ObjectKind::Checkpoint, &decl.name),
                Check {
                    name: decl.name.clone(),
                    digest: pin.digest,
                    size: Some(pin.size_bytes),
                    max: pin.size_bytes,
                    content_rules: false,
                },
                dir.join("resume"),
            ));
        }
        let mut staged = Staged::default();
        for (object, check, out) in wanted {
            let part = dir.join(".fetch").join(format!(
                "{}-{}.age.part",
                match object.kind {
                    ObjectKind::Bundle => "bundle",
                    ObjectKind::Checkpoint => "checkpoint",
                    _ => "input",
                },
                object.name
            ));
            let expect = Expect {
                known: None,
                max_plain: check.max,
            };
            let fetched = patiently(
                PACKAGE_PATIENCE,
                std::time::Duration::from_millis(250),
                std::time::Duration::from_secs(4),
                || async { fetch_object(&part, &object, expect, &ask, &mut |_, _| {}).await },
            )
            .await;
            let whole = match fetched {
                Ok(w) => w,
                Err(FetchError::Bad(why)) => return Err(format!("fetching {why}")),
                Err(FetchError::Transient(why)) => {
                    return Err(format!(
                        "fetching {:?} from the requester for {} s: {why}",
                        object.name,
                        PACKAGE_PATIENCE.as_secs()
                    ));
                }
            };
            let name = check.name.clone();
            open_checked(&whole, &out, check, &self.identity)
                .await
                .map_err(|e| format!("checking {e}"))?;
            let _ = std::fs::remove_file(&whole);
            match object.kind {
                ObjectKind::Bundle => staged.bundle = Some(out),
                ObjectKind::Checkpoint => staged.resume = Some(out),
                _ => staged.inputs.push((name, out)),
            }
        }
        let _ = std::fs::remove_dir_all(dir.join(".fetch"));
        info!(%request_id, inputs = staged.inputs.len(), "packages fetched and checked");
        Ok(staged)
    }
}

/// How often a leased attempt is looked at for a new stage: soon after it starts (a
/// sandbox is up within tens of milliseconds, and the requester waits for "running"),
/// then less often, up to `WATCH_EVERY`.
const WATCH_FIRST: std::time::Duration = std::time::Duration::from_millis(10);

/// See [`WATCH_FIRST`].
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// How often a running attempt's sandbox is asked for a newer sealed checkpoint.
const CHECKPOINT_LOOK: std::time::Duration = std::time::Duration::from_secs(1);

/// Where a leased attempt's outputs go once it completes.
struct Delivery {
    request_id: String,
    outputs: Vec<(String, u64)>,
    requester: Address,
    to: Option<DeliveryRecipient>,
    data_dir: PathBuf,
    /// A testnet fault: deliver wrong outputs ([`crate::delivery::SealOrder::corrupt`]).
    corrupt: Arc<AtomicBool>,
    /// The attempt's rank, for a group's: its sandbox gets the group's interface.
    rank: Option<u32>,
    /// The task's checkpoint file: each new copy the sandbox seals for the requester while
    /// the attempt runs is taken into the lease's outbox, and the requester told.
    checkpoint: Option<String>,
}

/// Reports each stage a leased attempt reaches (admitted, preparing, running, then how it
/// ended) to the node, until it is over; a completed attempt's outputs are then sealed for
/// the requester and the node told (or, if they cannot be, the run reported failed).
async fn watch(ex: ExecutorHandle, d: Delivery, node: mpsc::Sender<Command>) {
    let request_id = d.request_id.clone();
    let mut last = None;
    let mut pause = WATCH_FIRST;
    // The attempt's id once found: then it is read alone, not found among every attempt.
    let mut known: Option<String> = None;
    let mut sandboxed = false;
    // The last checkpoint copy sealed for the requester, and when to look for the next.
    let mut sealed_seq = 0u64;
    let mut next_checkpoint_look = std::time::Instant::now();
    loop {
        let (ex2, id, known2) = (ex.clone(), request_id.clone(), known.clone());
        let found = tokio::task::spawn_blocking(move || match known2 {
            Some(attempt) => ex2.get(&attempt).map(Some),
            None => attempt_for(&ex2, &id),
        })
        .await;
        let attempt = match found {
            Ok(Ok(Some(a))) => a,
            // Not admitted (the order failed) or the executor is gone: nothing to report.
            _ => return,
        };
        known = Some(attempt.id.clone());
        let stage = stage_of(&attempt);
        // A group rank's sandbox exists, held until its node connects it to its group:
        // the executor (root, or the supervisor) makes its interface, and the node's
        // group channel takes the device.
        if let (false, Some(rank), Some(_)) = (sandboxed, d.rank, attempt.monitor_pid)
            && !stage.is_final()
        {
            sandboxed = true;
            let (ex2, id) = (ex.clone(), attempt.id.clone());
            let device = tokio::task::spawn_blocking(move || {
                ex2.interface(&id, rank, crate::group::MTU)
                    .map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            let sandboxed = Command::Sandboxed {
                request_id: request_id.clone(),
                device,
            };
            if node.send(sandboxed).await.is_err() {
                return;
            }
        }
        if last != Some(stage) {
            last = Some(stage);
            let detail = attempt.reason.clone().unwrap_or_default();
            let sent = node
                .send(Command::Ran {
                    request_id: request_id.clone(),
                    stage,
                    detail,
                })
                .await;
            if sent.is_err() {
                return;
            }
        }
        if stage == RunStage::Running
            && let Some(name) = &d.checkpoint
            && std::time::Instant::now() >= next_checkpoint_look
        {
            // The sandbox seals a new copy at most every second: looking more often reads
            // the same `checkpoint/latest` again.
            next_checkpoint_look = std::time::Instant::now() + CHECKPOINT_LOOK;
            let (ex2, id, name) = (ex.clone(), attempt.id.clone(), name.clone());
            let (data_dir, req, last) = (d.data_dir.clone(), request_id.clone(), sealed_seq);
            let sealed = tokio::task::spawn_blocking(move || {
                take_new_checkpoint(&ex2, &data_dir, &req, &id, last, &name)
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            match sealed {
                Ok(None) => {}
                Ok(Some((seq, checkpoint))) => {
                    sealed_seq = seq;
                    let told = node
                        .send(Command::CheckpointSealed {
                            request_id: request_id.clone(),
                            seq,
                            checkpoint,
                        })
                        .await;
                    if told.is_err() {
                        return;
                    }
                }
                Err(why) => {
                    // Tried again at the next look; the one sealed before stays.
                    debug!(%request_id, reason = %why, "checkpoint not sealed");
                }
            }
        }
        if stage.is_final() {
            // The packages' plaintext goes with the attempt.
            let _ = std::fs::remove_dir_all(staging_dir(&d.data_dir, &request_id));
        }
        if stage == RunStage::Completed {
            let ex2 = ex.clone();
            let sealed = tokio::task::spawn_blocking(move || seal(&ex2, &d, &attempt)).await;
            let sealed = sealed.unwrap_or_else(|e| Err(e.to_string()));
            let command = match sealed {
                Ok(command) => command,
                Err(why) => {
                    warn!(%request_id, reason = %why, "outputs not delivered");
                    Command::Ran {
                        request_id,
                        stage: RunStage::Failed,
                        detail: why,
                    }
                }
            };
            let _ = node.send(command).await;
            return;
        }
        if stage.is_final() {
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(WATCH_EVERY);
    }
}

/// The executor's newest sealed copy of a running attempt's checkpoint, taken into the
/// lease's outbox if it is newer than copy `last`: its number and digests. Blocking.
fn take_new_checkpoint(
    ex: &ExecutorHandle,
    data_dir: &std::path::Path,
    request_id: &str,
    attempt: &str,
    last: u64,
    name: &str,
) -> Result<Option<(u64, cannabis_protocol::OutputDigest)>, String> {
    // Missing until the first copy: nothing to take yet.
    let Ok(latest) = ex.read_output(attempt, "checkpoint/latest", 0, 4096) else {
        return Ok(None);
    };
    let copy: cannabis_runtime::sandbox::CheckpointCopy =
        serde_json::from_slice(&latest.data).map_err(|e| format!("checkpoint/latest: {e}"))?;
    if copy.seq <= last {
        return Ok(None);
    }
    let checkpoint =
        crate::delivery::take_checkpoint(data_dir, ex, request_id, attempt, &copy, name)?;
    Ok(Some((copy.seq, checkpoint)))
}

/// Seals a completed attempt's outputs; the node is then told what to deliver.
fn seal(ex: &ExecutorHandle, d: &Delivery, attempt: &Attempt) -> Result<Command, String> {
    let to =
        d.to.ok_or("the lease predates delivery: no recipient to encrypt the outputs to")?;
    let order = crate::delivery::SealOrder {
        request_id: &d.request_id,
        attempt: &attempt.id,
        outputs: d.outputs.clone(),
        requester: d.requester,
        to,
        corrupt: d.corrupt.load(Ordering::Relaxed),
    };
    let outputs = crate::delivery::seal(&d.data_dir, ex, &order)?;
    let exit = attempt.exit.as_ref();
    // Counted by the attempt's cgroups; a figure the host cannot count stays 0.
    let counted = attempt.usage.unwrap_or_default();
    let usage = ResourceUsage {
        wall_ms: exit.map_or(0, |e| e.ended_at_ms.saturating_sub(e.started_at_ms)),
        cpu_ms: counted.cpu_ms.unwrap_or(0),
        peak_memory_bytes: counted.peak_memory_bytes.unwrap_or(0),
        gpu_ms: 0,
        output_bytes: outputs.iter().map(|o| o.size_bytes).sum(),
    };
    Ok(Command::Prepared {
        request_id: d.request_id.clone(),
        outputs,
        usage,
        exit_code: exit.and_then(|e| e.code),
    })
}

/// The stage a requester is told of for an attempt.
fn stage_of(a: &Attempt) -> RunStage {
    match a.state {
        AttemptState::Reserved => RunStage::Admitted,
        AttemptState::Preparing => RunStage::Preparing,
        AttemptState::Running => RunStage::Running,
        AttemptState::Completed => RunStage::Completed,
        AttemptState::Failed if a.refused => RunStage::Refused,
        AttemptState::Failed => RunStage::Failed,
        AttemptState::Cancelled => RunStage::Cancelled,
        AttemptState::Unknown => RunStage::Unknown,
    }
}

/// The executor's attempt for a request id, if it has one.
pub(super) fn attempt_for(
    ex: &ExecutorHandle,
    request_id: &str,
) -> Result<Option<Attempt>, ExecError> {
    Ok(ex
        .attempts()?
        .into_iter()
        .filter(|a| a.request.request_id == request_id)
        .max_by_key(|a| a.history.first().map(|h| h.0)))
}

fn carry_out(ex: &ExecutorHandle, order: RunOrder, packages: Option<Staged>) {
    let result = match &order {
        RunOrder::Start {
            request_id,
            key,
            task,
            seed,
            until,
            group,
            deliver_to,
            ..
        } => match attempt_for(ex, request_id) {
            // The executor has it (a restart, an award seen again): it never runs twice.
            Ok(Some(a)) if !a.state.is_final() => ex.renew(&a.id, until.0).map(|()| {
                info!(%request_id, attempt = %a.id, "leased work found again");
            }),
            Ok(Some(a)) => {
                info!(%request_id, attempt = %a.id, state = ?a.state, "leased work already ran");
                Ok(())
            }
            Ok(None) => match task {
                None => {
                    warn!(%request_id, "leased work not run: its task is unknown here");
                    Ok(())
                }
                Some(task) => {
                    let synthetic = task.workload.adapter == AdapterKind::Synthetic;
                    let request = AttemptRequest {
                        request_id: request_id.clone(),
                        task: (**task).clone(),
                        bundle: packages.as_ref().and_then(|p| p.bundle.clone()),
                        resume: packages.as_ref().and_then(|p| p.resume.clone()),
                        checkpoint_to: deliver_to.map(|to| to.to_string()),
                        inputs: packages.map(|p| p.inputs).unwrap_or_default(),
                        seed: synthetic.then_some(*seed),
                        lease_until_ms: until.0,
                        renewal: Renewal::External,
                        env: group
                            .as_ref()
                            .map_or_else(Vec::new, |g| crate::group::Groups::environment(key.2, g)),
                        loopback: group.is_some(),
                        hold: group.is_some(),
                    };
                    ex.submit(request).map(|a| {
                        if a.refused {
                            warn!(%request_id, attempt = %a.id, reason = a.reason.as_deref().unwrap_or(""), "leased work refused by the executor");
                        } else {
                            info!(%request_id, attempt = %a.id, "leased work admitted");
                        }
                    })
                }
            },
            Err(e) => Err(e),
        },
        RunOrder::Renew { request_id, until } => match attempt_for(ex, request_id) {
            Ok(Some(a)) if !a.state.is_final() => ex.renew(&a.id, until.0),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        },
        RunOrder::Stop { request_id, why } => match attempt_for(ex, request_id) {
            Ok(Some(a)) if !a.state.is_final() => ex.stop(&a.id, why).map(|a| {
                info!(%request_id, attempt = %a.id, %why, "leased work stopped");
            }),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        },
    };
    if let Err(e) = result {
        warn!(?order, error = %e, "the executor did not carry out a run order");
    }
}
