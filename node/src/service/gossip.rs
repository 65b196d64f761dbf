//! Gossip: validating what arrives (accept / ignore / reject), publishing our own ad and
//! offers.

use anyhow::Context as _;
use cannabis_api as api;
use cannabis_market::Verdict;
use cannabis_protocol::{
    AdapterKind, Amount, CapabilityAd, FOUNDER_FEE_BPS, FeeTerms, JobOffer, Signed, Uuid,
};
use libp2p::gossipsub::{self, MessageAcceptance};
use tracing::{debug, info, warn};

use super::{Node, OfferTemplate, now};
use crate::store::{Kind, Records};
use crate::swarm::{self, Topic};

impl Node {
    pub(super) fn on_gossip(&mut self, event: gossipsub::Event) {
        let gossipsub::Event::Message {
            propagation_source,
            message_id,
            message,
        } = event
        else {
            if let gossipsub::Event::Subscribed { peer_id, topic } = event {
                debug!(peer = %peer_id, %topic, "peer subscribed");
            }
            return;
        };
        let (now_ms, now_us) = now();
        // Strict validation mode: gossipsub has checked that `source` signed the message.
        let source = message.source.as_ref().and_then(swarm::address_of);
        let topic = Topic::from_hash(&message.topic);
        let verdict = match (topic, source) {
            (Some(Topic::Ads), Some(source)) => {
                self.view
                    .on_ad(&message.data, Some(&source), now_ms, now_us)
            }
            (Some(Topic::Offers), Some(source)) => {
                self.view
                    .on_offer(&message.data, Some(&source), now_ms, now_us)
            }
            (Some(Topic::Blocks), Some(source)) => on_block(&message.data, &source),
            (None, _) | (_, None) => Verdict::Reject(cannabis_market::RejectReason::Decode(
                cannabis_protocol::DecodeError::Malformed {
                    kind: "gossip message",
                    reason: "unknown topic or anonymous source".into(),
                },
            )),
        };
        let msg = hex_id(&message_id);
        let acceptance = match &verdict {
            Verdict::Accept(id) => {
                debug!(peer = %propagation_source, %msg, id = %id, topic = ?topic, "gossip accepted");
                MessageAcceptance::Accept
            }
            Verdict::Ignore(why) => {
                debug!(peer = %propagation_source, %msg, %why, "gossip ignored");
                MessageAcceptance::Ignore
            }
            Verdict::Reject(why) => {
                warn!(peer = %propagation_source, %msg, %why, "gossip rejected");
                MessageAcceptance::Reject
            }
        };
        let accepted = matches!(acceptance, MessageAcceptance::Accept);
        // Forward first, then persist: the store's fsync must not delay the next hop.
        self.swarm
            .behaviour_mut()
            .gossipsub
            .report_message_validation_result(&message_id, &propagation_source, acceptance);
        if accepted {
            match topic {
                Some(Topic::Ads) => self.keep(Kind::Ad, &message.data, now_us),
                Some(Topic::Offers) => {
                    self.keep(Kind::Offer, &message.data, now_us);
                    self.answer_offer(&message.data);
                }
                _ => {}
            }
        }
    }

    /// Persists an accepted ad or offer (so a restart keeps it).
    pub(super) fn keep(&mut self, kind: Kind, bytes: &[u8], received_us: u64) {
        if let Some(key) = kind.key_of(bytes)
            && let Err(e) = self.store.put(kind, &key, received_us, bytes)
        {
            warn!(error = %format!("{e:#}"), ?kind, "cannot store a gossip message");
        }
    }

    /// The owner's settings: re-read from the configuration file when there is one, so
    /// the next ad follows the owner's changes; a file that no longer parses keeps the last
    /// good settings.
    fn owner(&mut self) -> crate::config::Owner {
        if let Some(path) = self.config.source.clone() {
            match crate::config::NodeConfig::from_file(&path) {
                Ok(fresh) => self.config.owner = fresh.owner,
                Err(e) => warn!(error = %format!("{e:#}"), "keeping the previous owner settings"),
            }
        }
        self.config.owner.clone()
    }

    /// Probes, makes, signs, keeps and gossips this node's capability ad.
    pub(super) fn publish_ad(&mut self) -> anyhow::Result<()> {
        let (now_ms, now_us) = now();
        let owner = self.owner();
        let host = cannabis_runtime::probe::host(&self.data_dir);
        let (report, gpus, refusal) = cannabis_runtime::probe::gpus(
            &cannabis_runtime::gpu::Nvml,
            &owner.allowed_gpus,
            owner.cdi_map.as_deref(),
        );
        if let cannabis_runtime::gpu::GpuReport::Failed { error } = &report {
            warn!(%error, "GPU probe failed; advertising no GPU");
        }
        if let Some(refusal) = refusal {
            warn!(%refusal, "allowed GPUs withdrawn from the ad");
        }
        let mut hardware = host.hardware;
        hardware.gpus = gpus;
        let challenges = self.passes_for_ad(hardware.cpu_cores);
        let (runtimes, collectives) = self.software.clone().unwrap_or_default();
        let ad = CapabilityAd {
            node: self.address,
            seq: self.store.next_seq("ad", now_ms.0)?,
            issued_at: now_ms,
            expires_at: now_ms.plus_ms(self.config.gossip.ad_ttl_secs.saturating_mul(1000)),
            delivery: self.keys.delivery.recipient(),
            hardware,
            os: host.os,
            runtimes,
            adapters: vec![AdapterKind::Synthetic],
            collectives,
            isolation: match self.executor.as_ref() {
                Ok(ex) => ex.layers().to_vec(),
                Err(_) => Vec::new(),
            },
            network: owner.network,
            prices: owner.prices,
            attestation: None,
            challenges,
        };
        let bytes = Signed::sign(&self.keys.signing, &ad).to_bytes();
        self.publish(Topic::Ads, bytes, now_us)?;
        debug!(seq = ad.seq, "capability ad published");
        Ok(())
    }

