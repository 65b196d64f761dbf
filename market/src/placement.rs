//! Quote-aware placement: the cheapest set of bids that satisfies a task within its budget.
//!
//! A single-worker task takes the cheapest valid bid. A group of `k` is all-or-nothing (a
//! gang, like Ray's `STRICT_SPREAD` placement group): `k` distinct workers from one
//! compatibility class (same adapter, same GPU vendor, same versions of the runtimes the
//! task names), the cheapest `k` of the cheapest class, ranks assigned in that order. Ties
//! break on earliest start, then on the worker's address, so every node computes the same
//! placement from the same bids.
//!
//! "Cheapest" weighs each worker's record: a bid counts at its price times one more than
//! the worker's strikes on the ledger (disputes settled against it), so a worker caught
//! once must bid under half of a clean worker's price to be chosen over it. The weight
//! orders bids only: a chosen worker is paid its own price, and the budget is checked
//! against the prices.

use std::collections::{BTreeMap, BTreeSet};

use cannabis_protocol::{
    AdapterKind, Address, Amount, Bid, CapabilityAd, Digest, GpuVendor, TaskSpec, Timestamp,
};
use serde::{Deserialize, Serialize};

/// Workers that can share a process group: same adapter, same GPU vendor (or none), same
/// versions of the runtimes the task names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Class {
    /// The adapter.
    pub adapter: AdapterKind,
    /// Vendor of the GPUs the task would use, `None` for CPU-only tasks.
    pub gpu_vendor: Option<GpuVendor>,
    /// `(name, version)` of each runtime the task names, as the worker has it.
    pub runtimes: Vec<(String, String)>,
}

impl Class {
    /// The class of `ad` for `task`.
    pub fn of(task: &TaskSpec, ad: &CapabilityAd) -> Self {
        let gpu_vendor = (task.resources.gpus > 0)
            .then(|| {
                task.requirements.gpu_vendor.or_else(|| {
                    ad.hardware
                        .gpus
                        .iter()
                        .find(|g| g.allowed)
                        .map(|g| g.vendor)
                })
            })
            .flatten();
        let runtimes = task
            .requirements
            .runtimes
            .iter()
            .map(|want| {
                let have = ad
                    .runtimes
                    .iter()
                    .find(|r| r.name == want.name)
                    .map(|r| r.version.clone())
                    .unwrap_or_default();
                (want.name.clone(), have)
            })
            .collect();
        Self {
            adapter: task.workload.adapter,
            gpu_vendor,
            runtimes,
        }
    }
}

/// A verified bid with what placement needs to know about its worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// The bid.
    pub bid: Bid,
    /// Its message id.
    pub id: Digest,
    /// The worker's compatibility class for the task.
    pub class: Class,
    /// The worker's strikes on the ledger when the bid was weighed.
    #[serde(default)]
    pub strikes: u64,
}

impl Candidate {
    /// What placement ranks the bid by: its price times one more than its worker's
    /// strikes.
    pub fn weighed(&self) -> u128 {
        u128::from(self.bid.price.0) * (u128::from(self.strikes) + 1)
    }
}

/// One rank of a placement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    /// The rank.
    pub rank: u32,
    /// The worker.
    pub worker: Address,
    /// The bid taken.
    pub bid: Digest,
    /// Its price.
    pub price: Amount,
}

/// Why a task could not be placed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum Infeasible {
    /// No valid bid at all.
    #[error("no valid bids")]
    NoBids,
    /// Not enough compatible workers for the group.
    #[error(
        "a group of {needed} needs {needed} compatible workers; the largest compatible set has {largest}"
    )]
    TooFewCompatible {
        /// Group size.
        needed: u32,
        /// Workers in the largest class.
        largest: usize,
    },
    /// The cheapest placement costs more than what is left.
    #[error("the cheapest placement costs {cheapest}, above the {left} left in the budget")]
    OverBudget {
        /// Cheapest total.
        cheapest: Amount,
        /// Budget left.
        left: Amount,
    },
}

fn order(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    (a.weighed(), a.bid.earliest_start, a.bid.worker).cmp(&(
        b.weighed(),
        b.bid.earliest_start,
        b.bid.worker,
    ))
}

