//! One attempt's record: what was asked, what is reserved, where it stands, and what was
//! observed. Every change goes to the journal before the effect it allows.

use std::path::PathBuf;

use cannabis_protocol::{Digest, IsolationLayer, TaskSpec};
use serde::{Deserialize, Serialize};

use crate::sandbox::{CgroupUsage, ExitRecord};

/// What a caller asks the executor to run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AttemptRequest {
    /// The caller's id for this request. The same id always gets the same attempt (or the
    /// same refusal); it never runs twice.
    pub request_id: String,
    /// The task, as published.
    pub task: TaskSpec,
    /// The program bundle (a tar file) for the `process` adapter; its SHA-256 must equal
    /// the task's workload digest.
    pub bundle: Option<PathBuf>,
    /// Local files for the task's staged inputs, by input name; each must match the
    /// input's digest and size.
    pub inputs: Vec<(String, PathBuf)>,
    /// Seed of the `synthetic` adapter.
    pub seed: Option<Digest>,
    /// The lease: work may run until then, milliseconds since the Unix epoch.
    pub lease_until_ms: u64,
    /// Who renews the lease.
    pub renewal: Renewal,
    /// More environment for the workload, set by the caller (a group rank's `RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR` and the rest): names are letters, digits and `_`, and
    /// none may be one the executor sets itself.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Whether the workload may use TCP and UDP on its sandbox's own loopback (a group's
    /// rank, which reaches the others there through its node).
    #[serde(default)]
    pub loopback: bool,
    /// Whether the sandbox, once made and checked, waits for [`crate::exec::Executor::release`]
    /// before its command starts (a group's rank: its node connects the sandbox to the
    /// group, and all ranks start together). A held attempt stopped, or whose lease ends,
    /// never starts.
    #[serde(default)]
    pub hold: bool,
    /// A local file holding the checkpoint to resume from (a rank placed again): put in
    /// the work directory under the task's checkpoint name before the command starts.
    #[serde(default)]
    pub resume: Option<PathBuf>,
    /// The age recipient (`age1...`) the sandbox seals each copy of the task's checkpoint
    /// to while it runs; `None`: no copies are taken.
    #[serde(default)]
    pub checkpoint_to: Option<String>,
}

/// Who keeps an attempt's lease current.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Renewal {
    /// The executor itself, for as long as it runs (local runs).
    Local,
    /// The caller, with [`crate::exec::Executor::renew`] (market leases).
    External,
}

/// Where an attempt stands.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum AttemptState {
    /// Capacity reserved, nothing staged.
    Reserved,
    /// Inputs being staged and the sandbox being set up under a current lease.
    Preparing,
    /// The command was started.
    Running,
    /// The command exited 0 and every declared output was copied out.
    Completed,
    /// Refused, could not start, or ended badly.
    Failed,
    /// Stopped on request before it completed.
    Cancelled,
    /// Nobody can say what happened: never retried automatically.
    Unknown,
}

impl AttemptState {
    /// Whether the outcome is settled.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::Failed | Self::Cancelled | Self::Unknown
        )
    }

    /// The state's name as people see it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Preparing => "preparing",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Unknown => "unknown",
        }
    }
}

/// What happened to the reservation after the outcome.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Cleanup {
    /// Still held: the attempt is active or its cleanup has not finished.
    Pending,
    /// The process tree was confirmed empty and storage removed; capacity is free.
    Released,
    /// Cleanup could not be confirmed; the capacity stays held until the administrator
    /// clears it.
    Quarantined {
        /// What could not be confirmed.
        why: String,
    },
}

/// Capacity held for an attempt.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reservation {
    /// CPU in thousandths of a core.
    pub cpu_millicores: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Swap in bytes.
    pub swap_bytes: u64,
    /// Processes.
    pub processes: u64,
    /// Work-directory bytes.
    pub storage_bytes: u64,
    /// Whole GPUs, by UUID.
    pub gpus: Vec<String>,
    /// Host uid the sandbox runs as.
    pub uid: u32,
}

/// The result of a synthetic task.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SyntheticResult {
    /// The seed.
    pub seed: Digest,
    /// Matrix dimension.
    pub n: u32,
    /// SHA-256 of the product.
    pub result_hash: Digest,
}

