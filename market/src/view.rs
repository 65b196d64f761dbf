//! The live market view: capability ads and open job offers, with expiry, fed by gossip.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::rate::{Limiter, Rate};
use std::sync::Arc;

use cannabis_protocol::{
    Address, CapabilityAd, DecodeError, Digest, JobOffer, OpenError, Received, Signed, Timestamp,
    Uuid, draw,
};

/// Limits of the view.
#[derive(Clone, Debug)]
pub struct ViewConfig {
    /// How far in the future `issued_at` may be (clock skew between nodes).
    pub max_clock_skew_ms: u64,
    /// Longest an ad may stay valid from now.
    pub max_ad_ttl_ms: u64,
    /// Longest an offer may stay open from now.
    pub max_offer_ttl_ms: u64,
    /// Longest an offer's deadline may be from now: a worker keeps its quotes for a job
    /// until the deadline at most.
    pub max_deadline_ms: u64,
    /// Most ads held; more are ignored until some expire.
    pub max_ads: usize,
    /// Most offers held.
    pub max_offers: usize,
    /// Most payload bytes of offers held. Past it, a new offer pushes out offers of the
    /// signer holding the most bytes, never of a smaller holder (see [`View::on_offer`]).
    pub max_offer_bytes: usize,
    /// Most live offers of one signer.
    pub max_offers_per_signer: usize,
    /// How fast one signer's offers (new ones and new versions) are taken; `None`: no limit.
    pub offer_rate: Option<Rate>,
    /// How fast one node's ads are taken; `None`: no limit.
    pub ad_rate: Option<Rate>,
}

impl Default for ViewConfig {
    fn default() -> Self {
        Self {
            max_clock_skew_ms: 2 * 60_000,
            max_ad_ttl_ms: 60 * 60_000,
            max_offer_ttl_ms: 7 * 24 * 60 * 60_000,
            max_deadline_ms: 37 * 24 * 60 * 60_000,
            max_ads: 100_000,
            max_offers: 100_000,
            max_offer_bytes: 256 << 20,
            max_offers_per_signer: 1024,
            offer_rate: Some(Rate {
                burst: 256,
                per_minute: 1200,
            }),
            ad_rate: Some(Rate {
                burst: 16,
                per_minute: 10,
            }),
        }
    }
}

/// One signer's offers held: their payload bytes, and their job ids by expiry.
#[derive(Debug, Default)]
struct Holder {
    bytes: usize,
    offers: BTreeSet<(Timestamp, Uuid)>,
}

/// What to do with a gossiped message: the three answers of gossipsub's manual validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// New and valid: keep it and forward it.
    Accept(Digest),
    /// Valid but not useful (a duplicate, a stale version): drop it, do not penalize.
    Ignore(IgnoreReason),
    /// Invalid: drop it and penalize the peer that sent it.
    Reject(RejectReason),
}

/// Why a valid message was not kept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IgnoreReason {
    /// The same message was seen before.
    #[error("duplicate of a message already seen")]
    Duplicate,
    /// A newer version from the same author is held.
    #[error("older than the version held (seq {held})")]
    Stale {
        /// The sequence number held.
        held: u64,
    },
    /// Another requester already holds this job id.
    #[error("job id already used by another requester")]
    JobIdTaken,
    /// The view is full.
    #[error("market view is full")]
    Full,
    /// The signer holds as many live offers as one signer may.
    #[error("its signer holds {held} live offers, the most one signer may")]
    SignerFull {
        /// Live offers the signer holds.
        held: usize,
    },
    /// The signer sends faster than the view takes from one signer.
    #[error("its signer sends faster than one signer may")]
    RateLimited,
}

/// Why a message was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// It did not decode (size cap, version, canonical form).
    #[error("undecodable: {0}")]
    Decode(#[from] DecodeError),
    /// Signature, author or rule check failed.
    #[error("unverifiable: {0}")]
    Verify(#[from] OpenError),
    /// It had expired.
    #[error("expired at {expired_at}")]
    Expired {
        /// When it expired.
        expired_at: Timestamp,
    },
    /// It claims to be issued in the future.
    #[error("issued at {issued_at}, in the future")]
    FromTheFuture {
        /// Its issue time.
        issued_at: Timestamp,
    },
    /// Its expiry is further away than the view keeps anything.
    #[error("expires at {expires_at}, too far ahead")]
    TooLongLived {
        /// Its expiry.
        expires_at: Timestamp,
    },
    /// Its deadline is further away than any job may run.
    #[error("deadline {deadline} is too far ahead")]
    DeadlineTooFar {
        /// Its deadline.
        deadline: Timestamp,
    },
}

impl RejectReason {
    /// Its kind, a fixed word (for counting rejections by reason: the text holds
    /// times and details from the message, which a sender chooses).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Decode(_) => "undecodable",
            Self::Verify(_) => "unverifiable",
            Self::Expired { .. } => "expired",
            Self::FromTheFuture { .. } => "from-the-future",
            Self::TooLongLived { .. } => "too-long-lived",
            Self::DeadlineTooFar { .. } => "deadline-too-far",
        }
    }
}

