//! The transfer protocol (`/cannabis/transfer/1`): one peer fetches an object of a lease
//! from another, one checked chunk at a time, at any chunk index (so a transfer resumes
//! where it stopped, after a dropped connection or a restart of either side).
//!
//! The fetcher is authenticated by the connection (the peer id is the node's key); the
//! holder serves an object only to the party it is for: a delivered output only to the
//! requester its manifest names.

use serde::{Deserialize, Serialize};

use super::wire;
use crate::{Digest, Uuid};

/// Size of every transfer chunk but an object's last.
pub const TRANSFER_CHUNK: u64 = 256 * 1024;

/// What an object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum ObjectKind {
    /// A declared output of a delivered rank, as its age file; served by the worker to
    /// the requester.
    Output,
    /// The task's program bundle, as an age file to the worker; served by the requester
    /// to the worker the rank is awarded to at that epoch.
    Bundle,
    /// An input of the task (staged, or an earlier task's output), by its file name, as
    /// an age file to the worker; served like the bundle.
    Input,
    /// A rank's checkpoint: served by the worker to the requester, named by the
    /// [`crate::CheckpointNote`]'s `seq` in decimal, as an age file to the requester; and
    /// by the requester to the worker an award with a `resume` names, named as the task
    /// declares it, as an age file to the worker.
    Checkpoint,
}

/// One object of one lease.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ObjectRef {
    /// The job.
    pub job_id: Uuid,
    /// Index of the task.
    pub task: u32,
    /// The rank.
    pub rank: u32,
    /// The lease epoch it belongs to.
    pub epoch: u64,
    /// What it is.
    pub kind: ObjectKind,
    /// Its name: the output's or input's file name (`bundle` for the bundle).
    pub name: String,
}

/// A request for chunk `index` of an object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct TransferRequest {
    /// The object.
    pub object: ObjectRef,
    /// The chunk, from 0.
    pub index: u64,
}

/// The answer to a [`TransferRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum TransferResponse {
    /// The chunk, with the sibling hashes that lead from its leaf hash to the object's
    /// Merkle root (the `cipher_root` of its manifest entry).
    Chunk {
        /// The chunk's index.
        index: u64,
        /// The object's size in bytes.
        size: u64,
        /// The object's Merkle root over its chunks (an output's must be the
        /// `cipher_root` its manifest signed).
        root: Digest,
        /// The bytes: [`TRANSFER_CHUNK`] of them, fewer for the last chunk.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// The inclusion proof's path.
        proof: Vec<Digest>,
    },
    /// Not served, with the reason.
    Refused {
        /// Why.
        reason: String,
    },
}

wire!(TransferRequest, "transfer request", 1024);
wire!(
    TransferResponse,
    "transfer response",
    TRANSFER_CHUNK as usize + 64 * 34 + 512
);
