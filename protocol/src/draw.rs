//! The bid draw: how an offer draws a bounded number of bids however many workers match.
//!
//! Each task of an offer carries a [`BidCall`]: how many bids the requester wants
//! (`target`), the odds it computed from its view of the matching workers (`odds_ppb`, in
//! parts per billion), and a reference price. A worker that matches the task bids only if it
//! is *drawn*:
//!
//! ```text
//! distance  = worker_point(worker) - task_point(job_id, task)      (mod 2^64)
//! threshold = odds_ppb * weight(price) * 2^64 / (10^9 * 256)        (saturating)
//! drawn     = odds_ppb >= 10^9  or  distance < threshold
//! ```
//!
//! `worker_point` and `task_point` are the first eight bytes (big-endian) of domain-separated
//! SHA-256 hashes, so anyone can recompute the draw from the offer and the bid: a requester
//! refuses (and penalizes) a bid from a worker that was not drawn, before it spends a
//! signature check on it. The weight favours cheap quotes:
//! `weight = clamp(floor(16 * ref_price / price)^2, 64, 4096)` in 1/256 units, so a quote at
//! the reference price counts once, one at a quarter of it sixteen times, one at twice it a
//! quarter. A worker cannot buy a better draw without honouring the low price: the weight
//! is computed from the price in its signed bid.
//!
//! The requester picks `odds_ppb` so that the expected number of drawn workers,
//! `sum(min(1, odds * weight_i / 256))` over the workers it knows to match, is `target`.
//! Widening the call raises the odds; since the distance does not depend on the odds, the
//! workers drawn before are drawn again, and the new ones join them.

use serde::{Deserialize, Serialize};

use crate::{Address, Amount, Digest, JobOffer, Uuid};

/// Odds of one: every matching worker is drawn.
pub const ODDS_ONE: u32 = 1_000_000_000;

/// Weight of a quote at the reference price, in 1/256 units.
pub const WEIGHT_ONE: u64 = 256;

/// The largest weight (a quote at a sixteenth of the reference price or below).
pub const WEIGHT_MAX: u64 = 4096;

/// The smallest weight (a quote at twice the reference price or above).
pub const WEIGHT_MIN: u64 = 64;

/// How one task of an offer calls for bids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct BidCall {
    /// Bids the requester wants for this task.
    pub target: u32,
    /// Odds of a worker at the reference price being drawn, in parts per billion
    /// ([`ODDS_ONE`] and above: every matching worker).
    pub odds_ppb: u32,
    /// The price the weights are relative to (0: every quote weighs the same).
    pub ref_price: Amount,
}

impl BidCall {
    /// A call that every matching worker answers.
    pub const EVERYONE: BidCall = BidCall {
        target: 0,
        odds_ppb: ODDS_ONE,
        ref_price: Amount(0),
    };
}

fn point(parts: &[&[u8]]) -> u64 {
    let d = Digest::of_parts(parts);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d.0[..8]);
    u64::from_be_bytes(b)
}

/// Where a task sits on the draw's ring.
pub fn task_point(job_id: &Uuid, task: u32) -> u64 {
    point(&[b"cannabis/draw/task/v1\0", &job_id.0, &task.to_le_bytes()])
}

/// Where a worker sits on the draw's ring.
pub fn worker_point(worker: &Address) -> u64 {
    point(&[b"cannabis/draw/worker/v1\0", worker.public_key()])
}

/// The weight of a quote of `price` against `ref_price`, in 1/256 units.
pub fn weight(price: Amount, ref_price: Amount) -> u64 {
    if ref_price.0 == 0 {
        return WEIGHT_ONE;
    }
    if price.0 == 0 {
        return WEIGHT_MAX;
    }
    let q = u128::from(ref_price.0) * 16 / u128::from(price.0);
    let w = q.saturating_mul(q);
    u64::try_from(w)
        .unwrap_or(WEIGHT_MAX)
        .clamp(WEIGHT_MIN, WEIGHT_MAX)
}

/// The distance below which a worker whose quote weighs `weight` is drawn.
pub fn threshold(odds_ppb: u32, weight: u64) -> u64 {
    let scaled = (u128::from(odds_ppb) * u128::from(weight)) << 64;
    let t = scaled / (u128::from(ODDS_ONE) * u128::from(WEIGHT_ONE));
    u64::try_from(t).unwrap_or(u64::MAX)
}

/// The ring distance from a task to a worker.
pub fn distance(task_point: u64, worker_point: u64) -> u64 {
    worker_point.wrapping_sub(task_point)
}

/// Whether `worker`, quoting `price`, is drawn for task `task` of job `job_id` under `call`.
pub fn drawn(call: &BidCall, job_id: &Uuid, task: u32, worker: &Address, price: Amount) -> bool {
    if call.odds_ppb >= ODDS_ONE {
        return true;
    }
    let t = threshold(call.odds_ppb, weight(price, call.ref_price));
    distance(task_point(job_id, task), worker_point(worker)) < t
}

/// The odds that make the expected number of drawn workers `target`, given the sum of the
/// matching workers' weights (`weights`, in 1/256 units): `target * 256 / weights`, in
/// parts per billion, capped at [`ODDS_ONE`]. Workers whose weighted odds pass one are
/// drawn for sure, so the expectation is then a little under `target`; widening covers
/// that.
pub fn odds_for(target: u32, weights: u128) -> u32 {
    if weights == 0 {
        return ODDS_ONE;
    }
    let odds = u128::from(target) * u128::from(WEIGHT_ONE) * u128::from(ODDS_ONE) / weights;
    u32::try_from(odds.min(u128::from(ODDS_ONE))).unwrap_or(ODDS_ONE)
}

