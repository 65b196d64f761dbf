//! The live market view: capability ads and open job offers, with expiry, fed by gossip.

use std::collections::BTreeMap;

use cannabis_protocol::{
    Address, CapabilityAd, DecodeError, Digest, JobOffer, OpenError, Signed, Timestamp, Uuid,
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
    /// The signed message, as received.
    pub signed: Signed<CapabilityAd>,
    /// Its verified content.
    pub ad: CapabilityAd,
    /// Its message id.
    pub id: Digest,
    /// When this node received it, in microseconds since the epoch.
    pub received_at_us: u64,
}

/// An open offer held in the view.
#[derive(Clone, Debug)]
pub struct OfferEntry {
    /// The signed message, as received.
    pub signed: Signed<JobOffer>,
    /// Its verified content.
    pub offer: JobOffer,
    /// Its message id.
    pub id: Digest,
    /// When this node received it, in microseconds since the epoch.
    pub received_at_us: u64,
}

/// The live market a node sees.
#[derive(Debug)]
pub struct View {
    config: ViewConfig,
    ads: BTreeMap<Address, AdEntry>,
    offers: BTreeMap<Uuid, OfferEntry>,
    /// Ids of messages seen, kept until the message expires: a replay later than that is
    /// expired and rejected; one before it is a duplicate.
    seen: BTreeMap<Digest, Timestamp>,
}

struct Checked<T> {
    body: T,
    id: Digest,
}

impl View {
    /// An empty view.
    pub fn new(config: ViewConfig) -> Self {
        Self {
            config,
            ads: BTreeMap::new(),
            offers: BTreeMap::new(),
            seen: BTreeMap::new(),
        }
    }

    /// Checks what every gossiped message must pass: decoding, signature, source, replay,
    /// time window. `ttl` is the longest the kind may live.
    fn check<T: cannabis_protocol::Message>(
        &self,
        bytes: &[u8],
        source: Option<&Address>,
        now: Timestamp,
        times: impl Fn(&T) -> (Timestamp, Timestamp),
        ttl_ms: u64,
    ) -> Result<(Signed<T>, Checked<T>), Verdict> {
        let signed =
            Signed::<T>::from_bytes(bytes).map_err(|e| Verdict::Reject(RejectReason::Decode(e)))?;
        let verified = signed
            .verify()
            .map_err(|e| Verdict::Reject(RejectReason::Verify(e)))?;
        if let Some(source) = source
            && *source != verified.signer
        {
            return Err(Verdict::Reject(RejectReason::NotFromSigner {
                source_addr: *source,
                signer: verified.signer,
            }));
        }
        let (issued_at, expires_at) = times(&verified.body);
        if expires_at <= now {
            return Err(Verdict::Reject(RejectReason::Expired {
                expired_at: expires_at,
            }));
        }
        if self.seen.contains_key(&verified.id) {
            return Err(Verdict::Ignore(IgnoreReason::Duplicate));
        }
        if issued_at > now.plus_ms(self.config.max_clock_skew_ms) {
            return Err(Verdict::Reject(RejectReason::FromTheFuture { issued_at }));
        }
        if expires_at > now.plus_ms(ttl_ms) {
            return Err(Verdict::Reject(RejectReason::TooLongLived { expires_at }));
        }
        Ok((
            signed,
            Checked {
                body: verified.body,
                id: verified.id,
            },
        ))
    }

    /// A gossiped capability ad. `source` is the gossip author's address, when known.
    pub fn on_ad(
        &mut self,
        bytes: &[u8],
        source: Option<&Address>,
        now: Timestamp,
        received_at_us: u64,
    ) -> Verdict {
        let (signed, Checked { body, id }) = match self.check::<CapabilityAd>(
            bytes,
            source,
            now,
            |a| (a.issued_at, a.expires_at),
            self.config.max_ad_ttl_ms,
        ) {
            Ok(ok) => ok,
            Err(verdict) => return verdict,
        };
        match self.ads.get(&body.node) {
            Some(held) if held.ad.seq >= body.seq => {
                return Verdict::Ignore(IgnoreReason::Stale { held: held.ad.seq });
            }
            None if self.ads.len() >= self.config.max_ads => {
                return Verdict::Ignore(IgnoreReason::Full);
            }
            _ => {}
        }
        self.seen.insert(id, body.expires_at);
        self.ads.insert(
            body.node,
            AdEntry {
                signed,
                ad: body,
                id,
                received_at_us,
            },
        );
        Verdict::Accept(id)
    }

    /// A gossiped job offer. `source` is the gossip author's address, when known.
    pub fn on_offer(
        &mut self,
        bytes: &[u8],
        source: Option<&Address>,
        now: Timestamp,
        received_at_us: u64,
    ) -> Verdict {
        let (signed, Checked { body, id }) = match self.check::<JobOffer>(
            bytes,
            source,
            now,
            |o| (o.issued_at, o.expires_at),
            self.config.max_offer_ttl_ms,
        ) {
            Ok(ok) => ok,
            Err(verdict) => return verdict,
        };
        match self.offers.get(&body.job_id) {
            Some(held) if held.offer.requester != body.requester => {
                return Verdict::Ignore(IgnoreReason::JobIdTaken);
            }
            Some(held) if held.offer.seq >= body.seq => {
                return Verdict::Ignore(IgnoreReason::Stale {
                    held: held.offer.seq,
                });
            }
            None if self.offers.len() >= self.config.max_offers => {
                return Verdict::Ignore(IgnoreReason::Full);
            }
            _ => {}
        }
        self.seen.insert(id, body.expires_at);
        self.offers.insert(
            body.job_id,
            OfferEntry {
                signed,
                offer: body,
                id,
                received_at_us,
            },
        );
        Verdict::Accept(id)
    }

