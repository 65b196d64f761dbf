//! Bounded bid fan-in: how a requester sizes each task's [`BidCall`] so that an offer draws
//! about `target` bids however many workers match, and how many bids it keeps.
//!
//! The requester looks at a sample of the ads it holds (at most `sample`, from a place the
//! job id picks), prices the task on each matching ad with the ad's own price sheet, takes
//! the median as the reference price, and scales the sample's summed weights to the whole
//! view. The odds then give an expected `target` drawn workers (see
//! [`cannabis_protocol::draw`]). If too few bids come, the engine widens the call when the
//! bid window ends. Every rule a worker could break is checked on receipt: the draw (from
//! the bid's own price), one bid per worker and task, and the cap on bids kept.

use cannabis_protocol::draw::{self, BidCall};
use cannabis_protocol::{Address, Amount, TaskSpec, Uuid};
use serde::{Deserialize, Serialize};

use crate::View;
use crate::matching::{Context, Matcher};
use crate::quote;

/// How a requester calls for bids.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaninConfig {
    /// Bids wanted for a single-worker task.
    pub min_target: u32,
    /// Bids wanted per rank of a group task (a group of `k` wants `max(min_target,
    /// per_rank * k)`).
    pub per_rank: u32,
    /// Bids kept per task, as a multiple of the target.
    pub keep_factor: u32,
    /// Most ads looked at to size a call.
    pub sample: u32,
    /// How much a widened call multiplies the odds by.
    pub widen_factor: u32,
}

impl Default for FaninConfig {
    fn default() -> Self {
        Self {
            min_target: 8,
            per_rank: 2,
            keep_factor: 4,
            sample: 1024,
            widen_factor: 4,
        }
    }
}

impl FaninConfig {
    /// Bids wanted for a task with `group_size` ranks.
    pub fn target(&self, group_size: u32) -> u32 {
        self.min_target
            .max(self.per_rank.saturating_mul(group_size.max(1)))
    }

    /// Bids kept for a task with `group_size` ranks.
    pub fn keep(&self, group_size: u32) -> u32 {
        self.target(group_size)
            .saturating_mul(self.keep_factor.max(1))
    }
}

/// A task's call, and what sizing it saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sized {
    /// The call.
    pub call: BidCall,
    /// Ads that qualified for the task among those looked at (a sample of at most
    /// [`FaninConfig::sample`]): workers the requester knows could bid.
    pub qualified: u32,
}

/// Sizes the call of `task` (job `job_id`, lasting `duration_ms`) from the ads in `view`,
/// leaving out `me` (a node does not bid on its own offers).
pub fn size_call(
    config: &FaninConfig,
    view: &View,
    me: &Address,
    job_id: &Uuid,
    task: &TaskSpec,
    duration_ms: u64,
    ctx: &Context<'_>,
) -> Sized {
    let target = config.target(task.group_size);
    let total = view
        .ad_count()
        .saturating_sub(usize::from(view.ad(me).is_some()));
    let sample = (config.sample.max(1) as usize).min(total.max(1));
    // Where the sample starts, from the job id: spread over the view, and the same on
    // every node that recomputes it.
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&job_id.0[..8]);
    let start = if total > sample {
        (u64::from_le_bytes(seed) % (total as u64)) as usize
    } else {
        0
    };
    let matcher = Matcher::new(task);
    let mut looked = 0usize;
    let mut qualified = 0u32;
    let mut prices: Vec<Amount> = Vec::new();
    let ads = view
        .ads()
        .chain(view.ads())
        .filter(|e| e.ad().node != *me)
        .skip(start)
        .take(sample);
    for e in ads {
        looked += 1;
        let ad = e.ad();
        if !matcher.qualifies(ad, ctx) {
            continue;
        }
        qualified += 1;
        if let Some(p) = quote::price(&ad.prices, ad, task, duration_ms) {
            prices.push(p);
        }
    }
    if looked == 0 {
        return Sized {
            call: BidCall {
                target,
                ..BidCall::EVERYONE
            },
            qualified,
        };
    }
    prices.sort_unstable();
    let ref_price = prices.get(prices.len() / 2).copied().unwrap_or(Amount(0));
    let weights: u128 = if prices.is_empty() {
        // None of the sample matches: assume one in it does, so a rare match is still
        // called; widening covers a wrong guess.
        u128::from(draw::WEIGHT_ONE)
    } else {
        prices
            .iter()
            .map(|p| u128::from(draw::weight(*p, ref_price)))
            .sum()
    };
    let scaled = weights * total as u128 / looked as u128;
    Sized {
        call: BidCall {
            target,
            odds_ppb: draw::odds_for(target, scaled).max(1),
            ref_price,
        },
        qualified,
    }
}

/// The call widened by `factor`: better odds for the same target and reference price.
pub fn widened(call: &BidCall, factor: u32) -> BidCall {
    BidCall {
        odds_ppb: call
            .odds_ppb
            .saturating_mul(factor.max(2))
            .min(draw::ODDS_ONE),
        ..*call
    }
}
