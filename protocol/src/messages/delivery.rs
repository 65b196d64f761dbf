//! What a worker delivers: the signed `DeliveryManifest` and the `ComputeResult` whose
//! commitment goes to the chain.

use serde::{Deserialize, Serialize};

use super::{AdapterKind, Runtime, wire};
use crate::identity::BadSignature;
use crate::signed::signing_input;
use crate::{
    Address, Digest, Fixed, Invalid, Keypair, Message, SignatureBytes, Timestamp, Uuid, codec,
};

/// The signed record of a delivery: what was produced, from what, on what, at what cost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct DeliveryManifest {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// Rank that produced it.
    pub rank: u32,
    /// Lease epoch it was produced under; a stale epoch is refused.
    pub epoch: u64,
    /// The worker; must be the signer.
    pub worker: Address,
    /// The requester the outputs are encrypted to (its offer's delivery recipient).
    pub requester: Address,
    /// The adapter the task ran under.
    pub adapter: AdapterKind,
    /// The program bundle's digest, as the offer pinned it.
    pub bundle: Digest,
    /// The inputs staged for the run, by file name and digest.
    pub inputs: Vec<NamedDigest>,
    /// The workload's exit code (`None`: it ended without one, as the synthetic task does).
    pub exit_code: Option<i32>,
    /// Every output the task delivers: its declared outputs (and the synthetic task's
    /// `result.json`), in declaration order.
    pub outputs: Vec<OutputDigest>,
    /// Configuration the workload ran with.
    pub configuration: Vec<Setting>,
    /// Datasets used, by digest.
    pub datasets: Vec<NamedDigest>,
    /// Models used, by digest.
    pub models: Vec<NamedDigest>,
    /// Dependency versions.
    pub dependencies: Vec<Runtime>,
    /// Hardware it ran on, as the worker's probe describes it.
    pub hardware: String,
    /// Resources used.
    pub usage: ResourceUsage,
    /// The worker-side evaluation report, if the workload produced one.
    pub evaluation: Option<EvaluationReport>,
    /// When delivered.
    pub issued_at: Timestamp,
}

/// A worker's signed note that a rank's checkpoint changed: the requester fetches it
/// (an `ObjectKind::Checkpoint` named by `seq`) and keeps it for the rank's next epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct CheckpointNote {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// The rank whose checkpoint it is.
    pub rank: u32,
    /// The lease's epoch.
    pub epoch: u64,
    /// The worker; must be the signer.
    pub worker: Address,
    /// The requester it is encrypted to.
    pub requester: Address,
    /// Counts the checkpoints of this attempt from 1; a later one replaces an earlier.
    pub seq: u64,
    /// The checkpoint: named as the task declares it, its plaintext's digest and size,
    /// and its age file's size and Merkle root.
    pub checkpoint: OutputDigest,
    /// When sent.
    pub issued_at: Timestamp,
}

/// Digest of one declared output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct OutputDigest {
    /// Declared output name.
    pub name: String,
    /// SHA-256 of the plaintext.
    pub digest: Digest,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Size of its age file (the plaintext encrypted to the requester's recipient).
    pub cipher_size: u64,
    /// Merkle root (see [`crate::merkle`]) over the age file cut in
    /// [`crate::TRANSFER_CHUNK`]-byte pieces (the last one shorter): each piece fetched is
    /// checked against it.
    pub cipher_root: Digest,
}

impl OutputDigest {
    /// Number of transfer chunks of its age file.
    pub fn chunks(&self) -> u64 {
        self.cipher_size.div_ceil(crate::TRANSFER_CHUNK)
    }
}

/// The largest age file (one X25519 recipient, no armor) of `plain` bytes of plaintext:
/// a header of at most [`AGE_HEADER_MAX`] bytes, a 16-byte nonce, the plaintext, and a
/// 16-byte tag for each 64 KiB chunk (at least one).
pub fn max_cipher_size(plain: u64) -> u64 {
    let chunks = plain.div_ceil(64 * 1024).max(1);
    AGE_HEADER_MAX + 16 + plain + 16 * chunks
}

/// Bound on the header of an age file to one X25519 recipient (it is about 200 bytes).
pub const AGE_HEADER_MAX: u64 = 1024;

/// A configuration key and value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Setting {
    /// Key.
    pub key: String,
    /// Value.
    pub value: String,
}

/// A named digest (dataset, model).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct NamedDigest {
    /// Name.
    pub name: String,
    /// SHA-256 of the content.
    pub digest: Digest,
}

/// Resources a run used.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ResourceUsage {
    /// Wall time in milliseconds.
    pub wall_ms: u64,
    /// CPU time in milliseconds.
    pub cpu_ms: u64,
    /// Peak memory in bytes.
    pub peak_memory_bytes: u64,
    /// GPU busy time in milliseconds.
    pub gpu_ms: u64,
    /// Bytes written to outputs.
    pub output_bytes: u64,
}