/// Places `task` on the cheapest bids, at most one per worker, skipping bids that expired
/// by `now` and `excluded` workers, within `left`.
pub fn place<'a>(
    task: &TaskSpec,
    candidates: impl IntoIterator<Item = &'a Candidate>,
    excluded: &BTreeSet<Address>,
    left: Amount,
    now: Timestamp,
) -> Result<Vec<Slot>, Infeasible> {
    let k = task.group_size.max(1) as usize;
    // The newest valid bid of each worker, grouped by class.
    let mut by_class: BTreeMap<&Class, BTreeMap<Address, &Candidate>> = BTreeMap::new();
    for c in candidates {
        if c.bid.valid_until <= now || excluded.contains(&c.bid.worker) {
            continue;
        }
        let slot = by_class.entry(&c.class).or_default();
        match slot.get(&c.bid.worker) {
            Some(held) if held.bid.issued_at >= c.bid.issued_at => {}
            _ => {
                slot.insert(c.bid.worker, c);
            }
        }
    }
    if by_class.is_empty() {
        return Err(Infeasible::NoBids);
    }
    // Per class, the `k` best by weight, and the `k` cheapest (which fit the budget when
    // the best by weight do not); of the sets that fit, the best by weight wins.
    let mut best: Option<(u128, Vec<&Candidate>)> = None;
    let mut cheapest: Option<Amount> = None;
    let mut largest = 0;
    for workers in by_class.values() {
        largest = largest.max(workers.len());
        if workers.len() < k {
            continue;
        }
        let mut by_weight: Vec<&Candidate> = workers.values().copied().collect();
        let mut by_price = by_weight.clone();
        by_weight.sort_by(|a, b| order(a, b));
        by_weight.truncate(k);
        by_price.sort_by_key(|c| (c.bid.price, c.bid.earliest_start, c.bid.worker));
        by_price.truncate(k);
        for set in [by_weight, by_price] {
            let Ok(total) = Amount::sum(set.iter().map(|c| &c.bid.price)) else {
                continue;
            };
            cheapest = Some(cheapest.map_or(total, |c| c.min(total)));
            if total > left {
                continue;
            }
            let weighed: u128 = set.iter().map(|c| c.weighed()).sum();
            let better = match &best {
                None => true,
                Some((w, chosen)) => (weighed, key(&set)) < (*w, key(chosen)),
            };
            if better {
                best = Some((weighed, set));
            }
        }
    }
    let Some((_, chosen)) = best else {
        return Err(match cheapest {
            Some(cheapest) => Infeasible::OverBudget { cheapest, left },
            None => Infeasible::TooFewCompatible {
                needed: k as u32,
                largest,
            },
        });
    };
    Ok(chosen
        .into_iter()
        .enumerate()
        .map(|(rank, c)| Slot {
            rank: rank as u32,
            worker: c.bid.worker,
            bid: c.id,
            price: c.bid.price,
        })
        .collect())
}

