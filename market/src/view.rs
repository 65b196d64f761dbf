//! The live market view: capability ads and open job offers, with expiry, fed by gossip.

use std::collections::{BTreeMap, BTreeSet};
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
    /// Most ads held; more are ignored until some expire.
    pub max_ads: usize,
    /// Most offers held.
    pub max_offers: usize,
}

impl Default for ViewConfig {
    fn default() -> Self {
        Self {
            max_clock_skew_ms: 2 * 60_000,
            max_ad_ttl_ms: 60 * 60_000,
            max_offer_ttl_ms: 7 * 24 * 60 * 60_000,
            max_ads: 100_000,
            max_offers: 100_000,
        }
    }
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
    /// It was relayed as published by a peer other than its signer.
    #[error("published by {source_addr}, signed by {signer}")]
    NotFromSigner {
        /// The gossip source.
        source_addr: Address,
        /// The signer.
        signer: Address,
    },
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
    /// The signed message, as received.
    pub fn signed(&self) -> &Signed<CapabilityAd> {
        &self.item.signed
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
    /// The signed message, as received.
    pub fn signed(&self) -> &Signed<JobOffer> {
        &self.item.signed
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
    config: ViewConfig,
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
        }
    }

    /// The cheap checks every gossiped message must pass, in order: source, expiry,
    /// duplicate, issue time, lifetime. The signature comes last, in [`View::admit`].
    fn precheck(
        &self,
        signer: &Address,
        id: &Digest,
        source: Option<&Address>,
        now: Timestamp,
        (issued_at, expires_at): (Timestamp, Timestamp),
        ttl_ms: u64,
    ) -> Result<(), Verdict> {
        if let Some(source) = source
            && source != signer
        {
            return Err(Verdict::Reject(RejectReason::NotFromSigner {
                source_addr: *source,
                signer: *signer,
            }));
        }
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

    /// A gossiped capability ad. `source` is the gossip author's address, when known.
    pub fn on_ad(
        &mut self,
        item: Arc<Received<CapabilityAd>>,
        source: Option<&Address>,
        now: Timestamp,
        received_at_us: u64,
    ) -> Verdict {
        let ad = &item.body;
        if let Err(v) = self.precheck(
            &item.signer,
            &item.id,
            source,
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
        if let Err(e) = self.signatures.check(&*item) {
            return Verdict::Reject(RejectReason::Verify(e));
        }
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

    /// A gossiped job offer. `source` is the gossip author's address, when known.
    pub fn on_offer(
        &mut self,
        item: Arc<Received<JobOffer>>,
        source: Option<&Address>,
        now: Timestamp,
        received_at_us: u64,
    ) -> Verdict {
        let offer = &item.body;
        if let Err(v) = self.precheck(
            &item.signer,
            &item.id,
            source,
            now,
            (offer.issued_at, offer.expires_at),
            self.config.max_offer_ttl_ms,
        ) {
            return v;
        }
        match self.offers.get(&offer.job_id) {
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
        if let Err(e) = self.signatures.check(&*item) {
            return Verdict::Reject(RejectReason::Verify(e));
        }
        let (job, id, expires_at) = (offer.job_id, item.id, offer.expires_at);
        self.see(id, expires_at);
        let entry = OfferEntry {
            item,
            received_at_us,
        };
        if let Some(old) = self.offers.insert(job, entry) {
            self.expiries
                .remove(&(old.offer().expires_at, Held::Offer(job)));
        }
        self.expiries.insert((expires_at, Held::Offer(job)));
        Verdict::Accept(id)
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
                    self.offers.remove(&job);
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

    fn feed(
        v: &mut View,
        bytes: &[u8],
        source: Option<&Address>,
        now: Timestamp,
        us: u64,
    ) -> Verdict {
        match decode_gossip::<CapabilityAd>(bytes) {
            Ok(item) => v.on_ad(Arc::new(item), source, now, us),
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
            feed(&mut v, &tamper(ad(&k, 1, 900_000, 1_000_000)), None, NOW, 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
        // A fresh one with a bad signature fails the check.
        assert!(matches!(
            feed(&mut v, &tamper(ad(&k, 1, 999_000, 1_060_000)), None, NOW, 0),
            Verdict::Reject(RejectReason::Verify(_))
        ));
        // Once the good one is held, a stale copy with a bad signature is only stale.
        assert!(matches!(
            feed(&mut v, &ad(&k, 2, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            feed(&mut v, &tamper(ad(&k, 1, 999_000, 1_060_000)), None, NOW, 0),
            Verdict::Ignore(IgnoreReason::Stale { held: 2 })
        );
        // Assumed signatures (simulations) take the tampered one.
        let mut sim = View::new(ViewConfig::default(), Signatures::Assume);
        assert!(matches!(
            feed(
                &mut sim,
                &tamper(ad(&k, 1, 999_000, 1_060_000)),
                None,
                NOW,
                0
            ),
            Verdict::Accept(_)
        ));
    }

    #[test]
    fn accepts_then_ignores_duplicates_and_stale_versions() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        let a2 = ad(&k, 2, 999_000, 1_060_000);
        assert!(matches!(
            feed(&mut v, &a2, Some(&k.address()), NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            feed(&mut v, &a2, Some(&k.address()), NOW, 0),
            Verdict::Ignore(IgnoreReason::Duplicate)
        );
        let a1 = ad(&k, 1, 999_000, 1_060_000);
        assert_eq!(
            feed(&mut v, &a1, None, NOW, 0),
            Verdict::Ignore(IgnoreReason::Stale { held: 2 })
        );
        let a3 = ad(&k, 3, 999_500, 1_070_000);
        assert!(matches!(
            feed(&mut v, &a3, None, NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(v.ads().count(), 1);
        assert_eq!(v.ad(&k.address()).unwrap().ad().seq, 3);
    }

    #[test]
    fn rejects_what_is_invalid() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        assert!(matches!(
            feed(&mut v, b"\x82\x01\xa0", None, NOW, 0),
            Verdict::Reject(RejectReason::Decode(_))
        ));
        // Expired.
        assert!(matches!(
            feed(&mut v, &ad(&k, 1, 900_000, 1_000_000), None, NOW, 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
        // From the future.
        assert!(matches!(
            feed(&mut v, &ad(&k, 1, 1_200_001, 1_300_000), None, NOW, 0),
            Verdict::Reject(RejectReason::FromTheFuture { .. })
        ));
        // Lives too long.
        assert!(matches!(
            feed(&mut v, &ad(&k, 1, 999_000, NOW.0 + 3_600_001), None, NOW, 0),
            Verdict::Reject(RejectReason::TooLongLived { .. })
        ));
        // Relayed as published by someone else.
        assert!(matches!(
            feed(
                &mut v,
                &ad(&k, 1, 999_000, 1_060_000),
                Some(&keys(2).address()),
                NOW,
                0
            ),
            Verdict::Reject(RejectReason::NotFromSigner { .. })
        ));
        // Tampered.
        let mut t = ad(&k, 1, 999_000, 1_060_000);
        let last = t.len() - 1;
        t[last] ^= 1;
        assert!(matches!(
            feed(&mut v, &t, None, NOW, 0),
            Verdict::Reject(RejectReason::Verify(_))
        ));
        assert_eq!(v.ads().count(), 0);
    }

    #[test]
    fn expiry_drops_and_a_late_replay_is_rejected() {
        let mut v = View::new(ViewConfig::default(), Signatures::Check);
        let k = keys(1);
        let a = ad(&k, 1, 999_000, 1_010_000);
        assert!(matches!(feed(&mut v, &a, None, NOW, 0), Verdict::Accept(_)));
        assert_eq!(v.poll_timeout(), Some(Timestamp(1_010_000)));
        assert_eq!(v.expire(Timestamp(1_009_999)), Expired::default());
        assert_eq!(v.expire(Timestamp(1_010_000)).ads, vec![k.address()]);
        assert_eq!(v.ads().count(), 0);
        assert_eq!(v.poll_timeout(), None);
        assert!(matches!(
            feed(&mut v, &a, None, Timestamp(1_010_001), 0),
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
            feed(&mut v, &ad(&keys(1), 1, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            feed(&mut v, &ad(&keys(2), 1, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Ignore(IgnoreReason::Full)
        );
        // An update of a held node still goes in.
        assert!(matches!(
            feed(&mut v, &ad(&keys(1), 2, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Accept(_)
        ));
    }
}
