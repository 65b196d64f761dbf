//! The node's driver: one task owns the swarm, the market view and the store. Swarm events
//! and commands (from the local API, the CLI, tests) go in; gossip, requests and answers
//! come out. A cheap-to-clone [`NodeHandle`] sends commands over a bounded channel.

mod challenge;
mod directed;
mod gossip;
mod handle;
mod jobs;

pub use cannabis_api::OfferTemplate;
pub use handle::NodeHandle;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use cannabis_api as api;
use cannabis_market::{View, ViewConfig};
use cannabis_protocol::{Address, MarketResponse, Timestamp};
use futures::StreamExt as _;
use libp2p::request_response::OutboundRequestId;
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Swarm, identify, kad, mdns};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::config::NodeConfig;
use crate::keystore::NodeKeys;
use crate::store::{Kind, Store};
use crate::swarm::{self, Behaviour, BehaviourEvent, Topic};

/// Connections a node keeps open to peers it discovers, so that gossip meshes can form.
const TARGET_PEERS: usize = 16;

/// Now, as the protocol's millisecond timestamp and in microseconds.
pub(crate) fn now() -> (Timestamp, u64) {
    let us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    (Timestamp(us / 1000), us)
}

/// Sleeps until `at`, or forever.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What the driver is asked to do.
pub(crate) enum Command {
    Status(oneshot::Sender<api::Status>),
    Peers(oneshot::Sender<Vec<api::Peer>>),
    Ads(oneshot::Sender<Vec<api::Ad>>),
    Offers(oneshot::Sender<Vec<api::Offer>>),
    Bids(oneshot::Sender<Vec<api::ReceivedBid>>),
    PublishOffer(
        OfferTemplate,
        oneshot::Sender<anyhow::Result<api::Published>>,
    ),
    PublishAd(oneshot::Sender<anyhow::Result<()>>),
    SubmitJob(
        OfferTemplate,
        oneshot::Sender<anyhow::Result<api::JobSummary>>,
    ),
    Jobs(oneshot::Sender<Vec<api::JobSummary>>),
    Leases(oneshot::Sender<Vec<api::HeldLease>>),
    Job(
        cannabis_protocol::Uuid,
        oneshot::Sender<anyhow::Result<api::JobDetail>>,
    ),
    CancelJob(
        cannabis_protocol::Uuid,
        oneshot::Sender<anyhow::Result<api::JobSummary>>,
    ),
    Explain(
        OfferTemplate,
        oneshot::Sender<anyhow::Result<Vec<api::TaskExplanation>>>,
    ),
    Market {
        peer: PeerId,
        request: cannabis_protocol::MarketRequest,
        reply: oneshot::Sender<anyhow::Result<MarketResponse>>,
    },
    Dial(Multiaddr, oneshot::Sender<anyhow::Result<()>>),
    /// The slow part of the probe (python3, torch) finished.
    Software(Software),
    /// Set a peer the capability challenge.
    Challenge(
        PeerId,
        oneshot::Sender<anyhow::Result<api::ChallengeReport>>,
    ),
    /// A challenge this node answers has been proved.
    ChallengeProved(cannabis_protocol::ChallengeResponse),
    /// A challenge this node set has been checked.
    ChallengeChecked(
        api::ChallengeReport,
        cannabis_protocol::Digest,
        oneshot::Sender<anyhow::Result<api::ChallengeReport>>,
    ),
}

/// Runtimes and collectives found by the slow part of the probe.
pub(crate) type Software = (
    Vec<cannabis_protocol::Runtime>,
    Vec<cannabis_protocol::Collective>,
);