/// Metrics measured on the outputs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EvaluationReport {
    /// Metric values.
    pub metrics: Vec<MetricValue>,
    /// Free-form notes.
    pub notes: String,
}

/// One measured metric.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct MetricValue {
    /// Metric name.
    pub name: String,
    /// Value, fixed-point with six decimals.
    pub value: Fixed,
}

wire!(DeliveryManifest, "delivery manifest", 64 * 1024);
wire!(CheckpointNote, "checkpoint note", 1024);

impl Message for CheckpointNote {
    const DOMAIN: &'static str = "cannabis/checkpoint-note/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.worker)
    }
    fn validate(&self) -> Result<(), Invalid> {
        if !super::is_safe_name(&self.checkpoint.name) {
            return Err(Invalid::new("checkpoint.name", "not a plain file name"));
        }
        if self.seq == 0 {
            return Err(Invalid::new("seq", "counts from 1"));
        }
        Ok(())
    }
}

impl Message for DeliveryManifest {
    const DOMAIN: &'static str = "cannabis/delivery-manifest/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.worker)
    }
    fn validate(&self) -> Result<(), Invalid> {
        let mut seen = std::collections::BTreeSet::new();
        for o in &self.outputs {
            if !super::is_safe_name(&o.name) {
                return Err(Invalid::new(
                    "outputs",
                    format!("{:?} is not a plain file name", o.name),
                ));
            }
            if !seen.insert(o.name.as_str()) {
                return Err(Invalid::new(
                    "outputs",
                    format!("{:?} is named twice", o.name),
                ));
            }
        }
        Ok(())
    }
}

/// A worker's proof-of-compute result, in exactly the seed layout. It carries its own
/// signature (the `signature` field) rather than an envelope, because it is embedded as the
/// payload of a `SUBMIT_RESULT` transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ComputeResult {
    /// The task, as a UUID string.
    pub task_id: Uuid,
    /// The worker's `cpc1...` address; must equal the transaction's sender.
    pub worker_address: Address,
    /// SHA-256 of the result, as `0x` + 64 lowercase hex digits.
    #[serde(with = "crate::bytes::hex0x::digest")]
    pub result_hash: Digest,
    /// Proof of correctness (reserved for zero-knowledge proofs), if any.
    pub proof: Option<String>,
    /// Nonce, for synthetic tasks.
    pub nonce: Option<u64>,
    /// The worker's ed25519 signature, as `0x` + 128 lowercase hex digits.
    #[serde(with = "crate::bytes::hex0x::opt_signature")]
    pub signature: Option<SignatureBytes>,
}

/// Why a compute result is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeResultError {
    /// The signature field is empty.
    #[error("compute result is not signed")]
    Unsigned,
    /// The signature does not verify for `worker_address`.
    #[error(transparent)]
    BadSignature(#[from] BadSignature),
}

/// Domain of the compute result's own signature.
pub const COMPUTE_RESULT_DOMAIN: &str = "cannabis/compute-result/v1";

wire!(ComputeResult, "compute result", 4 * 1024);

impl ComputeResult {
    /// A result signed by `keys`, whose address becomes `worker_address`.
    pub fn signed(
        keys: &Keypair,
        task_id: Uuid,
        result_hash: Digest,
        proof: Option<String>,
        nonce: Option<u64>,
    ) -> Self {
        let mut r = ComputeResult {
            task_id,
            worker_address: keys.address(),
            result_hash,
            proof,
            nonce,
            signature: None,
        };
        r.signature = Some(keys.sign_raw(&r.signing_bytes()));
        r
    }

    /// The bytes the signature covers: the domain, then the canonical encoding of this
    /// result with `signature` empty.
    pub fn signing_bytes(&self) -> Vec<u8> {
        let unsigned = ComputeResult {
            signature: None,
            ..self.clone()
        };
        signing_input(COMPUTE_RESULT_DOMAIN, &codec::encode(&unsigned))
    }

    /// Checks the signature against `worker_address`.
    pub fn verify(&self) -> Result<(), ComputeResultError> {
        let sig = self
            .signature
            .as_ref()
            .ok_or(ComputeResultError::Unsigned)?;
        self.worker_address.verify(&self.signing_bytes(), sig)?;
        Ok(())
    }

    /// The result's id: SHA-256 of its canonical encoding, signature included. This is the
    /// leaf data of the block's `compute_root`.
    pub fn id(&self) -> Digest {
        Digest::of(&codec::encode(self))
    }
}

impl From<ComputeResultError> for Invalid {
    fn from(e: ComputeResultError) -> Self {
        Invalid::new("payload.signature", e.to_string())
    }
}
