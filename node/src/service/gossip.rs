//! Gossip: decoding what arrives and reporting the engine's verdict (accept / ignore /
//! reject) to gossipsub; probing the machine off the driver; making, signing and gossiping
//! our own ad and the offers the engine publishes.

use std::sync::Arc;

use anyhow::Context as _;
use cannabis_market::{
    Command as MarketCommand, GossipId, Heard, Input, Origin, Verdict, decode_gossip,
};
use cannabis_protocol::{AdapterKind, AttestationKind, CapabilityAd, JobOffer, Signed};
use libp2p::gossipsub::{self, MessageAcceptance};
use tracing::{debug, info, warn};

use super::{Command, Node, now};
use crate::swarm::{self, Topic};

/// How long an ad waits for other changes before it is published.
const AD_SETTLE: std::time::Duration = std::time::Duration::from_millis(500);

/// What the machine looked like when last probed (off the driver: the probe reads /proc,
/// the disk, and NVML, which can take long on a machine with GPUs).
pub(crate) struct Probe {
    pub(super) owner: crate::config::Owner,
    hardware: cannabis_protocol::Hardware,
    os: cannabis_protocol::OsInfo,
}

/// How many messages past their signer's rate a peer may send before each further one
/// counts against it: 32 at once, then 30 a minute (an honest relay sends a few at most).
const OVER_RATE_SLACK: cannabis_market::rate::Rate = cannabis_market::rate::Rate {
    burst: 32,
    per_minute: 30,
};