/// A running node's state, owned by its driver task.
pub(crate) struct Node {
    swarm: Swarm<Behaviour>,
    view: View,
    store: std::sync::Arc<Store>,
    /// The local executor, or why there is none.
    executor: handle::ExecutorSlot,
    keys: NodeKeys,
    config: NodeConfig,
    address: Address,
    started: Instant,
    data_dir: PathBuf,
    api_addr: Option<std::net::SocketAddr>,
    pending: HashMap<OutboundRequestId, oneshot::Sender<anyhow::Result<MarketResponse>>>,
    ping_rtt: HashMap<PeerId, Duration>,
    /// Remote addresses of each peer's open connections.
    connections: HashMap<PeerId, Vec<(libp2p::swarm::ConnectionId, Multiaddr)>>,
    app_scores: HashMap<PeerId, f64>,
    /// Runtimes and collectives, once probed.
    software: Option<Software>,
    /// Commands to itself, from blocking work.
    self_tx: mpsc::Sender<Command>,
    /// Challenges this node set, by request.
    challenges: HashMap<OutboundRequestId, challenge::Pending>,
    /// The challenge this node is proving (one at a time), and where to answer.
    proving:
        Option<libp2p::request_response::ResponseChannel<cannabis_protocol::ChallengeResponse>>,
    /// When each node last passed a challenge this node set.
    challenge_passes: HashMap<Address, Timestamp>,
    /// Passes other nodes signed for this one, by verifier; carried in the ad.
    own_passes: challenge::OwnPasses,
    /// Jobs this node published, as requester.
    jobs: std::collections::BTreeMap<cannabis_protocol::Uuid, jobs::Tracked>,
    /// This node's leases, as worker.
    leases: cannabis_market::lease::Leases,
    /// What this node's own market requests were for, so their answers reach the job.
    requests: HashMap<OutboundRequestId, jobs::Purpose>,
    /// Challenges this node answered lately: who set them, with which seed. Only a pass for
    /// one of them is kept.
    answered: std::collections::VecDeque<(PeerId, cannabis_protocol::Digest)>,
}

