//! `CapabilityAd`: what a worker offers, built from its hardware probe and signed.

use serde::{Deserialize, Serialize};

use super::{AdapterKind, Collective, GpuVendor, IsolationLayer, Runtime, wire};
use crate::{Address, Amount, DeliveryRecipient, Digest, Invalid, Message, Timestamp};

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
    /// The last passed capability challenge, if any.
    pub challenge: Option<ChallengeRecord>,
}

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

/// Record of the last capability challenge this node passed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ChallengeRecord {
    /// Who set and checked the challenge.
    pub verifier: Address,
    /// The seed the verifier picked.
    pub seed: Digest,
    /// Matrix dimension of the challenge.
    pub size: u32,
    /// When it was passed.
    pub passed_at: Timestamp,
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
        Ok(())
    }
}
