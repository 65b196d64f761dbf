//! A job as it is stored: cut into parts, so that a change rewrites only the parts it
//! touched. A bid, a decline or a history line is a part of its own, written once; the offer
//! is written when a new version is published; the head (task states, leases, epochs,
//! money) is the only part most changes rewrite, and its size does not grow with the bids,
//! declines or history a job gathers.

use std::collections::BTreeMap;

use cannabis_protocol::{Address, Digest, JobOffer, SignatureBytes};
use serde::{Deserialize, Serialize};

use super::{AcceptEquivocation, Bidding, Equivocation, Event, Job, LeaseConfig, Task};
use crate::placement::Candidate;

/// One stored part of a job.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Part {
    /// The offer as last published, its message id and the ids of earlier versions.
    Offer {
        /// The offer.
        offer: Box<JobOffer>,
        /// Its message id.
        offer_id: Digest,
        /// Earlier versions' ids.
        earlier: Vec<Digest>,
    },
    /// Everything but the offer, bids, declines and history.
    Head(Box<Head>),
    /// One worker's bid held for one task, with its signature (the evidence if the worker
    /// signs a conflicting one).
    Bid {
        /// The task.
        task: u32,
        /// The bid.
        candidate: Candidate,
        /// Its signature, when kept.
        signature: Option<SignatureBytes>,
    },
    /// One worker's signed reason for declining a task.
    Decline {
        /// The task.
        task: u32,
        /// The worker.
        worker: Address,
        /// Its reason.
        reason: String,
    },
    /// One line of the history, numbered from the job's first.
    Line {
        /// Its number: line 0 is the first; numbers are never reused when old lines go.
        n: u64,
        /// The line.
        event: Event,
    },
}

/// The head of a job: its tasks without their bids and declines, and the job's own state.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Head {
    name: String,
    config: LeaseConfig,
    bidding: Bidding,
    tasks: Vec<Task>,
    cancelled: bool,
    evidence: Vec<Equivocation>,
    #[serde(default)]
    accept_evidence: Vec<AcceptEquivocation>,
    history_dropped: u64,
    #[serde(default)]
    early_look_at: Option<cannabis_protocol::Timestamp>,
    #[serde(default)]
    escrow: super::Escrowed,
    #[serde(default)]
    evaluation: Option<super::Evaluating>,
    #[serde(default)]
    spot: crate::spot::SpotChecks,
}

impl Part {
    /// Its key within the job's: a kind byte, then what tells it from others of its kind
    /// (big-endian, so a job's parts sort by kind, task and number).
    pub fn key(&self) -> Vec<u8> {
        let with = |kind: u8, task: u32, rest: &[u8]| {
            let mut k = Vec::with_capacity(5 + rest.len());
            k.push(kind);
            k.extend_from_slice(&task.to_be_bytes());
            k.extend_from_slice(rest);
            k
        };
        match self {
            Part::Offer { .. } => vec![0],
            Part::Head(_) => vec![1],
            Part::Bid {
                task, candidate, ..
            } => with(2, *task, candidate.bid.worker.public_key()),
            Part::Decline { task, worker, .. } => with(3, *task, worker.public_key()),
            Part::Line { n, .. } => {
                let mut k = vec![4];
                k.extend_from_slice(&n.to_be_bytes());
                k
            }
        }
    }
}

/// Why stored parts do not make a job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PartsError {
    /// No offer or no head.
    #[error("the job's {0} is missing")]
    Missing(&'static str),
    /// A bid or decline names a task the offer does not have.
    #[error("a stored part names task {0}, which the job does not have")]
    NoSuchTask(u32),
}