    /// Drops everything that expired by `now` and says what was dropped.
    pub fn expire(&mut self, now: Timestamp) -> Expired {
        let mut dropped = Expired::default();
        self.ads.retain(|node, e| {
            let keep = e.ad.expires_at > now;
            if !keep {
                dropped.ads.push(*node);
            }
            keep
        });
        self.offers.retain(|job, e| {
            let keep = e.offer.expires_at > now;
            if !keep {
                dropped.offers.push(*job);
            }
            keep
        });
        self.seen.retain(|_, expires| *expires > now);
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
        let ads = self.ads.values().map(|e| e.ad.expires_at);
        let offers = self.offers.values().map(|e| e.offer.expires_at);
        ads.chain(offers).min()
    }

    /// The live ads, by node address.
    pub fn ads(&self) -> impl Iterator<Item = &AdEntry> {
        self.ads.values()
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

    #[test]
    fn accepts_then_ignores_duplicates_and_stale_versions() {
        let mut v = View::new(ViewConfig::default());
        let k = keys(1);
        let a2 = ad(&k, 2, 999_000, 1_060_000);
        assert!(matches!(
            v.on_ad(&a2, Some(&k.address()), NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            v.on_ad(&a2, Some(&k.address()), NOW, 0),
            Verdict::Ignore(IgnoreReason::Duplicate)
        );
        let a1 = ad(&k, 1, 999_000, 1_060_000);
        assert_eq!(
            v.on_ad(&a1, None, NOW, 0),
            Verdict::Ignore(IgnoreReason::Stale { held: 2 })
        );
        let a3 = ad(&k, 3, 999_500, 1_070_000);
        assert!(matches!(v.on_ad(&a3, None, NOW, 0), Verdict::Accept(_)));
        assert_eq!(v.ads().count(), 1);
        assert_eq!(v.ad(&k.address()).unwrap().ad.seq, 3);
    }

    #[test]
    fn rejects_what_is_invalid() {
        let mut v = View::new(ViewConfig::default());
        let k = keys(1);
        assert!(matches!(
            v.on_ad(b"\x82\x01\xa0", None, NOW, 0),
            Verdict::Reject(RejectReason::Decode(_))
        ));
        // Expired.
        assert!(matches!(
            v.on_ad(&ad(&k, 1, 900_000, 1_000_000), None, NOW, 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
        // From the future.
        assert!(matches!(
            v.on_ad(&ad(&k, 1, 1_200_001, 1_300_000), None, NOW, 0),
            Verdict::Reject(RejectReason::FromTheFuture { .. })
        ));
        // Lives too long.
        assert!(matches!(
            v.on_ad(&ad(&k, 1, 999_000, NOW.0 + 3_600_001), None, NOW, 0),
            Verdict::Reject(RejectReason::TooLongLived { .. })
        ));
        // Relayed as published by someone else.
        assert!(matches!(
            v.on_ad(
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
            v.on_ad(&t, None, NOW, 0),
            Verdict::Reject(RejectReason::Verify(_))
        ));
        assert_eq!(v.ads().count(), 0);
    }

    #[test]
    fn expiry_drops_and_a_late_replay_is_rejected() {
        let mut v = View::new(ViewConfig::default());
        let k = keys(1);
        let a = ad(&k, 1, 999_000, 1_010_000);
        assert!(matches!(v.on_ad(&a, None, NOW, 0), Verdict::Accept(_)));
        assert_eq!(v.poll_timeout(), Some(Timestamp(1_010_000)));
        assert_eq!(v.expire(Timestamp(1_009_999)), Expired::default());
        assert_eq!(v.expire(Timestamp(1_010_000)).ads, vec![k.address()]);
        assert_eq!(v.ads().count(), 0);
        assert_eq!(v.poll_timeout(), None);
        assert!(matches!(
            v.on_ad(&a, None, Timestamp(1_010_001), 0),
            Verdict::Reject(RejectReason::Expired { .. })
        ));
    }

    #[test]
    fn full_views_ignore_newcomers() {
        let mut v = View::new(ViewConfig {
            max_ads: 1,
            ..ViewConfig::default()
        });
        assert!(matches!(
            v.on_ad(&ad(&keys(1), 1, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Accept(_)
        ));
        assert_eq!(
            v.on_ad(&ad(&keys(2), 1, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Ignore(IgnoreReason::Full)
        );
        // An update of a held node still goes in.
        assert!(matches!(
            v.on_ad(&ad(&keys(1), 2, 999_000, 1_060_000), None, NOW, 0),
            Verdict::Accept(_)
        ));
    }
}
