//! The worker's side of matching: its owner's policy against an offer, and its quote.
//!
//! A worker whose hardware does not meet a task's requirements stays silent (nothing to
//! say to a requester that asked for something else). One that could run it but will not,
//! by its owner's choice or because its price is above the budget, sends a signed reason.

use cannabis_protocol::{
    AdapterKind, Address, Amount, Bid, CapabilityAd, Decline, Digest, FeeTerms, JobOffer,
    PriceSheet, TaskSpec, draw,
};
use serde::{Deserialize, Serialize};

use crate::matching::{self, Context};

/// What the owner of a worker opts in to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerPolicy {
    /// Whether requesters' own programs may run here (`process` and `torchrun` adapters).
    /// The synthetic task is always allowed.
    pub custom_code: bool,
    /// Longest lease this worker takes, in milliseconds from the start to the job's
    /// deadline; `None` for no limit.
    pub max_duration_ms: Option<u64>,
    /// Requesters whose offers this worker answers; empty means anyone.
    pub allowed_requesters: Vec<Address>,
    /// How long a quote holds, in milliseconds; `None`: until the job's deadline, so the
    /// requester can still place a retry or a later task of a graph on it. A worker that
    /// is busy when an award comes refuses it, and the requester moves on.
    pub bid_validity_ms: Option<u64>,
    /// Most leases held at once. A worker that holds this many stops quoting and refuses
    /// awards as busy.
    pub max_leases: u32,
}

impl Default for WorkerPolicy {
    fn default() -> Self {
        Self {
            custom_code: false,
            max_duration_ms: None,
            allowed_requesters: Vec::new(),
            bid_validity_ms: None,
            max_leases: 4,
        }
    }
}

/// What a worker does about one task of an offer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Send this quote.
    Bid(Bid),
    /// Tell the requester why not.
    Decline(Decline),
    /// Its hardware does not meet the requirements: say nothing.
    Silent(Vec<matching::Requirement>),
    /// It matches, but the task's bid call did not draw it: say nothing.
    NotDrawn,
}

/// The price of one rank of `task` on this worker for `duration_ms`, from the owner's
/// sheet: cores, memory and whole GPUs by the hour, rounded up to the base unit, and at
/// least the sheet's minimum job. `None` when the task needs GPUs the sheet has no price
/// for.
pub fn price(
    sheet: &PriceSheet,
    ad: &CapabilityAd,
    task: &TaskSpec,
    duration_ms: u64,
) -> Option<Amount> {
    const GIB: u128 = 1 << 30;
    const HOUR_MS: u128 = 3_600_000;
    let r = &task.resources;
    let gpu_rate = if r.gpus == 0 {
        0
    } else {
        // The cheapest listed model among the GPUs that qualify, per GPU.
        ad.hardware
            .gpus
            .iter()
            .filter(|g| g.allowed && g.memory_bytes >= task.requirements.min_gpu_memory_bytes)
            .filter_map(|g| sheet.gpu_hour.iter().find(|p| p.model == g.name))
            .map(|p| u128::from(p.price.0))
            .min()?
    };
    // Everything in (base units) * ms * 1000 * GiB, divided once at the end.
    let per_hour_scaled = u128::from(r.cpu_millicores) * u128::from(sheet.cpu_core_hour.0) * GIB
        + u128::from(r.memory_bytes) * u128::from(sheet.memory_gib_hour.0) * 1000
        + u128::from(r.gpus) * gpu_rate * 1000 * GIB;
    let denom = HOUR_MS * 1000 * GIB;
    let total = (per_hour_scaled.checked_mul(u128::from(duration_ms))?).div_ceil(denom);
    let total = u64::try_from(total).ok()?;
    Some(Amount(total.max(sheet.minimum_job.0)))
}

/// A worker's answer to task `task` of `offer` (message id `offer_id`), given its own ad,
/// its owner's policy, its network's fee terms and the time. Only a worker the task's bid
/// call draws answers (see [`cannabis_protocol::draw`]); a decline is drawn at the call's
/// reference price. An offer whose fee terms are not the network's is declined: a worker
/// that took one would help its requester skip the fee (and with no terms pinned, a worker
/// cannot tell, so it takes none).
pub fn answer(
    policy: &WorkerPolicy,
    terms: Option<&FeeTerms>,
    ad: &CapabilityAd,
    offer: &JobOffer,
    offer_id: Digest,
    task: u32,
    ctx: &Context<'_>,
) -> Option<Answer> {
    let spec = offer.tasks.get(task as usize)?;
    let now = ctx.now;
    let unmet = matching::unmet(spec, ad, ctx);
    if !unmet.is_empty() {
        return Some(Answer::Silent(unmet));
    }
    let call = offer.calls.get(task as usize)?;
    let drawn = |price: Amount| draw::drawn(call, &offer.job_id, task, &ad.node, price);
    let decline = |reason: String| {
        if !drawn(call.ref_price) {
            return Some(Answer::NotDrawn);
        }
        Some(Answer::Decline(Decline {
            job_id: offer.job_id,
            task,
            offer: offer_id,
            worker: ad.node,
            reason,
            issued_at: now,
        }))
    };
    match terms {
        None => return decline("this worker's network pins no fee terms".into()),
        Some(t) if *t != offer.fee => {
            return decline(format!(
                "the offer's fee terms ({} bps to {}) are not the network's ({} bps to {})",
                offer.fee.rate_bps, offer.fee.recipient, t.rate_bps, t.recipient
            ));
        }
        Some(_) => {}
    }
    if !policy.allowed_requesters.is_empty()
        && !policy.allowed_requesters.contains(&offer.requester)
    {
        return decline("this worker takes work only from the requesters its owner lists".into());
    }
    if spec.workload.adapter != AdapterKind::Synthetic && !policy.custom_code {
        return decline("this worker's owner does not allow custom code".into());
    }
    let duration_ms = offer.deadline.ms_since(now);
    if let Some(max) = policy.max_duration_ms
        && duration_ms > max
    {
        return decline(format!(
            "the job may run {} s; this worker takes at most {} s",
            duration_ms / 1000,
            max / 1000
        ));
    }
    let Some(price) = price(&ad.prices, ad, spec, duration_ms) else {
        return decline("this worker has no price for the GPUs the task needs".into());
    };
    let share = spec.budget.0 / u64::from(spec.group_size.max(1));
    if price.0 > share {
        return decline(format!(
            "this worker's price {price} is above the task's budget of {share} per worker"
        ));
    }
    if !drawn(price) {
        return Some(Answer::NotDrawn);
    }
    Some(Answer::Bid(Bid {
        job_id: offer.job_id,
        task,
        offer: offer_id,
        worker: ad.node,
        price,
        earliest_start: now,
        issued_at: now,
        // A task that waits for others may start long after the bid window: its quote
        // holds until the deadline, so it can still be placed when it is ready.
        valid_until: match policy.bid_validity_ms {
            Some(ms) if spec.depends_on.is_empty() => now.plus_ms(ms.max(1)).min(offer.deadline),
            _ => offer.deadline,
        },
    }))
}
