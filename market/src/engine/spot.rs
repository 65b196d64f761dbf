//! The requester's spot checks ([`crate::spot`]): drawing delivered tasks, publishing the
//! check jobs that re-run them elsewhere, comparing what comes back, and disputing the
//! delivery that two other runs agree against.

use std::collections::BTreeMap;

use cannabis_protocol::{EscrowSettle, EvaluationOutcome, NamedDigest, Outcome, Uuid};

use super::{CommandOk, Market, Output, RecordKey, Settle};
use crate::OfferTemplate;
use crate::job::{Escrowed, Evaluating, JobState, LeaseState};
use crate::spot::{CheckOf, CheckRun, Next, RunResult, SpotCheck, SpotVerdict, drawn};

impl Market {
    /// A rank delivered and its outputs checked out: for a check job, its run is compared;
    /// for a job that spot-checks, the task may be drawn and a check job published.
    pub(super) fn spot_delivered(
        &mut self,
        job: Uuid,
        task: u32,
        rank: u32,
        epoch: u64,
        outputs: &[NamedDigest],
    ) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        let Some(a) = j
            .tasks()
            .get(task as usize)
            .and_then(|t| t.ranks().get(rank as usize))
            .filter(|a| a.epoch == epoch && a.state == LeaseState::Done)
        else {
            return;
        };
        let result = RunResult::Delivered {
            worker: a.worker,
            epoch,
            manifest: a
                .delivery
                .as_ref()
                .map_or(cannabis_protocol::Digest([0; 32]), |d| d.id()),
            outputs: outputs
                .iter()
                .map(|o| (o.name.clone(), o.digest))
                .collect::<BTreeMap<_, _>>(),
        };
        if let Some(of) = j.spot().of {
            self.spot_run_ended(of, result);
            return;
        }
        let checkable = crate::spot::checkable(&j.offer().tasks[task as usize])
            && !j.spot().checks.contains_key(&task);
        if !checkable || !drawn(&self.config.spot_secret, &job, task, j.spot().rate_ppm) {
            return;
        }
        let delivery = CheckRun {
            job,
            task,
            result: Some(result),
        };
        if let Some(j) = self.jobs.get_mut(&job) {
            j.spot_mut().checks.insert(task, SpotCheck::new(delivery));
        }
        self.spot_publish(job, task, 1);
    }

    /// A check job ended without delivering (it failed or was cancelled).
    pub(super) fn spot_job_ended(&mut self, job: Uuid) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        let Some(of) = j.spot().of else {
            return;
        };
        if !matches!(j.state(), JobState::Failed | JobState::Cancelled) {
            return;
        }
        let why = j
            .history()
            .last()
            .map_or_else(|| "it ended".to_string(), |e| e.text.clone());
        self.spot_run_ended(of, RunResult::Failed(format!("check job {job}: {why}")));
    }

    /// Publishes run `run` of the check of `job`'s task `task`: an offer of that one task,
    /// excluding every worker that ran it so far.
    fn spot_publish(&mut self, job: Uuid, task: u32, run: u32) {
        let now = self.now;
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        let Some(check) = j.spot().checks.get(&task) else {
            return;
        };
        let offer = j.offer();
        let mut spec = offer.tasks[task as usize].clone();
        spec.depends_on.clear();
        let window = offer.expires_at.ms_since(offer.issued_at).max(1);
        let template = OfferTemplate {
            name: Some(format!("{}-check-{task}-{run}", j.name())),
            nonce: Some(crate::spot::check_nonce(&job, task, run)),
            tasks: vec![spec],
            ttl_ms: window,
            // As long to deliver as the checked job was given.
            deadline_ms: offer.deadline.ms_since(offer.issued_at).max(window + 1),
            review_window_ms: offer.review_window_ms,
            acceptance: Vec::new(),
            evaluation: None,
            // Placed on the first valid bid (widened if none comes): a check that waits
            // out its window may come after the review window it has to beat.
            early: Some(crate::job::Early::FirstBids(1)),
            spot_check_ppm: 0,
        };
        let excluded = check.workers();
        let outcome = self.submit(template, [0; 16], true);
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        match outcome {
            Ok(CommandOk::Submitted { job: id, .. }) => {
                let idx = j.spot().checks.get(&task).map_or(0, |c| c.runs.len());
                if let Some(c) = j.spot_mut().checks.get_mut(&task) {
                    c.runs.push(CheckRun {
                        job: id,
                        task: 0,
                        result: None,
                    });
                }
                let what = if run == 1 {
                    "spot check: re-run on another worker"
                } else {
                    "spot check: the re-run disagreed; a third worker breaks the tie"
                };
                j.note_task(now, task, format!("{what} as job {id} (run {idx})"));
                if let Some(c) = self.jobs.get_mut(&id) {
                    c.spot_mut().of = Some(CheckOf { job, task, run });
                    for w in excluded {
                        c.exclude(0, w);
                    }
                    c.note(now, format!("spot check of job {job}'s task {task}"));
                }
                self.out.dirty(RecordKey::Job(id));
            }
            Ok(_) => {}
            Err(e) => {
                let why = format!("the re-run could not be published: {e}");
                if let Some(c) = j.spot_mut().checks.get_mut(&task) {
                    c.verdict = Some(SpotVerdict::Undecided(why.clone()));
                }
                j.note_task(now, task, format!("spot check undecided: {why}"));
            }
        }
        self.out.dirty(RecordKey::Job(job));
    }

    /// Run `of.run` of a check came out as `result`: kept, then the check goes on or is
    /// decided.
    fn spot_run_ended(&mut self, of: CheckOf, result: RunResult) {
        let now = self.now;
        let Some(j) = self.jobs.get_mut(&of.job) else {
            return;
        };
        let Some(check) = j.spot_mut().checks.get_mut(&of.task) else {
            return;
        };
        let Some(run) = check.runs.get_mut(of.run as usize) else {
            return;
        };
        if run.result.is_some() || check.verdict.is_some() {
            return;
        }
        run.result = Some(result);
        let next = check.next();
        let runs = check.runs.clone();
        self.out.dirty(RecordKey::Job(of.job));
        match next {
            Next::Wait => {}
            Next::TieBreak => self.spot_publish(of.job, of.task, 2),
            Next::Decided(verdict) => {
                if let Some(c) = j.spot_mut().checks.get_mut(&of.task) {
                    c.verdict = Some(verdict.clone());
                }
                match verdict {
                    SpotVerdict::Agreed => {
                        j.note_task(
                            now,
                            of.task,
                            format!(
                                "spot check passed: {} other worker(s) delivered the same outputs",
                                runs.len() - 1
                            ),
                        );
                        self.spot_accept(of.job, of.task);
                    }
                    SpotVerdict::Undecided(why) => {
                        j.note_task(now, of.task, format!("spot check undecided: {why}"));
                    }
                    SpotVerdict::Caught { run } => self.spot_caught(of, &runs, run),
                }
            }
        }
    }

    /// Run `caught` of a check disagrees with the two others: its delivery is marked wrong
    /// and disputed in its own job (the checked one or a check job), the three manifests
    /// named.
    fn spot_caught(&mut self, of: CheckOf, runs: &[CheckRun], caught: u32) {
        let now = self.now;
        let Some(bad) = runs.get(caught as usize) else {
            return;
        };
        let Some(RunResult::Delivered { worker, epoch, .. }) = &bad.result else {
            return;
        };
        let evidence: Vec<String> = runs
            .iter()
            .filter_map(|r| match &r.result {
                Some(RunResult::Delivered {
                    worker, manifest, ..
                }) => Some(format!("{worker} (manifest {manifest}, job {})", r.job)),
                _ => None,
            })
            .collect();
        let why = format!(
            "spot check: its outputs differ from those two other workers delivered for the \
             same task; runs: {}",
            evidence.join(", ")
        );
        if let Some(j) = self.jobs.get_mut(&of.job) {
            j.note_task(
                now,
                of.task,
                format!("spot check caught {worker} (run {caught}): its delivery is disputed"),
            );
        }
        let (job, task, epoch) = (bad.job, bad.task, *epoch);
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        if !j.on_caught(task, 0, epoch, why, now) {
            return;
        }
        self.out.dirty(RecordKey::Job(job));
        if *j.escrow() == Escrowed::Locked {
            self.out
                .fenced(Output::Settle(Settle::Dispute(EscrowSettle {
                    job_id: job,
                    task,
                    rank: 0,
                    epoch,
                    outcome: Outcome::Rejected,
                })));
        }
    }

    /// A check passed: when the job's evaluation passed and accepted the rest, this
    /// delivery, held back meanwhile, is accepted too.
    fn spot_accept(&mut self, job: Uuid, task: u32) {
        let Some(j) = self.jobs.get(&job) else {
            return;
        };
        let confirm = j.offer().evaluation.as_ref().is_some_and(|t| t.confirm);
        let passed = matches!(j.evaluation(), Some(Evaluating::Done { report, .. })
            if report.verify().is_ok_and(|r| r.body.outcome == EvaluationOutcome::Passed));
        if !passed || confirm || *j.escrow() != Escrowed::Locked {
            return;
        }
        let Some(t) = j.tasks().get(task as usize) else {
            return;
        };
        for a in t.ranks() {
            if a.state == LeaseState::Done && !a.found_wrong() {
                self.out.fenced(Output::Settle(Settle::Accept(EscrowSettle {
                    job_id: job,
                    task,
                    rank: a.rank,
                    epoch: a.epoch,
                    outcome: Outcome::Accepted,
                })));
            }
        }
    }
}
