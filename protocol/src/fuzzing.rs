//! Every decoder a peer can reach, behind one entry point: what the fuzz targets (`fuzz/`)
//! and their regression inputs in the test suite run. A decoder may refuse anything; it
//! must never panic, hang or allocate beyond its kind's cap.

use crate::{
    Award, Bid, Block, Cancel, CapabilityAd, ChallengePass, ChallengeRequest, ChallengeResponse,
    ComputeResult, Decline, DeliveryManifest, JobOffer, LeaseAccept, LeaseRenewal, MarketRequest,
    MarketResponse, Message, Signed, SyncRequest, SyncResponse, Transaction, TransferRequest, Wire,
    decode,
};

/// The kinds, by the first byte of a fuzz input (modulo their number).
pub const KINDS: &[&str] = &[
    "capability-ad",
    "job-offer",
    "bid",
    "decline",
    "award",
    "lease-accept",
    "lease-renewal",
    "cancel",
    "challenge-pass",
    "delivery-manifest",
    "transaction",
    "market-request",
    "market-response",
    "sync-request",
    "sync-response",
    "challenge-request",
    "challenge-response",
    "block",
    "compute-result",
    "transfer-request",
    "transfer-response",
];

fn signed<T: Message>(bytes: &[u8]) {
    if let Ok(s) = Signed::<T>::from_bytes(bytes) {
        let _ = s.verify();
        let _ = s.open();
    }
}

fn plain<T: Wire>(bytes: &[u8]) -> Option<T> {
    decode::<T>(bytes).ok()
}

/// Decodes `data[1..]` as the kind `data[0]` picks, with every check a receiver makes.
pub fn decode_any(data: &[u8]) {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    match usize::from(kind) % KINDS.len() {
        0 => signed::<CapabilityAd>(bytes),
        1 => signed::<JobOffer>(bytes),
        2 => signed::<Bid>(bytes),
        3 => signed::<Decline>(bytes),
        4 => signed::<Award>(bytes),
        5 => signed::<LeaseAccept>(bytes),
        6 => signed::<LeaseRenewal>(bytes),
        7 => signed::<Cancel>(bytes),
        8 => signed::<ChallengePass>(bytes),
        9 => signed::<DeliveryManifest>(bytes),
        10 => signed::<Transaction>(bytes),
        11 => {
            if let Some(r) = plain::<MarketRequest>(bytes) {
                match r {
                    MarketRequest::Bid(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::Decline(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::Award(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::LeaseAccept(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::LeaseRenewal(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::Cancel(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::RunReport(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::Deliver(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::Checkpoint(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::ChallengePass(s) => {
                        let _ = s.open();
                    }
                    MarketRequest::Ping { .. } => {}
                }
            }
        }
        12 => {
            let _ = plain::<MarketResponse>(bytes);
        }
        13 => {
            let _ = plain::<SyncRequest>(bytes);
        }
        14 => {
            if let Some(page) = plain::<SyncResponse>(bytes) {
                for s in page.ads {
                    let _ = s.open();
                }
                for s in page.offers {
                    let _ = s.open();
                }
            }
        }
        15 => {
            if let Some(r) = plain::<ChallengeRequest>(bytes) {
                let _ = crate::challenge::Challenge::new(r.seed, r.n, r.rounds);
            }
        }
        16 => {
            if let Some(r) = plain::<ChallengeResponse>(bytes) {
                let _ = r.to_answer();
            }
        }
        17 => {
            if let Some(b) = plain::<Block>(bytes) {
                let _ = b.verify();
            }
        }
        18 => {
            if let Some(r) = plain::<ComputeResult>(bytes) {
                let _ = r.verify();
            }
        }
        19 => {
            let _ = plain::<TransferRequest>(bytes);
        }
        _ => {
            if let Some(crate::TransferResponse::Chunk {
                index,
                size,
                root,
                data,
                proof,
            }) = plain::<crate::TransferResponse>(bytes)
            {
                let p = crate::merkle::InclusionProof {
                    index,
                    tree_size: size.div_ceil(crate::TRANSFER_CHUNK),
                    path: proof,
                };
                let _ = p.verify(&data, &root);
            }
        }
    }
}
