//! Directed protocols: the market protocol (bids and the lease messages, ping) and sync,
//! which gives a node that just connected the live market it missed.

use cannabis_market::Verdict;
use cannabis_protocol::{
    MarketRequest, MarketResponse, Signed, SyncRequest, SyncResponse, Wire as _,
};
use libp2p::PeerId;
use libp2p::request_response::{Event, InboundFailure, Message};
use tracing::{debug, info, warn};

use super::{Node, now};
use crate::store::{Kind, Records};

/// A sync page stops growing past this many bytes, well under the frame cap.
const SYNC_PAGE_BYTES: usize = SyncResponse::MAX_SIZE / 2;
/// Penalty for a directed request that is oversized or does not decode.
const BAD_REQUEST_PENALTY: f64 = 20.0;

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
            } => {
                let response = self.answer_market(peer, request);
                if self
                    .swarm
                    .behaviour_mut()
                    .market
                    .send_response(channel, response)
                    .is_err()
                {
                    debug!(%peer, "requester went away before the answer");
                }
            }
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
                } else if let Some(purpose) = self.requests.remove(&request_id) {
                    self.on_own_response(purpose, Ok(response));
                }
            }
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                debug!(%peer, %error, "market request failed");
                if let Some(reply) = self.pending.remove(&request_id) {
                    let _ = reply.send(Err(anyhow::anyhow!("request to {peer} failed: {error}")));
                } else if let Some(purpose) = self.requests.remove(&request_id) {
                    self.on_own_response(purpose, Err(error.to_string()));
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

    fn answer_market(&mut self, peer: PeerId, request: MarketRequest) -> MarketResponse {
        let refused = |reason: String| MarketResponse::Refused { reason };
        let answer = |what: &str, outcome: Result<(), String>| match outcome {
            Ok(()) => MarketResponse::Ack,
            Err(reason) => {
                info!(%peer, %reason, "{what} refused");
                MarketResponse::Refused { reason }
            }
        };
        match request {
            MarketRequest::Ping { nonce } => MarketResponse::Pong { nonce },
            MarketRequest::Bid(bid) => match self.take_bid(&bid) {
                Ok(()) => MarketResponse::Ack,
                Err(reason) => {
                    info!(%peer, %reason, "bid refused");
                    refused(reason)
                }
            },
            MarketRequest::ChallengePass(pass) => {
                answer("challenge pass", self.take_pass(peer, pass))
            }
            MarketRequest::Decline(d) => answer("decline", self.take_decline(&d)),
            MarketRequest::Award(a) => answer("award", self.take_award(peer, &a)),
            MarketRequest::LeaseAccept(a) => answer("lease acceptance", self.take_accept(&a)),
            MarketRequest::LeaseRenewal(r) => answer("renewal", self.take_renewal(&r)),
            MarketRequest::Cancel(c) => answer("cancellation", self.take_cancel(&c)),
        }
    }

    /// A bid is kept when it verifies and answers an open offer this node published.
    fn take_bid(&mut self, bid: &Signed<cannabis_protocol::Bid>) -> Result<(), String> {
        let verified = bid.verify().map_err(|e| e.to_string())?;
        let (now_ms, _) = now();
        let b = &verified.body;
        if b.valid_until <= now_ms {
            return Err("the bid has expired".into());
        }
        let offer = self
            .view
            .offer(&b.job_id)
            .ok_or_else(|| format!("no open offer {}", b.job_id))?;
        if offer.offer.requester != self.address {
            return Err(format!("offer {} is not this node's", b.job_id));
        }
        if offer.id != b.offer {
            return Err("the bid answers another version of the offer".into());
        }
        if b.task as usize >= offer.offer.tasks.len() {
            return Err(format!("offer {} has no task {}", b.job_id, b.task));
        }
        self.bid_for_job(b.clone(), verified.id, now_ms)?;
        self.store
            .put_record(Records::Bids, &verified.id.0, &bid.to_bytes())
            .map_err(|e| format!("cannot record the bid: {e:#}"))?;
        info!(job = %b.job_id, worker = %b.worker, price = %b.price, msg = %verified.id, "bid received");
        Ok(())
    }

    /// Asks a newly connected peer for its live market, ads and offers.
    pub(super) fn start_sync(&mut self, peer: PeerId) {
        let sync = &mut self.swarm.behaviour_mut().sync;
        sync.send_request(&peer, SyncRequest::Ads { after: None });
        sync.send_request(&peer, SyncRequest::Offers { after: None });
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
                let page = self.sync_page(&request);
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
                message: Message::Response { response, .. },
                ..
            } => self.on_sync_page(peer, response),
            Event::OutboundFailure { peer, error, .. } => {
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
        match request {
            SyncRequest::Ads { after } => {
                for e in self.view.ads_after(after.as_ref()) {
                    size += e.signed.payload().len() + 128;
                    if size > SYNC_PAGE_BYTES {
                        page.more = true;
                        break;
                    }
                    page.ads.push(e.signed.clone());
                }
            }
            SyncRequest::Offers { after } => {
                for e in self.view.offers_after(after.as_ref()) {
                    size += e.signed.payload().len() + 128;
                    if size > SYNC_PAGE_BYTES {
                        page.more = true;
                        break;
                    }
                    page.offers.push(e.signed.clone());
                }
            }
        }
        page
    }

    /// Feeds a sync page through the same checks as gossip; asks for the next page.
    fn on_sync_page(&mut self, peer: PeerId, page: SyncResponse) {
        let (now_ms, now_us) = now();
        let mut accepted = 0;
        let mut rejected = 0;
        let mut last_ad = None;
        let mut last_offer = None;
        for ad in &page.ads {
            let bytes = ad.to_bytes();
            match self.view.on_ad(&bytes, None, now_ms, now_us) {
                Verdict::Accept(_) => {
                    accepted += 1;
                    self.keep(Kind::Ad, &bytes, now_us);
                }
                Verdict::Ignore(_) => {}
                Verdict::Reject(why) => {
                    rejected += 1;
                    warn!(%peer, %why, "invalid ad in a sync page");
                }
            }
            last_ad = cannabis_protocol::decode::<cannabis_protocol::CapabilityAd>(ad.payload())
                .ok()
                .map(|a| a.node);
        }
        for offer in &page.offers {
            let bytes = offer.to_bytes();
            match self.view.on_offer(&bytes, None, now_ms, now_us) {
                Verdict::Accept(_) => {
                    accepted += 1;
                    self.keep(Kind::Offer, &bytes, now_us);
                    self.answer_offer(&bytes);
                }
                Verdict::Ignore(_) => {}
                // An offer that expired while the page travelled is not the peer's fault.
                Verdict::Reject(cannabis_market::RejectReason::Expired { .. }) => {}
                Verdict::Reject(why) => {
                    rejected += 1;
                    warn!(%peer, %why, "invalid offer in a sync page");
                }
            }
            last_offer = cannabis_protocol::decode::<cannabis_protocol::JobOffer>(offer.payload())
                .ok()
                .map(|o| o.job_id);
        }
        if rejected > 0 {
            self.penalize(
                peer,
                BAD_REQUEST_PENALTY * f64::from(rejected),
                "invalid sync items",
            );
        }
        debug!(%peer, accepted, rejected, more = page.more, "sync page");
        if page.more && rejected == 0 {
            let next = if !page.ads.is_empty() {
                SyncRequest::Ads { after: last_ad }
            } else {
                SyncRequest::Offers { after: last_offer }
            };
            self.swarm.behaviour_mut().sync.send_request(&peer, next);
        }
    }
}
