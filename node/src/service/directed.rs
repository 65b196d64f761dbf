//! Directed protocols: the market protocol (bids and the lease messages, ping) and sync,
//! which gives a node that just connected the live market it missed. Requests are decoded
//! here once and handed to the engine; what the engine sends is signed here.

use std::sync::Arc;

use cannabis_market::rate::Rate;
use cannabis_market::{
    Answer, Heard, Inbound, InboundId, Input, Origin, Outbound, OutboundId, Reply, SyncId, Verdict,
};
use cannabis_protocol::{
    Address, CapabilityAd, JobOffer, MarketRequest, MarketResponse, OpenError, Signed, SyncRequest,
    SyncResponse, Wire as _,
};
use libp2p::PeerId;
use libp2p::request_response::{Event, InboundFailure, Message, ResponseChannel};
use tracing::{debug, info, warn};

use super::{Node, SyncTally, now};
use crate::swarm;

/// A sync page stops growing past this many bytes, well under the frame cap.
const SYNC_PAGE_BYTES: usize = SyncResponse::MAX_SIZE / 2;
/// Most pages, and most bytes, one sync run fetches of one kind. A view of 100,000 ads of
/// about 1.6 KB fits in 80 pages; past the bound, gossip and ads' refreshes bring the rest.
const MAX_SYNC_PAGES: u32 = 128;
const MAX_SYNC_BYTES: usize = 256 << 20;

/// How many sync pages one peer is served: 160 at once (a view of 100,000 ads and as many
/// offers is about 160 pages), then 30 a minute. Past it a peer gets an empty last page: a
/// 512-byte request cannot make the node encode megabytes at will.
pub(crate) const SERVE_RATE: Rate = Rate {
    burst: 160,
    per_minute: 30,
};

/// A sync run with one peer for one kind: the page asked for, and what came so far.
pub(super) struct SyncRun {
    request: SyncRequest,
    pages: u32,
    bytes: usize,
}

/// Opens (decodes, without checking signatures) every item of a sync page, counting those
/// that do not open.
fn open_all<T: cannabis_protocol::Message>(
    items: Vec<Signed<T>>,
    undecodable: &mut usize,
) -> Vec<cannabis_protocol::Received<T>> {
    items
        .into_iter()
        .filter_map(|s| s.open().inspect_err(|_| *undecodable += 1).ok())
        .collect()
}

/// The last key of a page whose keys ascend strictly from after `after`; `Ok(None)` for an
/// empty page, `Err` when the order is broken.
fn ascending_after<K: Ord>(
    after: Option<&K>,
    keys: impl Iterator<Item = K>,
) -> Result<Option<K>, ()> {
    let mut last: Option<K> = None;
    for k in keys {
        let prev = last.as_ref().or(after);
        if prev.is_some_and(|p| k <= *p) {
            return Err(());
        }
        last = Some(k);
    }
    Ok(last)
}
/// Penalty for a directed request that is oversized, does not decode, or breaks a rule no
/// honest node breaks.
pub(super) const BAD_REQUEST_PENALTY: f64 = 20.0;

