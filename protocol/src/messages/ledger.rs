//! Ledger transactions and blocks of the embedded dev chain.
//!
//! The transaction keeps the seed's fields (`from_address`, `to_address`, `amount`, `fee`,
//! `nonce`, `gas_price`, `gas_limit`, `payload`); its `tx_type` is derived from the payload
//! so the two can never disagree. A block header carries `compute_root`: the merkle root
//! (see [`crate::merkle`]) over the ids of the block's `SUBMIT_RESULT` compute results.

use serde::{Deserialize, Serialize};

use super::{ComputeResult, wire};
use crate::signed::OpenError;
use crate::{
    Address, Amount, Digest, FeeTerms, Invalid, Keypair, Message, Outcome, Signed, Timestamp, Uuid,
    Verified, merkle,
};

/// Gas limit of a `SUBMIT_RESULT` transaction, fixed by the seed.
pub const SUBMIT_RESULT_GAS_LIMIT: u64 = 80_000;

/// A ledger transaction, signed by `from_address` inside a `Signed` envelope.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Transaction {
    /// Sender; must be the signer.
    pub from_address: Address,
    /// Receiver, for transfers.
    pub to_address: Option<Address>,
    /// Amount moved (transfers) or locked (escrow lock).
    pub amount: Amount,
    /// Network fee: exactly `gas_limit * gas_price`, quoted separately from job budgets.
    pub fee: Amount,
    /// Sender's transaction counter.
    pub nonce: u64,
    /// Price per unit of gas.
    pub gas_price: u64,
    /// Gas limit; fixed per transaction type.
    pub gas_limit: u64,
    /// What the transaction does.
    pub payload: TxPayload,
}

/// The operation a transaction performs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum TxPayload {
    /// Move `amount` to `to_address`.
    Transfer,
    /// Record a worker's compute result.
    SubmitResult(ComputeResult),
    /// Lock a job's budget in escrow.
    EscrowLock(EscrowLock),
    /// Bind an awarded assignment (and its price) to the escrow.
    EscrowAssign(EscrowAssign),
    /// Bind several assignments of one job awarded together (a group's ranks) at once.
    EscrowAssignMany(EscrowAssignMany),
    /// A worker's commitment to a delivery.
    ResultCommit(ResultCommit),
    /// The requester disputes a delivery inside the review window.
    EscrowDispute(EscrowSettle),
    /// Settle an assignment: accept, partially accept, cancel, resolve a dispute.
    EscrowSettle(EscrowSettle),
    /// The requester ends a job early: no new assignments, every undelivered one is
    /// cancelled, and the rest of the lock is refunded once the delivered ones settle.
    EscrowCancel(EscrowCancel),
}

/// Transaction types, as the seed names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TxType {
    /// `TRANSFER`
    Transfer,
    /// `SUBMIT_RESULT`
    SubmitResult,
    /// `ESCROW_LOCK`
    EscrowLock,
    /// `ESCROW_ASSIGN`
    EscrowAssign,
    /// `ESCROW_ASSIGN_MANY`
    EscrowAssignMany,
    /// `RESULT_COMMIT`
    ResultCommit,
    /// `ESCROW_DISPUTE`
    EscrowDispute,
    /// `ESCROW_SETTLE`
    EscrowSettle,
    /// `ESCROW_CANCEL`
    EscrowCancel,
}

impl TxType {
    /// The fixed gas limit of this type.
    pub fn gas_limit(self) -> u64 {
        match self {
            TxType::Transfer => 21_000,
            TxType::SubmitResult => SUBMIT_RESULT_GAS_LIMIT,
            TxType::EscrowLock
            | TxType::EscrowAssign
            | TxType::EscrowAssignMany
            | TxType::ResultCommit
            | TxType::EscrowDispute
            | TxType::EscrowSettle
            | TxType::EscrowCancel => 60_000,
        }
    }

    /// The seed's upper-case name.
    pub fn name(self) -> &'static str {
        match self {
            TxType::Transfer => "TRANSFER",
            TxType::SubmitResult => "SUBMIT_RESULT",
            TxType::EscrowLock => "ESCROW_LOCK",
            TxType::EscrowAssign => "ESCROW_ASSIGN",
            TxType::EscrowAssignMany => "ESCROW_ASSIGN_MANY",
            TxType::ResultCommit => "RESULT_COMMIT",
            TxType::EscrowDispute => "ESCROW_DISPUTE",
            TxType::EscrowSettle => "ESCROW_SETTLE",
            TxType::EscrowCancel => "ESCROW_CANCEL",
        }
    }
}