/// What each message past the slack costs the peer (P5): a peer that keeps flooding is
/// graylisted after a handful and let go.
const OVER_RATE_PENALTY: f64 = 20.0;

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
                if self.ad_unheard && self.topics.from_hash(&topic) == Some(Topic::Ads) {
                    // Our ad went out to nobody: now somebody listens.
                    self.publish_ad_soon();
                }
            }
            return;
        };
        if self.safe_mode.is_some() {
            // Not kept, so not forwarded either.
            let _ = self
                .swarm
                .behaviour_mut()
                .gossipsub
                .report_message_validation_result(
                    &message_id,
                    &propagation_source,
                    MessageAcceptance::Ignore,
                );
            return;
        }
        let (now_ms, now_us) = now();
        let topic = self.topics.from_hash(&message.topic);
        self.next_gossip += 1;
        let id = GossipId(self.next_gossip);
        let origin = Origin::Gossip(id);
        self.gossip.insert(id, (message_id, propagation_source));
        match topic {
            Some(Topic::Ads) => match decode_gossip::<CapabilityAd>(&message.data) {
                Ok(item) => self.market.handle(
                    now_ms,
                    Input::Ad(Heard {
                        origin,
                        received_us: now_us,
                        item: Arc::new(item),
                    }),
                ),
                Err(why) => self.on_verdict(origin, Verdict::Reject(why)),
            },
            Some(Topic::Offers { .. }) => match decode_gossip::<JobOffer>(&message.data) {
                Ok(item) => self.market.handle(
                    now_ms,
                    Input::Offer(Heard {
                        origin,
                        received_us: now_us,
                        item: Arc::new(item),
                    }),
                ),
                Err(why) => self.on_verdict(origin, Verdict::Reject(why)),
            },
            Some(Topic::Blocks) => self.on_block(origin, &message.data),
            None => self.on_verdict(
                origin,
                Verdict::Reject(cannabis_market::RejectReason::Decode(
                    cannabis_protocol::DecodeError::Malformed {
                        kind: "gossip message",
                        reason: "unknown topic".into(),
                    },
                )),
            ),
        }
    }

    /// The engine's verdict on a gossiped message (forwarded at once: the store's write
    /// does not delay the next hop) or on a sync item (counted against its page).
    pub(super) fn on_verdict(&mut self, origin: Origin, verdict: Verdict) {
        let id = match origin {
            Origin::Sync(id) => return self.count_sync(id, &verdict),
            Origin::Gossip(id) => id,
        };
        let Some((message_id, peer)) = self.gossip.remove(&id) else {
            return;
        };
        let msg = hex::encode(&message_id.0);
        let acceptance = match &verdict {
            Verdict::Accept(id) => {
                debug!(%peer, %msg, id = %id, "gossip accepted");
                MessageAcceptance::Accept
            }
            Verdict::Ignore(why) => {
                debug!(%peer, %msg, %why, "gossip ignored");
                // Honest relays forward only what they took at the same rate, so they
                // pass on a message past its signer's rate rarely (their buckets and ours
                // started apart): a peer that keeps doing it is the flood's source.
                if matches!(why, cannabis_market::IgnoreReason::RateLimited)
                    && !self.over_rate.take(OVER_RATE_SLACK, peer, now().0)
                {
                    self.penalize(
                        peer,
                        OVER_RATE_PENALTY,
                        "sends messages past their signer's rate",
                    );
                }
                MessageAcceptance::Ignore
            }
            Verdict::Reject(why) => {
                warn!(%peer, %msg, %why, "gossip rejected");
                MessageAcceptance::Reject
            }
        };
        let rejected = acceptance == MessageAcceptance::Reject;
        let word = match &verdict {
            Verdict::Accept(_) => "accepted",
            Verdict::Ignore(_) => "ignored",
            Verdict::Reject(why) => {
                // By kind: a label per distinct text would let one sender grow the
                // metrics without bound.
                self.metrics
                    .gossip_rejected
                    .get_or_create(&crate::metrics::label("reason", why.kind()))
                    .inc();
                "rejected"
            }
        };
        self.metrics
            .gossip_in
            .get_or_create(&crate::metrics::label("verdict", word))
            .inc();
        self.swarm
            .behaviour_mut()
            .gossipsub
            .report_message_validation_result(&message_id, &peer, acceptance);
        if rejected {
            self.let_go_if_graylisted(peer);
        }
    }

    /// Probes the machine off the driver; the driver publishes the ad when it is back.
    pub(super) fn probe_machine(
        &mut self,
        reply: Option<tokio::sync::oneshot::Sender<anyhow::Result<()>>>,
    ) {
        self.probes_asked += 1;
        let n = self.probes_asked;
        let data_dir = self.data_dir.clone();
        let source = self.config.source.clone();
        let mut owner = self.config.owner.clone();
        let tx = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            // The owner's settings are re-read from the file, so the next ad follows the
            // owner's changes; a file that no longer parses keeps the last good settings.
            if let Some(path) = source {
                match crate::config::NodeConfig::from_file(&path) {
                    Ok(fresh) => owner = fresh.owner,
                    Err(e) => {
                        warn!(error = %format!("{e:#}"), "keeping the previous owner settings")
                    }
                }
            }
            let host = cannabis_runtime::probe::host(&data_dir);
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
            let probe = Probe {
                owner,
                hardware,
                os: host.os,
            };
            let _ = tx.blocking_send(Command::Probed(n, Box::new(probe), reply));
        });
    }

    /// Publishes the ad in a moment (what changes meanwhile goes into the same ad).
    pub(super) fn publish_ad_soon(&mut self) {
        if self.ad_due.is_none() {
            self.ad_due = Some(tokio::time::Instant::now() + AD_SETTLE);
        }
    }

    /// Publishes the ad again from the last probe, if there is one yet.
    pub(super) fn publish_ad_now(&mut self) {
        if self.probe.is_none() {
            return;
        }
        if let Err(e) = self.publish_ad() {
            warn!(error = %format!("{e:#}"), "cannot publish the capability ad");
        }
    }

    /// Makes, signs, keeps and gossips this node's capability ad from the last probe.
    pub(super) fn publish_ad(&mut self) -> anyhow::Result<()> {
        let probe = self
            .probe
            .as_ref()
            .context("the machine has not been probed yet")?;
        let (now_ms, now_us) = now();
        let (runtimes, collectives) = self.software.clone().unwrap_or_default();
        // The ad offers what the executor admits: the owner's limits (within the
        // administrator's ceilings) cap what the probe found.
        let mut hardware = probe.hardware.clone();
        let mut capacity = cannabis_market::Capacity::default();
        let (isolation, mut adapters) = match self.executor.borrow().as_deref() {
            Some(Ok(ex)) => {
                let limits = ex.limits();
                capacity = cannabis_market::Capacity {
                    cpu_millicores: limits.cpu_millicores,
                    memory_bytes: limits.memory_bytes,
                    storage_bytes: limits.storage_bytes,
                    gpus: limits.gpus.len() as u64,
                };
                // Whole cores admission gives: an owner limit of half a core is 0, never
                // rounded up to a core the executor would then refuse.
                let cores = u32::try_from(limits.cpu_millicores / 1000).unwrap_or(u32::MAX);
                hardware.cpu_cores = hardware.cpu_cores.min(cores);
                hardware.memory_bytes = hardware.memory_bytes.min(limits.memory_bytes);
                hardware.swap_bytes = hardware.swap_bytes.min(limits.swap_bytes);
                hardware.storage_bytes = hardware.storage_bytes.min(limits.storage_bytes);
                (ex.layers(), ex.adapters())
            }
            // No executor (yet, or at all): no capacity for work.
            _ => {
                hardware.cpu_cores = 0;
                hardware.memory_bytes = 0;
                hardware.swap_bytes = 0;
                hardware.storage_bytes = 0;
                hardware.gpus.clear();
                (Vec::new(), Vec::new())
            }
        };
        // The engine's busy rule counts what the executor admits, in millicores: the ad's
        // whole cores say less (a quarter core is 0 of them).
        if let Err(e) = self
            .market
            .command(now_ms, cannabis_market::Command::Capacity(capacity))
        {
            debug!(error = %e, "capacity not taken");
        }
        // Requesters' own programs only on the owner's opt-in (`[worker] custom_code`).
        adapters.retain(|a| *a == AdapterKind::Synthetic || self.config.worker.custom_code);
        let challenges = self.market.passes_for_ad(hardware.cpu_cores);
        let ad = CapabilityAd {
            node: self.address,
            seq: self.store.next_seq("ad", now_ms.0)?,
            issued_at: now_ms,
            expires_at: now_ms.plus_ms(self.config.gossip.ad_ttl_secs.saturating_mul(1000)),
            delivery: self.keys.delivery.recipient(),
            hardware,
            os: probe.os.clone(),
            runtimes,
            adapters,
            collectives,
            isolation,
            network: probe.owner.network.clone(),
            prices: probe.owner.prices.clone(),
            attestation: match self.config.attestation {
                // Checked at start: only on a testnet.
                Some(AttestationKind::Dev) => {
                    Some(cannabis_market::attest::dev_attestation(&self.address))
                }
                _ => None,
            },
            challenges,
        };
        let signed = Signed::sign(&self.keys.signing, &ad);
        let bytes = signed.to_bytes();
        let item = signed.open().context("our own ad does not open")?;
        self.market
            .command(now_ms, MarketCommand::KeepOwnAd(item, now_us))
            .map_err(|e| anyhow::anyhow!("not published: {e}"))?;
        let heard = self.gossip_publish(Topic::Ads, bytes)?;
        self.ad_unheard = !heard;
        debug!(seq = ad.seq, heard, "capability ad published");
        Ok(())
    }

    /// Signs an offer the engine publishes, keeps it in the view, and gossips it.
    pub(super) fn publish_offer_signed(&mut self, offer: JobOffer) {
        let (now_ms, now_us) = now();
        let job = offer.job_id;
        let signed = Signed::sign(&self.keys.signing, &offer);
        let bytes = signed.to_bytes();
        let kept = signed
            .open()
            .map_err(|e| anyhow::anyhow!("our own offer does not open: {e}"))
            .and_then(|item| {
                self.market
                    .command(now_ms, MarketCommand::KeepOwnOffer(item, now_us))
                    .map_err(|e| anyhow::anyhow!("not published: {e}"))
            });
        if let Err(e) = kept {
            warn!(%job, error = %format!("{e:#}"), "offer not published");
            return;
        }
        let handed_over_us = now().1;
        // On the topic of every shard its calls reach (one topic when offers are not
        // sharded).
        let topics = self.topics.of_offer(&offer);
        let mut heard = 0;
        for topic in &topics {
            match self.gossip_publish(*topic, bytes.clone()) {
                Ok(true) => heard += 1,
                Ok(false) => {}
                Err(e) => warn!(%job, ?topic, error = %format!("{e:#}"), "offer not gossiped"),
            }
        }
        info!(%job, topics = topics.len(), heard, "offer published");
        self.published_at.insert(job, handed_over_us);
    }

    /// Gossips a message. Having no peers yet is fine: peers that connect later get it
    /// through sync. Returns whether any peer was there to hear it.
    pub(super) fn gossip_publish(&mut self, topic: Topic, bytes: Vec<u8>) -> anyhow::Result<bool> {
        let kind = match topic {
            Topic::Ads => "ad",
            Topic::Offers { .. } => "offer",
            Topic::Blocks => "block",
        };
        self.metrics
            .gossip_out
            .get_or_create(&crate::metrics::label("kind", kind))
            .inc();
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(self.topics.ident(topic), bytes)
        {
            Ok(_) => Ok(true),
            Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => {
                debug!(
                    ?topic,
                    "no gossip peers yet; peers will get it through sync"
                );
                Ok(false)
            }
            Err(e) => Err(anyhow::anyhow!("gossip publish failed: {e}")),
        }
    }
}

