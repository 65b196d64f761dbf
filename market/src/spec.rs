//! The job file: what a requester writes (TOML, documented in `docs/requester-guide.md`),
//! parsed and checked into an [`OfferTemplate`]. Parsing is pure: inputs given by path are
//! returned as [`Source::Path`] and the caller hashes the files ([`JobSpec::resolve`]).
//!
//! Every error names the field (`task[1].resources.memory`) and says how to fix it.

use std::collections::BTreeMap;

use cannabis_protocol::{
    AcceptanceMetric, AdapterKind, Address, Amount, ArtifactCheck, ArtifactFormat, Collective,
    Comparison, Digest, EvaluationLimits, EvaluationTerms, Fixed, GpuVendor, InputRef,
    IsolationLayer, NamedDigest, OutputDecl, OutputRights, Requirements, Resources,
    RuntimeRequirement, Setting, TaskInput, TaskSpec, TensorCheck, Uuid, Workload, is_safe_name,
};
use serde::{Deserialize, Serialize};

use cannabis_protocol::units::{parse_duration_ms, parse_size};

/// Default time bids are taken.
pub const DEFAULT_BID_WINDOW_MS: u64 = 30_000;
/// Default review window.
pub const DEFAULT_REVIEW_WINDOW_MS: u64 = 3_600_000;

/// A job file that does not hold up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct SpecError {
    /// Where, e.g. `task[0].resources.memory`.
    pub field: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

fn err(field: impl Into<String>, problem: impl Into<String>) -> SpecError {
    SpecError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// Where a workload bundle or an input comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Pinned by the requester.
    Digest {
        /// SHA-256 of the content.
        digest: Digest,
        /// Size in bytes.
        size_bytes: u64,
    },
    /// A local file; the caller hashes it.
    Path(String),
}

/// `POST /v1/offers`: what a requester fills in to publish an offer; the node adds its identity, sequence
/// number, times and delivery recipient, then signs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OfferTemplate {
    /// A name for people; kept by the requester's node, not published.
    #[serde(default)]
    pub name: Option<String>,
    /// The nonce the job id is derived from with the requester's key
    /// ([`cannabis_protocol::job_id_of`]): the same nonce gives the same id, so a
    /// resubmission is refused as a duplicate; a random one when absent.
    #[serde(default)]
    pub nonce: Option<Uuid>,
    /// The tasks; the budget is their sum.
    pub tasks: Vec<TaskSpec>,
    /// How long bids are taken, in milliseconds.
    pub ttl_ms: u64,
    /// When results are due, in milliseconds from now.
    pub deadline_ms: u64,
    /// Review window in milliseconds.
    pub review_window_ms: u64,
    /// Acceptance metrics.
    #[serde(default)]
    pub acceptance: Vec<AcceptanceMetric>,
    /// How the requester's node evaluates deliveries against the acceptance metrics.
    #[serde(default)]
    pub evaluation: Option<EvaluationTerms>,
    /// Place before the bid window ends, as soon as this is met (kept by the requester's
    /// node, not published).
    #[serde(default)]
    pub early: Option<crate::job::Early>,
    /// The fraction of delivered tasks re-run on another worker to check them, in parts
    /// per million ([`crate::spot`]; kept by the requester's node, not published).
    #[serde(default)]
    pub spot_check_ppm: u32,
}

/// A parsed, checked job file, waiting for its local files to be hashed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobSpec {
    /// A name for people.
    pub name: String,
    /// Total budget in base units, fee included.
    pub budget: Amount,
    /// Results due this long after submission.
    pub deadline_ms: u64,
    /// Bids are taken this long.
    pub bid_window_ms: u64,
    /// Review window.
    pub review_window_ms: u64,
    /// Acceptance metrics.
    pub acceptance: Vec<AcceptanceMetric>,
    /// The evaluation terms, with their sources still to resolve.
    pub evaluation: Option<EvaluationDraft>,
    /// Place before the bid window ends, as soon as this is met.
    pub early: Option<crate::job::Early>,
    /// The fraction of delivered tasks re-run elsewhere to check them, in parts per
    /// million.
    pub spot_check_ppm: u32,
    /// The tasks, with their sources still to resolve.
    pub tasks: Vec<TaskDraft>,
}

/// One task of a [`JobSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskDraft {
    /// The task with every digest that is already known; sources below fill the rest.
    pub task: TaskSpec,
    /// Where the workload bundle comes from.
    pub bundle: Source,
    /// For each staged input (by position in `task.inputs`), where it comes from.
    pub inputs: Vec<(usize, Source)>,
}

/// The evaluation terms of a [`JobSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvaluationDraft {
    /// The terms with every digest already known; the sources below fill the rest.
    pub terms: EvaluationTerms,
    /// Where the evaluator's bundle comes from.
    pub bundle: Source,
    /// For each held-out file (by position in `terms.held_out`), where it comes from.
    pub held_out: Vec<Source>,
}

