//! The messages of the market, with every field documented. `docs/protocol.md` lists their
//! domain strings, size caps and the rules [`crate::Message::validate`] enforces.

use serde::{Deserialize, Serialize};

mod capability;
mod delivery;
mod directed;
mod evaluation;
mod ledger;
mod market;
mod offer;
mod transfer;

pub use capability::{
    Attestation, AttestationKind, CapabilityAd, ChallengePass, Gpu, GpuPrice, Hardware,
    MAX_AD_PASSES, NetworkLimits, OsInfo, PriceSheet,
};
pub use delivery::{
    AGE_HEADER_MAX, COMPUTE_RESULT_DOMAIN, CheckpointNote, ComputeResult, ComputeResultError,
    DeliveryManifest, EvaluationReport, MetricValue, NamedDigest, OutputDigest, ResourceUsage,
    Setting, max_cipher_size,
};
pub use directed::{
    ChallengeRequest, ChallengeResponse, LedgerRequest, LedgerResponse, MarketRequest,
    MarketResponse, SyncRequest, SyncResponse,
};
pub use evaluation::{
    ArtifactCheck, ArtifactFormat, Criterion, EVALUATION_CONFIGURATION, EVALUATION_METRICS,
    EvaluatedDelivery, Evaluation, EvaluationLimits, EvaluationOutcome, EvaluationTerms,
    MAX_EVALUATION_ITEMS, MAX_TENSOR_CHECKS, MAX_TENSOR_RANK, TensorCheck, judge,
};
pub use ledger::{
    Assigned, Block, BlockError, BlockHeader, EscrowAssign, EscrowAssignMany, EscrowCancel,
    EscrowLock, EscrowSettle, MAX_ASSIGNED, ResultCommit, SUBMIT_RESULT_GAS_LIMIT, Transaction,
    TxError, TxPayload, TxType, compute_leaves,
};
pub use market::{
    Award, Bid, Cancel, Decline, LeaseAccept, LeaseRenewal, Rendezvous, Resume, RosterEntry,
    RunReport, RunStage,
};
pub use offer::{
    AcceptanceMetric, Comparison, InputRef, JobOffer, MAX_GROUP_SIZE, MAX_RESTARTS, MAX_TASKS,
    OutputDecl, OutputRights, Requirements, Resources, RuntimeRequirement, SYNTHETIC_DEFAULT_N,
    SYNTHETIC_PRODUCT, SYNTHETIC_RESULT, TaskInput, TaskSpec, Workload, is_safe_name, job_id_of,
};
pub use transfer::{ObjectKind, ObjectRef, TRANSFER_CHUNK, TransferRequest, TransferResponse};

/// Implements [`crate::Wire`] (and optionally [`crate::Message`]'s domain) for a type.
macro_rules! wire {
    ($ty:ty, $kind:literal, $max:expr) => {
        impl $crate::Wire for $ty {
            const KIND: &'static str = $kind;
            const VERSION: u16 = 1;
            const MAX_SIZE: usize = $max;
        }
    };
}
pub(crate) use wire;

/// The executor adapter a workload runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum AdapterKind {
    /// A program bundle pinned by digest, run with an entrypoint.
    Process,
    /// The seeded deterministic matrix-multiplication proof-of-compute task.
    Synthetic,
    /// One rank of a multi-node group launched with torchrun.
    Torchrun,
}

impl AdapterKind {
    /// Whether its workload is the requester's program bundle (pinned by the workload's
    /// digest), which the worker fetches before it runs.
    pub fn runs_a_bundle(self) -> bool {
        matches!(self, Self::Process | Self::Torchrun)
    }
}

/// GPU vendors. Group jobs never mix vendors in one process group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum GpuVendor {
    /// NVIDIA (CUDA).
    Nvidia,
    /// AMD (ROCm).
    Amd,
    /// Intel.
    Intel,
    /// Anything else.
    Other,
}

/// Collective communication backends a node can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    /// Gloo (CPU and GPU).
    Gloo,
    /// NVIDIA NCCL.
    Nccl,
    /// AMD RCCL.
    Rccl,
    /// MPI.
    Mpi,
}

/// An isolation layer the sandbox enforces (and a job may require).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum IsolationLayer {
    /// A new user namespace; the workload runs as an unprivileged uid.
    UserNamespace,
    /// A new mount namespace with a read-only or absent host filesystem.
    MountNamespace,
    /// A new pid namespace.
    PidNamespace,
    /// An empty network namespace: no workload network.
    NetworkNamespace,
    /// New IPC and UTS namespaces.
    IpcUtsNamespace,
    /// Memory limit enforced by a cgroup.
    CgroupMemory,
    /// Process-count limit enforced by a cgroup.
    CgroupPids,
    /// CPU limit enforced by a cgroup.
    CgroupCpu,
    /// rlimits for file size, open files and core dumps.
    Rlimits,
    /// A seccomp filter on dangerous system calls.
    Seccomp,
    /// Landlock filesystem rules.
    Landlock,
    /// All capabilities dropped and `no_new_privs` set.
    NoPrivileges,
    /// A writable work directory bounded in size.
    BoundedWorkdir,
    /// The sandbox is run by a separate root supervisor; the network-facing node runs
    /// as an unprivileged user and cannot change the administrator's ceilings.
    PrivilegeSeparated,
}

/// A runtime with its version, e.g. `python3 3.11.7` or `torch 2.5.1+cu124`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Runtime {
    /// Name, lowercase.
    pub name: String,
    /// Version as the runtime reports it.
    pub version: String,
}