/// Blocks seen lately, and the highest height taken from each sequencer: a replay of a
/// block, after gossipsub's duplicate window or not, is ignored before anything is verified.
#[derive(Default)]
pub(crate) struct Blocks {
    recent: std::collections::HashSet<cannabis_protocol::Digest>,
    order: std::collections::VecDeque<cannabis_protocol::Digest>,
    highest: std::collections::HashMap<cannabis_protocol::Address, u64>,
}

/// Blocks remembered by hash; one further below a sequencer's highest is stale.
const RECENT_BLOCKS: usize = 1024;

impl Blocks {
    /// The cheap checks of a gossiped block, in order, before any signature: it decodes;
    /// the sequencer its header names is one of the network's; the block is not one seen before, nor older than the recent ones. `Ok`:
    /// verify it (off the driver) and then [`Blocks::taken`].
    fn precheck(
        &self,
        bytes: &[u8],
        sequencers: &[cannabis_protocol::Address],
    ) -> Result<cannabis_protocol::Block, Verdict> {
        use cannabis_market::{IgnoreReason, RejectReason};
        let block: cannabis_protocol::Block = cannabis_protocol::decode(bytes)
            .map_err(|e| Verdict::Reject(RejectReason::Decode(e)))?;
        let header = block
            .header
            .clone()
            .open()
            .map_err(|e| Verdict::Reject(RejectReason::Verify(e)))?;
        let sequencer = header.body.sequencer;
        if !sequencers.contains(&sequencer) {
            return Err(Verdict::Reject(RejectReason::Decode(
                cannabis_protocol::DecodeError::Malformed {
                    kind: "block",
                    reason: format!("{sequencer} is not a sequencer of this network"),
                },
            )));
        }
        if self.recent.contains(&block.hash()) {
            return Err(Verdict::Ignore(IgnoreReason::Duplicate));
        }
        if let Some(&h) = self.highest.get(&sequencer)
            && header.body.height.saturating_add(RECENT_BLOCKS as u64) <= h
        {
            return Err(Verdict::Ignore(IgnoreReason::Stale { held: h }));
        }
        Ok(block)
    }

