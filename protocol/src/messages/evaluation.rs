//! Trust in outputs: the evaluation terms an offer pins (the evaluator, the held-out data,
//! the agreed configuration, limits and artifact checks) and the requester's signed
//! [`Evaluation`] of a delivery against them.
//!
//! An artifact's hash proves which bytes were delivered, not that they are any good: the
//! evaluator, run by the requester on data the workers never see, is what measures quality.

use serde::{Deserialize, Serialize};

use super::{AcceptanceMetric, MetricValue, NamedDigest, Setting, wire};
use crate::{Address, Digest, Fixed, Invalid, Message, Timestamp, Uuid};

/// Most artifact checks, held-out files, settings or metrics in one set of terms.
pub const MAX_EVALUATION_ITEMS: usize = 64;
/// Most tensors one artifact check names.
pub const MAX_TENSOR_CHECKS: usize = 256;
/// Most dimensions of one tensor's shape.
pub const MAX_TENSOR_RANK: usize = 8;
/// The file the evaluator writes its metrics to, in its work directory.
pub const EVALUATION_METRICS: &str = "metrics.json";
/// The staged input holding the agreed configuration as a JSON object.
pub const EVALUATION_CONFIGURATION: &str = "configuration.json";

/// How the requester judges a delivery: pinned in the offer, so the workers bid knowing it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EvaluationTerms {
    /// SHA-256 of the evaluator's program bundle (a tar file), run with the `process`
    /// adapter's rules on the requester's node.
    pub evaluator: Digest,
    /// Command and arguments inside the evaluator's bundle.
    pub entrypoint: Vec<String>,
    /// The held-out data, by staged file name and digest. The requester keeps it; it is
    /// never sent to a worker.
    pub held_out: Vec<NamedDigest>,
    /// The agreed architecture and configuration, staged for the evaluator as
    /// `configuration.json` (one JSON object of these keys and values).
    pub configuration: Vec<Setting>,
    /// What the evaluator may take.
    pub limits: EvaluationLimits,
    /// Checks of the delivered artifacts made before the evaluator runs.
    pub artifacts: Vec<ArtifactCheck>,
    /// Whether a passing evaluation waits for the requester's confirmation before it
    /// accepts (a failing one disputes at once either way).
    pub confirm: bool,
}

/// The evaluator's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EvaluationLimits {
    /// Wall time, in milliseconds; an evaluator still running then is stopped.
    pub wall_ms: u64,
    /// Memory, in bytes.
    pub memory_bytes: u64,
    /// Most bytes of delivered outputs and held-out data together it is given.
    pub max_input_bytes: u64,
}

/// A check of one delivered output before evaluation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ArtifactCheck {
    /// The output, by its declared name.
    pub output: String,
    /// Its format.
    pub format: ArtifactFormat,
    /// Its largest size, in bytes.
    pub max_size_bytes: u64,
    /// For safetensors: tensors that must be present, each with its dtype and shape.
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<TensorCheck>(), 0..4)"
        )
    )]
    pub tensors: Vec<TensorCheck>,
}

/// Formats an artifact check knows. None of them executes code when loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum ArtifactFormat {
    /// A safetensors file: a JSON header of tensors, then their bytes.
    Safetensors,
    /// Any bytes (only the size is checked; pickles are refused by every output check).
    Bytes,
}

/// A tensor a safetensors artifact must hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct TensorCheck {
    /// Its name in the header.
    pub name: String,
    /// Its dtype as safetensors spells it (`F32`, `BF16`, `I8`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
}

