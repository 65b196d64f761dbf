//! Spot checks: a requester re-runs a fraction of its delivered tasks on other workers and
//! compares what came back.
//!
//! A hash in a delivery manifest proves which bytes a worker sent, not that they are the
//! task's result. For a synthetic task the requester checks the product itself (Freivalds'
//! method); for any other workload whose outputs are reproducible, the check is to run it
//! again elsewhere. When a delivered task is drawn, the requester's engine publishes a
//! *check job*: an ordinary offer of that one task (same workload, inputs, outputs and
//! budget) that excludes the worker who delivered it. Nothing on the wire says a job is a
//! check, and the draw is made from a secret of the requester's after the delivery, so a
//! worker cannot tell which of its deliveries will be checked.
//!
//! The check's outputs are compared with the delivery's, digest by digest:
//! - equal: the delivery stands;
//! - different: a second check job, excluding both workers, breaks the tie. The run that
//!   two others agree against is disputed with the three manifests named as evidence (the
//!   resolver decides, and a dispute settled against a worker is a strike placement
//!   weighs). When no two of the three agree, the workload is not reproducible: nothing is
//!   disputed and the requester is told.
//!
//! A check costs the requester another run of the task (two when the first disagrees),
//! paid like any other; the job's own budget is not touched. Groups (more than one rank),
//! tasks that read other tasks' outputs, and synthetic tasks (checked exactly) are not
//! drawn.

use std::collections::BTreeMap;

use cannabis_protocol::{Address, Digest, Uuid};
use serde::{Deserialize, Serialize};

/// Parts per million: a rate of 1,000,000 checks every task.
pub const PPM: u32 = 1_000_000;

/// How many runs a check holds at most: the delivery, the check, the tie-break.
pub const MAX_RUNS: usize = 3;

/// A job's spot checks: its rate, and for a check job, the task it re-runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotChecks {
    /// The fraction of delivered tasks re-run, in parts per million.
    #[serde(default)]
    pub rate_ppm: u32,
    /// For a check job: which job's task, and which of its runs, this job is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub of: Option<CheckOf>,
    /// The checks of this job's tasks, by task.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checks: BTreeMap<u32, SpotCheck>,
}

impl SpotChecks {
    /// Nothing set: no rate, not a check, no checks.
    pub fn is_empty(&self) -> bool {
        self.rate_ppm == 0 && self.of.is_none() && self.checks.is_empty()
    }

    /// Whether task `task` has a check under way (its delivery is not to be accepted
    /// automatically until it ends).
    pub fn pending(&self, task: u32) -> bool {
        self.checks.get(&task).is_some_and(|c| c.verdict.is_none())
    }
}

/// What a check job re-runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckOf {
    /// The checked job.
    pub job: Uuid,
    /// Its task.
    pub task: u32,
    /// Which run of the check this job is (1: the check, 2: the tie-break).
    pub run: u32,
}

/// One task's check: its runs (the delivery first) and, once decided, the verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotCheck {
    /// The delivery, then each check job's run.
    pub runs: Vec<CheckRun>,
    /// How it ended; `None` while a run is still out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<SpotVerdict>,
}

/// One run of a checked task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckRun {
    /// The job it ran in (the checked job for the delivery, a check job otherwise).
    pub job: Uuid,
    /// The task in that job.
    pub task: u32,
    /// How it came out; `None` while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<RunResult>,
}

/// What a run came to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunResult {
    /// A delivery: who, at which epoch, and its outputs' digests by name.
    Delivered {
        /// The worker.
        worker: Address,
        /// The delivered epoch.
        epoch: u64,
        /// Its manifest's message id (the evidence a dispute names).
        manifest: Digest,
        /// The outputs' digests, by name.
        outputs: BTreeMap<String, Digest>,
    },
    /// The check job ended without a delivery; why.
    Failed(String),
}