    /// Remembers a block that verified.
    fn taken(
        &mut self,
        hash: cannabis_protocol::Digest,
        sequencer: cannabis_protocol::Address,
        height: u64,
    ) {
        if self.recent.insert(hash) {
            self.order.push_back(hash);
            if self.order.len() > RECENT_BLOCKS
                && let Some(old) = self.order.pop_front()
            {
                self.recent.remove(&old);
            }
        }
        let h = self.highest.entry(sequencer).or_default();
        *h = (*h).max(height);
    }
}

/// The full check of a block that passed the cheap ones: the header's signature, every
/// transaction's, the roots.
fn verify_block(block: cannabis_protocol::Block) -> Result<super::ledger::Checked, Verdict> {
    super::ledger::Checked::verify(block).map_err(|reason| {
        Verdict::Reject(cannabis_market::RejectReason::Decode(
            cannabis_protocol::DecodeError::Malformed {
                kind: "block",
                reason,
            },
        ))
    })
}

impl Node {
    /// A gossiped block: the cheap checks here, the signatures off the driver (a block of
    /// 1 MiB takes a few hundred milliseconds to verify).
    fn on_block(&mut self, origin: Origin, bytes: &[u8]) {
        let block = match self.blocks.precheck(bytes, &self.config.gossip.sequencers) {
            Ok(b) => b,
            Err(verdict) => return self.on_verdict(origin, verdict),
        };
        let tx = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            let checked = verify_block(block).map(Box::new);
            let _ = tx.blocking_send(Command::BlockChecked(origin, checked));
        });
    }

    /// The verdict on a block verified off the driver.
    pub(super) fn block_checked(
        &mut self,
        origin: Origin,
        checked: Result<Box<super::ledger::Checked>, Verdict>,
    ) {
        let verdict = match checked {
            Ok(checked) => {
                let (hash, sequencer, height) = checked.key();
                if self.blocks.recent.contains(&hash) {
                    // The same block came twice while the first was being verified.
                    Verdict::Ignore(cannabis_market::IgnoreReason::Duplicate)
                } else {
                    // Applied to the ledger (when the node keeps one) before it is
                    // forwarded: a block that does not apply is rejected.
                    let verdict = self.on_checked_block(origin, *checked);
                    if matches!(verdict, Verdict::Accept(_)) {
                        self.blocks.taken(hash, sequencer, height);
                    }
                    verdict
                }
            }
            Err(v) => v,
        };
        self.on_verdict(origin, verdict);
    }
}