/// Lock a job's budget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EscrowLock {
    /// The job.
    pub job_id: Uuid,
    /// Id of the signed offer whose terms are locked.
    pub offer: Digest,
    /// Budget locked (equals the transaction's `amount`).
    pub amount: Amount,
    /// Fee terms pinned for the job.
    pub fee: FeeTerms,
    /// Delivery deadline.
    pub deadline: Timestamp,
    /// Review window in milliseconds.
    pub review_window_ms: u64,
    /// Who resolves a dispute over this job: the network's resolver, named in its genesis.
    pub resolver: Address,
    /// How many assignments (ranks, over all tasks) the job has: once that many are
    /// settled, the rest of the lock is refunded.
    pub ranks: u32,
}

/// Bind an awarded assignment to the escrow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EscrowAssign {
    /// The job.
    pub job_id: Uuid,
    /// Task index.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// Worker paid on acceptance.
    pub worker: Address,
    /// Lease epoch; older epochs are refused.
    pub epoch: u64,
    /// Agreed price.
    pub price: Amount,
}

/// Most assignments one `ESCROW_ASSIGN_MANY` carries, so that the largest fits a
/// transaction's wire cap (8 KiB: at most 122 bytes each, with room to spare); a larger
/// group's ranks take several.
pub const MAX_ASSIGNED: usize = 56;

/// Bind several awarded assignments of one job to its escrow in one transaction: a
/// group's ranks are awarded together, and one signature for all of them is what every
/// node checks, instead of one per rank. It applies whole or not at all, each assignment
/// as an [`EscrowAssign`] would, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EscrowAssignMany {
    /// The job.
    pub job_id: Uuid,
    /// The assignments: at least one, at most [`MAX_ASSIGNED`].
    pub assignments: Vec<Assigned>,
}

/// One assignment of an [`EscrowAssignMany`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Assigned {
    /// Task index.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// Worker paid on acceptance.
    pub worker: Address,
    /// Lease epoch; older epochs are refused.
    pub epoch: u64,
    /// Agreed price.
    pub price: Amount,
}

impl EscrowAssignMany {
    /// The assignments, each as its own [`EscrowAssign`].
    pub fn each(&self) -> impl Iterator<Item = EscrowAssign> + '_ {
        self.assignments.iter().map(|a| EscrowAssign {
            job_id: self.job_id,
            task: a.task,
            rank: a.rank,
            worker: a.worker,
            epoch: a.epoch,
            price: a.price,
        })
    }
}

/// A worker's commitment to what it delivered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ResultCommit {
    /// The job.
    pub job_id: Uuid,
    /// Task index.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// Lease epoch.
    pub epoch: u64,
    /// Id of the signed delivery manifest.
    pub manifest: Digest,
}

/// The requester ends a job early.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EscrowCancel {
    /// The job.
    pub job_id: Uuid,
}

/// Settle (or dispute) one assignment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct EscrowSettle {
    /// The job.
    pub job_id: Uuid,
    /// Task index.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// Lease epoch.
    pub epoch: u64,
    /// The outcome; the split follows [`crate::Split::settle`].
    pub outcome: Outcome,
}

impl Transaction {
    /// The type, derived from the payload.
    pub fn tx_type(&self) -> TxType {
        match &self.payload {
            TxPayload::Transfer => TxType::Transfer,
            TxPayload::SubmitResult(_) => TxType::SubmitResult,
            TxPayload::EscrowLock(_) => TxType::EscrowLock,
            TxPayload::EscrowAssign(_) => TxType::EscrowAssign,
            TxPayload::EscrowAssignMany(_) => TxType::EscrowAssignMany,
            TxPayload::ResultCommit(_) => TxType::ResultCommit,
            TxPayload::EscrowDispute(_) => TxType::EscrowDispute,
            TxPayload::EscrowSettle(_) => TxType::EscrowSettle,
            TxPayload::EscrowCancel(_) => TxType::EscrowCancel,
        }
    }

    /// A transaction whose gas limit is its type's and whose fee is `gas_limit * gas_price`.
    pub fn new(
        from_address: Address,
        to_address: Option<Address>,
        amount: Amount,
        nonce: u64,
        gas_price: u64,
        payload: TxPayload,
    ) -> Result<Self, TxError> {
        let mut tx = Transaction {
            from_address,
            to_address,
            amount,
            fee: Amount::ZERO,
            nonce,
            gas_price,
            gas_limit: 0,
            payload,
        };
        tx.gas_limit = tx.tx_type().gas_limit();
        tx.fee = Amount(
            tx.gas_limit
                .checked_mul(gas_price)
                .ok_or(TxError::FeeOverflow)?,
        );
        Ok(tx)
    }