impl Job {
    /// The parts this job is stored as.
    pub fn parts(&self) -> Vec<Part> {
        let mut parts = Vec::with_capacity(2 + self.history.len());
        parts.push(Part::Offer {
            offer: Box::new(self.offer.clone()),
            offer_id: self.offer_id,
            earlier: self.earlier.clone(),
        });
        let tasks = self
            .tasks
            .iter()
            .map(|t| Task {
                status: t.status.clone(),
                bids: BTreeMap::new(),
                signatures: BTreeMap::new(),
                declines: BTreeMap::new(),
                excluded: t.excluded.clone(),
                refused: t.refused.clone(),
                recalls: t.recalls,
                known: t.known,
                ranks: t.ranks.clone(),
                attempts: t.attempts,
                failures: t.failures,
                committed: t.committed,
                spent: t.spent,
                budget: t.budget,
                outputs: t.outputs.clone(),
                epochs: t.epochs.clone(),
                checkpoints: t.checkpoints.clone(),
                bidding_since: t.bidding_since,
            })
            .collect();
        parts.push(Part::Head(Box::new(Head {
            name: self.name.clone(),
            config: self.config.clone(),
            bidding: self.bidding,
            tasks,
            cancelled: self.cancelled,
            evidence: self.evidence.clone(),
            accept_evidence: self.accept_evidence.clone(),
            history_dropped: self.history_dropped,
            early_look_at: self.early_look_at,
            escrow: self.escrow.clone(),
            evaluation: self.evaluation.clone(),
            spot: self.spot.clone(),
        })));
        for (i, t) in self.tasks.iter().enumerate() {
            let task = i as u32;
            for (worker, c) in &t.bids {
                parts.push(Part::Bid {
                    task,
                    candidate: c.clone(),
                    signature: t.signatures.get(worker).copied(),
                });
            }
            for (worker, reason) in &t.declines {
                parts.push(Part::Decline {
                    task,
                    worker: *worker,
                    reason: reason.clone(),
                });
            }
        }
        for (i, event) in self.history.iter().enumerate() {
            // Line 0 stays; when the history is full the oldest after it goes.
            let n = if i == 0 {
                0
            } else {
                self.history_dropped + i as u64
            };
            parts.push(Part::Line {
                n,
                event: event.clone(),
            });
        }
        parts
    }

    /// The job its stored parts make (in any order).
    pub fn from_parts(parts: impl IntoIterator<Item = Part>) -> Result<Job, PartsError> {
        let mut offer = None;
        let mut head = None;
        let mut bids = Vec::new();
        let mut declines = Vec::new();
        let mut lines = BTreeMap::new();
        for p in parts {
            match p {
                Part::Offer {
                    offer: o,
                    offer_id,
                    earlier,
                } => offer = Some((*o, offer_id, earlier)),
                Part::Head(h) => head = Some(h),
                Part::Bid {
                    task,
                    candidate,
                    signature,
                } => bids.push((task, candidate, signature)),
                Part::Decline {
                    task,
                    worker,
                    reason,
                } => declines.push((task, worker, reason)),
                Part::Line { n, event } => {
                    lines.insert(n, event);
                }
            }
        }
        let (offer, offer_id, earlier) = offer.ok_or(PartsError::Missing("offer"))?;
        let head = *head.ok_or(PartsError::Missing("head"))?;
        let mut tasks = head.tasks;
        for (task, candidate, signature) in bids {
            let t = tasks
                .get_mut(task as usize)
                .ok_or(PartsError::NoSuchTask(task))?;
            let worker = candidate.bid.worker;
            if let Some(s) = signature {
                t.signatures.insert(worker, s);
            }
            t.bids.insert(worker, candidate);
        }
        for (task, worker, reason) in declines {
            tasks
                .get_mut(task as usize)
                .ok_or(PartsError::NoSuchTask(task))?
                .declines
                .insert(worker, reason);
        }
        Ok(Job {
            offer,
            offer_id,
            earlier,
            name: head.name,
            config: head.config,
            bidding: head.bidding,
            tasks,
            history: lines.into_values().collect(),
            cancelled: head.cancelled,
            evidence: head.evidence,
            accept_evidence: head.accept_evidence,
            history_dropped: head.history_dropped,
            early_look_at: head.early_look_at,
            escrow: head.escrow,
            evaluation: head.evaluation,
            spot: head.spot,
        })
    }
}

#[cfg(test)]
mod tests {
    use cannabis_protocol::Timestamp;

    use crate::job::Job;
    use crate::testkit;

    /// A job cut into parts and put together again is the same job, its history past its
    /// bound included; no two parts share a key.
    #[test]
    fn a_job_is_its_parts() {
        let t = Timestamp(1_000_000);
        let mut job = testkit::job(
            testkit::keys(1).address(),
            vec![
                testkit::task("a", 1, 0, 0, 1, 1_000),
                testkit::task("b", 1, 0, 0, 2, 1_000),
            ],
            t,
        );
        for i in 0..1_200u64 {
            let worker = testkit::keys(10 + i).address();
            let d = testkit::decline(&job, (i % 2) as u32, worker, format!("reason {i}"), t);
            job.on_decline(d, t).unwrap();
        }
        let parts = job.parts();
        let mut keys: Vec<Vec<u8>> = parts.iter().map(|p| p.key()).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), parts.len());
        let back = Job::from_parts(parts.into_iter().rev()).unwrap();
        let json = |j: &Job| serde_json::to_string(j).unwrap();
        assert_eq!(json(&back), json(&job));
        assert!(Job::from_parts(Vec::new()).is_err());
    }
}