/// An attempt, as the journal keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Attempt {
    /// Executor-assigned id.
    pub id: String,
    /// The request.
    pub request: AttemptRequest,
    /// Where it stands.
    pub state: AttemptState,
    /// Whether admission refused it (then it never ran and never will).
    pub refused: bool,
    /// Why it failed, was refused, or is unknown.
    pub reason: Option<String>,
    /// Capacity held.
    pub reservation: Option<Reservation>,
    /// The reservation's fate.
    pub cleanup: Cleanup,
    /// A recorded stop: when and why (before anything acted on it).
    pub cancel: Option<(u64, String)>,
    /// Layers the host saw in effect on the running sandbox.
    pub layers: Vec<IsolationLayer>,
    /// Host pid of the sandbox's monitor, once started (a held attempt's, while it waits).
    pub monitor_pid: Option<u32>,
    /// A held attempt was released: its command may start.
    #[serde(default)]
    pub released: bool,
    /// What the sandbox observed.
    pub exit: Option<ExitRecord>,
    /// What the attempt's processes used, read from its cgroups when it ended.
    #[serde(default)]
    pub usage: Option<CgroupUsage>,
    /// The synthetic task's result.
    pub result: Option<SyntheticResult>,
    /// The attempt this one retries, by an explicit decision.
    pub retry_of: Option<String>,
    /// Lease end, milliseconds since the Unix epoch (renewals move it).
    pub lease_until_ms: u64,
    /// Events, oldest first: (milliseconds since the Unix epoch, what).
    pub history: Vec<(u64, String)>,
}

/// An illegal transition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("attempt {id} is {from}; it cannot become {to}")]
pub struct WrongState {
    /// The attempt.
    pub id: String,
    /// Its state.
    pub from: &'static str,
    /// The asked-for state.
    pub to: &'static str,
}

impl Attempt {
    fn wrong(&self, to: &'static str) -> WrongState {
        WrongState {
            id: self.id.clone(),
            from: self.state.name(),
            to,
        }
    }

    fn note(&mut self, now: u64, what: impl Into<String>) {
        self.history.push((now, what.into()));
    }

    /// Reserved -> preparing.
    #[must_use = "an illegal move must be handled"]
    pub fn to_preparing(&mut self, now: u64) -> Result<(), WrongState> {
        if self.state != AttemptState::Reserved || self.cancel.is_some() {
            return Err(self.wrong("preparing"));
        }
        self.state = AttemptState::Preparing;
        self.note(now, "preparing: staging inputs and setting up the sandbox");
        Ok(())
    }

    /// Preparing -> running, with the layers the host saw in effect.
    #[must_use = "an illegal move must be handled"]
    pub fn to_running(&mut self, now: u64, layers: Vec<IsolationLayer>) -> Result<(), WrongState> {
        if self.state != AttemptState::Preparing || self.cancel.is_some() {
            return Err(self.wrong("running"));
        }
        self.state = AttemptState::Running;
        self.layers = layers;
        self.note(now, "running");
        Ok(())
    }

    /// Records the outcome. An observed completed or unknown outcome is never replaced.
    #[must_use = "an illegal move must be handled"]
    pub fn finish(
        &mut self,
        now: u64,
        outcome: AttemptState,
        reason: Option<String>,
    ) -> Result<(), WrongState> {
        if !outcome.is_final() || self.state.is_final() {
            return Err(self.wrong(outcome.name()));
        }
        self.state = outcome;
        self.reason = reason.clone();
        let mut line = outcome.name().to_string();
        if let Some(r) = reason {
            line = format!("{line}: {r}");
        }
        self.note(now, line);
        Ok(())
    }

    /// Records a stop request. Returns `false` (and records nothing) when the outcome is
    /// already settled: a completed or unknown result stays as it is.
    pub fn record_cancel(&mut self, now: u64, why: &str) -> bool {
        if self.state.is_final() || self.cancel.is_some() {
            return false;
        }
        self.cancel = Some((now, why.to_string()));
        self.note(now, format!("stop recorded: {why}"));
        true
    }