/// What [`View::expire`] dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expired {
    /// Nodes whose ad expired.
    pub ads: Vec<Address>,
    /// Jobs whose offer expired.
    pub offers: Vec<Uuid>,
}

/// A capability ad held in the view.
#[derive(Clone, Debug)]
pub struct AdEntry {
    item: Arc<Received<CapabilityAd>>,
    received_at_us: u64,
}

impl AdEntry {
    /// Its verified content.
    pub fn ad(&self) -> &CapabilityAd {
        &self.item.body
    }
    /// The signed message, as received (re-encoded from what is held).
    pub fn signed(&self) -> Signed<CapabilityAd> {
        self.item.signed()
    }
    /// Its signed payload's length, in bytes.
    pub fn size(&self) -> usize {
        self.item.size()
    }
    /// Its message id.
    pub fn id(&self) -> Digest {
        self.item.id
    }
    /// When this node received it, in microseconds since the epoch.
    pub fn received_at_us(&self) -> u64 {
        self.received_at_us
    }
}

/// An open offer held in the view.
#[derive(Clone, Debug)]
pub struct OfferEntry {
    item: Arc<Received<JobOffer>>,
    received_at_us: u64,
}

impl OfferEntry {
    /// Its verified content.
    pub fn offer(&self) -> &JobOffer {
        &self.item.body
    }
    /// The signed message, as received (re-encoded from what is held).
    pub fn signed(&self) -> Signed<JobOffer> {
        self.item.signed()
    }
    /// Its signed payload's length, in bytes.
    pub fn size(&self) -> usize {
        self.item.size()
    }
    /// Its message id.
    pub fn id(&self) -> Digest {
        self.item.id
    }
    /// When this node received it, in microseconds since the epoch.
    pub fn received_at_us(&self) -> u64 {
        self.received_at_us
    }
    /// The shared message.
    pub fn item(&self) -> &Arc<Received<JobOffer>> {
        &self.item
    }
}

/// Whether the view checks signatures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Signatures {
    /// Check every signature (what a node does).
    #[default]
    Check,
    /// Take every signature as valid: only for simulations, which charge the time a check
    /// costs instead of spending it.
    Assume,
}

