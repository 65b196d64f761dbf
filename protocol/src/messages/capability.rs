//! `CapabilityAd`: what a worker offers, built from its hardware probe and signed.

use serde::{Deserialize, Serialize};

use super::{AdapterKind, Collective, GpuVendor, IsolationLayer, Runtime, wire};
use crate::{Address, Amount, DeliveryRecipient, Digest, Invalid, Message, Signed, Timestamp};

/// A worker's signed advertisement of its verified capabilities and prices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct CapabilityAd {
    /// The advertising node; must be the signer.
    pub node: Address,
    /// Per-node sequence number, increasing with every ad (replay protection).
    pub seq: u64,
    /// When the ad was made.
    pub issued_at: Timestamp,
    /// When it stops being valid; nodes drop it then.
    pub expires_at: Timestamp,
    /// The node's age recipient for encrypted workload packages.
    pub delivery: DeliveryRecipient,
    /// Probed hardware.
    pub hardware: Hardware,
    /// Operating system.
    pub os: OsInfo,
    /// Runtimes with versions (python3, torch, CUDA...).
    pub runtimes: Vec<Runtime>,
    /// Executor adapters this node runs.
    pub adapters: Vec<AdapterKind>,
    /// Collective backends available.
    pub collectives: Vec<Collective>,
    /// Isolation layers the sandbox verifiably enforces on this machine.
    pub isolation: Vec<IsolationLayer>,
    /// Owner-set network limits.
    pub network: NetworkLimits,
    /// The owner's prices.
    pub prices: PriceSheet,
    /// Confidential-execution evidence, if any.
    pub attestation: Option<Attestation>,
    /// Capability challenges this node passed, each signed by the verifier that set it
    /// (at most [`MAX_AD_PASSES`], one per verifier, newest kept).
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<Signed<ChallengePass>>(), 0..3)"
        )
    )]
    pub challenges: Vec<Signed<ChallengePass>>,
}

/// Most challenge passes one ad carries.
pub const MAX_AD_PASSES: usize = 4;

/// Probed hardware of a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Hardware {
    /// CPU model name.
    pub cpu_model: String,
    /// Logical CPU cores.
    pub cpu_cores: u32,
    /// Physical memory in bytes.
    pub memory_bytes: u64,
    /// Swap in bytes.
    pub swap_bytes: u64,
    /// Free storage under the node's data directory, in bytes.
    pub storage_bytes: u64,
    /// GPUs, whole devices by UUID.
    pub gpus: Vec<Gpu>,
}

/// One GPU as the probe saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Gpu {
    /// Device UUID (`GPU-...` for NVIDIA).
    pub uuid: String,
    /// Marketing name.
    pub name: String,
    /// Vendor.
    pub vendor: GpuVendor,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Driver version.
    pub driver_version: String,
    /// CUDA (or ROCm) version the driver supports.
    pub toolkit_version: String,
    /// Compute capability as `major.minor` (NVIDIA), empty when not applicable.
    pub compute_capability: String,
    /// Utilization when probed, in percent.
    pub utilization_pct: u8,
    /// Whether the owner allows jobs on this device.
    pub allowed: bool,
}

/// Operating system of a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct OsInfo {
    /// Distribution or OS name.
    pub name: String,
    /// Kernel release.
    pub kernel: String,
}

/// Owner-set bandwidth caps; `None` means not capped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(default)]
pub struct NetworkLimits {
    /// Upload cap in bytes per second.
    pub upload_bytes_per_sec: Option<u64>,
    /// Download cap in bytes per second.
    pub download_bytes_per_sec: Option<u64>,
}

/// The owner's price sheet, in base units.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(default)]
pub struct PriceSheet {
    /// Per CPU core per hour.
    pub cpu_core_hour: Amount,
    /// Per GiB of memory per hour.
    pub memory_gib_hour: Amount,
    /// Per whole GPU per hour, by model name.
    pub gpu_hour: Vec<GpuPrice>,
    /// The smallest job the owner takes.
    pub minimum_job: Amount,
}

