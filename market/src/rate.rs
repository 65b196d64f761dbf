//! Token buckets per key (a signer, a peer), in integer thousandths of a message and the
//! caller's time: what the market view uses per signer, and what a node uses per peer.

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

use cannabis_protocol::Timestamp;

/// A token bucket: `burst` at once, then `per_minute`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// Most taken at once.
    pub burst: u32,
    /// Sustained, per minute.
    pub per_minute: u32,
}

/// One bucket per key, in thousandths of a message; a bucket that has filled up again is
/// forgotten (the same as a fresh one), so throwaway keys leave nothing behind.
#[derive(Debug)]
pub struct Limiter<K> {
    buckets: HashMap<K, (u64, Timestamp)>,
    full_at: BTreeSet<(Timestamp, K)>,
}

impl<K> Default for Limiter<K> {
    fn default() -> Self {
        Self {
            buckets: HashMap::new(),
            full_at: BTreeSet::new(),
        }
    }
}

impl<K: Copy + Ord + Hash> Limiter<K> {
    fn level(rate: Rate, bucket: Option<&(u64, Timestamp)>, now: Timestamp) -> u64 {
        let cap = u64::from(rate.burst) * 1000;
        match bucket {
            None => cap,
            Some(&(milli, at)) => {
                let refill = now.ms_since(at).saturating_mul(u64::from(rate.per_minute)) / 60;
                milli.saturating_add(refill).min(cap)
            }
        }
    }

    /// Whether `who` has a message left at `now` (always, without a rate).
    pub fn allows(&self, rate: Option<Rate>, who: &K, now: Timestamp) -> bool {
        rate.is_none_or(|r| Self::level(r, self.buckets.get(who), now) >= 1000)
    }

    /// Spends one message of `who`'s.
    pub fn charge(&mut self, rate: Option<Rate>, who: K, now: Timestamp) {
        let Some(rate) = rate else { return };
        let old = self.buckets.get(&who).copied();
        let milli = Self::level(rate, old.as_ref(), now).saturating_sub(1000);
        if let Some((m, at)) = old {
            self.full_at.remove(&(Self::full(rate, m, at), who));
        }
        self.buckets.insert(who, (milli, now));
        self.full_at.insert((Self::full(rate, milli, now), who));
    }

    /// Spends one message of `who`'s if it has one left.
    pub fn take(&mut self, rate: Rate, who: K, now: Timestamp) -> bool {
        let allowed = self.allows(Some(rate), &who, now);
        if allowed {
            self.charge(Some(rate), who, now);
        }
        allowed
    }

    /// When a bucket at `milli` since `at` is full again.
    fn full(rate: Rate, milli: u64, at: Timestamp) -> Timestamp {
        let missing = (u64::from(rate.burst) * 1000).saturating_sub(milli);
        let per_minute = u64::from(rate.per_minute).max(1);
        at.plus_ms(missing.saturating_mul(60).div_ceil(per_minute))
    }

    /// Forgets the buckets full again by `now`.
    pub fn expire(&mut self, now: Timestamp) {
        while let Some(&(at, who)) = self.full_at.first() {
            if at > now {
                break;
            }
            self.full_at.pop_first();
            self.buckets.remove(&who);
        }
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}
