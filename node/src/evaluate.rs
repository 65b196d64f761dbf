//! The requester's evaluation of a job's deliveries ([`EvaluationOrder`]): the artifact
//! checks the terms name, then the evaluator itself, run on this node's executor under
//! the same sandbox as any requester's program (no network, read-only inputs: the
//! delivered outputs, the held-out data and the agreed configuration; one bounded work
//! directory; the terms' time and memory limits). Its `metrics.json` is judged against
//! the acceptance metrics into an [`Evaluation`], which the node signs.
//!
//! A hash proves which bytes were delivered, not that they are any good: the evaluator,
//! on data the workers never saw, is what measures quality. An evaluator that fails, is
//! stopped, or writes no readable metrics gives `not-evaluated`, never a pass.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cannabis_market::EvaluationOrder;
use cannabis_protocol::{
    AdapterKind, Address, Amount, ArtifactFormat, Criterion, Digest, EVALUATION_CONFIGURATION,
    EVALUATION_METRICS, Evaluation, EvaluationOutcome, Fixed, InputRef, MetricValue, NamedDigest,
    OutputDecl, OutputRights, Requirements, Resources, TaskInput, TaskSpec, Timestamp, Workload,
    judge,
};
use cannabis_runtime::exec::{AttemptRequest, AttemptState, Renewal};
use sha2::{Digest as _, Sha256};

use crate::delivery;
use crate::exec::ExecutorHandle;

/// Largest `metrics.json` read back.
const METRICS_MAX: u64 = 64 * 1024;
/// The evaluator's work directory.
const WORK_BYTES: u64 = 256 << 20;
/// How long past its time limit an evaluator is waited for before it is stopped here.
const GRACE: Duration = Duration::from_secs(30);
/// How often the attempt is looked at.
const POLL: Duration = Duration::from_millis(200);

/// Where a run keeps its own files (the staged configuration).
fn run_dir(data_dir: &Path, order: &EvaluationOrder) -> PathBuf {
    data_dir
        .join("evaluations")
        .join(order.job.to_string())
        .join(order.run.to_string())
}

/// The executor's request id of a run's `k`th admission: the same run asked again (after
/// a restart) finds the same attempts, and never runs twice.
pub fn request_id(order: &EvaluationOrder, k: u32) -> String {
    format!("evaluate-{}-{}-{k}", order.job, order.run)
}

/// Evaluations run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// Admissions tried before an evaluation is given up as not evaluated.
const ADMISSION_TRIES: u32 = 30;
/// The wait between them.
const ADMISSION_WAIT: Duration = Duration::from_secs(2);

/// Evaluates `order` and returns the report to sign (`requester` is this node). Blocks
/// for as long as the evaluator runs.
pub fn evaluate(
    data_dir: &Path,
    executor: Result<ExecutorHandle, String>,
    order: &EvaluationOrder,
    requester: Address,
) -> Evaluation {
    let mut report = Evaluation {
        job_id: order.job,
        requester,
        evaluator: order.terms.evaluator,
        held_out: order.terms.held_out.clone(),
        deliveries: order.deliveries.iter().map(|(d, _)| *d).collect(),
        inputs: Vec::new(),
        metrics: Vec::new(),
        criteria: Vec::new(),
        outcome: EvaluationOutcome::NotEvaluated,
        reason: String::new(),
        issued_at: Timestamp(0),
    };
    let ran = run(data_dir, executor, order, &mut report);
    // The run's own files (its staged configuration) are of no use once it has a report:
    // the executor staged copies of them, and a run asked again gets a directory of its
    // own. (A node that dies mid-run keeps them, and the same run asked again after its
    // restart finds them.)
    let dir = run_dir(data_dir, order);
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(job) = dir.parent() {
        // Only when empty: another run of the job may be under way.
        let _ = std::fs::remove_dir(job);
    }
    let (outcome, reason) = match ran {
        Ok(()) => {
            let (criteria, passed) = judge(&order.acceptance, &report.metrics);
            let reason = criteria
                .iter()
                .find(|c| !c.passed)
                .map_or_else(|| "every check and criterion passed".into(), missed);
            report.criteria = criteria;
            if passed {
                (EvaluationOutcome::Passed, reason)
            } else {
                (EvaluationOutcome::Failed, reason)
            }
        }
        Err(Verdict::Failed(why)) => (EvaluationOutcome::Failed, why),
        Err(Verdict::NotEvaluated(why)) => (EvaluationOutcome::NotEvaluated, why),
    };
    if report.criteria.is_empty() {
        report.criteria = order
            .acceptance
            .iter()
            .map(|m| Criterion {
                metric: m.name.clone(),
                comparison: m.comparison,
                required: m.required(),
                value: None,
                passed: false,
            })
            .collect();
    }
    report.outcome = outcome;
    report.reason = reason;
    report.issued_at = crate::service::now().0;
    report
}