/// Tie-break between equally priced groups: latest start among them, then addresses.
fn key(group: &[&Candidate]) -> (Timestamp, Vec<Address>) {
    (
        group
            .iter()
            .map(|c| c.bid.earliest_start)
            .max()
            .unwrap_or_default(),
        group.iter().map(|c| c.bid.worker).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{self, Machine};
    use cannabis_protocol::message_id;

    const NOW: Timestamp = Timestamp(1_000_000);

    fn candidate(n: u64, price: u64, machine: &Machine, task: &TaskSpec) -> Candidate {
        let worker = testkit::keys(n).address();
        let bid = Bid {
            job_id: cannabis_protocol::Uuid([1; 16]),
            task: 0,
            offer: Digest([0; 32]),
            worker,
            price: Amount(price),
            earliest_start: NOW,
            issued_at: NOW,
            valid_until: NOW.plus_ms(60_000),
        };
        Candidate {
            id: message_id(&bid),
            bid,
            class: Class::of(task, &testkit::ad(worker, machine, NOW)),
            strikes: 0,
        }
    }

    #[test]
    fn a_struck_worker_must_bid_under_half_to_be_chosen_and_is_paid_its_own_price() {
        let task = testkit::task("t", 1, 0, 0, 1, 1000);
        let m = Machine::default();
        let struck = |price| Candidate {
            strikes: 1,
            ..candidate(1, price, &m, &task)
        };
        let clean = candidate(2, 100, &m, &task);
        let chosen = |cs: &[Candidate], left| {
            place(&task, cs, &BTreeSet::new(), Amount(left), NOW).map(|s| (s[0].worker, s[0].price))
        };
        // At 60 against 100 it would win on price; its strike makes it count 120.
        assert_eq!(
            chosen(&[struck(60), clean.clone()], 1000),
            Ok((clean.bid.worker, Amount(100)))
        );
        // Under half, it wins, and is paid its own price.
        let cheap = struck(49);
        assert_eq!(
            chosen(&[cheap.clone(), clean.clone()], 1000),
            Ok((cheap.bid.worker, Amount(49)))
        );
        // When the budget holds only its price, it is placed rather than nothing.
        assert_eq!(
            chosen(&[struck(60), clean.clone()], 80),
            Ok((cheap.bid.worker, Amount(60)))
        );
        // Two strikes: a third of the price.
        let twice = Candidate {
            strikes: 2,
            ..candidate(1, 34, &m, &task)
        };
        assert_eq!(
            chosen(&[twice, clean.clone()], 1000),
            Ok((clean.bid.worker, Amount(100)))
        );
        assert_eq!(
            chosen(&[struck(150), clean], 90),
            Err(Infeasible::OverBudget {
                cheapest: Amount(100),
                left: Amount(90)
            })
        );
    }

    #[test]
    fn ties_break_the_same_way_whatever_the_order() {
        let task = testkit::task("t", 1, 0, 0, 2, 1000);
        let m = Machine::default();
        let mut cs: Vec<Candidate> = (1..=6).map(|n| candidate(n, 100, &m, &task)).collect();
        let first = place(&task, &cs, &BTreeSet::new(), Amount(1000), NOW).unwrap();
        cs.reverse();
        let second = place(&task, &cs, &BTreeSet::new(), Amount(1000), NOW).unwrap();
        assert_eq!(first, second);
        let mut lowest: Vec<Address> = cs.iter().map(|c| c.bid.worker).collect();
        lowest.sort();
        assert_eq!(
            first.iter().map(|s| s.worker).collect::<Vec<_>>(),
            lowest[..2]
        );
    }

    #[test]
    fn a_group_never_mixes_vendors_and_takes_the_cheapest_class() {
        let task = testkit::task("g", 1, 1, 16, 2, 10_000);
        let nvidia = Machine {
            gpus: vec![(GpuVendor::Nvidia, 24)],
            ..Machine::default()
        };
        let amd = Machine {
            gpus: vec![(GpuVendor::Amd, 24)],
            ..Machine::default()
        };
        // The two cheapest bids are of different vendors; the cheapest pair is AMD.
        let cs = vec![
            candidate(1, 10, &nvidia, &task),
            candidate(2, 11, &amd, &task),
            candidate(3, 50, &nvidia, &task),
            candidate(4, 12, &amd, &task),
        ];
        let slots = place(&task, &cs, &BTreeSet::new(), Amount(10_000), NOW).unwrap();
        let workers: Vec<Address> = slots.iter().map(|s| s.worker).collect();
        assert_eq!(workers, vec![cs[1].bid.worker, cs[3].bid.worker]);
        assert_eq!(slots.iter().map(|s| s.rank).collect::<Vec<_>>(), vec![0, 1]);
        // Within budget only.
        assert_eq!(
            place(&task, &cs, &BTreeSet::new(), Amount(22), NOW),
            Err(Infeasible::OverBudget {
                cheapest: Amount(23),
                left: Amount(22)
            })
        );
        // Excluded workers and expired bids do not count.
        let excluded = BTreeSet::from([cs[1].bid.worker]);
        let slots = place(&task, &cs, &excluded, Amount(10_000), NOW).unwrap();
        assert_eq!(slots[0].worker, cs[0].bid.worker);
        assert_eq!(
            place(
                &task,
                &cs,
                &BTreeSet::new(),
                Amount(10_000),
                NOW.plus_ms(60_000)
            ),
            Err(Infeasible::NoBids)
        );
    }
}