impl Node {
    /// With sharded offers, a node must reach each shard's topic to publish on it: for a
    /// shard none of its peers listens to, it dials a node whose ad places it there. A few
    /// dials per shard at most, every ten seconds.
    pub(super) fn reach_every_shard(&mut self) {
        let shards = self.topics.shards();
        if shards <= 1 {
            return;
        }
        let mut heard: std::collections::BTreeSet<u32> = std::collections::BTreeSet::new();
        for (_, topics) in self.swarm.behaviour().gossipsub.all_peers() {
            for hash in topics {
                if let Some(Topic::Offers { shard }) = self.topics.from_hash(hash) {
                    heard.insert(shard);
                }
            }
        }
        let me = self.address;
        let mut dial = Vec::new();
        for shard in (0..shards).filter(|s| !heard.contains(s)) {
            let in_shard = self
                .market
                .view()
                .ads()
                .map(|e| e.ad().node)
                .filter(|a| {
                    *a != me
                        && cannabis_protocol::draw::shard_of(
                            cannabis_protocol::draw::worker_point(a),
                            shards,
                        ) == shard
                })
                .take(2);
            dial.extend(in_shard.filter_map(|a| swarm::peer_of(&a)));
        }
        for peer in dial {
            if !self.swarm.is_connected(&peer)
                && let Err(e) = self.swarm.dial(peer)
            {
                debug!(%peer, error = %e, "cannot dial a peer of an unheard shard");
            }
        }
    }
}

impl Node {
    /// The machine in one line, for delivery manifests: CPU model and cores, memory, GPUs.
    pub(super) fn hardware_summary(&self) -> String {
        let Some(p) = &self.probe else {
            return "not probed".into();
        };
        let h = &p.hardware;
        let mut s = format!(
            "{} ({} cores), {} MiB memory",
            h.cpu_model,
            h.cpu_cores,
            h.memory_bytes >> 20
        );
        for g in &h.gpus {
            s.push_str(&format!(", {} ({} MiB)", g.name, g.memory_bytes >> 20));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use cannabis_protocol::{Block, Digest, Keypair, Timestamp};

    use super::*;

    fn block(k: &Keypair, height: u64) -> Vec<u8> {
        let b = Block::build(k, height, Digest::of(b"prev"), Timestamp(1), Vec::new()).unwrap();
        cannabis_protocol::encode(&b)
    }

    #[test]
    fn blocks_come_only_from_the_networks_sequencers_and_only_once() {
        let (seq, other) = (Keypair::from_secret([1; 32]), Keypair::from_secret([2; 32]));
        let sequencers = [seq.address()];
        let mut blocks = Blocks::default();
        // Signed by a key that is not the network's sequencer.
        let stranger = block(&other, 1);
        assert!(matches!(
            blocks.precheck(&stranger, &sequencers),
            Err(Verdict::Reject(_))
        ));
        let good = block(&seq, 1);
        // The sequencer's own: checked in full, then taken once.
        let b = blocks.precheck(&good, &sequencers).unwrap();
        let (hash, s, h) = verify_block(b).unwrap().key();
        blocks.taken(hash, s, h);
        assert!(matches!(
            blocks.precheck(&good, &sequencers),
            Err(Verdict::Ignore(cannabis_market::IgnoreReason::Duplicate))
        ));
        // Far below the highest height: stale, whatever its hash.
        let top = blocks.precheck(&block(&seq, 5_000), &sequencers).unwrap();
        blocks.taken(top.hash(), seq.address(), 5_000);
        assert!(matches!(
            blocks.precheck(&block(&seq, 2), &sequencers),
            Err(Verdict::Ignore(cannabis_market::IgnoreReason::Stale { .. }))
        ));
        // Nothing is remembered without bound.
        for height in 5_001..5_001 + 2 * RECENT_BLOCKS as u64 {
            let b: Block = cannabis_protocol::decode(&block(&seq, height)).unwrap();
            blocks.taken(b.hash(), seq.address(), height);
        }
        assert_eq!(blocks.recent.len(), RECENT_BLOCKS);
        assert_eq!(blocks.order.len(), RECENT_BLOCKS);
    }
}