    /// Makes, signs, keeps and gossips an offer from a template.
    pub(super) fn publish_offer(
        &mut self,
        t: OfferTemplate,
    ) -> anyhow::Result<(api::Published, JobOffer, cannabis_protocol::Digest)> {
        let (now_ms, now_us) = now();
        let budget =
            Amount::sum(t.tasks.iter().map(|t| &t.budget)).context("task budgets overflow")?;
        let offer = JobOffer {
            job_id: match t.job_id {
                Some(id) => id,
                None => Uuid::from_random(random16()?),
            },
            requester: self.address,
            seq: self.store.next_seq("offer", now_ms.0)?,
            issued_at: now_ms,
            expires_at: now_ms.plus_ms(t.ttl_ms),
            deadline: now_ms.plus_ms(t.deadline_ms),
            delivery: self.keys.delivery.recipient(),
            budget,
            fee: FeeTerms {
                rate_bps: FOUNDER_FEE_BPS,
                recipient: t.fee_recipient.unwrap_or(self.address),
            },
            review_window_ms: t.review_window_ms,
            acceptance: t.acceptance,
            tasks: t.tasks,
        };
        let signed = Signed::sign(&self.keys.signing, &offer);
        let id = signed.id();
        let published_at_us = self.publish(Topic::Offers, signed.to_bytes(), now_us)?;
        info!(job = %offer.job_id, msg = %id, "offer published");
        let published = api::Published {
            job_id: offer.job_id.to_string(),
            id: id.to_string(),
            published_at_us,
        };
        Ok((published, offer, id))
    }

    /// Puts our own message through the same checks as everyone's, keeps it (durably), and
    /// gossips it. Having no peers yet is fine: peers that connect later get it through
    /// sync. Returns when it was handed to gossip, in µs since the epoch.
    fn publish(&mut self, topic: Topic, bytes: Vec<u8>, now_us: u64) -> anyhow::Result<u64> {
        let me = self.address;
        let now_ms = cannabis_protocol::Timestamp(now_us / 1000);
        let verdict = match topic {
            Topic::Ads => self.view.on_ad(&bytes, Some(&me), now_ms, now_us),
            Topic::Offers => self.view.on_offer(&bytes, Some(&me), now_ms, now_us),
            Topic::Blocks => anyhow::bail!("blocks are published by the ledger"),
        };
        match verdict {
            Verdict::Accept(_) => {}
            Verdict::Ignore(why) => anyhow::bail!("not published: {why}"),
            Verdict::Reject(why) => anyhow::bail!("not published: {why}"),
        }
        match topic {
            Topic::Ads => self.keep(Kind::Ad, &bytes, now_us),
            _ => self.keep(Kind::Offer, &bytes, now_us),
        }
        let (_, handed_over_us) = now();
        let published = self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(topic.ident(), bytes);
        match published {
            Ok(_) => Ok(handed_over_us),
            Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => {
                debug!(
                    ?topic,
                    "no gossip peers yet; peers will get it through sync"
                );
                Ok(handed_over_us)
            }
            Err(e) => Err(anyhow::anyhow!("gossip publish failed: {e}")),
        }
    }

    pub(super) fn received_bids(&self) -> Vec<api::ReceivedBid> {
        let bids = match self.store.records(Records::Bids) {
            Ok(b) => b,
            Err(e) => {
                warn!(error = %format!("{e:#}"), "cannot read bids");
                return Vec::new();
            }
        };
        bids.iter()
            .filter_map(|(_, b)| Signed::<cannabis_protocol::Bid>::from_bytes(b).ok())
            .filter_map(|s| s.verify().ok())
            .map(|v| api::ReceivedBid {
                job_id: v.body.job_id.to_string(),
                task: v.body.task,
                worker: v.body.worker.to_string(),
                price: v.body.price,
                id: v.id.to_string(),
            })
            .collect()
    }
}

/// Gossiped ledger blocks: structure, signatures and roots, and published by their
/// sequencer. The ledger's own rules (height, parent, balances) are the settlement layer's.
fn on_block(bytes: &[u8], source: &cannabis_protocol::Address) -> Verdict {
    use cannabis_market::RejectReason;
    let block: cannabis_protocol::Block = match cannabis_protocol::decode(bytes) {
        Ok(b) => b,
        Err(e) => return Verdict::Reject(RejectReason::Decode(e)),
    };
    match block.verify() {
        Ok((header, _)) if header.signer == *source => Verdict::Accept(block.hash()),
        Ok((header, _)) => Verdict::Reject(RejectReason::NotFromSigner {
            source_addr: *source,
            signer: header.signer,
        }),
        Err(e) => Verdict::Reject(RejectReason::Decode(
            cannabis_protocol::DecodeError::Malformed {
                kind: "block",
                reason: e.to_string(),
            },
        )),
    }
}

fn hex_id(id: &gossipsub::MessageId) -> String {
    hex::encode(&id.0)
}

fn random16() -> anyhow::Result<[u8; 16]> {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b).context("reading the system random source")?;
    Ok(b)
}