/// Why an evaluation ended before its metrics were judged.
enum Verdict {
    /// A delivered artifact fails the terms: the workers' fault.
    Failed(String),
    /// Nothing could be measured.
    NotEvaluated(String),
}

fn missed(c: &Criterion) -> String {
    match c.value {
        None => format!("the evaluator reported no {:?}", c.metric),
        Some(v) => {
            let side = match c.comparison {
                cannabis_protocol::Comparison::AtLeast => "below",
                cannabis_protocol::Comparison::AtMost => "above",
            };
            format!("{} {v} is {side} the required {}", c.metric, c.required)
        }
    }
}

fn run(
    data_dir: &Path,
    executor: Result<ExecutorHandle, String>,
    order: &EvaluationOrder,
    report: &mut Evaluation,
) -> Result<(), Verdict> {
    let terms = &order.terms;
    let not = |why: String| Verdict::NotEvaluated(why);
    // The delivered outputs, one file per name.
    let mut delivered: BTreeMap<&str, (PathBuf, Digest, u64)> = BTreeMap::new();
    for (d, outputs) in &order.deliveries {
        let dir = delivery::rank_dir(data_dir, &order.job, d.task, d.rank);
        for o in outputs {
            if delivered
                .insert(&o.name, (dir.join(&o.name), o.digest, o.size_bytes))
                .is_some()
            {
                return Err(not(format!(
                    "more than one rank delivered {:?}: the evaluator takes one file per name",
                    o.name
                )));
            }
        }
    }
    // The artifact checks, before anything runs.
    for check in &terms.artifacts {
        let Some((path, _, size)) = delivered.get(check.output.as_str()) else {
            return Err(Verdict::Failed(format!(
                "no delivery holds the output {:?}",
                check.output
            )));
        };
        if *size > check.max_size_bytes {
            return Err(Verdict::Failed(format!(
                "{} is {size} bytes, over the {} the terms allow",
                check.output, check.max_size_bytes
            )));
        }
        if check.format == ArtifactFormat::Safetensors {
            let tensors = safetensors_of(path)
                .map_err(|e| Verdict::Failed(format!("{}: {e}", check.output)))?;
            for want in &check.tensors {
                match tensors.get(&want.name) {
                    None => {
                        return Err(Verdict::Failed(format!(
                            "{} holds no tensor {:?}",
                            check.output, want.name
                        )));
                    }
                    Some((dtype, shape)) if *dtype != want.dtype || *shape != want.shape => {
                        return Err(Verdict::Failed(format!(
                            "{}: tensor {:?} is {dtype} {shape:?}, the terms say {} {:?}",
                            check.output, want.name, want.dtype, want.shape
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
    }
    // What the evaluator is given.
    let mut inputs: Vec<(String, PathBuf, Digest, u64)> = delivered
        .iter()
        .map(|(name, (path, digest, size))| (name.to_string(), path.clone(), *digest, *size))
        .collect();
    report.inputs = inputs
        .iter()
        .map(|(name, _, digest, _)| NamedDigest {
            name: name.clone(),
            digest: *digest,
        })
        .collect();
    let delivered_bytes: u64 = inputs.iter().map(|i| i.3).sum();
    for h in &terms.held_out {
        let path = delivery::package_path(data_dir, &h.digest);
        let size = std::fs::metadata(&path)
            .map_err(|e| {
                not(format!(
                    "the held-out file {} is not kept by this node ({e})",
                    h.name
                ))
            })?
            .len();
        inputs.push((h.name.clone(), path, h.digest, size));
    }
    let total: u64 = inputs.iter().map(|i| i.3).sum();
    if total > terms.limits.max_input_bytes {
        return Err(Verdict::Failed(format!(
            "the deliveries ({delivered_bytes} bytes) and the held-out data come to {total} \
             bytes, over the {} the terms allow",
            terms.limits.max_input_bytes
        )));
    }
    let configuration: BTreeMap<&str, &str> = terms
        .configuration
        .iter()
        .map(|s| (s.key.as_str(), s.value.as_str()))
        .collect();
    let dir = run_dir(data_dir, order);
    std::fs::create_dir_all(&dir).map_err(|e| not(format!("{}: {e}", dir.display())))?;
    let config_path = dir.join(EVALUATION_CONFIGURATION);
    let config = serde_json::to_vec_pretty(&configuration).unwrap_or_default();
    std::fs::write(&config_path, &config)
        .map_err(|e| not(format!("{}: {e}", config_path.display())))?;
    inputs.push((
        EVALUATION_CONFIGURATION.into(),
        config_path,
        Digest(Sha256::digest(&config).into()),
        config.len() as u64,
    ));
    let bundle = delivery::package_path(data_dir, &terms.evaluator);
    if !bundle.exists() {
        return Err(not(format!(
            "the evaluator's bundle {} is not kept by this node",
            terms.evaluator
        )));
    }
    let executor = executor.map_err(|e| not(format!("this node cannot run the evaluator: {e}")))?;
    let task = TaskSpec {
        restarts: 0,
        name: "evaluate".into(),
        workload: Workload {
            adapter: AdapterKind::Process,
            digest: terms.evaluator,
            entrypoint: terms.entrypoint.clone(),
        },
        inputs: inputs
            .iter()
            .map(|(name, _, digest, size)| {
                TaskInput::Staged(InputRef {
                    name: name.clone(),
                    digest: *digest,
                    size_bytes: *size,
                })
            })
            .collect(),
        outputs: vec![OutputDecl {
            name: EVALUATION_METRICS.into(),
            max_bytes: METRICS_MAX,
            rights: OutputRights::Exclusive,
        }],
        resources: Resources {
            // One core, or what the owner allows where that is less (a node that offers
            // half a core still scores what it asked for).
            cpu_millicores: executor.limits().cpu_millicores.clamp(1, 1000) as u32,
            memory_bytes: terms.limits.memory_bytes,
            swap_bytes: 0,
            processes: 64,
            storage_bytes: WORK_BYTES,
            gpus: 0,
        },
        requirements: Requirements::default(),
        group_size: 1,
        depends_on: Vec::new(),
        budget: Amount(0),
        checkpoint: None,
    };
    // One evaluation at a time on this node; an admission refused (the executor busy
    // with leased work) is tried again under the next id, for a while.
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let request = |k: u32| AttemptRequest {
        request_id: request_id(order, k),
        task: task.clone(),
        bundle: Some(bundle.clone()),
        inputs: inputs
            .iter()
            .map(|(name, path, ..)| (name.clone(), path.clone()))
            .collect(),
        seed: None,
        // Never renewed: the lease's end is the evaluator's time limit.
        lease_until_ms: crate::service::now()
            .0
            .0
            .saturating_add(terms.limits.wall_ms),
        renewal: Renewal::External,
        env: Vec::new(),
        loopback: false,
        hold: false,
        resume: None,
        checkpoint_to: None,
    };
    let mut k = 0;
    let attempt = loop {
        let attempt = executor
            .submit(request(k))
            .map_err(|e| not(format!("the executor refused the evaluator: {e}")))?;
        if !attempt.refused {
            break attempt;
        }
        k += 1;
        if k == ADMISSION_TRIES {
            return Err(not(format!(
                "the executor refused the evaluator: {}",
                attempt.reason.as_deref().unwrap_or("no reason given")
            )));
        }
        std::thread::sleep(ADMISSION_WAIT);
    };
    let started = Instant::now();
    let wait = Duration::from_millis(terms.limits.wall_ms) + GRACE;
    let mut attempt = attempt;
    while !attempt.state.is_final() {
        if started.elapsed() > wait {
            let _ = executor.stop(&attempt.id, "the evaluation's time limit passed");
            return Err(not(format!(
                "the evaluator ran past its {} ms",
                terms.limits.wall_ms
            )));
        }
        std::thread::sleep(POLL);
        attempt = executor
            .get(&attempt.id)
            .map_err(|e| not(format!("the executor lost the evaluator: {e}")))?;
    }
    if attempt.state != AttemptState::Completed {
        return Err(not(format!(
            "the evaluator {}: {}{}",
            attempt.state.name(),
            attempt.reason.as_deref().unwrap_or("no reason given"),
            stderr_tail(&executor, &attempt.id)
        )));
    }
    let chunk = executor
        .read_output(&attempt.id, EVALUATION_METRICS, 0, METRICS_MAX)
        .map_err(|e| not(format!("reading {EVALUATION_METRICS}: {e}")))?;
    report.metrics = parse_metrics(&chunk.data).map_err(not)?;
    Ok(())
}

/// The end of an attempt's standard error, for the report's reason.
fn stderr_tail(executor: &ExecutorHandle, id: &str) -> String {
    const TAIL: u64 = 300;
    let Ok(size) = executor.read_output(id, "stderr", 0, 0).map(|c| c.size) else {
        return String::new();
    };
    match executor.read_output(id, "stderr", size.saturating_sub(TAIL), TAIL) {
        Ok(c) if !c.data.is_empty() => {
            let text = String::from_utf8_lossy(&c.data);
            format!("; its standard error ends: {}", text.trim())
        }
        _ => String::new(),
    }
}

/// The evaluator's `metrics.json`: one JSON object of metric names to finite numbers.
pub fn parse_metrics(bytes: &[u8]) -> Result<Vec<MetricValue>, String> {
    let bad = |why: String| format!("{EVALUATION_METRICS} {why}");
    let map: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("is not a JSON object: {e}")))?;
    map.into_iter()
        .map(|(name, v)| {
            let x = v
                .as_f64()
                .filter(|x| x.is_finite() && x.abs() < 9.0e12)
                .ok_or_else(|| bad(format!("gives {name:?} as {v}, not a number in range")))?;
            Ok(MetricValue {
                name,
                value: Fixed((x * Fixed::SCALE as f64).round() as i64),
            })
        })
        .collect()
}

/// The tensors of a safetensors file, by name: dtype and shape (after the file's own
/// checks, [`delivery::check_safetensors`]).
fn safetensors_of(path: &Path) -> Result<BTreeMap<String, (String, Vec<u64>)>, String> {
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let tensors = delivery::safetensors_tensors(&mut f, len)?;
    let mut seen = BTreeSet::new();
    Ok(tensors
        .into_iter()
        .filter(|(name, ..)| seen.insert(name.clone()))
        .map(|(name, dtype, shape)| (name, (dtype, shape)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_a_flat_object_of_finite_numbers() {
        let m = parse_metrics(br#"{"accuracy": 0.9512345, "loss": 2}"#).unwrap();
        assert_eq!(m[0].name, "accuracy");
        assert_eq!(m[0].value, Fixed(951_235));
        assert_eq!(m[1].value, Fixed(2_000_000));
        for bad in [
            &br#"[0.9]"#[..],
            br#"{"accuracy": "0.9"}"#,
            br#"{"accuracy": 1e300}"#,
            br#"{"accuracy": {"top1": 0.9}}"#,
            b"accuracy=0.9",
        ] {
            assert!(
                parse_metrics(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