/// How a check ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpotVerdict {
    /// A re-run elsewhere delivered the same outputs.
    Agreed,
    /// Run `run` disagrees with two runs that agree with each other: its delivery is
    /// disputed.
    Caught {
        /// The index of the run caught in [`SpotCheck::runs`].
        run: u32,
    },
    /// Nothing can be said (a re-run failed, or no two runs agree); why.
    Undecided(String),
}

/// What a check needs next, from its runs so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// A run is still out.
    Wait,
    /// The two runs disagree: publish the tie-break.
    TieBreak,
    /// It is decided.
    Decided(SpotVerdict),
}

impl SpotCheck {
    /// A check of a delivery, no re-run published yet.
    pub fn new(delivery: CheckRun) -> Self {
        Self {
            runs: vec![delivery],
            verdict: None,
        }
    }

    /// The workers of the runs that delivered (each check job excludes them all).
    pub fn workers(&self) -> Vec<Address> {
        self.runs
            .iter()
            .filter_map(|r| match &r.result {
                Some(RunResult::Delivered { worker, .. }) => Some(*worker),
                _ => None,
            })
            .collect()
    }

    /// What comes next, from the runs so far: the decision rule of the module's docs.
    pub fn next(&self) -> Next {
        if self.runs.len() < 2 {
            return Next::Wait;
        }
        let mut outputs = Vec::with_capacity(self.runs.len());
        for r in &self.runs {
            match r.result.as_ref() {
                Some(RunResult::Delivered { outputs: o, .. }) => outputs.push(o),
                Some(RunResult::Failed(why)) => {
                    return Next::Decided(SpotVerdict::Undecided(format!(
                        "a re-run failed: {why}"
                    )));
                }
                None => return Next::Wait,
            }
        }
        match outputs.as_slice() {
            [a, b] if a == b => Next::Decided(SpotVerdict::Agreed),
            [_, _] => Next::TieBreak,
            [a, b, c] => {
                let odd = if a == b && b == c {
                    return Next::Decided(SpotVerdict::Agreed);
                } else if b == c {
                    0
                } else if a == c {
                    1
                } else if a == b {
                    2
                } else {
                    return Next::Decided(SpotVerdict::Undecided(
                        "no two of three runs delivered the same outputs: the workload's \
                         outputs are not reproducible, so a re-run cannot check it"
                            .into(),
                    ));
                };
                Next::Decided(SpotVerdict::Caught { run: odd })
            }
            _ => Next::Decided(SpotVerdict::Undecided("too many runs".into())),
        }
    }
}

/// Whether a task can be spot-checked: one rank, no inputs from other tasks, and not the
/// synthetic task (its product is checked exactly). The engine draws only these, and the
/// quote counts only these.
pub fn checkable(task: &cannabis_protocol::TaskSpec) -> bool {
    task.group_size <= 1
        && task.depends_on.is_empty()
        && task.workload.adapter != cannabis_protocol::AdapterKind::Synthetic
}

/// Whether task `task` of `job` is drawn for a check at `rate_ppm`: a keyed hash of the
/// job and task with the requester's secret, so workers cannot predict it and a restart
/// draws the same.
pub fn drawn(secret: &[u8; 32], job: &Uuid, task: u32, rate_ppm: u32) -> bool {
    if rate_ppm == 0 {
        return false;
    }
    if rate_ppm >= PPM {
        return true;
    }
    let mut bytes = b"cannabis/spot-check/v1/".to_vec();
    bytes.extend_from_slice(secret);
    bytes.extend_from_slice(&job.0);
    bytes.extend_from_slice(&task.to_le_bytes());
    let d = Digest::of(&bytes);
    let x = u64::from_le_bytes(d.0[..8].try_into().expect("8 bytes"));
    // x / 2^64 < rate / 10^6, without floating point.
    u128::from(x) * u128::from(PPM) < u128::from(rate_ppm) << 64
}

