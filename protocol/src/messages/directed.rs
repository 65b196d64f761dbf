//! Frames of the directed (request-response) protocols: what two peers say to each other
//! about one job, and how a node that joins late learns the live market.

use serde::{Deserialize, Serialize};

use super::{
    Award, Bid, Block, Cancel, CapabilityAd, ChallengePass, CheckpointNote, Decline,
    DeliveryManifest, JobOffer, LeaseAccept, LeaseRenewal, RunReport, Transaction, wire,
};
use crate::{Address, Digest, Signed, Uuid};

/// A request of the market protocol (`/cannabis/market/1`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum MarketRequest {
    /// A worker's bid, to the requester.
    Bid(Signed<Bid>),
    /// A worker's signed reason for not bidding, to the requester.
    Decline(Signed<Decline>),
    /// A lease grant, to the worker.
    Award(Signed<Award>),
    /// The worker's countersignature, to the requester.
    LeaseAccept(Signed<LeaseAccept>),
    /// A lease extension, to the worker.
    LeaseRenewal(Signed<LeaseRenewal>),
    /// A cancellation, to every rank.
    Cancel(Signed<Cancel>),
    /// Where a leased attempt stands, from the worker to the requester.
    RunReport(Signed<RunReport>),
    /// A rank's signed delivery: its outputs' digests and where they came from, from the
    /// worker to the requester, who then fetches the outputs on the transfer protocol.
    Deliver(Signed<DeliveryManifest>),
    /// A rank's checkpoint changed, from the worker to the requester, who then fetches it
    /// on the transfer protocol.
    Checkpoint(Signed<CheckpointNote>),
    /// A capability challenge pass, from the verifier to the worker that earned it.
    ChallengePass(Signed<ChallengePass>),
    /// A round-trip probe; answered with the same nonce.
    Ping {
        /// Echoed back.
        nonce: u64,
    },
}

/// The answer to a [`MarketRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum MarketResponse {
    /// Received, verified and recorded.
    Ack,
    /// Refused, with the reason.
    Refused {
        /// What was wrong.
        reason: String,
    },
    /// Answer to a ping.
    Pong {
        /// The request's nonce.
        nonce: u64,
    },
}

/// A request of the sync protocol (`/cannabis/sync/1`): one page of the live market, in
/// key order, after a cursor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum SyncRequest {
    /// Capability ads of nodes whose address sorts after `after`.
    Ads {
        /// Cursor: the last address of the previous page.
        after: Option<Address>,
    },
    /// Open offers whose job id sorts after `after`.
    Offers {
        /// Cursor: the last job id of the previous page.
        after: Option<Uuid>,
    },
}

/// One page of the live market. Every item is checked by the receiver exactly like gossip.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct SyncResponse {
    /// Signed capability ads (for an `ads` request).
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<Signed<CapabilityAd>>(), 0..3)"
        )
    )]
    pub ads: Vec<Signed<CapabilityAd>>,
    /// Signed offers (for an `offers` request).
    #[cfg_attr(
        feature = "arbitrary",
        proptest(
            strategy = "proptest::collection::vec(proptest::arbitrary::any::<Signed<JobOffer>>(), 0..3)"
        )
    )]
    pub offers: Vec<Signed<JobOffer>>,
    /// Whether another page follows.
    pub more: bool,
}

wire!(
    MarketRequest,
    "market request",
    64 * 1024 + crate::ENVELOPE_OVERHEAD + 512
);
wire!(MarketResponse, "market response", 4 * 1024);
wire!(SyncRequest, "sync request", 512);
wire!(SyncResponse, "sync response", 4 * 1024 * 1024);

/// A capability challenge, on the challenge protocol (`/cannabis/challenge/2`). See
/// [`crate::challenge`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct ChallengeRequest {
    /// The verifier's fresh random seed.
    pub seed: crate::Digest,
    /// Matrix dimension.
    pub n: u32,
    /// Products to sum.
    pub rounds: u32,
}

/// The prover's answer to a [`ChallengeRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum ChallengeResponse {
    /// `S`, row-major, each entry a little-endian `i64`.
    Answer {
        /// Dimension computed.
        n: u32,
        /// The entries.
        #[serde(with = "serde_bytes")]
        sum: Vec<u8>,
    },
    /// Not answered, with the reason (busy, size out of range).
    Refused {
        /// Why.
        reason: String,
    },
}

impl ChallengeResponse {
    /// The answer of a computed challenge.
    pub fn answer(answer: &crate::challenge::Answer) -> Self {
        ChallengeResponse::Answer {
            n: answer.n,
            sum: answer.sum.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Back to an [`crate::challenge::Answer`] (its size is checked by the verifier).
    pub fn to_answer(&self) -> Option<crate::challenge::Answer> {
        match self {
            ChallengeResponse::Answer { n, sum } => Some(crate::challenge::Answer {
                n: *n,
                sum: sum
                    .chunks_exact(8)
                    .map(|c| {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(c);
                        i64::from_le_bytes(b)
                    })
                    .collect(),
            }),
            ChallengeResponse::Refused { .. } => None,
        }
    }
}

wire!(ChallengeRequest, "challenge request", 256);
wire!(
    ChallengeResponse,
    "challenge response",
    8 * (crate::challenge::MAX_CHALLENGE_N as usize).pow(2) + 1024
);

/// A request of the ledger protocol (`/cannabis/ledger/1`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum LedgerRequest {
    /// A signed transaction, to the sequencer: answered `submitted` once it is kept
    /// durably for a block.
    Submit(Signed<Transaction>),
    /// Blocks from height `from` on, at most `max` (and at most 4 MiB of them), to any
    /// node: how a node that was away catches up.
    Blocks {
        /// The first height wanted.
        from: u64,
        /// The most blocks wanted.
        max: u32,
    },
    /// A testnet faucet's grant to `to`, to the sequencer when it holds the faucet's key.
    Faucet {
        /// Who receives the grant.
        to: Address,
    },
}

/// The answer to a [`LedgerRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum LedgerResponse {
    /// The transaction is kept for a block (its id).
    Submitted {
        /// The transaction's id.
        id: Digest,
    },
    /// Blocks in height order, from the height asked (none: the node has none there).
    Blocks(
        #[cfg_attr(
            feature = "arbitrary",
            proptest(
                strategy = "proptest::collection::vec(proptest::arbitrary::any::<Block>(), 0..2)"
            )
        )]
        Vec<Block>,
    ),
    /// Refused, with the reason.
    Refused {
        /// What was wrong.
        reason: String,
    },
}

wire!(LedgerRequest, "ledger request", 16 * 1024);
wire!(
    LedgerResponse,
    "ledger response",
    4 * 1024 * 1024 + 64 * 1024
);