/// Starts a node: opens the store, builds the swarm, starts listening and dialing, and
/// spawns the driver. Returns the handle and the driver's task.
pub async fn start(
    config: NodeConfig,
    keys: NodeKeys,
    data_dir: &Path,
    api_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<(NodeHandle, tokio::task::JoinHandle<()>)> {
    config.check()?;
    let store = std::sync::Arc::new(Store::open(&data_dir.join("node.redb"))?);
    let executor = open_executor(&config, data_dir, &store).await;
    let libp2p_key = libp2p::identity::Keypair::ed25519_from_bytes(*keys.signing.secret())
        .context("turning the node key into a libp2p identity")?;
    let mut swarm = swarm::build(libp2p_key, &config)?;
    for addr in &config.listen {
        swarm
            .listen_on(addr.clone())
            .with_context(|| format!("listening on {addr}"))?;
    }
    for addr in &config.external_addrs {
        swarm.add_external_address(addr.clone());
    }
    let address = keys.signing.address();
    let peer_id = *swarm.local_peer_id();
    let (tx, rx) = mpsc::channel(256);
    // Blocking work reports back on a channel of its own, so the driver still stops when
    // every outside handle is gone.
    let (internal_tx, internal_rx) = mpsc::channel(16);
    let mut node = Node {
        swarm,
        view: View::new(ViewConfig::default()),
        store,
        executor: executor.clone(),
        keys,
        config,
        address,
        started: Instant::now(),
        data_dir: data_dir.to_path_buf(),
        api_addr,
        pending: HashMap::new(),
        ping_rtt: HashMap::new(),
        connections: HashMap::new(),
        app_scores: HashMap::new(),
        software: None,
        self_tx: internal_tx.clone(),
        challenges: HashMap::new(),
        proving: None,
        challenge_passes: HashMap::new(),
        own_passes: challenge::OwnPasses::default(),
        jobs: std::collections::BTreeMap::new(),
        leases: cannabis_market::lease::Leases::new(address),
        requests: HashMap::new(),
        answered: std::collections::VecDeque::new(),
    };
    node.restore()?;
    node.bootstrap();
    info!(%peer_id, %address, "node started");
    // Probing runtimes runs python3 (torch imports take seconds): off the driver.
    let probe_tx = internal_tx;
    tokio::task::spawn_blocking(move || {
        let software = cannabis_runtime::probe::runtimes();
        let _ = probe_tx.blocking_send(Command::Software(software));
    });
    let task = tokio::spawn(node.run(rx, internal_rx));
    Ok((NodeHandle::new(tx, peer_id, address, executor), task))
}

/// Opens the local executor off the async threads (it starts a self-test sandbox). A node
/// whose machine cannot run sandboxes still runs: it says why and takes no work.
async fn open_executor(
    config: &NodeConfig,
    data_dir: &Path,
    store: &std::sync::Arc<Store>,
) -> handle::ExecutorSlot {
    let dir = data_dir.join("exec");
    let ceilings = crate::exec::ceilings_path(config.ceilings.as_deref());
    let owner = config.executor.clone();
    let cdi_map = config.owner.cdi_map.clone();
    let data_dir = data_dir.to_path_buf();
    let journal: std::sync::Arc<dyn cannabis_runtime::exec::Journal> = store.clone();
    let opened = tokio::task::spawn_blocking(move || {
        let gpus = cannabis_runtime::probe::gpus(&cannabis_runtime::gpu::Nvml, &[], None)
            .1
            .into_iter()
            .map(|g| g.uuid)
            .collect();
        let machine = crate::exec::machine_limits(&data_dir, gpus);
        crate::exec::open(
            &dir,
            &machine,
            &ceilings,
            &owner,
            cdi_map.as_deref(),
            journal,
        )
    })
    .await
    .unwrap_or_else(|e| Err(format!("the executor did not open: {e}")));
    match &opened {
        Ok(ex) => info!(
            layers = ?ex.layers().iter().map(|l| cannabis_runtime::exec::layer_name(*l)).collect::<Vec<_>>(),
            cgroups = %ex.cgroups(),
            "local executor ready"
        ),
        Err(e) => warn!(reason = %e, "no local executor: this node takes no work"),
    }
    std::sync::Arc::new(opened)
}

impl Node {
    /// Loads what the store kept, re-verifying everything; drops what expired meanwhile.
    fn restore(&mut self) -> anyhow::Result<()> {
        let (now_ms, _) = now();
        let mut kept = 0;
        for kind in [Kind::Ad, Kind::Offer] {
            for (received_us, bytes) in self.store.load(kind)? {
                let verdict = match kind {
                    Kind::Ad => self.view.on_ad(&bytes, None, now_ms, received_us),
                    Kind::Offer => self.view.on_offer(&bytes, None, now_ms, received_us),
                };
                if matches!(verdict, cannabis_market::Verdict::Accept(_)) {
                    kept += 1;
                } else if let Some(key) = kind.key_of(&bytes) {
                    // Expired meanwhile, or no longer valid: it leaves the store too.
                    self.store.remove(kind, &key)?;
                }
            }
        }
        info!(kept, "market view restored from the store");
        self.restore_passes()?;
        self.restore_jobs()?;
        self.restore_worker()?;
        Ok(())
    }

    fn bootstrap(&mut self) {
        for addr in self.config.bootstrap.clone() {
            if let Some(libp2p::multiaddr::Protocol::P2p(peer)) = addr.iter().last() {
                self.swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer, addr.clone());
            }
            if let Err(e) = self.swarm.dial(addr.clone()) {
                warn!(%addr, error = %e, "cannot dial bootstrap peer");
            }
        }
        if !self.config.bootstrap.is_empty()
            && let Err(e) = self.swarm.behaviour_mut().kad.bootstrap()
        {
            debug!(error = %e, "kademlia bootstrap not started");
        }
    }

    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut internal: mpsc::Receiver<Command>,
    ) {
        let mut ad_timer =
            tokio::time::interval(Duration::from_secs(self.config.gossip.ad_refresh_secs));
        let mut expiry = tokio::time::interval(Duration::from_millis(250));
        expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Jobs are woken exactly when their state machine asks (end of a bid window,
            // an award's deadline, a renewal), not at the next expiry tick.
            let job_wake = self.next_job_wake();
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                () = sleep_until(job_wake) => self.tick_jobs(),
                command = commands.recv() => match command {
                    Some(c) => self.on_command(c),
                    None => break,
                },
                Some(command) = internal.recv() => self.on_command(command),
                _ = ad_timer.tick() => {
                    if let Err(e) = self.publish_ad() {
                        warn!(error = %format!("{e:#}"), "cannot publish the capability ad");
                    }
                }
                _ = expiry.tick() => {
                    self.expire();
                    self.tick_jobs();
                }
            }
        }
        info!("node stopped");
    }

    fn expire(&mut self) {
        let (now_ms, _) = now();
        let dropped = self.view.expire(now_ms);
        for node in dropped.ads {
            debug!(%node, "capability ad expired");
            if let Err(e) = self.store.remove(Kind::Ad, node.to_string().as_bytes()) {
                warn!(error = %e, "store");
            }
        }
        for job in dropped.offers {
            info!(%job, "offer expired");
            if let Err(e) = self.store.remove(Kind::Offer, &job.0) {
                warn!(error = %e, "store");
            }
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Command::Peers(reply) => {
                let _ = reply.send(self.peers());
            }
            Command::Ads(reply) => {
                let matcher = self.matching_context();
                let ads = self
                    .view
                    .ads()
                    .map(|e| {
                        let mut ad = api::Ad::from(e);
                        ad.challenge_passed_at_ms =
                            self.challenge_passes.get(&e.ad.node).map(|t| t.0);
                        ad.newest_pass_at_ms = matcher.newest_pass(&e.ad, &[]).map(|t| t.0);
                        ad
                    })
                    .collect();
                let _ = reply.send(ads);
            }
            Command::Offers(reply) => {
                let _ = reply.send(self.view.offers().map(api::Offer::from).collect());
            }
            Command::Bids(reply) => {
                let _ = reply.send(self.received_bids());
            }
            Command::PublishOffer(template, reply) => {
                let _ = reply.send(self.publish_offer(template).map(|p| p.0));
            }
            Command::SubmitJob(template, reply) => {
                let _ = reply.send(self.submit_job(template));
            }
            Command::Jobs(reply) => {
                let _ = reply.send(self.jobs.values().map(|j| self.job_summary(j)).collect());
            }
            Command::Leases(reply) => {
                let held = self
                    .leases
                    .iter()
                    .map(|((job, task, rank), lease)| api::HeldLease {
                        job_id: job.to_string(),
                        task: *task,
                        rank: *rank,
                        lease: lease.clone(),
                    })
                    .collect();
                let _ = reply.send(held);
            }
            Command::Job(id, reply) => {
                let _ = reply.send(self.job_detail(&id));
            }
            Command::CancelJob(id, reply) => {
                let _ = reply.send(self.cancel_job(&id));
            }
            Command::Explain(template, reply) => {
                let _ = reply.send(self.explain(&template));
            }
            Command::PublishAd(reply) => {
                let _ = reply.send(self.publish_ad());
            }
            Command::Market {
                peer,
                request,
                reply,
            } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .market
                    .send_request(&peer, request);
                self.pending.insert(id, reply);
            }
            Command::Dial(addr, reply) => {
                let _ = reply.send(self.swarm.dial(addr).map_err(Into::into));
            }
            Command::Challenge(peer, reply) => self.start_challenge(peer, reply),
            Command::ChallengeProved(response) => self.send_proved(response),
            Command::ChallengeChecked(report, seed, reply) => {
                self.record_challenge(report, seed, reply);
            }
            Command::Software(software) => {
                info!(runtimes = ?software.0, collectives = ?software.1, "runtimes probed");
                self.software = Some(software);
                if let Err(e) = self.publish_ad() {
                    warn!(error = %format!("{e:#}"), "cannot publish the capability ad");
                }
            }
        }
    }

    fn status(&self) -> api::Status {
        let gossipsub = &self.swarm.behaviour().gossipsub;
        api::Status {
            address: self.address.to_string(),
            peer_id: self.swarm.local_peer_id().to_string(),
            listen_addrs: self.swarm.listeners().map(ToString::to_string).collect(),
            connected_peers: self.swarm.connected_peers().count(),
            mesh_peers: Topic::ALL
                .iter()
                .map(|t| api::TopicPeers {
                    topic: t.name().to_string(),
                    peers: gossipsub.mesh_peers(&t.ident().hash()).count(),
                })
                .collect(),
            ads: self.view.ads().count(),
            offers: self.view.offers().count(),
            uptime_secs: self.started.elapsed().as_secs(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    fn peers(&self) -> Vec<api::Peer> {
        let gossipsub = &self.swarm.behaviour().gossipsub;
        self.swarm
            .connected_peers()
            .map(|peer| api::Peer {
                peer_id: peer.to_string(),
                address: swarm::address_of(peer).map(|a| a.to_string()),
                addrs: self
                    .connections
                    .get(peer)
                    .map(|c| c.iter().map(|(_, a)| a.to_string()).collect())
                    .unwrap_or_default(),
                score: gossipsub.peer_score(peer).unwrap_or(0.0),
                ping_us: self
                    .ping_rtt
                    .get(peer)
                    .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            })
            .collect()
    }

    /// Writes `node.json` in the data directory: how tools find this node.
    fn write_info(&self) {
        let info = serde_json::json!({
            "peer_id": self.swarm.local_peer_id().to_string(),
            "address": self.address.to_string(),
            "listen_addrs": self.swarm.listeners().map(ToString::to_string).collect::<Vec<_>>(),
            "api": self.api_addr.map(|a| a.to_string()),
            "pid": std::process::id(),
        });
        let path = self.data_dir.join("node.json");
        let tmp = self.data_dir.join("node.json.tmp");
        let result =
            std::fs::write(&tmp, info.to_string()).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = result {
            warn!(path = %path.display(), error = %e, "cannot write node info");
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                info!(%address, "listening");
                let relayed = address
                    .iter()
                    .any(|p| matches!(p, libp2p::multiaddr::Protocol::P2pCircuit));
                if self.config.relay_server && self.config.external_addrs.is_empty() && !relayed {
                    self.swarm.add_external_address(address.clone());
                }
                self.write_info();
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                debug!(peer = %peer_id, addr = %endpoint.get_remote_address(), "connected");
                self.connections
                    .entry(peer_id)
                    .or_default()
                    .push((connection_id, endpoint.get_remote_address().clone()));
                if num_established.get() == 1 {
                    self.start_sync(peer_id);
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                cause,
                ..
            } => {
                if let Some(c) = self.connections.get_mut(&peer_id) {
                    c.retain(|(id, _)| *id != connection_id);
                }
                debug!(peer = %peer_id, remaining = num_established, cause = ?cause, "connection closed");
                if num_established == 0 {
                    self.ping_rtt.remove(&peer_id);
                    self.connections.remove(&peer_id);
                }
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                debug!(peer = ?peer_id, error = %error, "dial failed");
            }
            SwarmEvent::IncomingConnectionError { error, .. } => {
                debug!(error = %error, "incoming connection failed");
            }
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            _ => {}
        }
    }

    fn on_behaviour_event(&mut self, event: BehaviourEvent) {
        match event {
            BehaviourEvent::Gossipsub(e) => self.on_gossip(e),
            BehaviourEvent::Market(e) => self.on_market(e),
            BehaviourEvent::Sync(e) => self.on_sync(e),
            BehaviourEvent::Challenge(e) => self.on_challenge(e),
            BehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. }) => {
                for addr in info.listen_addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            BehaviourEvent::Kad(kad::Event::RoutingUpdated { peer, .. }) => self.maybe_dial(peer),
            BehaviourEvent::Mdns(mdns::Event::Discovered(found)) => {
                for (peer, addr) in found {
                    self.swarm.behaviour_mut().kad.add_address(&peer, addr);
                    self.maybe_dial(peer);
                }
            }
            BehaviourEvent::Ping(libp2p::ping::Event {
                peer,
                result: Ok(rtt),
                ..
            }) => {
                self.ping_rtt.insert(peer, rtt);
            }
            other => debug!(event = ?other, "swarm"),
        }
    }

    /// Dials a discovered peer while the node has fewer connections than it aims for.
    fn maybe_dial(&mut self, peer: PeerId) {
        if peer == *self.swarm.local_peer_id()
            || self.swarm.is_connected(&peer)
            || self.swarm.connected_peers().count() >= TARGET_PEERS
        {
            return;
        }
        if let Err(e) = self.swarm.dial(peer) {
            debug!(%peer, error = %e, "cannot dial discovered peer");
        }
    }

    /// Lowers a peer's application score after a bad directed request or sync page.
    fn penalize(&mut self, peer: PeerId, by: f64, why: &str) {
        let score = self.app_scores.entry(peer).or_insert(0.0);
        *score -= by;
        let score = *score;
        self.swarm
            .behaviour_mut()
            .gossipsub
            .set_application_score(&peer, score);
        warn!(%peer, score, why, "peer penalized");
    }
}