/// The nonce of check job `run` of `job`'s task `task`: the same on every retry, so a
/// restart that asks again finds the job already there.
pub fn check_nonce(job: &Uuid, task: u32, run: u32) -> Uuid {
    let mut bytes = b"cannabis/spot-check-job/v1/".to_vec();
    bytes.extend_from_slice(&job.0);
    bytes.extend_from_slice(&task.to_le_bytes());
    bytes.extend_from_slice(&run.to_le_bytes());
    let d = Digest::of(&bytes);
    Uuid::from_random(d.0[..16].try_into().expect("16 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(b: u8) -> Address {
        cannabis_protocol::Keypair::from_secret([b; 32]).address()
    }

    fn delivered(worker: u8, byte: u8) -> CheckRun {
        CheckRun {
            job: Uuid::from_random([worker; 16]),
            task: 0,
            result: Some(RunResult::Delivered {
                worker: addr(worker),
                epoch: 1,
                manifest: Digest([worker; 32]),
                outputs: BTreeMap::from([("out".to_string(), Digest([byte; 32]))]),
            }),
        }
    }

    fn check(runs: Vec<CheckRun>) -> SpotCheck {
        SpotCheck {
            runs,
            verdict: None,
        }
    }

    #[test]
    fn equal_outputs_agree_and_different_ones_ask_for_a_tie_break() {
        assert_eq!(check(vec![delivered(1, 7)]).next(), Next::Wait);
        let mut out = delivered(2, 7);
        out.result = None;
        assert_eq!(check(vec![delivered(1, 7), out]).next(), Next::Wait);
        assert_eq!(
            check(vec![delivered(1, 7), delivered(2, 7)]).next(),
            Next::Decided(SpotVerdict::Agreed)
        );
        assert_eq!(
            check(vec![delivered(1, 7), delivered(2, 8)]).next(),
            Next::TieBreak
        );
    }

    #[test]
    fn the_tie_break_catches_the_run_the_other_two_agree_against() {
        for (bytes, caught) in [([9, 7, 7], 0), ([7, 9, 7], 1), ([7, 7, 9], 2)] {
            let c = check(vec![
                delivered(1, bytes[0]),
                delivered(2, bytes[1]),
                delivered(3, bytes[2]),
            ]);
            assert_eq!(
                c.next(),
                Next::Decided(SpotVerdict::Caught { run: caught }),
                "{bytes:?}"
            );
        }
        let c = check(vec![delivered(1, 1), delivered(2, 2), delivered(3, 3)]);
        assert!(matches!(
            c.next(),
            Next::Decided(SpotVerdict::Undecided(why)) if why.contains("not reproducible")
        ));
        let mut failed = delivered(3, 7);
        failed.result = Some(RunResult::Failed("no bids".into()));
        let c = check(vec![delivered(1, 7), delivered(2, 8), failed]);
        assert!(matches!(
            c.next(),
            Next::Decided(SpotVerdict::Undecided(why)) if why.contains("no bids")
        ));
        assert_eq!(c.workers(), vec![addr(1), addr(2)]);
    }

    #[test]
    fn the_draw_takes_the_rate_and_depends_on_the_secret() {
        let job = Uuid::from_random([5; 16]);
        let count = |secret: [u8; 32], rate| {
            (0..10_000u32)
                .filter(|t| drawn(&secret, &job, *t, rate))
                .count()
        };
        assert_eq!(count([1; 32], 0), 0);
        assert_eq!(count([1; 32], PPM), 10_000);
        let quarter = count([1; 32], PPM / 4);
        assert!((2_300..2_700).contains(&quarter), "{quarter}");
        let other: Vec<bool> = (0..64).map(|t| drawn(&[2; 32], &job, t, PPM / 2)).collect();
        let mine: Vec<bool> = (0..64).map(|t| drawn(&[1; 32], &job, t, PPM / 2)).collect();
        assert_ne!(mine, other);
        assert_ne!(check_nonce(&job, 0, 1), check_nonce(&job, 0, 2));
        assert_eq!(check_nonce(&job, 3, 1), check_nonce(&job, 3, 1));
    }
}