/// Most offer shards a network may have.
pub const MAX_SHARDS: u32 = 1024;

/// The shard of a point on the ring, among `shards` (a power of two): its top bits.
pub fn shard_of(point: u64, shards: u32) -> u32 {
    if shards <= 1 {
        return 0;
    }
    (point >> (64 - shards.trailing_zeros())) as u32
}

/// The shards a task's call reaches: those holding a point in
/// `[task_point, task_point + threshold(odds, WEIGHT_MAX))` on the ring, which is where
/// every worker the call could draw at any price sits. An offer is gossiped on the topics
/// of these shards (every shard when the call reaches everyone).
pub fn reached_shards(call: &BidCall, job_id: &Uuid, task: u32, shards: u32) -> Vec<u32> {
    if shards <= 1 {
        return vec![0];
    }
    let reach = threshold(call.odds_ppb, WEIGHT_MAX);
    let span = u64::MAX >> shards.trailing_zeros();
    if call.odds_ppb >= ODDS_ONE || reach >= u64::MAX - span {
        return (0..shards).collect();
    }
    let start = task_point(job_id, task);
    let first = shard_of(start, shards);
    let last = shard_of(start.wrapping_add(reach), shards);
    let mut out = vec![first];
    let mut s = first;
    while s != last {
        s = (s + 1) % shards;
        out.push(s);
    }
    out
}

/// The shards an offer reaches: those of every task's call, each once, in order. Its
/// topics are these shards' topics.
pub fn offer_shards(offer: &JobOffer, shards: u32) -> Vec<u32> {
    let mut out: Vec<u32> = offer
        .calls
        .iter()
        .zip(0u32..)
        .flat_map(|(call, task)| reached_shards(call, &offer.job_id, task, shards))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Keypair;

    #[test]
    fn weights_favour_cheap_quotes_within_bounds() {
        let r = Amount(1000);
        assert_eq!(weight(Amount(1000), r), WEIGHT_ONE);
        assert_eq!(weight(Amount(250), r), WEIGHT_MAX);
        assert_eq!(weight(Amount(1), r), WEIGHT_MAX);
        assert_eq!(weight(Amount(0), r), WEIGHT_MAX);
        assert_eq!(weight(Amount(2000), r), WEIGHT_MIN);
        assert_eq!(weight(Amount(u64::MAX), r), WEIGHT_MIN);
        assert_eq!(weight(Amount(500), Amount(0)), WEIGHT_ONE);
        assert_eq!(weight(Amount(1), Amount(u64::MAX)), WEIGHT_MAX);
        let mut last = WEIGHT_MAX;
        for p in (100..3000).step_by(37) {
            let w = weight(Amount(p), r);
            assert!(w <= last, "weights never rise with the price");
            last = w;
        }
    }

    #[test]
    fn odds_of_one_draw_everyone_and_widening_keeps_who_was_drawn() {
        let job = Uuid([9; 16]);
        let workers: Vec<Address> = (0..2000u32)
            .map(|i| {
                let mut s = [0u8; 32];
                s[..4].copy_from_slice(&i.to_le_bytes());
                s[31] = 1;
                Keypair::from_secret(s).address()
            })
            .collect();
        let price = Amount(100);
        let narrow = BidCall {
            target: 10,
            odds_ppb: odds_for(10, 2000 * u128::from(WEIGHT_ONE)),
            ref_price: price,
        };
        let wide = BidCall {
            odds_ppb: narrow.odds_ppb * 4,
            ..narrow
        };
        let drawn_at = |c: &BidCall| -> Vec<usize> {
            (0..workers.len())
                .filter(|&i| drawn(c, &job, 0, &workers[i], price))
                .collect()
        };
        let n = drawn_at(&narrow);
        let w = drawn_at(&wide);
        assert!(n.iter().all(|i| w.contains(i)));
        // Around 10 and 40: far from 2000.
        assert!((2..=30).contains(&n.len()), "{}", n.len());
        assert!((15..=80).contains(&w.len()), "{}", w.len());
        assert_eq!(drawn_at(&BidCall::EVERYONE).len(), workers.len());
    }

    #[test]
    fn an_offer_reaches_the_shards_of_every_worker_it_can_draw() {
        let job = Uuid([3; 16]);
        let call = BidCall {
            target: 8,
            odds_ppb: 2_000,
            ref_price: Amount(100),
        };
        for shards in [1u32, 2, 16, 256] {
            let reached = reached_shards(&call, &job, 0, shards);
            assert!(!reached.is_empty() && reached.len() <= 2, "{reached:?}");
            for i in 0..5000u32 {
                let mut s = [0u8; 32];
                s[..4].copy_from_slice(&i.to_le_bytes());
                s[31] = 9;
                let w = Keypair::from_secret(s).address();
                if drawn(&call, &job, 0, &w, Amount(1)) {
                    assert!(reached.contains(&shard_of(worker_point(&w), shards)));
                }
            }
        }
        assert_eq!(reached_shards(&BidCall::EVERYONE, &job, 0, 8).len(), 8);
        assert_eq!(shard_of(u64::MAX, 16), 15);
        assert_eq!(shard_of(0, 16), 0);
        assert_eq!(shard_of(u64::MAX, 1), 0);
    }

    #[test]
    fn threshold_saturates_instead_of_overflowing() {
        assert_eq!(threshold(ODDS_ONE, WEIGHT_MAX), u64::MAX);
        assert_eq!(threshold(0, WEIGHT_MAX), 0);
        assert_eq!(threshold(ODDS_ONE / 2, WEIGHT_ONE), 1 << 63);
        assert_eq!(odds_for(5, 0), ODDS_ONE);
        assert_eq!(odds_for(u32::MAX, 1), ODDS_ONE);
    }
}