/// Default wall time of an evaluator.
pub const DEFAULT_EVALUATION_TIMEOUT_MS: u64 = 10 * 60 * 1000;
/// Default memory of an evaluator.
pub const DEFAULT_EVALUATION_MEMORY: u64 = 1 << 30;
/// Default bytes an evaluator is given.
pub const DEFAULT_EVALUATION_INPUT: u64 = 4 << 30;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvaluation {
    #[serde(default)]
    bundle: Option<String>,
    #[serde(default)]
    digest: Option<String>,
    #[serde(default)]
    entrypoint: Vec<String>,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    memory: Option<String>,
    #[serde(default)]
    max_input: Option<String>,
    #[serde(default)]
    confirm: bool,
    #[serde(default)]
    configuration: BTreeMap<String, toml::Value>,
    #[serde(default)]
    held_out: Vec<RawInput>,
    #[serde(default, rename = "artifact")]
    artifacts: Vec<RawArtifact>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawArtifact {
    output: String,
    #[serde(default)]
    format: Option<ArtifactFormat>,
    max_size: String,
    #[serde(default)]
    tensors: Vec<RawTensor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    #[serde(default)]
    name: Option<String>,
    budget: Option<u64>,
    deadline: String,
    #[serde(default)]
    bid_window: Option<String>,
    #[serde(default)]
    review_window: Option<String>,
    #[serde(default)]
    acceptance: Vec<RawMetric>,
    #[serde(default)]
    evaluation: Option<RawEvaluation>,
    #[serde(default)]
    early: Option<RawEarly>,
    #[serde(default)]
    spot_check: Option<f64>,
    #[serde(default, rename = "task")]
    tasks: Vec<RawTask>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEarly {
    #[serde(default)]
    first_bids: Option<u32>,
    #[serde(default)]
    max_price: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetric {
    metric: String,
    #[serde(default)]
    at_least: Option<f64>,
    #[serde(default)]
    at_most: Option<f64>,
    #[serde(default)]
    baseline: Option<f64>,
    #[serde(default)]
    above_baseline: Option<f64>,
    #[serde(default)]
    below_baseline: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    name: String,
    #[serde(default)]
    budget: Option<u64>,
    #[serde(default = "one")]
    group_size: u32,
    #[serde(default)]
    restarts: u32,
    #[serde(default)]
    depends_on: Vec<String>,
    workload: RawWorkload,
    #[serde(default)]
    resources: RawResources,
    #[serde(default)]
    requirements: RawRequirements,
    #[serde(default)]
    inputs: Vec<RawInput>,
    #[serde(default)]
    outputs: Vec<RawOutput>,
    #[serde(default)]
    checkpoint: Option<RawCheckpoint>,
}

/// `checkpoint = { name = "state.bin", max_size = "64MiB" }`: the file in the work
/// directory each rank keeps its progress in (`max_size` defaults to the rank's storage).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    name: String,
    #[serde(default)]
    max_size: Option<String>,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkload {
    adapter: AdapterKind,
    #[serde(default)]
    digest: Option<String>,
    #[serde(default)]
    bundle: Option<String>,
    #[serde(default)]
    entrypoint: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawResources {
    #[serde(default)]
    cpu: Option<toml::Value>,
    #[serde(default)]
    memory: Option<String>,
    #[serde(default)]
    swap: Option<String>,
    #[serde(default)]
    processes: Option<u32>,
    #[serde(default)]
    storage: Option<String>,
    #[serde(default)]
    gpus: u32,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRequirements {
    #[serde(default)]
    gpu_vendor: Option<GpuVendor>,
    #[serde(default)]
    gpu_memory: Option<String>,
    #[serde(default)]
    runtimes: BTreeMap<String, String>,
    #[serde(default)]
    collectives: Vec<Collective>,
    #[serde(default)]
    isolation: Vec<IsolationLayer>,
    #[serde(default)]
    confidential: bool,
    #[serde(default)]
    challenge_max_age: Option<String>,
    #[serde(default)]
    challenge_verifiers: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInput {
    name: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    digest: Option<String>,
    #[serde(default)]
    size: Option<String>,
    #[serde(default)]
    from: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutput {
    name: String,
    max_size: String,
    #[serde(default = "exclusive")]
    rights: OutputRights,
}

fn exclusive() -> OutputRights {
    OutputRights::Exclusive
}

/// Default resources of a rank when the file says nothing.
const DEFAULT_CPU_MILLICORES: u32 = 1000;
const DEFAULT_MEMORY: u64 = 1 << 30;
const DEFAULT_STORAGE: u64 = 1 << 30;
const DEFAULT_PROCESSES: u32 = 256;

impl JobSpec {
    /// Parses and checks a job file.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        let raw: RawJob = toml::from_str(text).map_err(|e| {
            let field = e
                .span()
                .map(|s| format!("line {}", text[..s.start].matches('\n').count() + 1))
                .unwrap_or_else(|| "file".into());
            err(field, e.message().to_string())
        })?;
        Self::check(raw)
    }

    fn check(raw: RawJob) -> Result<Self, SpecError> {
        let duration =
            |field: &str, v: &str| parse_duration_ms(v).map_err(|e| err(field, e.to_string()));
        let deadline_ms = duration("deadline", &raw.deadline)?;
        let bid_window_ms = match &raw.bid_window {
            Some(v) => duration("bid_window", v)?,
            None => DEFAULT_BID_WINDOW_MS,
        };
        let review_window_ms = match &raw.review_window {
            Some(v) => duration("review_window", v)?,
            None => DEFAULT_REVIEW_WINDOW_MS,
        };
        if bid_window_ms == 0 {
            return Err(err("bid_window", "must be longer than 0 (e.g. \"30s\")"));
        }
        if deadline_ms <= bid_window_ms {
            return Err(err(
                "deadline",
                "must be after the bid window ends: make the deadline longer or the bid window shorter",
            ));
        }
        if raw.tasks.is_empty() {
            return Err(err("task", "a job needs at least one [[task]]"));
        }
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        let mut tasks = Vec::with_capacity(raw.tasks.len());
        for (i, t) in raw.tasks.iter().enumerate() {
            let draft = check_task(i, t, &names, &tasks, raw.tasks.len(), raw.budget)?;
            if names.insert(t.name.as_str(), i).is_some() {
                return Err(err(
                    format!("task[{i}].name"),
                    format!(
                        "{:?} is used by an earlier task; names must be unique",
                        t.name
                    ),
                ));
            }
            tasks.push(draft);
        }
        let sum = Amount::sum(tasks.iter().map(|t: &TaskDraft| &t.task.budget))
            .map_err(|_| err("budget", "task budgets overflow"))?;
        let budget = match raw.budget {
            Some(b) if b != sum.0 => {
                return Err(err(
                    "budget",
                    format!("is {b} but the task budgets add up to {sum}: make them agree"),
                ));
            }
            _ => sum,
        };
        if budget.0 == 0 {
            return Err(err("budget", "must be more than 0 base units"));
        }
        let acceptance = raw
            .acceptance
            .iter()
            .enumerate()
            .map(|(i, m)| check_metric(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let evaluation = match &raw.evaluation {
            Some(e) => Some(check_evaluation(e, &tasks)?),
            None if !acceptance.is_empty() => {
                return Err(err(
                    "acceptance",
                    "nothing measures these metrics: add an [evaluation] with the evaluator \
                     that reports them",
                ));
            }
            None => None,
        };
        let early = match raw.early {
            None => None,
            Some(RawEarly {
                first_bids: Some(n),
                max_price: None,
            }) if n > 0 => Some(crate::job::Early::FirstBids(n)),
            Some(RawEarly {
                first_bids: None,
                max_price: Some(p),
            }) => Some(crate::job::Early::PriceAtMost(Amount(p))),
            Some(_) => {
                return Err(err(
                    "early",
                    "give exactly one of first_bids (at least 1) or max_price",
                ));
            }
        };
        let spot_check_ppm = match raw.spot_check {
            None => 0,
            Some(f) if (0.0..=1.0).contains(&f) => (f * f64::from(crate::spot::PPM)).round() as u32,
            Some(f) => {
                return Err(err(
                    "spot_check",
                    format!("is {f}: the fraction of tasks re-run to check them, from 0 to 1"),
                ));
            }
        };
        Ok(JobSpec {
            name: raw.name.unwrap_or_else(|| raw.tasks[0].name.clone()),
            early,
            spot_check_ppm,
            budget,
            deadline_ms,
            bid_window_ms,
            review_window_ms,
            acceptance,
            evaluation,
            tasks,
        })
    }

    /// Fills in the digests of local files with `hash(path) -> (digest, size)` and returns
    /// what the node publishes.
    pub fn resolve<E>(
        &self,
        mut hash: impl FnMut(&str) -> Result<(Digest, u64), E>,
    ) -> Result<OfferTemplate, (String, E)> {
        let mut tasks = Vec::with_capacity(self.tasks.len());
        for (i, draft) in self.tasks.iter().enumerate() {
            let mut task = draft.task.clone();
            if let Source::Path(p) = &draft.bundle {
                task.workload.digest = hash(p)
                    .map_err(|e| (format!("task[{i}].workload.bundle"), e))?
                    .0;
            }
            for (at, source) in &draft.inputs {
                let (digest, size_bytes) = match source {
                    Source::Digest { digest, size_bytes } => (*digest, *size_bytes),
                    Source::Path(p) => {
                        hash(p).map_err(|e| (format!("task[{i}].inputs[{at}].path"), e))?
                    }
                };
                if let Some(TaskInput::Staged(r)) = task.inputs.get_mut(*at) {
                    r.digest = digest;
                    r.size_bytes = size_bytes;
                }
            }
            tasks.push(task);
        }
        let evaluation = match &self.evaluation {
            None => None,
            Some(draft) => {
                let mut terms = draft.terms.clone();
                if let Source::Path(p) = &draft.bundle {
                    terms.evaluator = hash(p).map_err(|e| ("evaluation.bundle".into(), e))?.0;
                }
                for (i, source) in draft.held_out.iter().enumerate() {
                    if let Source::Path(p) = source {
                        terms.held_out[i].digest = hash(p)
                            .map_err(|e| (format!("evaluation.held_out[{i}].path"), e))?
                            .0;
                    }
                }
                Some(terms)
            }
        };
        Ok(OfferTemplate {
            name: Some(self.name.clone()),
            nonce: None,
            tasks,
            ttl_ms: self.bid_window_ms,
            deadline_ms: self.deadline_ms,
            review_window_ms: self.review_window_ms,
            acceptance: self.acceptance.clone(),
            evaluation,
            early: self.early,
            spot_check_ppm: self.spot_check_ppm,
        })
    }
}

fn check_metric(i: usize, m: &RawMetric) -> Result<AcceptanceMetric, SpecError> {
    let field = format!("acceptance[{i}]");
    let (comparison, value, baseline) = match (
        m.at_least,
        m.at_most,
        m.baseline,
        m.above_baseline,
        m.below_baseline,
    ) {
        (Some(v), None, None, None, None) => (Comparison::AtLeast, v, None),
        (None, Some(v), None, None, None) => (Comparison::AtMost, v, None),
        (None, None, Some(b), Some(v), None) => (Comparison::AtLeast, v, Some(b)),
        (None, None, Some(b), None, Some(v)) => (Comparison::AtMost, v, Some(b)),
        _ => {
            return Err(err(
                field,
                "give exactly one of at_least = N, at_most = N, or baseline = B with one of \
                 above_baseline = D or below_baseline = D",
            ));
        }
    };
    if baseline.is_some() && value < 0.0 {
        return Err(err(
            field,
            "the improvement on the baseline cannot be negative",
        ));
    }
    let fixed = |v: f64| {
        let scaled = v * Fixed::SCALE as f64;
        if !scaled.is_finite() || scaled.abs() > 9.0e15 {
            return Err(err(field.clone(), "threshold out of range"));
        }
        // Rounded to the six decimals a signed threshold holds.
        Ok(Fixed(scaled.round() as i64))
    };
    if m.metric.is_empty() {
        return Err(err(
            format!("{field}.metric"),
            "name the metric the evaluator reports",
        ));
    }
    Ok(AcceptanceMetric {
        name: m.metric.clone(),
        comparison,
        threshold: fixed(value)?,
        baseline: baseline.map(fixed).transpose()?,
    })
}

fn check_evaluation(e: &RawEvaluation, tasks: &[TaskDraft]) -> Result<EvaluationDraft, SpecError> {
    let f = |s: &str| format!("evaluation.{s}");
    let bundle = match (&e.digest, &e.bundle) {
        (Some(d), None) => Source::Digest {
            digest: parse_digest(&f("digest"), d)?,
            size_bytes: 0,
        },
        (None, Some(p)) => Source::Path(p.clone()),
        _ => {
            return Err(err(
                "evaluation",
                "give exactly one of digest = \"<sha256>\" or bundle = \"path/to/evaluator.tar\"",
            ));
        }
    };
    if e.entrypoint.is_empty() {
        return Err(err(
            f("entrypoint"),
            "name the evaluator's command, e.g. [\"python3\", \"evaluate.py\"]",
        ));
    }
    let wall_ms = match &e.timeout {
        Some(v) => parse_duration_ms(v).map_err(|x| err(f("timeout"), x.to_string()))?,
        None => DEFAULT_EVALUATION_TIMEOUT_MS,
    };
    if wall_ms == 0 {
        return Err(err(f("timeout"), "must be longer than 0 (e.g. \"5m\")"));
    }
    let memory_bytes = size_field(&f("memory"), &e.memory, DEFAULT_EVALUATION_MEMORY)?;
    if memory_bytes < 16 << 20 {
        return Err(err(f("memory"), "give the evaluator at least 16MiB"));
    }
    let max_input_bytes = size_field(&f("max_input"), &e.max_input, DEFAULT_EVALUATION_INPUT)?;
    let mut held_out = Vec::with_capacity(e.held_out.len());
    let mut sources = Vec::with_capacity(e.held_out.len());
    for (i, h) in e.held_out.iter().enumerate() {
        let field = f(&format!("held_out[{i}]"));
        let source = match (&h.path, &h.digest, &h.from) {
            (Some(p), None, None) => Source::Path(p.clone()),
            (None, Some(d), None) => Source::Digest {
                digest: parse_digest(&format!("{field}.digest"), d)?,
                size_bytes: 0,
            },
            _ => {
                return Err(err(
                    field,
                    "give exactly one of path = \"local/file\" or digest = \"<sha256>\" \
                     (held-out data stays on this node)",
                ));
            }
        };
        held_out.push(NamedDigest {
            name: h.name.clone(),
            digest: match &source {
                Source::Digest { digest, .. } => *digest,
                Source::Path(_) => Digest([0; 32]),
            },
        });
        sources.push(source);
    }
    let configuration = e
        .configuration
        .iter()
        .map(|(k, v)| {
            let value = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    v.to_string()
                }
                _ => {
                    return Err(err(
                        f(&format!("configuration.{k}")),
                        "give a string, number or boolean",
                    ));
                }
            };
            Ok(Setting {
                key: k.clone(),
                value,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut artifacts = Vec::with_capacity(e.artifacts.len());
    for (i, a) in e.artifacts.iter().enumerate() {
        let field = f(&format!("artifact[{i}]"));
        let format = a.format.unwrap_or(if a.output.ends_with(".safetensors") {
            ArtifactFormat::Safetensors
        } else {
            ArtifactFormat::Bytes
        });
        artifacts.push(ArtifactCheck {
            output: a.output.clone(),
            format,
            max_size_bytes: parse_size(&a.max_size)
                .map_err(|x| err(format!("{field}.max_size"), x.to_string()))?,
            tensors: a
                .tensors
                .iter()
                .map(|t| TensorCheck {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                    shape: t.shape.clone(),
                })
                .collect(),
        });
    }
    let terms = EvaluationTerms {
        evaluator: match &bundle {
            Source::Digest { digest, .. } => *digest,
            Source::Path(_) => Digest([0; 32]),
        },
        entrypoint: e.entrypoint.clone(),
        held_out,
        configuration,
        limits: EvaluationLimits {
            wall_ms,
            memory_bytes,
            max_input_bytes,
        },
        artifacts,
        confirm: e.confirm,
    };
    terms
        .validate(
            tasks
                .iter()
                .flat_map(|t| t.task.outputs.iter().map(|o| o.name.as_str())),
        )
        .map_err(|x| err(x.field.to_string(), x.reason.to_string()))?;
    Ok(EvaluationDraft {
        terms,
        bundle,
        held_out: sources,
    })
}

fn parse_digest(field: &str, v: &str) -> Result<Digest, SpecError> {
    v.parse().map_err(|_| {
        err(
            field,
            format!("{v:?} is not a SHA-256 digest (64 hex digits, `sha256sum FILE`)"),
        )
    })
}

fn size_field(field: &str, v: &Option<String>, default: u64) -> Result<u64, SpecError> {
    match v {
        Some(v) => parse_size(v).map_err(|e| err(field, e.to_string())),
        None => Ok(default),
    }
}

fn cpu_millicores(field: &str, v: &Option<toml::Value>) -> Result<u32, SpecError> {
    let text = match v {
        None => return Ok(DEFAULT_CPU_MILLICORES),
        Some(toml::Value::Integer(n)) => n.to_string(),
        Some(toml::Value::Float(f)) => format!("{f}"),
        Some(toml::Value::String(s)) => s.clone(),
        Some(_) => {
            return Err(err(
                field,
                "give cores as a number, e.g. cpu = 2 or cpu = 0.5",
            ));
        }
    };
    let bad = || {
        err(
            field,
            format!("{text:?} is not a core count (e.g. 2, 0.5, \"1.25\")"),
        )
    };
    let (int, frac) = text.split_once('.').unwrap_or((&text, ""));
    if frac.len() > 3 || int.is_empty() {
        return Err(bad());
    }
    let int: u32 = int.parse().map_err(|_| bad())?;
    let frac: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<3}").parse().map_err(|_| bad())?
    };
    let m = int
        .checked_mul(1000)
        .and_then(|m| m.checked_add(frac))
        .ok_or_else(bad)?;
    if m == 0 {
        return Err(err(field, "must be more than 0 cores"));
    }
    Ok(m)
}

fn check_task(
    i: usize,
    t: &RawTask,
    names: &BTreeMap<&str, usize>,
    earlier: &[TaskDraft],
    task_count: usize,
    job_budget: Option<u64>,
) -> Result<TaskDraft, SpecError> {
    let f = |name: &str| format!("task[{i}].{name}");
    if !is_safe_name(&t.name) {
        return Err(err(f("name"), "use 1-255 of A-Z a-z 0-9 . _ -"));
    }
    if t.group_size == 0 {
        return Err(err(f("group_size"), "must be at least 1"));
    }
    if t.restarts > cannabis_protocol::MAX_RESTARTS {
        return Err(err(
            f("restarts"),
            format!("at most {}", cannabis_protocol::MAX_RESTARTS),
        ));
    }
    let budget = match (t.budget, job_budget) {
        (Some(b), _) => b,
        (None, Some(b)) if task_count == 1 => b,
        (None, _) => {
            return Err(err(
                f("budget"),
                "each task of a task graph needs its own budget (they add up to the job's)",
            ));
        }
    };
    if budget < u64::from(t.group_size) {
        return Err(err(
            f("budget"),
            "must give every rank of the group at least 1 base unit",
        ));
    }
    // Workload.
    let w = &t.workload;
    let bundle = match (&w.digest, &w.bundle) {
        (Some(d), None) => Source::Digest {
            digest: parse_digest(&f("workload.digest"), d)?,
            size_bytes: 0,
        },
        (None, Some(p)) => Source::Path(p.clone()),
        (None, None) if w.adapter == AdapterKind::Synthetic => Source::Digest {
            digest: Digest([0; 32]),
            size_bytes: 0,
        },
        _ => {
            return Err(err(
                f("workload"),
                "give exactly one of digest = \"<sha256>\" or bundle = \"path/to/bundle.tar\"",
            ));
        }
    };
    if w.adapter != AdapterKind::Synthetic && w.entrypoint.is_empty() {
        return Err(err(
            f("workload.entrypoint"),
            "say what to run, e.g. [\"python3\", \"main.py\"]",
        ));
    }
    // Resources.
    let r = &t.resources;
    let resources = Resources {
        cpu_millicores: cpu_millicores(&f("resources.cpu"), &r.cpu)?,
        memory_bytes: size_field(&f("resources.memory"), &r.memory, DEFAULT_MEMORY)?,
        swap_bytes: size_field(&f("resources.swap"), &r.swap, 0)?,
        processes: r.processes.unwrap_or(DEFAULT_PROCESSES),
        storage_bytes: size_field(&f("resources.storage"), &r.storage, DEFAULT_STORAGE)?,
        gpus: r.gpus,
    };
    if resources.memory_bytes == 0 || resources.processes == 0 || resources.storage_bytes == 0 {
        return Err(err(
            f("resources"),
            "memory, processes and storage must be more than 0",
        ));
    }
    // Requirements.
    let q = &t.requirements;
    if resources.gpus == 0 && (q.gpu_vendor.is_some() || q.gpu_memory.is_some()) {
        return Err(err(
            f("requirements.gpu_vendor"),
            "GPU requirements need GPUs: set resources.gpus = 1 or more, or drop them",
        ));
    }
    let challenge_verifiers = q
        .challenge_verifiers
        .iter()
        .map(|a| {
            a.parse::<Address>()
                .map_err(|e| err(f("requirements.challenge_verifiers"), format!("{a:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if !challenge_verifiers.is_empty() && q.challenge_max_age.is_none() {
        return Err(err(
            f("requirements.challenge_verifiers"),
            "only means something with challenge_max_age (e.g. \"1d\")",
        ));
    }
    let requirements = Requirements {
        gpu_vendor: q.gpu_vendor,
        min_gpu_memory_bytes: size_field(&f("requirements.gpu_memory"), &q.gpu_memory, 0)?,
        runtimes: q
            .runtimes
            .iter()
            .map(|(name, min_version)| RuntimeRequirement {
                name: name.clone(),
                min_version: min_version.clone(),
            })
            .collect(),
        collectives: q.collectives.clone(),
        isolation: q.isolation.clone(),
        confidential: q.confidential,
        max_challenge_age_ms: match &q.challenge_max_age {
            Some(v) => Some(
                parse_duration_ms(v)
                    .map_err(|e| err(f("requirements.challenge_max_age"), e.to_string()))?,
            ),
            None => None,
        },
        challenge_verifiers,
    };
    // Dependencies, by name, on earlier tasks.
    let mut depends_on = Vec::new();
    for d in &t.depends_on {
        match names.get(d.as_str()) {
            Some(&j) if !depends_on.contains(&(j as u32)) => depends_on.push(j as u32),
            Some(_) => return Err(err(f("depends_on"), format!("{d:?} is listed twice"))),
            None => {
                return Err(err(
                    f("depends_on"),
                    format!(
                        "no earlier task named {d:?}: list tasks so that dependencies come first"
                    ),
                ));
            }
        }
    }
    // Outputs.
    let mut outputs = Vec::new();
    for (k, o) in t.outputs.iter().enumerate() {
        if !is_safe_name(&o.name) {
            return Err(err(
                f(&format!("outputs[{k}].name")),
                "use 1-255 of A-Z a-z 0-9 . _ -",
            ));
        }
        if outputs.iter().any(|x: &OutputDecl| x.name == o.name) {
            return Err(err(
                f(&format!("outputs[{k}].name")),
                format!("{:?} is declared twice", o.name),
            ));
        }
        outputs.push(OutputDecl {
            name: o.name.clone(),
            max_bytes: size_field(
                &f(&format!("outputs[{k}].max_size")),
                &Some(o.max_size.clone()),
                0,
            )?,
            rights: o.rights,
        });
    }
    // Inputs: a local path, a pinned digest, or an earlier task's output.
    let mut inputs = Vec::new();
    let mut sources = Vec::new();
    for (k, input) in t.inputs.iter().enumerate() {
        let field = f(&format!("inputs[{k}]"));
        if !is_safe_name(&input.name) {
            return Err(err(
                format!("{field}.name"),
                "use 1-255 of A-Z a-z 0-9 . _ -",
            ));
        }
        match (&input.path, &input.digest, &input.from) {
            (Some(p), None, None) => {
                sources.push((inputs.len(), Source::Path(p.clone())));
                inputs.push(TaskInput::Staged(InputRef {
                    name: input.name.clone(),
                    digest: Digest([0; 32]),
                    size_bytes: 0,
                }));
            }
            (None, Some(d), None) => {
                let size = match &input.size {
                    Some(s) => {
                        parse_size(s).map_err(|e| err(format!("{field}.size"), e.to_string()))?
                    }
                    None => {
                        return Err(err(
                            format!("{field}.size"),
                            "a pinned input needs its size (e.g. \"12MiB\" or bytes)",
                        ));
                    }
                };
                let digest = parse_digest(&format!("{field}.digest"), d)?;
                sources.push((
                    inputs.len(),
                    Source::Digest {
                        digest,
                        size_bytes: size,
                    },
                ));
                inputs.push(TaskInput::Staged(InputRef {
                    name: input.name.clone(),
                    digest,
                    size_bytes: size,
                }));
            }
            (None, None, Some(from)) => {
                let Some((task, output)) = from.split_once(':') else {
                    return Err(err(
                        format!("{field}.from"),
                        "write \"task:output\", e.g. \"train:model.pt\"",
                    ));
                };
                let Some(&j) = names.get(task) else {
                    return Err(err(
                        format!("{field}.from"),
                        format!("no earlier task named {task:?}"),
                    ));
                };
                if !depends_on.contains(&(j as u32)) {
                    return Err(err(
                        format!("{field}.from"),
                        format!("add {task:?} to depends_on"),
                    ));
                }
                if !earlier[j].task.outputs.iter().any(|o| o.name == output) {
                    return Err(err(
                        format!("{field}.from"),
                        format!("task {task:?} declares no output {output:?}"),
                    ));
                }
                inputs.push(TaskInput::FromTask {
                    task: j as u32,
                    output: output.to_string(),
                    name: input.name.clone(),
                });
            }
            _ => {
                return Err(err(
                    field,
                    "give exactly one of path = \"file\", digest = \"<sha256>\" (with size), or from = \"task:output\"",
                ));
            }
        }
    }
    let checkpoint = match &t.checkpoint {
        None => None,
        Some(c) => {
            if !w.adapter.runs_a_bundle() {
                return Err(err(
                    f("checkpoint"),
                    "only a program of the requester's (process or torchrun) keeps a checkpoint",
                ));
            }
            if !is_safe_name(&c.name) {
                return Err(err(f("checkpoint.name"), "use 1-255 of A-Z a-z 0-9 . _ -"));
            }
            let taken = outputs
                .iter()
                .map(|o| o.name.as_str())
                .chain(inputs.iter().map(|i| match i {
                    TaskInput::Staged(r) => r.name.as_str(),
                    TaskInput::FromTask { name, .. } => name.as_str(),
                }));
            if let Some(other) = taken.into_iter().find(|n| *n == c.name) {
                return Err(err(
                    f("checkpoint.name"),
                    format!("{other:?} names an output or an input of the task already"),
                ));
            }
            let field = f("checkpoint.max_size");
            let max = size_field(&field, &c.max_size, resources.storage_bytes)?;
            if max == 0 || max > resources.storage_bytes {
                return Err(err(
                    field,
                    format!(
                        "from 1 byte to the rank's storage ({} bytes)",
                        resources.storage_bytes
                    ),
                ));
            }
            Some(OutputDecl {
                name: c.name.clone(),
                max_bytes: max,
                rights: OutputRights::Exclusive,
            })
        }
    };
    let digest = match &bundle {
        Source::Digest { digest, .. } => *digest,
        Source::Path(_) => Digest([0; 32]),
    };
    Ok(TaskDraft {
        task: TaskSpec {
            name: t.name.clone(),
            workload: Workload {
                adapter: w.adapter,
                digest,
                entrypoint: w.entrypoint.clone(),
            },
            inputs,
            outputs,
            resources,
            requirements,
            group_size: t.group_size,
            depends_on,
            budget: Amount(budget),
            restarts: t.restarts,
            checkpoint,
        },
        bundle,
        inputs: sources,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(name: &str) -> String {
        std::fs::read_to_string(format!(
            "{}/../docs/examples/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    }

    fn error(text: &str) -> SpecError {
        JobSpec::parse(text).unwrap_err()
    }

    const MINIMAL: &str = r#"
deadline = "1h"
budget = 1000
[[task]]
name = "t"
[task.workload]
adapter = "synthetic"
"#;

    #[test]
    fn the_examples_parse() {
        let s = JobSpec::parse(&example("synthetic.toml")).unwrap();
        assert_eq!(s.budget, Amount(200_000));
        assert_eq!(s.tasks[0].task.resources.memory_bytes, 256 << 20);
        assert_eq!(s.bid_window_ms, 10_000);

        let s = JobSpec::parse(&example("train.toml")).unwrap();
        let t = &s.tasks[0];
        assert_eq!(t.bundle, Source::Path("train-bundle.tar".into()));
        assert_eq!(t.task.requirements.min_gpu_memory_bytes, 24 << 30);
        assert_eq!(t.task.requirements.max_challenge_age_ms, Some(86_400_000));
        assert_eq!(t.task.requirements.runtimes.len(), 2);
        assert_eq!(s.acceptance[0].threshold, Fixed(910_000));
        assert_eq!(s.acceptance[0].comparison, Comparison::AtLeast);
        let e = s.evaluation.as_ref().unwrap();
        assert_eq!(e.bundle, Source::Path("eval-bundle.tar".into()));
        assert!(e.terms.confirm);
        assert_eq!(e.terms.artifacts[0].format, ArtifactFormat::Safetensors);

        let s = JobSpec::parse(&example("numpy-train/job.toml")).unwrap();
        let loss = &s.acceptance[1];
        assert_eq!(loss.baseline, Some(Fixed(1_098_600)));
        assert_eq!(loss.required(), Fixed(598_600));
        let e = s.evaluation.as_ref().unwrap();
        assert_eq!(e.held_out, vec![Source::Path("heldout.npy".into())]);
        assert_eq!(e.terms.configuration[0].key, "hidden");
        assert_eq!(e.terms.artifacts[0].tensors[2].shape, vec![32, 3]);
        assert_eq!(e.terms.limits.wall_ms, 120_000);

        let s = JobSpec::parse(&example("pipeline.toml")).unwrap();
        assert_eq!(s.budget, Amount(3_250_000));
        assert_eq!(s.tasks[1].task.group_size, 3);
        assert_eq!(s.tasks[2].task.depends_on, vec![1]);
        assert_eq!(
            s.tasks[2].task.inputs[0],
            TaskInput::FromTask {
                task: 1,
                output: "model.safetensors".into(),
                name: "model.safetensors".into()
            }
        );
    }

    #[test]
    fn local_files_are_hashed_by_the_caller() {
        let s = JobSpec::parse(&example("train.toml")).unwrap();
        let mut asked = Vec::new();
        let t = s
            .resolve(|p| {
                asked.push(p.to_string());
                Ok::<_, ()>((Digest([7; 32]), 42))
            })
            .unwrap();
        // The evaluator's bundle and the held-out data are hashed (and kept) too.
        assert_eq!(asked, ["train-bundle.tar", "eval-bundle.tar", "test.bin"]);
        assert_eq!(t.tasks[0].workload.digest, Digest([7; 32]));
        let terms = t.evaluation.unwrap();
        assert_eq!(terms.evaluator, Digest([7; 32]));
        assert_eq!(terms.held_out[0].digest, Digest([7; 32]));
        assert_eq!(t.ttl_ms, 30_000);
        // A file that cannot be read names the field.
        let (field, ()) = s.resolve(|_| Err(())).unwrap_err();
        assert_eq!(field, "task[0].workload.bundle");
    }

    #[test]
    fn a_single_task_takes_the_job_budget() {
        let s = JobSpec::parse(MINIMAL).unwrap();
        assert_eq!(s.tasks[0].task.budget, Amount(1000));
        assert_eq!(s.tasks[0].task.resources.cpu_millicores, 1000);
    }

    #[test]
    fn a_spot_check_rate_is_a_fraction() {
        let rate = |v: &str| JobSpec::parse(&format!("spot_check = {v}\n{MINIMAL}"));
        assert_eq!(JobSpec::parse(MINIMAL).unwrap().spot_check_ppm, 0);
        assert_eq!(rate("0.25").unwrap().spot_check_ppm, 250_000);
        assert_eq!(rate("1.0").unwrap().spot_check_ppm, 1_000_000);
        let t = rate("0.1")
            .unwrap()
            .resolve(|_| Ok::<_, ()>((Digest([0; 32]), 0)));
        assert_eq!(t.unwrap().spot_check_ppm, 100_000);
        for bad in ["1.5", "-0.1"] {
            let e = rate(bad).unwrap_err();
            assert_eq!(e.field, "spot_check", "{e}");
        }
    }

    #[test]
    fn a_checkpoint_is_declared_by_name_with_a_cap_within_the_storage() {
        let process = MINIMAL.replace(
            "adapter = \"synthetic\"",
            "adapter = \"process\"\nbundle = \"b.tar\"\nentrypoint = [\"sh\", \"run.sh\"]",
        );
        let with = |decl: &str| process.replace("name = \"t\"", &format!("name = \"t\"\n{decl}"));
        let s = JobSpec::parse(&with(
            "checkpoint = { name = \"state\", max_size = \"1KiB\" }",
        ))
        .unwrap();
        let c = s.tasks[0].task.checkpoint.clone().unwrap();
        assert_eq!((c.name.as_str(), c.max_bytes), ("state", 1024));
        // The cap defaults to the rank's storage.
        let s = JobSpec::parse(&with("checkpoint = { name = \"state\" }")).unwrap();
        let t = &s.tasks[0].task;
        assert_eq!(
            t.checkpoint.as_ref().unwrap().max_bytes,
            t.resources.storage_bytes
        );
        for (decl, field) in [
            (
                "checkpoint = { name = \"../state\" }",
                "task[0].checkpoint.name",
            ),
            (
                "checkpoint = { name = \"state\", max_size = \"1TiB\" }",
                "task[0].checkpoint.max_size",
            ),
            (
                "checkpoint = { name = \"out\" }\n[[task.outputs]]\nname = \"out\"\nmax_size = \"1KiB\"",
                "task[0].checkpoint.name",
            ),
        ] {
            let e = error(&with(decl));
            assert_eq!(e.field, field, "{decl}: {e}");
        }
        // The synthetic task runs no program of the requester's to keep one.
        let e = error(&MINIMAL.replace(
            "name = \"t\"",
            "name = \"t\"\ncheckpoint = { name = \"state\" }",
        ));
        assert_eq!(e.field, "task[0].checkpoint");
    }

    #[test]
    fn errors_name_the_field_and_the_fix() {
        let cases = [
            (MINIMAL.replace("1h", "soon"), "deadline"),
            (
                MINIMAL.replace(
                    "deadline = \"1h\"",
                    "deadline = \"5s\"\nbid_window = \"10s\"",
                ),
                "deadline",
            ),
            (MINIMAL.replace("synthetic", "quantum"), "line"),
            (
                MINIMAL.replace("name = \"t\"", "name = \"t\"\nflavour = 1"),
                "line",
            ),
            (
                MINIMAL.replace("name = \"t\"", "name = \"../t\""),
                "task[0].name",
            ),
            (
                MINIMAL.replace("budget = 1000", "budget = 0"),
                "task[0].budget",
            ),
            (
                format!("{MINIMAL}[task.resources]\nmemory = \"lots\"\n"),
                "task[0].resources.memory",
            ),
            (
                format!("{MINIMAL}[task.resources]\ncpu = \"0.0001\"\n"),
                "task[0].resources.cpu",
            ),
            (
                format!("{MINIMAL}[task.requirements]\ngpu_memory = \"24GiB\"\n"),
                "task[0].requirements.gpu_vendor",
            ),
            (
                MINIMAL.replace(
                    "adapter = \"synthetic\"",
                    "adapter = \"process\"\ndigest = \"00\"\nentrypoint=[\"x\"]",
                ),
                "task[0].workload.digest",
            ),
            (
                MINIMAL.replace(
                    "adapter = \"synthetic\"",
                    "adapter = \"process\"\nbundle = \"b.tar\"",
                ),
                "task[0].workload.entrypoint",
            ),
            (
                format!("{MINIMAL}[[task.inputs]]\nname = \"x\"\nfrom = \"nope:out\"\n"),
                "task[0].inputs[0].from",
            ),
            (
                format!("{MINIMAL}[[task.inputs]]\nname = \"x\"\n"),
                "task[0].inputs[0]",
            ),
            (
                format!("{MINIMAL}[[acceptance]]\nmetric = \"acc\"\n"),
                "acceptance[0]",
            ),
            (
                format!("{MINIMAL}[[acceptance]]\nmetric = \"acc\"\nat_least = 1\n"),
                "acceptance",
            ),
            (
                format!(
                    "{MINIMAL}[[acceptance]]\nmetric = \"acc\"\nbaseline = 0.5\nabove_baseline = -1\n"
                ),
                "acceptance[0]",
            ),
            (
                format!("{MINIMAL}[evaluation]\nentrypoint = [\"x\"]\n"),
                "evaluation",
            ),
            (
                format!("{MINIMAL}[evaluation]\nbundle = \"e.tar\"\n"),
                "evaluation.entrypoint",
            ),
            (
                format!(
                    "{MINIMAL}[evaluation]\nbundle = \"e.tar\"\nentrypoint = [\"x\"]\n\
                     [[evaluation.artifact]]\noutput = \"nothing\"\nmax_size = \"1KiB\"\n"
                ),
                "evaluation.artifacts.output",
            ),
            (
                format!(
                    "{MINIMAL}[evaluation]\nbundle = \"e.tar\"\nentrypoint = [\"x\"]\n\
                     [[evaluation.held_out]]\nname = \"configuration.json\"\npath = \"c\"\n"
                ),
                "evaluation.held_out.name",
            ),
            (
                format!(
                    "{MINIMAL}[evaluation]\nbundle = \"e.tar\"\nentrypoint = [\"x\"]\ntimeout = \"0s\"\n"
                ),
                "evaluation.timeout",
            ),
        ];
        for (text, field) in cases {
            let e = error(&text);
            assert!(e.field.starts_with(field), "{field}: got {e}");
            assert!(!e.problem.is_empty());
        }
        // Syntax and unknown keys point at the line.
        let e = error(&MINIMAL.replace("name = \"t\"", "name = \"t\"\nflavour = 1"));
        assert_eq!(e.field, "line 6");
        assert!(e.problem.contains("flavour"), "{e}");
        // Graph errors: a dependency that comes later, budgets that disagree.
        let graph = r#"
deadline = "1h"
budget = 10
[[task]]
name = "a"
budget = 4
depends_on = ["b"]
[task.workload]
adapter = "synthetic"
[[task]]
name = "b"
budget = 5
[task.workload]
adapter = "synthetic"
"#;
        let e = error(graph);
        assert_eq!(e.field, "task[0].depends_on");
        assert!(e.problem.contains("dependencies come first"), "{e}");
        let e = error(&graph.replace("depends_on = [\"b\"]", ""));
        assert_eq!(e.field, "budget");
        assert!(e.problem.contains("add up to 9"), "{e}");
        let e = error(
            &graph
                .replace("depends_on = [\"b\"]", "")
                .replace("budget = 4\n", ""),
        );
        assert_eq!(e.field, "task[0].budget");
    }
}