impl Node {
    pub(super) fn on_market(&mut self, event: Event<MarketRequest, MarketResponse>) {
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.on_market_request(peer, request, channel),
            Event::Message {
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let Some(reply) = self.pending.remove(&request_id) {
                    let _ = reply.send(Ok(response));
                } else if let Some(req) = self.outbound.remove(&request_id) {
                    let result = match response {
                        MarketResponse::Ack => Ok(Answer::Ack),
                        MarketResponse::Refused { reason } => Ok(Answer::Refused(reason)),
                        other => Err(format!("unexpected answer {other:?}")),
                    };
                    self.market.handle(now().0, Input::Response { req, result });
                }
            }
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                info!(%peer, %error, "market request failed");
                if let Some(reply) = self.pending.remove(&request_id) {
                    let _ = reply.send(Err(anyhow::anyhow!("request to {peer} failed: {error}")));
                } else if let Some(req) = self.outbound.remove(&request_id) {
                    let result = Err(error.to_string());
                    self.market.handle(now().0, Input::Response { req, result });
                }
            }
            Event::InboundFailure { peer, error, .. } => self.on_inbound_failure(peer, &error),
            Event::ResponseSent { .. } => {}
        }
    }

    fn on_inbound_failure(&mut self, peer: PeerId, error: &InboundFailure) {
        match error {
            InboundFailure::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                self.penalize(
                    peer,
                    BAD_REQUEST_PENALTY,
                    "oversized or undecodable request",
                );
                debug!(%peer, error = %e, "request refused");
            }
            other => debug!(%peer, error = %other, "inbound request failed"),
        }
    }

    /// A request from a peer: decoded once, then the engine decides (ping aside).
    fn on_market_request(
        &mut self,
        peer: PeerId,
        request: MarketRequest,
        channel: ResponseChannel<MarketResponse>,
    ) {
        if self.graylisted(&peer) {
            self.answer(
                channel,
                MarketResponse::Refused {
                    reason: "graylisted: too many invalid messages".into(),
                },
            );
            return;
        }
        if let Err(e) = self.refuse_if_safe()
            && !matches!(request, MarketRequest::Ping { .. })
        {
            self.answer(
                channel,
                MarketResponse::Refused {
                    reason: format!("{e:#}"),
                },
            );
            return;
        }
        let Some(from) = swarm::address_of(&peer) else {
            self.answer(
                channel,
                MarketResponse::Refused {
                    reason: "only nodes with ed25519 identities take part in the market".into(),
                },
            );
            return;
        };
        let msg: Result<Inbound, OpenError> = match request {
            MarketRequest::Ping { nonce } => {
                self.answer(channel, MarketResponse::Pong { nonce });
                return;
            }
            MarketRequest::Bid(s) => s.open().map(Inbound::Bid),
            MarketRequest::Decline(s) => s.open().map(Inbound::Decline),
            MarketRequest::Award(s) => s.open().map(Inbound::Award),
            MarketRequest::LeaseAccept(s) => s.open().map(Inbound::Accept),
            MarketRequest::LeaseRenewal(s) => s.open().map(Inbound::Renewal),
            MarketRequest::Cancel(s) => s.open().map(Inbound::Cancel),
            MarketRequest::RunReport(s) => s.open().map(Inbound::RunReport),
            MarketRequest::Checkpoint(s) => s.open().map(Inbound::Checkpoint),
            MarketRequest::Deliver(s) => s.open().map(Inbound::Deliver),
            MarketRequest::ChallengePass(s) => s.open().map(Inbound::Pass),
        };
        match msg {
            Ok(msg) => {
                self.next_inbound += 1;
                let req = InboundId(self.next_inbound);
                self.inbound.insert(req, channel);
                self.market
                    .handle(now().0, Input::Request { req, from, msg });
            }
            Err(e) => {
                self.penalize(peer, BAD_REQUEST_PENALTY, "malformed market message");
                self.answer(
                    channel,
                    MarketResponse::Refused {
                        reason: format!("unverifiable: {e}"),
                    },
                );
            }
        }
    }

    fn answer(&mut self, channel: ResponseChannel<MarketResponse>, response: MarketResponse) {
        if self
            .swarm
            .behaviour_mut()
            .market
            .send_response(channel, response)
            .is_err()
        {
            debug!("the requester went away before the answer");
        }
    }

    /// The engine's answer to a request.
    pub(super) fn reply(&mut self, req: InboundId, answer: Reply) {
        let Some(channel) = self.inbound.remove(&req) else {
            return;
        };
        let response = match answer {
            Reply::Ack => MarketResponse::Ack,
            Reply::Refused(why) => MarketResponse::Refused {
                reason: why.to_string(),
            },
        };
        self.answer(channel, response);
    }

    /// Signs and sends what the engine asks.
    pub(super) fn send(&mut self, req: OutboundId, to: Address, msg: Outbound) {
        let k = &self.keys.signing;
        let request = match msg {
            Outbound::Bid(b) => MarketRequest::Bid(Signed::sign(k, &b)),
            Outbound::Decline(d) => MarketRequest::Decline(Signed::sign(k, &d)),
            Outbound::Award(a) => MarketRequest::Award(Signed::sign(k, &a)),
            Outbound::Accept(a) => MarketRequest::LeaseAccept(Signed::sign(k, &a)),
            Outbound::Renewal(r) => MarketRequest::LeaseRenewal(Signed::sign(k, &r)),
            Outbound::Cancel(c) => MarketRequest::Cancel(Signed::sign(k, &c)),
            Outbound::RunReport(r) => MarketRequest::RunReport(Signed::sign(k, &r)),
            Outbound::Checkpoint(c) => MarketRequest::Checkpoint(Signed::sign(k, &c)),
            Outbound::Deliver(d) => MarketRequest::Deliver(Signed::sign(k, &d)),
        };
        let Some(peer) = swarm::peer_of(&to) else {
            warn!(%to, "no peer id for address");
            self.market.handle(
                now().0,
                Input::Response {
                    req,
                    result: Err(format!("no peer id for {to}")),
                },
            );
            return;
        };
        let id = self
            .swarm
            .behaviour_mut()
            .market
            .send_request(&peer, request);
        self.outbound.insert(id, req);
    }

    /// Asks a newly connected peer for its live market, ads and offers.
    pub(super) fn start_sync(&mut self, peer: PeerId) {
        for request in [
            SyncRequest::Ads { after: None },
            SyncRequest::Offers { after: None },
        ] {
            self.request_page(
                peer,
                SyncRun {
                    request,
                    pages: 0,
                    bytes: 0,
                },
            );
        }
    }

    fn request_page(&mut self, peer: PeerId, run: SyncRun) {
        let id = self
            .swarm
            .behaviour_mut()
            .sync
            .send_request(&peer, run.request.clone());
        self.sync_runs.insert(id, run);
    }
    pub(super) fn on_sync(&mut self, event: Event<SyncRequest, SyncResponse>) {
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => {
                // A graylisted peer, or one past its allowance, gets an empty last page:
                // nothing to encode.
                let allowed = self.served.take(SERVE_RATE, peer, now().0);
                if !allowed {
                    debug!(%peer, "sync pages beyond the peer's allowance: an empty page");
                }
                let page = if !allowed || self.graylisted(&peer) {
                    SyncResponse {
                        ads: Vec::new(),
                        offers: Vec::new(),
                        more: false,
                    }
                } else {
                    self.sync_page(&request)
                };
                if self
                    .swarm
                    .behaviour_mut()
                    .sync
                    .send_response(channel, page)
                    .is_err()
                {
                    debug!(%peer, "sync peer went away");
                }
            }
            Event::Message {
                peer,
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let Some(run) = self.sync_runs.remove(&request_id) {
                    self.on_sync_page(peer, run, response);
                }
            }
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                self.sync_runs.remove(&request_id);
                debug!(%peer, %error, "sync request failed");
            }
            Event::InboundFailure { peer, error, .. } => self.on_inbound_failure(peer, &error),
            Event::ResponseSent { .. } => {}
        }
    }

    fn sync_page(&self, request: &SyncRequest) -> SyncResponse {
        let mut page = SyncResponse {
            ads: Vec::new(),
            offers: Vec::new(),
            more: false,
        };
        let mut size = 0;
        let view = self.market.view();
        match request {
            SyncRequest::Ads { after } => {
                for e in view.ads_after(after.as_ref()) {
                    size += e.size() + 128;
                    if size > SYNC_PAGE_BYTES {
                        page.more = true;
                        break;
                    }
                    page.ads.push(e.signed());
                }
            }
            SyncRequest::Offers { after } => {
                for e in view.offers_after(after.as_ref()) {
                    size += e.size() + 128;
                    if size > SYNC_PAGE_BYTES {
                        page.more = true;
                        break;
                    }
                    page.offers.push(e.signed());
                }
            }
        }
        page
    }

    /// Feeds a sync page through the same checks as gossip; asks for the next page while
    /// the cursor moves and the run is within `MAX_SYNC_PAGES` and `MAX_SYNC_BYTES`.
    fn on_sync_page(&mut self, peer: PeerId, run: SyncRun, page: SyncResponse) {
        if self.safe_mode.is_some() {
            return;
        }
        let bytes = run.bytes
            + page
                .ads
                .iter()
                .map(|s| s.payload().len())
                .chain(page.offers.iter().map(|s| s.payload().len()))
                .sum::<usize>();
        let mut undecodable = 0;
        // Decoded first (no signature checked yet), to check the page's order: only the
        // kind asked for, strictly after the cursor, ascending. A page that breaks it
        // (e.g. the same page again and again) ends the run.
        let (ads, offers, cursor) = match &run.request {
            SyncRequest::Ads { after } if page.offers.is_empty() => {
                let ads = open_all(page.ads, &mut undecodable);
                let keys = ads.iter().map(|r| r.body.node);
                let last = ascending_after(after.as_ref(), keys);
                let cursor = last.map(|l| l.map(|after| SyncRequest::Ads { after: Some(after) }));
                (ads, Vec::new(), cursor)
            }
            SyncRequest::Offers { after } if page.ads.is_empty() => {
                let offers = open_all(page.offers, &mut undecodable);
                let keys = offers.iter().map(|r| r.body.job_id);
                let last = ascending_after(after.as_ref(), keys);
                let cursor =
                    last.map(|l| l.map(|after| SyncRequest::Offers { after: Some(after) }));
                (Vec::new(), offers, cursor)
            }
            _ => (Vec::new(), Vec::new(), Err(())),
        };
        let cursor = match cursor {
            Ok(c) => c,
            Err(()) => {
                warn!(%peer, "a sync page out of order or of the wrong kind: sync stopped");
                self.penalize(peer, BAD_REQUEST_PENALTY, "sync page out of order");
                return;
            }
        };
        let (now_ms, now_us) = now();
        self.next_sync += 1;
        let id = SyncId(self.next_sync);
        self.sync.insert(id, SyncTally::default());
        for item in ads {
            self.market.handle(
                now_ms,
                Input::Ad(Heard::<CapabilityAd> {
                    origin: Origin::Sync(id),
                    received_us: now_us,
                    item: Arc::new(item),
                }),
            );
        }
        for item in offers {
            self.market.handle(
                now_ms,
                Input::Offer(Heard::<JobOffer> {
                    origin: Origin::Sync(id),
                    received_us: now_us,
                    item: Arc::new(item),
                }),
            );
        }
        self.drain();
        let tally = self.sync.remove(&id).unwrap_or_default();
        let rejected = tally.rejected + undecodable;
        if rejected > 0 {
            warn!(%peer, rejected, "invalid items in a sync page");
            self.penalize(
                peer,
                BAD_REQUEST_PENALTY * rejected as f64,
                "invalid sync items",
            );
        }
        let pages = run.pages + 1;
        debug!(%peer, accepted = tally.accepted, rejected, more = page.more, pages, bytes,
               "sync page");
        let Some(next) = cursor.filter(|_| page.more && rejected == 0) else {
            return;
        };
        if pages >= MAX_SYNC_PAGES || bytes >= MAX_SYNC_BYTES {
            info!(%peer, pages, bytes, "sync stopped at its bound; gossip brings the rest");
            return;
        }
        self.request_page(
            peer,
            SyncRun {
                request: next,
                pages,
                bytes,
            },
        );
    }

    /// A sync item's verdict, counted against its page.
    pub(super) fn count_sync(&mut self, id: SyncId, verdict: &Verdict) {
        let Some(tally) = self.sync.get_mut(&id) else {
            return;
        };
        match verdict {
            Verdict::Accept(_) => tally.accepted += 1,
            // An offer that expired while the page travelled is not the peer's fault.
            Verdict::Reject(cannabis_market::RejectReason::Expired { .. }) | Verdict::Ignore(_) => {
            }
            Verdict::Reject(why) => {
                debug!(%why, "invalid item in a sync page");
                tally.rejected += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use cannabis_market::rate::Limiter;
    use cannabis_protocol::Timestamp;

    use super::*;

    #[test]
    fn a_peer_is_served_its_burst_of_sync_pages_then_its_rate() {
        let mut served = Limiter::default();
        let (p, q) = (PeerId::random(), PeerId::random());
        let t = Timestamp(1_000_000);
        let taken = (0..1000).filter(|_| served.take(SERVE_RATE, p, t)).count();
        assert_eq!(taken, SERVE_RATE.burst as usize);
        // Another peer has its own allowance.
        assert!(served.take(SERVE_RATE, q, t));
        // Two seconds later, one more page (30 a minute).
        let later = t.plus_ms(2_000);
        assert!(served.take(SERVE_RATE, p, later));
        assert!(!served.take(SERVE_RATE, p, later));
        // Full again after long enough, and forgotten.
        served.expire(t.plus_ms(3_600_000));
        assert!(served.is_empty());
    }
}
