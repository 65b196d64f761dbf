//! The worker's side of the engine: answering offers (bid, signed decline or silence, and
//! only when the offer's call draws this worker), taking awards within the owner's limit
//! of leases, renewals and cancellations, and the end of leases.

use std::sync::Arc;

use cannabis_protocol::{Address, Award, Cancel, JobOffer, LeaseRenewal, Received, message_id};

use super::{KEEP_ENDED_MS, Market, MarketEvent, Outbound, Purpose, RecordKey};
use crate::Refusal;
use crate::lease::{SentBid, Stopped};
use crate::quote::{self, Answer};

impl Market {
    /// A new offer (or a new version of one) this node holds now: answer each task it has
    /// not answered yet.
    pub(super) fn answer_offer(&mut self, item: &Arc<Received<JobOffer>>) {
        let me = self.me.address;
        let offer = &item.body;
        if offer.requester == me {
            return;
        }
        let now = self.now;
        if self.leases.live_count(now) >= self.config.worker.max_leases as usize {
            // Full: no quotes until a lease ends.
            return;
        }
        let Some(own) = self.view.ad(&me).map(|e| e.ad()) else {
            return;
        };
        let ctx = self.context();
        let declined = self.declined.get(&offer.job_id);
        let answers: Vec<(u32, Answer)> = (0..offer.tasks.len() as u32)
            .filter(|&t| {
                self.leases.bid_for(&offer.job_id, t).is_none()
                    && declined.is_none_or(|d| !d.contains(&t))
            })
            .filter_map(|t| {
                let terms = self.config.fee.as_ref();
                quote::answer(&self.config.worker, terms, own, offer, item.id, t, &ctx)
                    .map(|a| (t, a))
            })
            .collect();
        let requester = offer.requester;
        let job = offer.job_id;
        for (task, answer) in answers {
            match answer {
                Answer::Bid(bid) => {
                    let id = message_id(&bid);
                    let price = bid.price;
                    self.leases.on_bid_sent(
                        id,
                        SentBid {
                            bid: bid.clone(),
                            requester,
                        },
                    );
                    // Kept before it is sent: an award for it is recognised after a restart.
                    self.out.dirty(RecordKey::SentBid(id));
                    self.event(MarketEvent::BidSent { job, task, price });
                    self.send(
                        requester,
                        Outbound::Bid(bid),
                        Purpose::Other("bid", requester),
                    );
                }
                Answer::Decline(decline) => {
                    self.declined.entry(job).or_default().insert(task);
                    self.event(MarketEvent::Declined {
                        job,
                        task,
                        reason: decline.reason.clone(),
                    });
                    let purpose = Purpose::Other("decline", requester);
                    self.send(requester, Outbound::Decline(decline), purpose);
                }
                Answer::Silent(_) | Answer::NotDrawn => {}
            }
        }
    }

    /// An award: taken within the owner's limit of leases, for a bid this worker sent.
    pub(super) fn on_award(&mut self, from: Address, r: Received<Award>) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        let now = self.now;
        let award = &r.body;
        let key = (award.job_id, award.task, award.rank);
        // A newer epoch of an assignment this worker holds replaces its lease: no new slot.
        let held = self.leases.live_count(now);
        let replaces = self.leases.get(&key).is_some_and(|l| l.is_live());
        if held >= self.config.worker.max_leases as usize && !replaces {
            return Err(Refusal::Busy { held: held as u32 });
        }
        self.check_signature(&r)?;
        let (accept, superseded) = self.leases.on_award(award, r.id, now)?;
        let requester = award.requester;
        self.out.dirty(RecordKey::Lease(key));
        if let Some(s) = superseded {
            self.lease_ended(s);
        }
        self.event(MarketEvent::LeaseTaken {
            key,
            epoch: accept.epoch,
        });
        let purpose = Purpose::Other("lease acceptance", requester);
        self.send(requester, Outbound::Accept(accept), purpose);
        Ok(())
    }

    pub(super) fn on_renewal(
        &mut self,
        from: Address,
        r: Received<LeaseRenewal>,
    ) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        self.check_signature(&r)?;
        let now = self.now;
        self.leases.on_renewal(&r.body, now)?;
        let b = &r.body;
        self.out.dirty(RecordKey::Lease((b.job_id, b.task, b.rank)));
        Ok(())
    }

    pub(super) fn on_cancel(&mut self, from: Address, r: Received<Cancel>) -> Result<(), Refusal> {
        Self::from_signer(from, &r)?;
        self.check_signature(&r)?;
        let now = self.now;
        let s = self.leases.on_cancel(&r.body, now)?;
        self.out.dirty(RecordKey::Lease(s.key));
        self.lease_ended(s);
        Ok(())
    }

    fn lease_ended(&mut self, s: Stopped) {
        self.event(MarketEvent::LeaseEnded {
            key: s.key,
            epoch: s.epoch,
            reason: s.reason,
        });
    }

    /// Ends leases that ran out; forgets bids whose quote ran out and leases long over.
    pub(super) fn tick_leases(&mut self) {
        let now = self.now;
        for s in self.leases.tick(now) {
            self.out.dirty(RecordKey::Lease(s.key));
            self.lease_ended(s);
        }
        let pruned = self.leases.prune(now, KEEP_ENDED_MS);
        for id in pruned.bids {
            self.out.dirty(RecordKey::SentBid(id));
        }
        for key in pruned.leases {
            self.out.dirty(RecordKey::Lease(key));
        }
    }
}