    /// A `SUBMIT_RESULT` transaction for `result`, from its worker.
    pub fn submit_result(
        result: ComputeResult,
        nonce: u64,
        gas_price: u64,
    ) -> Result<Self, TxError> {
        Self::new(
            result.worker_address,
            None,
            Amount::ZERO,
            nonce,
            gas_price,
            TxPayload::SubmitResult(result),
        )
    }
}

/// Transaction construction errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TxError {
    /// `gas_limit * gas_price` does not fit.
    #[error("network fee gas_limit * gas_price overflows")]
    FeeOverflow,
}

wire!(Transaction, "transaction", 8 * 1024);

impl Message for Transaction {
    const DOMAIN: &'static str = "cannabis/transaction/v1";

    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.from_address)
    }

    fn validate(&self) -> Result<(), Invalid> {
        let ty = self.tx_type();
        if self.gas_limit != ty.gas_limit() {
            return Err(Invalid::new(
                "gas_limit",
                format!(
                    "{} transactions use gas limit {}",
                    ty.name(),
                    ty.gas_limit()
                ),
            ));
        }
        let fee = self.gas_limit.checked_mul(self.gas_price);
        if fee != Some(self.fee.0) {
            return Err(Invalid::new("fee", "must equal gas_limit * gas_price"));
        }
        match &self.payload {
            TxPayload::Transfer => {
                if self.to_address.is_none() {
                    return Err(Invalid::new("to_address", "a transfer needs a receiver"));
                }
            }
            TxPayload::SubmitResult(r) => {
                if self.amount != Amount::ZERO || self.to_address.is_some() {
                    return Err(Invalid::new(
                        "amount",
                        "SUBMIT_RESULT moves no money and has no receiver",
                    ));
                }
                if r.worker_address != self.from_address {
                    return Err(Invalid::new(
                        "payload.worker_address",
                        "must equal from_address",
                    ));
                }
                r.verify()?;
            }
            TxPayload::EscrowLock(lock) => {
                if lock.amount != self.amount {
                    return Err(Invalid::new("amount", "must equal the locked amount"));
                }
            }
            TxPayload::EscrowAssignMany(many)
                if many.assignments.is_empty() || many.assignments.len() > MAX_ASSIGNED =>
            {
                return Err(Invalid::new(
                    "payload.assignments",
                    "must hold 1 to 56 assignments",
                ));
            }
            TxPayload::EscrowAssign(_)
            | TxPayload::EscrowAssignMany(_)
            | TxPayload::ResultCommit(_)
            | TxPayload::EscrowDispute(_)
            | TxPayload::EscrowSettle(_)
            | TxPayload::EscrowCancel(_) => {
                if self.amount != Amount::ZERO {
                    return Err(Invalid::new(
                        "amount",
                        "escrow operations move no amount themselves",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A block header, signed by the sequencer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct BlockHeader {
    /// Height; the genesis is height 0 and the first block is 1.
    pub height: u64,
    /// Hash (message id) of the previous header; for block 1, the genesis id
    /// ([`crate::Genesis::id`]).
    pub prev_hash: Digest,
    /// When the block was made.
    pub timestamp: Timestamp,
    /// The sequencer; must be the signer.
    pub sequencer: Address,
    /// Number of transactions.
    pub tx_count: u32,
    /// Merkle root over SHA-256 of each signed transaction's wire bytes.
    pub tx_root: Digest,
    /// Number of `SUBMIT_RESULT` compute results: the size of the `compute_root` tree,
    /// which inclusion proofs are checked against.
    pub compute_count: u32,
    /// Merkle root over the ids of the block's `SUBMIT_RESULT` compute results.
    pub compute_root: Digest,
}

wire!(BlockHeader, "block header", 1024);

impl Message for BlockHeader {
    const DOMAIN: &'static str = "cannabis/block-header/v1";
    fn claimed_signer(&self) -> Option<&Address> {
        Some(&self.sequencer)
    }
}

/// A block: the signed header and the signed transactions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct Block {
    /// The signed header.
    pub header: Signed<BlockHeader>,
    /// The signed transactions, in order.
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<Signed<Transaction>>(), 0..6)"
        )
    )]
    pub txs: Vec<Signed<Transaction>>,
}

wire!(Block, "block", 1024 * 1024);

/// Why a block was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// The header did not verify.
    #[error("block header: {0}")]
    Header(OpenError),
    /// A transaction did not verify.
    #[error("transaction {index}: {error}")]
    Tx {
        /// Position in the block.
        index: usize,
        /// What was wrong.
        error: OpenError,
    },
    /// `tx_count` disagrees with the transactions.
    #[error("header says {claimed} transactions, block holds {actual}")]
    TxCount {
        /// From the header.
        claimed: u32,
        /// Counted.
        actual: usize,
    },
    /// `tx_root` disagrees with the transactions.
    #[error("tx_root does not match the transactions")]
    TxRoot,
    /// `compute_root` or `compute_count` disagrees with the compute results.
    #[error("compute_root or compute_count does not match the block's compute results")]
    ComputeRoot,
    /// Too many transactions for one block.
    #[error("too many transactions for one block")]
    TooManyTxs,
}