    /// Cleanup confirmed: capacity released.
    #[must_use = "an illegal move must be handled"]
    pub fn release(&mut self, now: u64) -> Result<(), WrongState> {
        if !self.state.is_final() || self.cleanup == Cleanup::Released {
            return Err(self.wrong("released"));
        }
        self.cleanup = Cleanup::Released;
        self.note(
            now,
            "released: process tree confirmed empty, storage removed",
        );
        Ok(())
    }

    /// Cleanup not confirmed: capacity stays held.
    #[must_use = "an illegal move must be handled"]
    pub fn quarantine(&mut self, now: u64, why: String) -> Result<(), WrongState> {
        if !self.state.is_final() || self.cleanup == Cleanup::Released {
            return Err(self.wrong("quarantined"));
        }
        self.note(now, format!("quarantined: {why}"));
        self.cleanup = Cleanup::Quarantined { why };
        Ok(())
    }

    /// Whether capacity is held for it.
    pub fn holds_capacity(&self) -> bool {
        self.reservation.is_some() && self.cleanup != Cleanup::Released
    }

    /// `completed`, `failed (refused)`, `running`, ... plus the reservation's fate.
    pub fn status_line(&self) -> String {
        let mut s = self.state.name().to_string();
        if self.refused {
            s.push_str(" (refused)");
        }
        match &self.cleanup {
            Cleanup::Released if self.state.is_final() && !self.refused => s.push_str(", released"),
            Cleanup::Quarantined { .. } => s.push_str(", quarantined"),
            _ => {}
        }
        s
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn attempt() -> Attempt {
        Attempt {
            id: "a1".into(),
            request: AttemptRequest {
                request_id: "r1".into(),
                task: crate::exec::tests::task(cannabis_protocol::AdapterKind::Synthetic),
                bundle: None,
                inputs: vec![],
                seed: None,
                lease_until_ms: 0,
                renewal: Renewal::Local,
                env: Vec::new(),
                loopback: false,
                hold: false,
                resume: None,
                checkpoint_to: None,
            },
            state: AttemptState::Reserved,
            refused: false,
            reason: None,
            reservation: Some(Reservation::default()),
            cleanup: Cleanup::Pending,
            cancel: None,
            layers: vec![],
            monitor_pid: None,
            released: false,
            exit: None,
            usage: None,
            result: None,
            retry_of: None,
            lease_until_ms: 0,
            history: vec![],
        }
    }

    #[test]
    fn the_happy_path_and_no_way_back() {
        let mut a = attempt();
        assert!(
            a.to_running(1, vec![]).is_err(),
            "running needs preparing first"
        );
        a.to_preparing(1).unwrap();
        a.to_running(2, vec![IsolationLayer::Seccomp]).unwrap();
        a.finish(3, AttemptState::Completed, None).unwrap();
        assert!(a.holds_capacity());
        a.release(4).unwrap();
        assert!(!a.holds_capacity());
        assert!(a.release(5).is_err());
        assert!(a.to_preparing(6).is_err());
    }

    #[test]
    fn a_stop_never_replaces_completed_or_unknown() {
        for outcome in [AttemptState::Completed, AttemptState::Unknown] {
            let mut a = attempt();
            a.to_preparing(1).unwrap();
            a.to_running(2, vec![]).unwrap();
            a.finish(3, outcome, None).unwrap();
            assert!(!a.record_cancel(4, "owner stop"));
            assert_eq!(a.cancel, None);
            assert!(a.finish(5, AttemptState::Cancelled, None).is_err());
            assert_eq!(a.state, outcome);
        }
    }

    #[test]
    fn a_recorded_stop_blocks_every_start() {
        let mut a = attempt();
        assert!(a.record_cancel(1, "owner stop"));
        assert!(!a.record_cancel(2, "again"), "recorded once");
        assert!(a.to_preparing(3).is_err());
        a.finish(4, AttemptState::Cancelled, None).unwrap();
    }

    #[test]
    fn quarantine_holds_capacity_until_cleared() {
        let mut a = attempt();
        assert!(
            a.quarantine(1, "x".into()).is_err(),
            "only after an outcome"
        );
        a.finish(1, AttemptState::Failed, Some("boom".into()))
            .unwrap();
        a.quarantine(2, "pids left".into()).unwrap();
        assert!(a.holds_capacity());
        a.release(3).unwrap();
        assert!(!a.holds_capacity());
    }
}