impl Signatures {
    /// Checks `item`'s signature unless assumed.
    pub fn check<T: cannabis_protocol::Message>(self, item: &Received<T>) -> Result<(), OpenError> {
        match self {
            Signatures::Check => item.check_signature(),
            Signatures::Assume => Ok(()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Held {
    Ad(Address),
    Offer(Uuid),
}

/// The live market a node sees.
#[derive(Debug)]
pub struct View {
    pub(crate) config: ViewConfig,
    signatures: Signatures,
    ads: BTreeMap<Address, AdEntry>,
    /// The ads' nodes by their place on the bid draw's ring ([`draw::worker_point`]): a
    /// sample of the market around any point, in O(log n).
    ring: BTreeMap<u64, Address>,
    offers: BTreeMap<Uuid, OfferEntry>,
    /// What is held, by expiry.
    expiries: BTreeSet<(Timestamp, Held)>,
    /// Ids of messages seen, kept until the message expires: a replay later than that is
    /// expired and rejected; one before it is a duplicate.
    seen: BTreeMap<Digest, Timestamp>,
    seen_expiries: BTreeSet<(Timestamp, Digest)>,
    /// The offers of each signer, and the signers by the bytes they hold.
    holders: HashMap<Address, Holder>,
    by_bytes: BTreeSet<(usize, Address)>,
    offer_bytes: usize,
    offer_limiter: Limiter<Address>,
    ad_limiter: Limiter<Address>,
    /// Offers pushed out to make room, not yet taken by [`View::take_evicted`].
    evicted: Vec<Uuid>,
}

/// Decodes a gossiped message of kind `T`: the envelope (size cap, version, canonical
/// form), then the payload, its author and rules. The signature is checked later, by the
/// view, after the cheap checks.
pub fn decode_gossip<T: cannabis_protocol::Message>(
    bytes: &[u8],
) -> Result<Received<T>, RejectReason> {
    Signed::<T>::from_bytes(bytes)?
        .open()
        .map_err(RejectReason::Verify)
}

impl View {
    /// An empty view.
    pub fn new(config: ViewConfig, signatures: Signatures) -> Self {
        Self {
            config,
            signatures,
            ads: BTreeMap::new(),
            ring: BTreeMap::new(),
            offers: BTreeMap::new(),
            expiries: BTreeSet::new(),
            seen: BTreeMap::new(),
            seen_expiries: BTreeSet::new(),
            holders: HashMap::new(),
            by_bytes: BTreeSet::new(),
            offer_bytes: 0,
            offer_limiter: Limiter::default(),
            ad_limiter: Limiter::default(),
            evicted: Vec::new(),
        }
    }

    /// The offers pushed out to make room for others since the last call.
    pub fn take_evicted(&mut self) -> Vec<Uuid> {
        std::mem::take(&mut self.evicted)
    }

    /// The cheap checks every gossiped message must pass, in order: expiry,
    /// duplicate, issue time, lifetime. The signature comes last, in [`View::admit`].
    fn precheck(
        &self,
        id: &Digest,
        now: Timestamp,
        (issued_at, expires_at): (Timestamp, Timestamp),
        ttl_ms: u64,
    ) -> Result<(), Verdict> {
        if expires_at <= now {
            return Err(Verdict::Reject(RejectReason::Expired {
                expired_at: expires_at,
            }));
        }
        if self.seen.contains_key(id) {
            return Err(Verdict::Ignore(IgnoreReason::Duplicate));
        }
        if issued_at > now.plus_ms(self.config.max_clock_skew_ms) {
            return Err(Verdict::Reject(RejectReason::FromTheFuture { issued_at }));
        }
        if expires_at > now.plus_ms(ttl_ms) {
            return Err(Verdict::Reject(RejectReason::TooLongLived { expires_at }));
        }
        Ok(())
    }

    fn see(&mut self, id: Digest, expires_at: Timestamp) {
        self.seen.insert(id, expires_at);
        self.seen_expiries.insert((expires_at, id));
    }

    /// A gossiped capability ad (from anyone: a signed message is its signer's word,
    /// whoever relays it).
    pub fn on_ad(
        &mut self,
        item: Arc<Received<CapabilityAd>>,
        now: Timestamp,
        received_at_us: u64,
    ) -> Verdict {
        let ad = &item.body;
        if let Err(v) = self.precheck(
            &item.id,
            now,
            (ad.issued_at, ad.expires_at),
            self.config.max_ad_ttl_ms,
        ) {
            return v;
        }
        match self.ads.get(&ad.node) {
            Some(held) if held.ad().seq >= ad.seq => {
                return Verdict::Ignore(IgnoreReason::Stale {
                    held: held.ad().seq,
                });
            }
            None if self.ads.len() >= self.config.max_ads => {
                return Verdict::Ignore(IgnoreReason::Full);
            }
            _ => {}
        }
        if !self.ad_limiter.allows(self.config.ad_rate, &ad.node, now) {
            return Verdict::Ignore(IgnoreReason::RateLimited);
        }
        if let Err(e) = self.signatures.check(&*item) {
            return Verdict::Reject(RejectReason::Verify(e));
        }
        // Charged once verified: nobody can spend another signer's allowance.
        self.ad_limiter.charge(self.config.ad_rate, ad.node, now);
        let (node, id, expires_at) = (ad.node, item.id, ad.expires_at);
        self.see(id, expires_at);
        let entry = AdEntry {
            item,
            received_at_us,
        };
        if let Some(old) = self.ads.insert(node, entry) {
            self.expiries.remove(&(old.ad().expires_at, Held::Ad(node)));
        }
        self.expiries.insert((expires_at, Held::Ad(node)));
        Verdict::Accept(id)
    }

    /// Whether `signer`'s rate of offers allows one more now (every node holds each signer
    /// to it: an offer past it is dropped by them all).
    pub fn offer_rate_allows(&self, signer: &Address, now: Timestamp) -> bool {
        self.offer_limiter
            .allows(self.config.offer_rate, signer, now)
    }

    /// A gossiped job offer (from anyone, like an ad).
    pub fn on_offer(
        &mut self,
        item: Arc<Received<JobOffer>>,
        now: Timestamp,
        received_at_us: u64,
    ) -> Verdict {
        let offer = &item.body;
        if let Err(v) = self.precheck(
            &item.id,
            now,
            (offer.issued_at, offer.expires_at),
            self.config.max_offer_ttl_ms,
        ) {
            return v;
        }
        if offer.deadline > now.plus_ms(self.config.max_deadline_ms) {
            return Verdict::Reject(RejectReason::DeadlineTooFar {
                deadline: offer.deadline,
            });
        }
        let signer = offer.requester;
        let held = self.offers.get(&offer.job_id);
        match held {
            Some(held) if held.offer().requester != offer.requester => {
                return Verdict::Ignore(IgnoreReason::JobIdTaken);
            }
            Some(held) if held.offer().seq >= offer.seq => {
                return Verdict::Ignore(IgnoreReason::Stale {
                    held: held.offer().seq,
                });
            }
            None if self.offers.len() >= self.config.max_offers => {
                return Verdict::Ignore(IgnoreReason::Full);
            }
            _ => {}
        }
        let replaces = held.is_some();
        let mine = self.holders.get(&signer).map_or(0, |h| h.offers.len());
        if !replaces && mine >= self.config.max_offers_per_signer {
            return Verdict::Ignore(IgnoreReason::SignerFull { held: mine });
        }
        if !self
            .offer_limiter
            .allows(self.config.offer_rate, &signer, now)
        {
            return Verdict::Ignore(IgnoreReason::RateLimited);
        }
        let size = item.size();
        let freed = held.map_or(0, OfferEntry::size);
        let Some(evict) = self.room_for(&signer, size, freed) else {
            return Verdict::Ignore(IgnoreReason::Full);
        };
        if let Err(e) = self.signatures.check(&*item) {
            return Verdict::Reject(RejectReason::Verify(e));
        }
        self.offer_limiter
            .charge(self.config.offer_rate, signer, now);
        for job in evict {
            self.drop_offer(&job);
            self.evicted.push(job);
        }
        let (job, id, expires_at) = (offer.job_id, item.id, offer.expires_at);
        self.see(id, expires_at);
        if replaces {
            self.drop_offer(&job);
        }
        self.hold(signer, size, (expires_at, job), true);
        let entry = OfferEntry {
            item,
            received_at_us,
        };
        self.offers.insert(job, entry);
        self.expiries.insert((expires_at, Held::Offer(job)));
        Verdict::Accept(id)
    }

    /// Whether `size` more bytes of `signer` (replacing `freed`) fit, and which offers go
    /// to make room: those of the signer holding the most bytes, soonest to expire first,
    /// while it holds more than `signer` would. A signer cannot push out anyone smaller
    /// than itself, so many offers from one key never displace a requester's few. `None`:
    /// no room.
    fn room_for(&self, signer: &Address, size: usize, freed: usize) -> Option<Vec<Uuid>> {
        let mut over = (self.offer_bytes + size)
            .saturating_sub(freed)
            .saturating_sub(self.config.max_offer_bytes);
        if over == 0 {
            return Some(Vec::new());
        }
        let mine = self.holders.get(signer).map_or(0, |h| h.bytes) + size - freed;
        // Holders largest first, with what each would have left as its offers go.
        let mut evict = Vec::new();
        for &(bytes, top) in self.by_bytes.iter().rev() {
            let mut left = bytes;
            let holder = &self.holders[&top];
            for &(_, job) in &holder.offers {
                if over == 0 || left <= mine || top == *signer {
                    break;
                }
                let b = self.offers[&job].size();
                evict.push(job);
                left -= b;
                over = over.saturating_sub(b);
            }
            if over == 0 {
                return Some(evict);
            }
            if left <= mine {
                // Every holder further down holds less still.
                return None;
            }
        }
        None
    }

    /// Counts an offer of `signer` (`held`) or forgets it.
    fn hold(&mut self, signer: Address, size: usize, key: (Timestamp, Uuid), held: bool) {
        let holder = self.holders.entry(signer).or_default();
        self.by_bytes.remove(&(holder.bytes, signer));
        if held {
            holder.bytes += size;
            holder.offers.insert(key);
            self.offer_bytes += size;
        } else {
            holder.bytes -= size;
            holder.offers.remove(&key);
            self.offer_bytes -= size;
        }
        if holder.offers.is_empty() {
            self.holders.remove(&signer);
        } else {
            self.by_bytes.insert((holder.bytes, signer));
        }
    }

    /// Drops a held offer and everything that counts it.
    fn drop_offer(&mut self, job: &Uuid) -> Option<OfferEntry> {
        let e = self.offers.remove(job)?;
        let (signer, expires_at) = (e.offer().requester, e.offer().expires_at);
        self.expiries.remove(&(expires_at, Held::Offer(*job)));
        self.hold(signer, e.size(), (expires_at, *job), false);
        Some(e)
    }

    /// Drops everything that expired by `now` and says what was dropped.
    pub fn expire(&mut self, now: Timestamp) -> Expired {
        let mut dropped = Expired::default();
        while let Some(&(at, held)) = self.expiries.first() {
            if at > now {
                break;
            }
            self.expiries.pop_first();
            match held {
                Held::Ad(node) => {
                    self.ads.remove(&node);
                    self.ring.remove(&draw::worker_point(&node));
                    dropped.ads.push(node);
                }
                Held::Offer(job) => {
                    self.drop_offer(&job);
                    dropped.offers.push(job);
                }
            }
        }
        while let Some(&(at, id)) = self.seen_expiries.first() {
            if at > now {
                break;
            }
            self.seen_expiries.pop_first();
            self.seen.remove(&id);
        }
        self.offer_limiter.expire(now);
        self.ad_limiter.expire(now);
        dropped
    }

    /// Ads of nodes whose address sorts after `after`, in address order (sync pages).
    pub fn ads_after(&self, after: Option<&Address>) -> impl Iterator<Item = &AdEntry> {
        use std::ops::Bound;
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.ads.range((start, Bound::Unbounded)).map(|(_, e)| e)
    }

    /// Offers whose job id sorts after `after`, in job-id order (sync pages).
    pub fn offers_after(&self, after: Option<&Uuid>) -> impl Iterator<Item = &OfferEntry> {
        use std::ops::Bound;
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.offers.range((start, Bound::Unbounded)).map(|(_, e)| e)
    }

    /// When the next held message expires: the caller should call [`View::expire`] then.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let held = self.expiries.first().map(|(t, _)| *t);
        let seen = self.seen_expiries.first().map(|(t, _)| *t);
        held.into_iter().chain(seen).min()
    }

    /// The live ads, by node address.
    pub fn ads(&self) -> impl Iterator<Item = &AdEntry> {
        self.ads.values()
    }

    /// Number of live ads.
    pub fn ad_count(&self) -> usize {
        self.ads.len()
    }

    /// Number of open offers.
    pub fn offer_count(&self) -> usize {
        self.offers.len()
    }

    /// The ads of the nodes next on the draw's ring from `point`, wrapping around: a sample
    /// of the market that does not depend on what the ads say.
    pub fn ads_around(&self, point: u64) -> impl Iterator<Item = &AdEntry> {
        self.ring
            .range(point..)
            .chain(self.ring.range(..point))
            .filter_map(|(_, a)| self.ads.get(a))
    }

    /// The open offers, by job id.
    pub fn offers(&self) -> impl Iterator<Item = &OfferEntry> {
        self.offers.values()
    }

    /// One offer.
    pub fn offer(&self, job_id: &Uuid) -> Option<&OfferEntry> {
        self.offers.get(job_id)
    }

    /// One node's ad.
    pub fn ad(&self, node: &Address) -> Option<&AdEntry> {
        self.ads.get(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::*;

    fn keys(n: u8) -> Keypair {
        Keypair::from_secret([n; 32])
    }

    fn ad(k: &Keypair, seq: u64, issued: u64, expires: u64) -> Vec<u8> {
        let ad = CapabilityAd {
            node: k.address(),
            seq,
            issued_at: Timestamp(issued),
            expires_at: Timestamp(expires),
            delivery: DeliveryIdentity::from_secret([1; 32]).recipient(),
            hardware: Hardware {
                cpu_model: "cpu".into(),
                cpu_cores: 4,
                memory_bytes: 1 << 30,
                swap_bytes: 0,
                storage_bytes: 1 << 30,
                gpus: Vec::new(),
            },
            os: OsInfo {
                name: "linux".into(),
                kernel: "6".into(),
            },
            runtimes: Vec::new(),
            adapters: vec![AdapterKind::Synthetic],
            collectives: Vec::new(),
            isolation: Vec::new(),
            network: NetworkLimits::default(),
            prices: PriceSheet::default(),
            attestation: None,
            challenges: Vec::new(),
        };
        Signed::sign(k, &ad).to_bytes()
    }

    const NOW: Timestamp = Timestamp(1_000_000);

    fn feed(v: &mut View, bytes: &[u8], now: Timestamp, us: u64) -> Verdict {
        match decode_gossip::<CapabilityAd>(bytes) {
            Ok(item) => v.on_ad(Arc::new(item), now, us),
            Err(why) => Verdict::Reject(why),
        }
    }

    #[test]
    fn cheap_checks_come_before_the_signature() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        let tamper = |bytes: Vec<u8>| {
            let (payload, signer, mut sig) = Signed::<CapabilityAd>::from_bytes(&bytes)
                .unwrap()
                .into_parts();
            sig.0[0] ^= 1;
            Signed::<CapabilityAd>::from_parts(payload, signer, sig).to_bytes()
        };
        // Expired with a bad signature: dropped as expired, no signature check spent.
        assert!(matches!(
            feed(&mut v, &tamper(ad(&k, 1, 900_000, 1_000_000)), NOW, 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
        // A fresh one with a bad signature fails the check.
        assert!(matches!(
            feed(&mut v, &tamper(ad(&k, 1, 999_000, 1_060_000)), NOW, 0),
            Verdict::Reject(RejectReason::Verify(_))
        ));
        // Once the good one is held, a stale copy with a bad signature is only stale.
        assert!(matches!(
            feed(&mut v, &ad(&k, 2, 999_000, 1_060_000), NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            feed(&mut v, &tamper(ad(&k, 1, 999_000, 1_060_000)), NOW, 0),
            Verdict::Ignore(IgnoreReason::Stale { held: 2 })
        );
        // Assumed signatures (simulations) take the tampered one.
        let mut sim = View::new(ViewConfig::default(), Signatures::Assume);
        assert!(matches!(
            feed(&mut sim, &tamper(ad(&k, 1, 999_000, 1_060_000)), NOW, 0),
            Verdict::Accept(_)
        ));
    }

    #[test]
    fn accepts_then_ignores_duplicates_and_stale_versions() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        let a2 = ad(&k, 2, 999_000, 1_060_000);
        assert!(matches!(feed(&mut v, &a2, NOW, 0), Verdict::Accept(_)));
        assert_eq!(
            feed(&mut v, &a2, NOW, 0),
            Verdict::Ignore(IgnoreReason::Duplicate)
        );
        let a1 = ad(&k, 1, 999_000, 1_060_000);
        assert_eq!(
            feed(&mut v, &a1, NOW, 0),
            Verdict::Ignore(IgnoreReason::Stale { held: 2 })
        );
        let a3 = ad(&k, 3, 999_500, 1_070_000);
        assert!(matches!(feed(&mut v, &a3, NOW, 0), Verdict::Accept(_)));
        assert_eq!(v.ads().count(), 1);
        assert_eq!(v.ad(&k.address()).unwrap().ad().seq, 3);
    }

    #[test]
    fn rejects_what_is_invalid() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        assert!(matches!(
            feed(&mut v, b"\x82\x01\xa0", NOW, 0),
            Verdict::Reject(RejectReason::Decode(_))
        ));
        // Expired.
        assert!(matches!(
            feed(&mut v, &ad(&k, 1, 900_000, 1_000_000), NOW, 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
        // From the future.
        assert!(matches!(
            feed(&mut v, &ad(&k, 1, 1_200_001, 1_300_000), NOW, 0),
            Verdict::Reject(RejectReason::FromTheFuture { .. })
        ));
        // Lives too long.
        assert!(matches!(
            feed(&mut v, &ad(&k, 1, 999_000, NOW.0 + 3_600_001), NOW, 0),
            Verdict::Reject(RejectReason::TooLongLived { .. })
        ));
        // Tampered.
        let mut t = ad(&k, 1, 999_000, 1_060_000);
        let last = t.len() - 1;
        t[last] ^= 1;
        assert!(matches!(
            feed(&mut v, &t, NOW, 0),
            Verdict::Reject(RejectReason::Verify(_))
        ));
        assert_eq!(v.ads().count(), 0);
    }

    #[test]
    fn a_rejections_kind_does_not_carry_what_the_sender_chose() {
        let a = RejectReason::Expired {
            expired_at: Timestamp(1),
        };
        let b = RejectReason::Expired {
            expired_at: Timestamp(2),
        };
        assert_ne!(a.to_string(), b.to_string());
        assert_eq!(a.kind(), b.kind());
        assert_eq!(a.kind(), "expired");
    }

    #[test]
    fn expiry_drops_and_a_late_replay_is_rejected() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        let a = ad(&k, 1, 999_000, 1_010_000);
        assert!(matches!(feed(&mut v, &a, NOW, 0), Verdict::Accept(_)));
        assert_eq!(v.poll_timeout(), Some(Timestamp(1_010_000)));
        assert_eq!(v.expire(Timestamp(1_009_999)), Expired::default());
        assert_eq!(v.expire(Timestamp(1_010_000)).ads, vec![k.address()]);
        assert_eq!(v.ads().count(), 0);
        assert_eq!(v.poll_timeout(), None);
        assert!(matches!(
            feed(&mut v, &a, Timestamp(1_010_001), 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
    }

    #[test]
    fn full_views_ignore_newcomers() {
        let mut v = View::new(
            ViewConfig {
                max_ads: 1,
                ..ViewConfig::default()
            },
            Signatures::Check,
        );
        assert!(matches!(
            feed(&mut v, &ad(&keys(1), 1, 999_000, 1_060_000), NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            feed(&mut v, &ad(&keys(2), 1, 999_000, 1_060_000), NOW, 0),
            Verdict::Ignore(IgnoreReason::Full)
        );
        // An update of a held node still goes in.
        assert!(matches!(
            feed(&mut v, &ad(&keys(1), 2, 999_000, 1_060_000), NOW, 0),
            Verdict::Accept(_)
        ));
    }

    fn offer_item(
        k: &Keypair,
        job: u64,
        seq: u64,
        pad: usize,
        ttl_ms: u64,
    ) -> Arc<Received<JobOffer>> {
        let mut o = crate::testkit::offer(
            k.address(),
            job,
            vec![crate::testkit::task("t", 1, 0, 0, 1, 1_000)],
            NOW,
            ttl_ms,
            ttl_ms + 60_000,
        );
        o.seq = seq;
        // Padding makes offers of a known size.
        o.tasks[0].name = "t".repeat(pad.max(1));
        Arc::new(Signed::sign(k, &o).open().unwrap())
    }

    fn limited(config: ViewConfig) -> View {
        View::new(config, Signatures::Check)
    }

    #[test]
    fn one_signer_holds_at_most_its_share_of_live_offers() {
        let mut v = limited(ViewConfig {
            max_offers_per_signer: 3,
            ..ViewConfig::default()
        });
        let (a, b) = (keys(1), keys(2));
        for job in 1..=3 {
            assert!(matches!(
                v.on_offer(offer_item(&a, job, 1, 1, 60_000), NOW, 0),
                Verdict::Accept(_)
            ));
        }
        assert_eq!(
            v.on_offer(offer_item(&a, 4, 1, 1, 60_000), NOW, 0),
            Verdict::Ignore(IgnoreReason::SignerFull { held: 3 })
        );
        // A new version of one it holds is no new offer; another signer is not affected.
        assert!(matches!(
            v.on_offer(offer_item(&a, 1, 2, 1, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        assert!(matches!(
            v.on_offer(offer_item(&b, 9, 1, 1, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        // When one expires, there is room again.
        v.expire(NOW.plus_ms(60_000));
        assert!(matches!(
            v.on_offer(offer_item(&a, 5, 1, 1, 120_000), NOW.plus_ms(60_000), 0),
            Verdict::Accept(_)
        ));
    }

    #[test]
    fn one_signer_is_taken_at_its_rate_and_a_forgery_spends_none_of_it() {
        let mut v = limited(ViewConfig {
            offer_rate: Some(Rate {
                burst: 2,
                per_minute: 60,
            }),
            ..ViewConfig::default()
        });
        let a = keys(1);
        // A forged copy (bad signature) is rejected without spending a's allowance.
        let forged = {
            let item = offer_item(&a, 1, 1, 1, 60_000);
            let (payload, signer, mut sig) = item.signed().into_parts();
            sig.0[0] ^= 1;
            Arc::new(
                Signed::<JobOffer>::from_parts(payload, signer, sig)
                    .open()
                    .unwrap(),
            )
        };
        for _ in 0..5 {
            assert!(matches!(
                v.on_offer(forged.clone(), NOW, 0),
                Verdict::Reject(RejectReason::Verify(_))
            ));
        }
        assert!(matches!(
            v.on_offer(offer_item(&a, 1, 1, 1, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        assert!(matches!(
            v.on_offer(offer_item(&a, 1, 2, 1, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        // Updates as fast as it likes: the third at once is dropped, unforwarded.
        assert_eq!(
            v.on_offer(offer_item(&a, 1, 3, 1, 60_000), NOW, 0),
            Verdict::Ignore(IgnoreReason::RateLimited)
        );
        // A second later the bucket holds one more.
        let later = NOW.plus_ms(1_000);
        assert!(matches!(
            v.on_offer(offer_item(&a, 1, 3, 1, 60_000), later, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            v.on_offer(offer_item(&a, 1, 4, 1, 60_000), later, 0),
            Verdict::Ignore(IgnoreReason::RateLimited)
        );
        // A full bucket is forgotten: nothing is kept per signer once it would be full.
        v.expire(NOW.plus_ms(10_000));
        assert!(v.offer_limiter.is_empty());
    }

    #[test]
    fn a_deadline_beyond_any_job_is_rejected() {
        let mut v = limited(ViewConfig::default());
        let a = keys(1);
        let mut o = crate::testkit::offer(
            a.address(),
            1,
            vec![crate::testkit::task("t", 1, 0, 0, 1, 1_000)],
            NOW,
            60_000,
            120_000,
        );
        o.deadline = Timestamp(u64::MAX);
        let item = Arc::new(Signed::sign(&a, &o).open().unwrap());
        assert!(matches!(
            v.on_offer(item, NOW, 0),
            Verdict::Reject(RejectReason::DeadlineTooFar { .. })
        ));
    }

    #[test]
    fn a_full_view_pushes_out_the_largest_holder_never_a_smaller_one() {
        let size = offer_item(&keys(1), 1, 1, 200, 60_000).size();
        let mut v = limited(ViewConfig {
            // Room for ten (sizes differ by a few bytes with their numbers).
            max_offer_bytes: 10 * size + size / 2,
            ..ViewConfig::default()
        });
        let (flood, honest, other) = (keys(1), keys(2), keys(3));
        // One key fills the view.
        for job in 1..=10 {
            let ttl = 60_000 + job * 1_000;
            assert!(matches!(
                v.on_offer(offer_item(&flood, job, 1, 200, ttl), NOW, 0),
                Verdict::Accept(_)
            ));
        }
        // It cannot add more: it is the largest holder itself.
        assert_eq!(
            v.on_offer(offer_item(&flood, 11, 1, 200, 90_000), NOW, 0),
            Verdict::Ignore(IgnoreReason::Full)
        );
        // An honest requester's offer gets in, pushing out the flood's soonest to expire.
        assert!(matches!(
            v.on_offer(offer_item(&honest, 100, 1, 200, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(v.take_evicted().len(), 1);
        assert!(
            v.offer(&offer_item(&flood, 1, 1, 200, 61_000).body.job_id)
                .is_none()
        );
        assert!(
            v.offer(&offer_item(&flood, 2, 1, 200, 62_000).body.job_id)
                .is_some()
        );
        assert_eq!(v.offer_count(), 10);
        // Two more honest ones, from another key: still the flood pays.
        assert!(matches!(
            v.on_offer(offer_item(&other, 200, 1, 200, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        assert!(matches!(
            v.on_offer(offer_item(&honest, 101, 1, 200, 60_000), NOW, 0),
            Verdict::Accept(_)
        ));
        // Now the flood (7 offers) tries again: the honest (2) and other (1) stay.
        assert_eq!(
            v.on_offer(offer_item(&flood, 12, 1, 200, 90_000), NOW, 0),
            Verdict::Ignore(IgnoreReason::Full)
        );
        let held = |k: &Keypair| {
            v.offers()
                .filter(|e| e.offer().requester == k.address())
                .count()
        };
        assert_eq!((held(&flood), held(&honest), held(&other)), (7, 2, 1));
        // The accounting returns to zero as everything expires.
        v.expire(NOW.plus_ms(200_000));
        assert_eq!(
            (
                v.offer_count(),
                v.offer_bytes,
                v.holders.len(),
                v.by_bytes.len()
            ),
            (0, 0, 0, 0)
        );
    }
}