impl EvaluationTerms {
    /// Checks the terms' own shape; `outputs` are every output name the offer's tasks
    /// declare.
    pub fn validate<'a>(
        &self,
        outputs: impl Iterator<Item = &'a str> + Clone,
    ) -> Result<(), Invalid> {
        if self.entrypoint.is_empty() || self.entrypoint.iter().any(String::is_empty) {
            return Err(Invalid::new(
                "evaluation.entrypoint",
                "names the command to run",
            ));
        }
        if self.limits.wall_ms == 0 || self.limits.memory_bytes == 0 {
            return Err(Invalid::new(
                "evaluation.limits",
                "wall time and memory must be above 0",
            ));
        }
        if [
            self.held_out.len(),
            self.configuration.len(),
            self.artifacts.len(),
        ]
        .iter()
        .any(|n| *n > MAX_EVALUATION_ITEMS)
        {
            return Err(Invalid::new(
                "evaluation",
                format!("holds more than {MAX_EVALUATION_ITEMS} of one kind of item"),
            ));
        }
        let mut staged = std::collections::BTreeSet::new();
        for h in &self.held_out {
            if !super::is_safe_name(&h.name) || h.name == EVALUATION_CONFIGURATION {
                return Err(Invalid::new(
                    "evaluation.held_out.name",
                    format!("{:?} is not a plain file name of its own", h.name),
                ));
            }
            if outputs.clone().any(|o| o == h.name) {
                return Err(Invalid::new(
                    "evaluation.held_out.name",
                    format!("{:?} is also an output's name", h.name),
                ));
            }
            if !staged.insert(h.name.as_str()) {
                return Err(Invalid::new(
                    "evaluation.held_out.name",
                    format!("{:?} appears twice", h.name),
                ));
            }
        }
        let mut keys = std::collections::BTreeSet::new();
        for s in &self.configuration {
            if !keys.insert(s.key.as_str()) {
                return Err(Invalid::new(
                    "evaluation.configuration",
                    format!("{:?} appears twice", s.key),
                ));
            }
        }
        let mut checked = std::collections::BTreeSet::new();
        for a in &self.artifacts {
            if !outputs.clone().any(|o| o == a.output) {
                return Err(Invalid::new(
                    "evaluation.artifacts.output",
                    format!("no task declares an output {:?}", a.output),
                ));
            }
            if !checked.insert(a.output.as_str()) {
                return Err(Invalid::new(
                    "evaluation.artifacts.output",
                    format!("{:?} is checked twice", a.output),
                ));
            }
            if a.tensors.len() > MAX_TENSOR_CHECKS {
                return Err(Invalid::new(
                    "evaluation.artifacts.tensors",
                    format!("more than {MAX_TENSOR_CHECKS}"),
                ));
            }
            if a.format != ArtifactFormat::Safetensors && !a.tensors.is_empty() {
                return Err(Invalid::new(
                    "evaluation.artifacts.tensors",
                    "only a safetensors artifact holds tensors",
                ));
            }
            if a.tensors.iter().any(|t| t.shape.len() > MAX_TENSOR_RANK) {
                return Err(Invalid::new(
                    "evaluation.artifacts.tensors.shape",
                    format!("more than {MAX_TENSOR_RANK} dimensions"),
                ));
            }
        }
        Ok(())
    }
}

impl AcceptanceMetric {
    /// The value a delivery must reach: the threshold itself, or with a baseline, the
    /// baseline improved by the threshold (raised for `at-least`, lowered for `at-most`).
    pub fn required(&self) -> Fixed {
        match self.baseline {
            None => self.threshold,
            Some(b) => Fixed(match self.comparison {
                super::Comparison::AtLeast => b.0.saturating_add(self.threshold.0),
                super::Comparison::AtMost => b.0.saturating_sub(self.threshold.0),
            }),
        }
    }

    /// Whether `value` meets this metric.
    pub fn passes(&self, value: Fixed) -> bool {
        self.comparison.passes(value, self.required())
    }
}

/// The requester's signed evaluation of a job's deliveries: what was evaluated, with what,
/// what it measured and how that compares with each criterion. It joins the job's record
/// and is the evidence of any dispute it opens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Evaluation {
    /// The job.
    pub job_id: Uuid,
    /// The requester; must be the signer.
    pub requester: Address,
    /// The evaluator's bundle digest, as the offer pinned it.
    pub evaluator: Digest,
    /// The held-out data, as the offer pinned it.
    pub held_out: Vec<NamedDigest>,
    /// The deliveries evaluated: each signed manifest's id with its task, rank and epoch.
    pub deliveries: Vec<EvaluatedDelivery>,
    /// The delivered outputs the evaluator was given, by staged name and digest.
    pub inputs: Vec<NamedDigest>,
    /// What the evaluator measured (empty when it did not finish).
    pub metrics: Vec<MetricValue>,
    /// Each acceptance metric, judged.
    pub criteria: Vec<Criterion>,
    /// The verdict.
    pub outcome: EvaluationOutcome,
    /// Why, for people: the first failed check or criterion, or why nothing was measured.
    pub reason: String,
    /// When the evaluation ended.
    pub issued_at: Timestamp,
}