/// Price of one GPU model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct GpuPrice {
    /// GPU model name as in [`Gpu::name`].
    pub model: String,
    /// Per GPU per hour.
    pub price: Amount,
}

/// Kinds of confidential-execution evidence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum AttestationKind {
    /// Testnet-only evidence. Insecure by design; refused outside testnets.
    Dev,
    /// Intel TDX quote.
    Tdx,
    /// AMD SEV-SNP report.
    SevSnp,
    /// NVIDIA confidential-computing GPU report.
    NvidiaCc,
}

/// Confidential-execution evidence; a verifier decides whether it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Attestation {
    /// Evidence kind.
    pub kind: AttestationKind,
    /// Raw evidence bytes.
    #[serde(with = "serde_bytes")]
    pub evidence: Vec<u8>,
}

/// A verifier's signed statement that a worker passed a capability challenge it set. The
/// worker carries it in its ads so that nodes which did not set the challenge can weigh it;
/// it is worth what the verifier is worth to them (see `docs/security.md`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ChallengePass {
    /// Who set and checked the challenge; must be the signer.
    pub verifier: Address,
    /// The node that answered it.
    pub worker: Address,
    /// The seed the verifier picked.
    pub seed: Digest,
    /// Matrix dimension.
    pub n: u32,
    /// Products summed.
    pub rounds: u32,
    /// CPU cores the worker's ad claimed; the challenge was sized from them.
    pub claimed_cores: u32,
    /// Milliseconds from sending the challenge to receiving the answer.
    pub took_ms: u64,
    /// The deadline the answer had to meet, in milliseconds.
    pub deadline_ms: u64,
    /// When the verifier accepted the answer.
    pub passed_at: Timestamp,
}

wire!(ChallengePass, "challenge pass", 512);

impl Message for ChallengePass {
    const DOMAIN: &'static str = "cannabis/challenge-pass/v1";

    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.verifier)
    }

    fn validate(&self) -> Result<(), Invalid> {
        if self.verifier == self.worker {
            return Err(Invalid::new("worker", "a node cannot vouch for itself"));
        }
        if self.n == 0 || self.rounds == 0 || self.claimed_cores == 0 {
            return Err(Invalid::new(
                "n",
                "n, rounds and claimed_cores must be positive",
            ));
        }
        if self.took_ms > self.deadline_ms {
            return Err(Invalid::new("took_ms", "a pass must meet its deadline"));
        }
        Ok(())
    }
}

impl CapabilityAd {
    /// The contents of the challenge passes the ad carries. Their signatures are checked with
    /// the ad (in [`Message::validate`]); this only reads them.
    pub fn passes(&self) -> impl Iterator<Item = ChallengePass> + '_ {
        self.challenges
            .iter()
            .filter_map(|s| crate::decode(s.payload()).ok())
    }
}

wire!(CapabilityAd, "capability ad", 16 * 1024);

impl Message for CapabilityAd {
    const DOMAIN: &'static str = "cannabis/capability-ad/v1";

    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.node)
    }

    fn validate(&self) -> Result<(), Invalid> {
        if self.expires_at <= self.issued_at {
            return Err(Invalid::new("expires_at", "must be after issued_at"));
        }
        if self.challenges.len() > MAX_AD_PASSES {
            return Err(Invalid::new("challenges", "at most 4 passes"));
        }
        let mut verifiers = std::collections::BTreeSet::new();
        for pass in &self.challenges {
            let pass = pass
                .verify()
                .map_err(|e| Invalid::new("challenges", format!("a pass does not verify: {e}")))?;
            if pass.body.worker != self.node {
                return Err(Invalid::new("challenges", "a pass names another worker"));
            }
            if !verifiers.insert(pass.signer) {
                return Err(Invalid::new("challenges", "two passes from one verifier"));
            }
        }
        Ok(())
    }
}