/// The ids of the `SUBMIT_RESULT` compute results in `txs`, in order: the leaves of
/// `compute_root`.
pub fn compute_leaves<'a>(txs: impl IntoIterator<Item = &'a Transaction>) -> Vec<[u8; 32]> {
    txs.into_iter()
        .filter_map(|tx| match &tx.payload {
            TxPayload::SubmitResult(r) => Some(r.id().0),
            _ => None,
        })
        .collect()
}

fn tx_root(txs: &[Signed<Transaction>]) -> Digest {
    let leaves: Vec<[u8; 32]> = txs.iter().map(|t| Digest::of(&t.to_bytes()).0).collect();
    merkle::root(&leaves)
}

impl Block {
    /// Builds and signs a block of already-verified transactions.
    pub fn build(
        sequencer: &Keypair,
        height: u64,
        prev_hash: Digest,
        timestamp: Timestamp,
        txs: Vec<(Signed<Transaction>, Transaction)>,
    ) -> Result<Block, BlockError> {
        let tx_count = u32::try_from(txs.len()).map_err(|_| BlockError::TooManyTxs)?;
        let leaves = compute_leaves(txs.iter().map(|(_, t)| t));
        let compute_count = u32::try_from(leaves.len()).map_err(|_| BlockError::TooManyTxs)?;
        let signed: Vec<Signed<Transaction>> = txs.into_iter().map(|(s, _)| s).collect();
        let header = BlockHeader {
            height,
            prev_hash,
            timestamp,
            sequencer: sequencer.address(),
            tx_count,
            tx_root: tx_root(&signed),
            compute_count,
            compute_root: merkle::root(&leaves),
        };
        Ok(Block {
            header: Signed::sign(sequencer, &header),
            txs: signed,
        })
    }

    /// The block hash: the id of its signed header.
    pub fn hash(&self) -> Digest {
        self.header.id()
    }

    /// Checks that the compute result with id `result` is in this block's `compute_root`,
    /// taking the tree size from the header rather than from the proof.
    pub fn proves_compute_result(
        header: &BlockHeader,
        result: &Digest,
        proof: &merkle::InclusionProof,
    ) -> Result<(), merkle::ProofError> {
        let sized = merkle::InclusionProof {
            tree_size: u64::from(header.compute_count),
            ..proof.clone()
        };
        sized.verify(&result.0, &header.compute_root)
    }

    /// Verifies the header, every transaction, the count and both roots. Returns the
    /// verified header and transactions.
    pub fn verify(
        &self,
    ) -> Result<(Verified<BlockHeader>, Vec<Verified<Transaction>>), BlockError> {
        let header = self.header.verify().map_err(BlockError::Header)?;
        if header.body.tx_count as usize != self.txs.len() {
            return Err(BlockError::TxCount {
                claimed: header.body.tx_count,
                actual: self.txs.len(),
            });
        }
        let txs = self
            .txs
            .iter()
            .enumerate()
            .map(|(index, t)| t.verify().map_err(|error| BlockError::Tx { index, error }))
            .collect::<Result<Vec<_>, _>>()?;
        if tx_root(&self.txs) != header.body.tx_root {
            return Err(BlockError::TxRoot);
        }
        let leaves = compute_leaves(txs.iter().map(|t| &t.body));
        if leaves.len() != header.body.compute_count as usize
            || merkle::root(&leaves) != header.body.compute_root
        {
            return Err(BlockError::ComputeRoot);
        }
        Ok((header, txs))
    }
}