/// One delivery an [`Evaluation`] covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EvaluatedDelivery {
    /// Task index.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// Lease epoch delivered at.
    pub epoch: u64,
    /// The id of the worker's signed delivery manifest.
    pub manifest: Digest,
}

/// One acceptance metric against what was measured.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Criterion {
    /// The metric's name.
    pub metric: String,
    /// How it is compared.
    pub comparison: super::Comparison,
    /// The value it had to reach ([`AcceptanceMetric::required`]).
    pub required: Fixed,
    /// What was measured (`None`: the evaluator reported no such metric).
    pub value: Option<Fixed>,
    /// Whether it passed.
    pub passed: bool,
}

/// An evaluation's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum EvaluationOutcome {
    /// Every artifact check and every criterion passed.
    Passed,
    /// An artifact check or a criterion failed.
    Failed,
    /// The evaluator could not say: it failed, was stopped, or wrote no readable metrics.
    /// Never taken as a pass.
    NotEvaluated,
}

wire!(Evaluation, "evaluation", 64 * 1024);

impl Message for Evaluation {
    const DOMAIN: &'static str = "cannabis/evaluation/v1";

    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.requester)
    }

    fn validate(&self) -> Result<(), Invalid> {
        let passed = self.criteria.iter().all(|c| c.passed);
        match self.outcome {
            EvaluationOutcome::Passed if !passed => Err(Invalid::new(
                "outcome",
                "is passed while a criterion failed",
            )),
            EvaluationOutcome::Passed if self.deliveries.is_empty() => {
                Err(Invalid::new("deliveries", "a pass must cover a delivery"))
            }
            _ => Ok(()),
        }
    }
}

/// Metrics an evaluator wrote, judged against `acceptance`: each criterion, and whether
/// they all passed.
pub fn judge(acceptance: &[AcceptanceMetric], metrics: &[MetricValue]) -> (Vec<Criterion>, bool) {
    let criteria: Vec<Criterion> = acceptance
        .iter()
        .map(|m| {
            let value = metrics.iter().find(|v| v.name == m.name).map(|v| v.value);
            Criterion {
                metric: m.name.clone(),
                comparison: m.comparison,
                required: m.required(),
                value,
                passed: value.is_some_and(|v| m.passes(v)),
            }
        })
        .collect();
    let all = criteria.iter().all(|c| c.passed);
    (criteria, all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Comparison;

    fn metric(
        name: &str,
        comparison: Comparison,
        threshold: i64,
        baseline: Option<i64>,
    ) -> AcceptanceMetric {
        AcceptanceMetric {
            name: name.into(),
            comparison,
            threshold: Fixed(threshold),
            baseline: baseline.map(Fixed),
        }
    }

    fn measured(name: &str, value: i64) -> MetricValue {
        MetricValue {
            name: name.into(),
            value: Fixed(value),
        }
    }

    #[test]
    fn thresholds_and_baselines_are_judged_in_their_direction() {
        let terms = [
            metric("accuracy", Comparison::AtLeast, 900_000, None),
            // The loss must be 0.5 below an untrained model's 1.1.
            metric("loss", Comparison::AtMost, 500_000, Some(1_100_000)),
        ];
        let (c, ok) = judge(
            &terms,
            &[measured("accuracy", 950_000), measured("loss", 600_000)],
        );
        assert!(ok, "{c:?}");
        assert_eq!(c[1].required, Fixed(600_000));
        // The threshold met, the baseline not improved by enough.
        let (c, ok) = judge(
            &terms,
            &[measured("accuracy", 950_000), measured("loss", 600_001)],
        );
        assert!(!ok);
        assert!(c[0].passed && !c[1].passed);
        // Missed.
        let (_, ok) = judge(
            &terms,
            &[measured("accuracy", 899_999), measured("loss", 0)],
        );
        assert!(!ok);
        // A metric the evaluator did not report fails.
        let (c, ok) = judge(&terms, &[measured("accuracy", 950_000)]);
        assert!(!ok);
        assert_eq!(c[1].value, None);
        // Above a baseline, for a metric that should grow.
        let up = [metric(
            "accuracy",
            Comparison::AtLeast,
            300_000,
            Some(500_000),
        )];
        assert!(judge(&up, &[measured("accuracy", 800_000)]).1);
        assert!(!judge(&up, &[measured("accuracy", 799_999)]).1);
    }
}
