//! The node's driver: one task owns the swarm, the market engine and the store. Swarm
//! events and commands (from the local API, the CLI, tests) go in; the engine decides; the
//! driver decodes, checks what the engine asks, signs, sends, persists and runs timers. A
//! cheap-to-clone [`NodeHandle`] sends commands over a bounded channel.
//!
//! The loop: take one event (and whatever else is ready, up to a bound, so a burst of bids
//! costs one disk write), feed it to the engine, then drain the engine's outputs in order.
//! A `Persist` is committed before anything that waits for it is sent.

mod challenge;
mod directed;
mod gossip;
mod handle;
mod ledger;
mod run;
mod settle;
mod transfer;

pub use cannabis_market::OfferTemplate;
pub use handle::NodeHandle;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_api as api;
use cannabis_market::{
    Command as MarketCommand, GossipId, Identity, InboundId, Input, Market, MarketConfig,
    MarketEvent, OutboundId, Output, SyncId, ViewConfig,
};
use cannabis_protocol::{Address, MarketResponse, Timestamp};
use futures::{FutureExt as _, StreamExt as _};
use libp2p::request_response::{OutboundRequestId, ResponseChannel};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Swarm, identify, kad, mdns};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, error, info, warn};

use crate::config::NodeConfig;
use crate::keystore::NodeKeys;
use crate::store::Store;
use crate::swarm::{self, Behaviour, BehaviourEvent};

/// Connections a node keeps open to peers it discovers, so that gossip meshes can form.
const TARGET_PEERS: usize = 16;
/// How long a node waits for its supervisor to answer at start before it says it has no
/// executor.
const SUPERVISOR_WAIT: Duration = Duration::from_secs(60);
/// How long after an executor that did not open the node tries again; doubled after each
/// try that fails, up to `EXECUTOR_RETRY_MAX`. What kept it closed often passes: a
/// self-test sandbox too slow on a machine busy starting, a supervisor started later, a
/// ceilings file the administrator mends.
const EXECUTOR_RETRY: Duration = Duration::from_secs(5);
const EXECUTOR_RETRY_MAX: Duration = Duration::from_secs(600);
/// How long a connection is kept before it may be trimmed (see `trim_connections`).
const TRIM_GRACE: Duration = Duration::from_secs(30);

/// Peers a node asks for the live market after it starts.
const SYNC_PEERS: usize = 3;

/// When (after its start) a node asks one more peer for the live market: gossip sent
/// while the network was still forming may have missed it, and the next copy of an ad
/// comes only with its refresh minutes later.
const CATCH_UP_SECS: [u64; 4] = [10, 30, 70, 150];

/// Most events taken in one turn of the loop before the engine's outputs are drained.
const BATCH: usize = 64;

/// A write to the store this slow is logged (a disk that stalls holds up the market).
const SLOW_WRITE: Duration = Duration::from_millis(250);

/// Now, as the protocol's millisecond timestamp and in microseconds.
pub(crate) fn now() -> (Timestamp, u64) {
    let us = crate::clock::now_us();
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
    /// Set the gauges `/metrics` reads from the node's state.
    Metrics(oneshot::Sender<()>),
    /// On a testnet: refuse these peers until told otherwise (a partition), dropping
    /// connections to them; peers no longer named may connect (and are dialled) again.
    Partition(Vec<PeerId>, oneshot::Sender<anyhow::Result<usize>>),
    /// On a testnet: deliver wrong outputs (a fabricating worker), or stop doing so.
    Corrupt(bool, oneshot::Sender<anyhow::Result<()>>),
    /// A testnet fault: every TCP link of this node delayed and lossy (zero: plain).
    Slow(api::Slow, oneshot::Sender<anyhow::Result<()>>),
    JudgeJob(
        cannabis_protocol::Uuid,
        api::Verdict,
        oneshot::Sender<anyhow::Result<api::JobDetail>>,
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
    /// The machine was probed (off the driver): the next ad uses it.
    Probed(
        u64,
        Box<gossip::Probe>,
        Option<oneshot::Sender<anyhow::Result<()>>>,
    ),
    /// The local executor opened (or could not).
    ExecutorReady,
    /// A leased attempt changed stage: tell its requester.
    Ran {
        request_id: String,
        stage: cannabis_protocol::RunStage,
        detail: String,
    },
    /// A group rank's held sandbox got its group interface (the device), or could not
    /// (why): its group's channel takes the device.
    Sandboxed {
        request_id: String,
        device: Result<std::os::fd::OwnedFd, String>,
    },
    /// A completed leased attempt's outputs are sealed: deliver the manifest.
    Prepared {
        request_id: String,
        outputs: Vec<cannabis_protocol::OutputDigest>,
        usage: cannabis_protocol::ResourceUsage,
        exit_code: Option<i32>,
    },
    /// A leased attempt's new checkpoint is sealed for the requester: send the note.
    CheckpointSealed {
        request_id: String,
        seq: u64,
        checkpoint: cannabis_protocol::OutputDigest,
    },
    /// A checkpoint fetch ended: the checkpoint is kept, or why not.
    CheckpointFetched(Box<cannabis_protocol::CheckpointNote>, Result<(), String>),
    /// Ask a peer for a chunk (for a fetch).
    Transfer {
        peer: PeerId,
        request: cannabis_protocol::TransferRequest,
        reply: oneshot::Sender<Result<cannabis_protocol::TransferResponse, String>>,
    },
    /// A chunk read for a peer, to send.
    TransferServed(
        PeerId,
        ResponseChannel<cannabis_protocol::TransferResponse>,
        cannabis_protocol::TransferResponse,
    ),
    /// A fetch ended: its outputs are kept, or why not.
    Fetched(
        Box<cannabis_protocol::DeliveryManifest>,
        Result<Vec<cannabis_protocol::NamedDigest>, String>,
    ),
    /// A delivered synthetic product was checked off the driver.
    ProductChecked(cannabis_market::ProductCheck, Result<(), String>),
    /// An evaluation run ended off the driver: its report, to sign.
    Evaluated(u32, Box<cannabis_protocol::Evaluation>),
    /// Set a peer the capability challenge.
    Challenge(
        PeerId,
        oneshot::Sender<anyhow::Result<api::ChallengeReport>>,
    ),
    /// A gossiped block has been verified (or not) off the driver.
    BlockChecked(
        cannabis_market::Origin,
        Result<Box<ledger::Checked>, cannabis_market::Verdict>,
    ),
    /// Blocks asked of a peer, verified off the driver (and whether the answer was full).
    BlocksFetched(PeerId, Result<Vec<ledger::Checked>, String>, bool),
    /// The ledger as this node holds it.
    LedgerStatus(oneshot::Sender<anyhow::Result<api::LedgerStatus>>),
    /// An account (this node's when `None`).
    Balance(
        Option<Address>,
        oneshot::Sender<anyhow::Result<api::Balance>>,
    ),
    /// The newest blocks.
    LedgerBlocks(u32, oneshot::Sender<anyhow::Result<Vec<api::BlockSummary>>>),
    /// One block.
    LedgerBlock(u64, oneshot::Sender<anyhow::Result<api::BlockDetail>>),
    /// A transfer from this node's account.
    WalletSend(
        Address,
        cannabis_protocol::Amount,
        oneshot::Sender<anyhow::Result<api::Submitted>>,
    ),
    /// A faucet grant to this node's account.
    WalletFaucet(oneshot::Sender<anyhow::Result<api::Submitted>>),
    /// Compute the task the newest block seeds for this node, and send its result.
    Compute(u32, oneshot::Sender<anyhow::Result<api::Computed>>),
    /// A result computed off the driver, to send.
    Computed(
        Box<(cannabis_protocol::ComputeResult, api::Computed)>,
        oneshot::Sender<anyhow::Result<api::Computed>>,
    ),
    /// A transaction the ledger took.
    Tx(
        cannabis_protocol::Digest,
        oneshot::Sender<anyhow::Result<api::TxDetail>>,
    ),
    /// A job's escrow.
    Escrow(
        cannabis_protocol::Uuid,
        oneshot::Sender<anyhow::Result<cannabis_market::ledger::Escrow>>,
    ),
    /// A transaction signed elsewhere, for the sequencer.
    SubmitTx(
        Box<cannabis_protocol::Signed<cannabis_protocol::Transaction>>,
        oneshot::Sender<anyhow::Result<api::Submitted>>,
    ),
    /// Where a result is in the ledger.
    Prove(
        cannabis_protocol::Digest,
        oneshot::Sender<anyhow::Result<api::ResultProof>>,
    ),
    /// The sequencer's answer to a settlement transaction of this node's.
    SettleSent {
        job: cannabis_protocol::Uuid,
        lock: bool,
        tx: cannabis_protocol::Digest,
        result: Result<(), settle::Unsent>,
    },
    /// A challenge this node answers has been proved.
    ChallengeProved(Option<cannabis_protocol::ChallengeResponse>),
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

/// One open connection to a peer.
struct Link {
    id: libp2p::swarm::ConnectionId,
    addr: Multiaddr,
    /// Whether this node dialed it.
    dialed: bool,
    since: tokio::time::Instant,
}

/// A sync page being fed to the engine: who sent it and what its items got.
#[derive(Default)]
struct SyncTally {
    accepted: usize,
    rejected: usize,
}

/// A running node's state, owned by its driver task.
pub(crate) struct Node {
    swarm: Swarm<Behaviour>,
    market: Market,
    market_config: MarketConfig,
    /// The gossip topics (offers sharded as the network is configured).
    topics: swarm::Topics,
    store: Arc<Store>,
    /// The local executor, once it opened (or why it did not).
    executor: handle::ExecutorSlot,
    /// The task opening it: waited for when the node stops (it holds the store).
    opening: Option<tokio::task::JoinHandle<()>>,
    /// Where an opening puts the executor (or why it did not open).
    executor_open: Arc<watch::Sender<handle::Opened>>,
    /// When to try again an executor that did not open.
    reopen: crate::clock::Backoff,
    /// Where the engine's run orders go: leased work on the executor.
    runner: mpsc::UnboundedSender<cannabis_market::RunOrder>,
    /// The group attempts this node holds ranks of, and their channels.
    groups: Arc<crate::group::Groups>,
    /// The task taking other ranks' channel streams.
    group_streams: tokio::task::JoinHandle<()>,
    /// The task carrying them out: waited for when the node stops (it holds the executor).
    running: Option<tokio::task::JoinHandle<()>>,
    /// Probes asked for, and the newest one applied: an older probe that finishes late
    /// never replaces a newer one.
    probes_asked: u64,
    probe_applied: u64,
    keys: NodeKeys,
    config: NodeConfig,
    address: Address,
    started: Instant,
    data_dir: PathBuf,
    api_addr: Option<std::net::SocketAddr>,
    /// Raw market requests from the handle (tests, `node ping`), by request.
    pending: HashMap<OutboundRequestId, oneshot::Sender<anyhow::Result<MarketResponse>>>,
    /// The engine's own requests.
    outbound: HashMap<OutboundRequestId, OutboundId>,
    /// Requests from peers waiting for the engine's answer.
    inbound: HashMap<InboundId, ResponseChannel<MarketResponse>>,
    next_inbound: u64,
    /// Gossip messages waiting for the engine's verdict.
    gossip: HashMap<GossipId, (libp2p::gossipsub::MessageId, PeerId)>,
    next_gossip: u64,
    /// Sync pages asked for, by request.
    sync_runs: HashMap<OutboundRequestId, directed::SyncRun>,
    /// Sync pages being fed to the engine.
    sync: HashMap<SyncId, SyncTally>,
    next_sync: u64,
    /// Peers asked for the live market since start.
    synced: std::collections::HashSet<PeerId>,
    /// Catch-up syncs done (see `CATCH_UP_SECS`).
    catch_ups: usize,
    /// When each offer this node published was handed to gossip, µs (for the API).
    published_at: HashMap<cannabis_protocol::Uuid, u64>,
    ping_rtt: HashMap<PeerId, Duration>,
    /// Each peer's open connections.
    connections: HashMap<PeerId, Vec<Link>>,
    /// Peers this node is dialing for discovery, not yet connected: they count against
    /// the connections it aims for, or a burst of discoveries dials everyone.
    dialing: std::collections::HashSet<PeerId>,
    app_scores: HashMap<PeerId, f64>,
    /// Graylisted peers refused at their handshake, oldest first (see `drop_graylisted`).
    blocked: std::collections::VecDeque<PeerId>,
    /// Peers a testnet partition cuts this node off from (`cannabis testnet partition`):
    /// refused until healed, whatever their score.
    partitioned: std::collections::HashSet<PeerId>,
    /// A testnet fault: this node's deliveries carry wrong outputs (`testnet corrupt`).
    corrupt: Arc<std::sync::atomic::AtomicBool>,
    /// A testnet fault: this node's TCP links are slow and lossy (`testnet slow`).
    shaping: swarm::shaping::Shaping,
    /// Peers a healed partition let back: asked for the live market when they connect
    /// (what was gossiped on their side meanwhile).
    resync: std::collections::HashSet<PeerId>,
    /// What `/metrics` shows: counters moved here, gauges set when scraped.
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Runtimes and collectives, once probed.
    software: Option<Software>,
    /// The machine as last probed.
    probe: Option<gossip::Probe>,
    /// Our ad went out before any peer listened: publish it again when one subscribes.
    ad_unheard: bool,
    /// When the ad is to be published next: changes that come together make one ad, not
    /// one each (every node checks and stores every ad).
    ad_due: Option<tokio::time::Instant>,
    /// Commands to itself, from blocking work.
    self_tx: mpsc::Sender<Command>,
    /// Chunks asked of peers for fetches, by request.
    transfers: HashMap<
        OutboundRequestId,
        oneshot::Sender<Result<cannabis_protocol::TransferResponse, String>>,
    >,
    /// Fetches running: (job, task, rank, epoch).
    fetching: std::collections::HashSet<(cannabis_protocol::Uuid, u32, u32, u64)>,
    /// The ranks whose checkpoint is being fetched, each with the newest note that came
    /// meanwhile (fetched next; the ones between are skipped).
    checkpoint_fetching: std::collections::HashMap<
        (cannabis_protocol::Uuid, u32, u32),
        Option<Box<cannabis_protocol::CheckpointNote>>,
    >,
    /// How far each running fetch is, by (job, task, rank).
    fetch_progress: transfer::Progresses,
    /// Held while a package is sealed for a worker (one sealing at a time).
    sealing: Arc<std::sync::Mutex<()>>,
    /// The Merkle trees of the sealed files served lately.
    trees: Arc<crate::delivery::Trees>,
    /// Transfer requests being answered, per peer (the cap on what one peer has read).
    serving: HashMap<PeerId, u32>,
    /// Challenges this node set, by request.
    challenges: HashMap<OutboundRequestId, challenge::Pending>,
    /// The challenge this node is proving (one at a time), and where to answer.
    proving: Option<challenge::Proving>,
    /// Challenges answered lately (the rate limit).
    answered: challenge::Answered,
    /// Blocks taken lately.
    blocks: gossip::Blocks,
    /// Sync pages served per peer (the allowance).
    served: cannabis_market::rate::Limiter<PeerId>,
    /// Messages each peer sent past their signer's rate (the slack honest relays get).
    over_rate: cannabis_market::rate::Limiter<PeerId>,
    /// Ads, offers and connections dropped since the allocator last gave free memory back.
    dropped_since_trim: usize,
    /// Why the node is in read-only safe mode (a write to its store failed), if it is.
    safe_mode: Option<String>,
    /// The embedded ledger, when the node has the network's genesis.
    chain: Option<ledger::Chain>,
}

/// Gives the memory the allocator holds free back to the system. glibc keeps what a
/// program frees for its next allocations: after a flood of offers expires, a node would
/// otherwise keep its peak for good. Called at upkeep after ads, offers or connections
/// were dropped.
#[allow(unsafe_code)]
fn give_back_memory() {
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it
    // takes no pointer and touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// How often the node does its upkeep.
const UPKEEP: Duration = crate::clock::SLEW_EVERY;
/// A turn of the node's loop that takes this long is logged (target `cannabis::turn`,
/// debug): everything else the node does waits for it.
const SLOW_TURN: Duration = Duration::from_millis(10);

/// Graylisted peers refused at the handshake at most (a key costs an attacker nothing, so
/// the list is bounded; one let out early is refused again after its next graylisting).
const MAX_BLOCKED: usize = 4096;

/// Decays every score by `APP_DECAY` a second over `over`, dropping those within 1 of 0;
/// returns the new scores to tell gossipsub.
fn decay_scores(scores: &mut HashMap<PeerId, f64>, over: Duration) -> Vec<(PeerId, f64)> {
    let keep = swarm::APP_DECAY.powf(over.as_secs_f64());
    let mut changed = Vec::with_capacity(scores.len());
    scores.retain(|peer, score| {
        *score *= keep;
        let faded = score.abs() < 1.0;
        changed.push((*peer, if faded { 0.0 } else { *score }));
        !faded
    });
    changed
}

/// Starts a node: opens the store, builds the swarm, starts listening and dialing, and
/// spawns the driver. The executor opens and the machine is probed in the background (off
/// the driver), so the swarm is up at once. Returns the handle and the driver's task.
pub async fn start(
    mut config: NodeConfig,
    keys: NodeKeys,
    data_dir: &Path,
    api_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<(NodeHandle, tokio::task::JoinHandle<()>)> {
    config.check()?;
    config.check_attestation()?;
    let genesis = config.ledger.load_genesis()?;
    if let Some(g) = &genesis {
        config.pin_to_genesis(g)?;
    }
    let store = Arc::new(Store::open(&data_dir.join("node.redb"))?);
    let libp2p_key = libp2p::identity::Keypair::ed25519_from_bytes(*keys.signing.secret())
        .context("turning the node key into a libp2p identity")?;
    let shaping = swarm::shaping::Shaping::default();
    let mut swarm = swarm::build(libp2p_key, &config, &shaping)?;
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
    let (executor_tx, executor_rx) = watch::channel(None);
    // The spot-check draw's secret, derived from the node key: others cannot predict it,
    // and the same key draws the same after a restart.
    let spot_secret = cannabis_protocol::Digest::of_parts(&[
        b"cannabis/spot-check-secret/v1/",
        &keys.signing.secret()[..],
    ])
    .0;
    let market_config = market_config(&config, genesis.as_ref(), spot_secret);
    let groups = crate::group::Groups::new(
        keys.signing.clone(),
        swarm.behaviour().streams.new_control(),
        group_starter(executor_rx.clone()),
    );
    let group_streams = groups.serve()?;
    let corrupt = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (runner, running) = run::spawn(
        executor_rx.clone(),
        internal_tx.clone(),
        data_dir.to_path_buf(),
        keys.delivery.clone(),
        corrupt.clone(),
    );
    let identity = Identity {
        address,
        delivery: keys.delivery.recipient(),
    };
    let market = Market::restore(
        market_config.clone(),
        identity,
        now().0,
        store.load_records()?,
    );
    info!(
        ads = market.view().ad_count(),
        offers = market.view().offer_count(),
        jobs = market.jobs().count(),
        "market restored from the store"
    );
    let metrics = crate::metrics::Metrics::new();
    let mut node = Node {
        swarm,
        market,
        market_config,
        topics: swarm::Topics::new(config.gossip.offer_shards),
        store: store.clone(),
        runner,
        running: Some(running),
        groups,
        group_streams,
        executor: executor_rx.clone(),
        opening: None,
        executor_open: Arc::new(executor_tx),
        reopen: crate::clock::Backoff::new(EXECUTOR_RETRY, EXECUTOR_RETRY_MAX),
        probes_asked: 0,
        probe_applied: 0,
        keys,
        config,
        address,
        started: Instant::now(),
        data_dir: data_dir.to_path_buf(),
        api_addr,
        pending: HashMap::new(),
        outbound: HashMap::new(),
        inbound: HashMap::new(),
        next_inbound: 0,
        gossip: HashMap::new(),
        next_gossip: 0,
        sync_runs: HashMap::new(),
        sync: HashMap::new(),
        next_sync: 0,
        synced: std::collections::HashSet::new(),
        catch_ups: 0,
        published_at: HashMap::new(),
        ping_rtt: HashMap::new(),
        connections: HashMap::new(),
        dialing: std::collections::HashSet::new(),
        app_scores: HashMap::new(),
        blocked: std::collections::VecDeque::new(),
        partitioned: std::collections::HashSet::new(),
        corrupt,
        shaping,
        resync: std::collections::HashSet::new(),
        metrics: metrics.clone(),
        software: None,
        probe: None,
        ad_unheard: false,
        ad_due: None,
        self_tx: internal_tx.clone(),
        transfers: HashMap::new(),
        fetching: Default::default(),
        checkpoint_fetching: Default::default(),
        fetch_progress: Default::default(),
        sealing: Default::default(),
        trees: Default::default(),
        serving: HashMap::new(),
        challenges: HashMap::new(),
        proving: None,
        answered: challenge::Answered::default(),
        blocks: gossip::Blocks::default(),
        served: cannabis_market::rate::Limiter::default(),
        over_rate: cannabis_market::rate::Limiter::default(),
        dropped_since_trim: 0,
        safe_mode: None,
        chain: None,
    };
    node.open_chain(genesis)?;
    node.drain();
    node.bootstrap();
    info!(%peer_id, %address, "node started");
    node.opening = Some(open_executor(
        &node.config,
        data_dir,
        &store,
        node.executor_open.clone(),
        internal_tx.clone(),
    ));
    node.probe_machine(None);
    // Probing runtimes runs python3 (torch imports take seconds): off the driver.
    let probe_tx = internal_tx;
    tokio::task::spawn_blocking(move || {
        let software = cannabis_runtime::probe::runtimes();
        let _ = probe_tx.blocking_send(Command::Software(software));
    });
    let task = tokio::spawn(node.run(rx, internal_rx));
    Ok((
        NodeHandle::new(tx, peer_id, address, executor_rx, metrics),
        task,
    ))
}

/// The engine's settings from the node's.
fn market_config(
    config: &NodeConfig,
    genesis: Option<&cannabis_protocol::Genesis>,
    spot_secret: [u8; 32],
) -> MarketConfig {
    MarketConfig {
        spot_secret,
        // With a ledger, jobs settle through it: locked before any award.
        resolver: genesis.map(|g| g.resolver),
        view: ViewConfig::default(),
        leases: config.leases.clone(),
        worker: config.worker.clone(),
        fanin: config.fanin.clone(),
        signatures: cannabis_market::Signatures::Check,
        fee: config.gossip.fee.clone(),
        attestation: cannabis_market::attest::AttestationPolicy {
            testnet: config.testnet,
        },
    }
}

/// Opens the local executor off the async threads (it starts a self-test sandbox and asks
/// NVML for the GPUs). A node whose machine cannot run sandboxes still runs: it says why
/// and takes no work.
fn open_executor(
    config: &NodeConfig,
    data_dir: &Path,
    store: &Arc<Store>,
    slot: Arc<watch::Sender<handle::Opened>>,
    tell: mpsc::Sender<Command>,
) -> tokio::task::JoinHandle<()> {
    let dir = data_dir.join("exec");
    let ceilings = crate::exec::ceilings_path(config.ceilings.as_deref());
    let owner = config.executor.clone();
    let cdi_map = config.owner.cdi_map.clone();
    let program = config.program.clone();
    let data_dir = data_dir.to_path_buf();
    let journal: Arc<dyn cannabis_runtime::exec::Journal> = store.clone();
    if let Some(socket) = config.supervisor.clone() {
        return tokio::task::spawn_blocking(move || {
            let opened = open_supervised(&socket, &owner);
            slot.send_replace(Some(Arc::new(opened)));
            let _ = tell.blocking_send(Command::ExecutorReady);
        });
    }
    tokio::task::spawn_blocking(move || {
        let gpus = cannabis_runtime::probe::gpus(&cannabis_runtime::gpu::Nvml, &[], None)
            .1
            .into_iter()
            .map(|g| g.uuid)
            .collect();
        let machine = crate::exec::machine_limits(&data_dir, gpus);
        let opened = crate::exec::open(
            &dir,
            &machine,
            &ceilings,
            &owner,
            cdi_map.as_deref(),
            journal,
            program.as_deref(),
        )
        .map(crate::exec::ExecutorHandle::Local);
        match &opened {
            Ok(ex) => info!(
                mode = %ex.mode().describe(),
                layers = ?ex.layers().iter().map(|l| cannabis_runtime::exec::layer_name(*l)).collect::<Vec<_>>(),
                "executor ready"
            ),
            Err(e) => warn!(reason = %e, "no local executor: this node takes no work"),
        }
        slot.send_replace(Some(Arc::new(opened)));
        let _ = tell.blocking_send(Command::ExecutorReady);
    })
}

/// Connects to the supervisor, waiting for it while it starts (a node and its supervisor
/// often start together); a node whose supervisor stays away takes no work and says why.
fn open_supervised(
    socket: &Path,
    owner: &cannabis_runtime::exec::LimitsFile,
) -> Result<crate::exec::ExecutorHandle, String> {
    let deadline = Instant::now() + SUPERVISOR_WAIT;
    loop {
        match crate::exec::ExecutorHandle::supervised(socket, owner) {
            Ok(ex) => {
                info!(
                    mode = %ex.mode().describe(),
                    layers = ?ex.layers().iter().map(|l| cannabis_runtime::exec::layer_name(*l)).collect::<Vec<_>>(),
                    "executor ready"
                );
                return Ok(ex);
            }
            Err(e) if Instant::now() >= deadline => {
                warn!(reason = %e, "no supervisor: this node takes no work");
                return Err(e);
            }
            Err(e) => {
                debug!(reason = %e, "waiting for the supervisor");
                std::thread::sleep(Duration::from_millis(250));
            }
        }
    }
}

impl Node {
    fn bootstrap(&mut self) {
        for addr in self.config.bootstrap.clone() {
            if let Some(libp2p::multiaddr::Protocol::P2p(peer)) = addr.iter().last() {
                self.swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer, addr.clone());
            }
            self.dial_bootstrap(addr);
        }
        if !self.config.bootstrap.is_empty()
            && let Err(e) = self.swarm.behaviour_mut().kad.bootstrap()
        {
            debug!(error = %e, "kademlia bootstrap not started");
        }
    }

    /// Dials a bootstrap peer unless it is connected or being dialed. A dial by address
    /// alone always dials: next to Kademlia's own dial of the same peer it made a third
    /// connection, which the per-peer limit refused, and Kademlia takes a refused dial for
    /// a peer that failed: the start-up lookup ended with no peer found, and the node was
    /// left with its bootstrap peer only.
    fn dial_bootstrap(&mut self, addr: Multiaddr) {
        use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
        let opts = match addr.iter().last() {
            Some(libp2p::multiaddr::Protocol::P2p(peer)) => {
                if self.swarm.is_connected(&peer) || self.dialing.contains(&peer) {
                    return;
                }
                self.dialing.insert(peer);
                DialOpts::peer_id(peer)
                    .addresses(vec![addr.clone()])
                    .condition(PeerCondition::DisconnectedAndNotDialing)
                    .build()
            }
            _ => DialOpts::unknown_peer_id().address(addr.clone()).build(),
        };
        if let Err(e) = self.swarm.dial(opts) {
            debug!(%addr, error = %e, "cannot dial bootstrap peer");
        }
    }

    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut internal: mpsc::Receiver<Command>,
    ) {
        let mut ad_timer =
            tokio::time::interval(Duration::from_secs(self.config.gossip.ad_refresh_secs));
        ad_timer.tick().await;
        let mut upkeep = tokio::time::interval(UPKEEP);
        upkeep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // The engine is woken exactly when it asks (end of a bid window, an award's
            // deadline, a renewal, an expiry), on the monotonic clock.
            let wake = self.market.poll_timeout().map(|at| {
                let wait = at.0.saturating_sub(now().0.0);
                tokio::time::Instant::now() + Duration::from_millis(wait)
            });
            let turn: (&str, std::time::Instant);
            tokio::select! {
                event = self.swarm.select_next_some() => {
                    turn = ("swarm", std::time::Instant::now());
                    self.on_swarm_event(event);
                    // Whatever else is ready goes in the same turn: one write for a burst.
                    for _ in 1..BATCH {
                        match self.swarm.next().now_or_never() {
                            Some(Some(event)) => self.on_swarm_event(event),
                            _ => break,
                        }
                    }
                }
                () = sleep_until(wake) => {
                    turn = ("timer", std::time::Instant::now());
                    if self.safe_mode.is_none() {
                        self.market.handle(now().0, Input::Tick);
                    }
                }
                command = commands.recv() => match command {
                    Some(c) => {
                        turn = ("command", std::time::Instant::now());
                        self.on_command(c);
                    }
                    None => break,
                },
                Some(command) = internal.recv() => {
                    turn = ("internal", std::time::Instant::now());
                    self.on_command(command);
                }
                _ = ad_timer.tick() => {
                    turn = ("ad", std::time::Instant::now());
                    self.probe_machine(None);
                }
                () = sleep_until(self.chain.as_ref().and_then(ledger::Chain::block_due)) => {
                    turn = ("block", std::time::Instant::now());
                    if self.safe_mode.is_none() {
                        self.make_block();
                    }
                }
                () = sleep_until(self.chain.as_ref().and_then(ledger::Chain::block_watch)) => {
                    turn = ("watch", std::time::Instant::now());
                    self.watch_blocks();
                }
                () = sleep_until(self.reopen.due()) => {
                    turn = ("executor", std::time::Instant::now());
                    self.reopen.disarm();
                    self.reopen_executor();
                }
                () = sleep_until(self.ad_due) => {
                    turn = ("ad", std::time::Instant::now());
                    self.ad_due = None;
                    self.publish_ad_now();
                }
                _ = upkeep.tick() => {
                    turn = ("upkeep", std::time::Instant::now());
                    let off = crate::clock::follow_wall();
                    if off.abs() > crate::clock::MAX_SLEW_MS {
                        warn!(off_ms = off, "the wall clock stepped: the node's time follows it slowly");
                    }
                    self.try_recover();
                    self.served.expire(now().0);
                    self.over_rate.expire(now().0);
                    if self.connections.is_empty() && !self.config.bootstrap.is_empty() {
                        // Alone (the first dials failed, or every peer went): try the
                        // bootstrap peers again rather than wait for Kademlia's next round.
                        debug!("no peers: dialing the bootstrap peers again");
                        self.bootstrap();
                    }
                    self.decay_penalties(UPKEEP);
                    self.drop_graylisted();
                    self.catch_up();
                    self.catch_up_blocks();
                    self.own_nonce_upkeep();
                    self.settle_due();
                    self.drain();
                    self.reach_every_shard();
                    self.trim_connections();
                    let (leases, t) = (self.market.leases(), now().0);
                    self.groups.retain(|key, epoch| leases.is_current(key, epoch, t));
                    if std::mem::take(&mut self.dropped_since_trim) > 0 {
                        give_back_memory();
                    }
                }
            }
            self.drain();
            let took = turn.1.elapsed();
            if took >= SLOW_TURN {
                debug!(
                    target: "cannabis::turn",
                    what = turn.0,
                    us = took.as_micros() as u64,
                    "slow turn"
                );
            }
        }
        // The executor's opening holds the store: the node is stopped when it is done, and
        // when the run orders' task (which holds the executor) has seen the last one.
        if let Some(opening) = self.opening.take() {
            let _ = tokio::time::timeout(Duration::from_secs(60), opening).await;
        }
        self.group_streams.abort();
        self.groups.close();
        self.runner = mpsc::unbounded_channel().0;
        if let Some(running) = self.running.take() {
            let _ = tokio::time::timeout(Duration::from_secs(60), running).await;
        }
        // An executor in this process stops its drivers (running sandboxes go on under
        // their leases and are found again by the next start).
        let local = match self.executor.borrow().as_deref() {
            Some(Ok(crate::exec::ExecutorHandle::Local(ex))) => Some(ex.clone()),
            _ => None,
        };
        if let Some(ex) = local {
            let _ =
                tokio::task::spawn_blocking(move || ex.shutdown_and_wait(Duration::from_secs(10)))
                    .await;
        }
        info!("node stopped");
    }

    /// Carries out what the engine asks, in order, until it has nothing more (or waits).
    pub(super) fn drain(&mut self) {
        // In safe mode the engine's state is not the store's: nothing it says goes out.
        while self.safe_mode.is_none()
            && let Some(output) = self.market.poll_output()
        {
            match output {
                Output::Persist { batch, ops } => match self.write(&ops) {
                    Ok(()) => self.market.persisted(batch),
                    Err(e) => {
                        // Nothing that depended on the batch was sent (the fence), and
                        // nothing more is taken until a write goes through again.
                        self.enter_safe_mode(format!("{e:#}"));
                        return;
                    }
                },
                Output::Validate { origin, verdict } => self.on_verdict(origin, verdict),
                Output::Send { req, to, msg } => self.send(req, to, msg),
                Output::Reply { req, answer } => self.reply(req, answer),
                Output::Publish(cannabis_market::Publish::Offer(offer)) => {
                    self.publish_offer_signed(offer);
                }
                Output::Penalize { peer, why } => {
                    if let Some(peer) = swarm::peer_of(&peer) {
                        self.penalize(peer, directed::BAD_REQUEST_PENALTY, &why.to_string());
                    }
                }
                Output::Event(e) => self.on_event(e),
                Output::Run(order) => {
                    self.group_order(&order);
                    let _ = self.runner.send(order);
                }
                Output::Fetch(manifest) => self.start_fetch(*manifest),
                Output::FetchCheckpoint(note) => self.start_checkpoint_fetch(note),
                Output::CheckProduct(check) => self.check_product(check),
                Output::Evaluate(order) => self.evaluate(*order),
                Output::Settle(order) => self.on_settle(order),
            }
        }
        self.settle_new();
    }

    /// Writes the market's records to the store, timed: a slow durable write holds up
    /// everything the engine sends after it, so it is counted and a very slow one logged.
    fn write(&self, ops: &[cannabis_market::RecordOp]) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        let result = self.store.apply(ops, &self.address);
        let took = started.elapsed();
        self.metrics.store_write_seconds.observe(took.as_secs_f64());
        debug!(
            target: "cannabis::store",
            us = took.as_micros() as u64,
            records = ops.len(),
            "store write"
        );
        if took >= SLOW_WRITE {
            warn!(
                ms = took.as_millis() as u64,
                records = ops.len(),
                "a slow write to the store held up what the market sends"
            );
        }
        result
    }

    /// A group rank's lease became current (its channel's endpoints open) or ended
    /// (they close, and every connection through them ends).
    fn group_order(&self, order: &cannabis_market::RunOrder) {
        match order {
            cannabis_market::RunOrder::Start {
                request_id,
                key,
                epoch,
                group: Some(group),
                ..
            } => {
                if let Err(e) = self.groups.join(request_id, *key, *epoch, group) {
                    warn!(%request_id, error = %format!("{e:#}"), "group channel not opened");
                }
            }
            cannabis_market::RunOrder::Stop { request_id, .. } => self.groups.leave(request_id),
            _ => {}
        }
    }

    /// A write to the store failed (a full disk, an I/O error): the node goes read-only. It
    /// takes no gossip, answers no market request, accepts no job and ticks no lease until
    /// a write goes through again (`try_recover`, every upkeep); status and logs say why.
    fn enter_safe_mode(&mut self, why: String) {
        error!(error = %why, "the store refused a write: read-only safe mode until it takes writes again");
        self.safe_mode = Some(why);
    }

    /// Leaves safe mode once the store takes a durable write again: the market restarts
    /// from what the store holds, which is the truth (what was not written is forgotten).
    fn try_recover(&mut self) {
        if self.safe_mode.is_none() {
            return;
        }
        match self.store.reopen().and_then(|()| self.store.probe_write()) {
            Ok(()) => {
                info!("the store takes writes again: safe mode over");
                self.safe_mode = None;
                self.restore_market();
                self.restore_chain();
            }
            Err(e) => debug!(error = %format!("{e:#}"), "the store still refuses writes"),
        }
    }

    /// The refusal while in safe mode.
    pub(super) fn refuse_if_safe(&self) -> anyhow::Result<()> {
        match &self.safe_mode {
            Some(why) => Err(anyhow::anyhow!(
                "the node is in read-only safe mode: its store refused a write ({why}); it \
                 resumes by itself once writes go through (free some disk space)"
            )),
            None => Ok(()),
        }
    }

    /// After a failed write the engine is rebuilt from the store, which is still the truth:
    /// what was not written is forgotten, and nothing that depended on it was sent.
    fn restore_market(&mut self) {
        let identity = self.market.identity().clone();
        match self.store.load_records() {
            Ok(records) => {
                self.market =
                    Market::restore(self.market_config.clone(), identity, now().0, records);
            }
            Err(e) => error!(error = %format!("{e:#}"), "cannot read the store"),
        }
        // Requests the old engine had not answered get no answer: their senders time out.
        self.inbound.clear();
        self.outbound.clear();
    }

    fn on_event(&mut self, e: MarketEvent) {
        match e {
            MarketEvent::BidSent { job, task, price } => {
                info!(%job, task, %price, "bid made, sending it to the requester");
            }
            MarketEvent::Declined { job, task, reason } => info!(%job, task, %reason, "declined"),
            MarketEvent::BidTaken {
                job,
                task,
                worker,
                price,
            } => info!(%job, task, %worker, %price, "bid received"),
            MarketEvent::Awarded {
                job,
                task,
                rank,
                epoch,
                worker,
            } => info!(%job, task, rank, epoch, %worker, "award sent"),
            MarketEvent::Widened { job } => info!(%job, "too few bids: the offer's call widened"),
            MarketEvent::TaskLeased { job, task } => {
                info!(%job, task, "every rank holds a current lease");
            }
            MarketEvent::JobEnded { job, state } => {
                info!(%job, ?state, "job ended");
                // No rank of it is placed again: its checkpoints are of no more use.
                let _ =
                    std::fs::remove_dir_all(crate::delivery::job_checkpoints(&self.data_dir, &job));
                let word = format!("{state:?}").to_lowercase();
                self.metrics
                    .jobs_ended
                    .get_or_create(&crate::metrics::label("state", word))
                    .inc();
                if state == cannabis_market::job::JobState::Completed
                    && let Some(j) = self.market.job(&job)
                {
                    let ms = now().0.ms_since(j.offer().issued_at);
                    self.metrics.job_seconds.observe(ms as f64 / 1000.0);
                }
            }
            MarketEvent::LeaseTaken { key, epoch } => {
                info!(job = %key.0, task = key.1, rank = key.2, epoch, "award countersigned");
            }
            MarketEvent::LeaseEnded { key, epoch, reason } => {
                info!(job = %key.0, task = key.1, rank = key.2, epoch, %reason, "lease ended");
            }
            MarketEvent::PassKept { verifier } => {
                info!(%verifier, "challenge pass received");
                self.publish_ad_soon();
            }
            MarketEvent::Refused { from, what, why } => {
                info!(peer = %from, reason = %why, "{what} refused");
            }
            MarketEvent::Answered { what, to, result } => match result {
                Ok(cannabis_market::Answer::Ack) if what == "bid" => info!(%to, "bid delivered"),
                Ok(cannabis_market::Answer::Ack) => debug!(%to, "{what} taken"),
                Ok(cannabis_market::Answer::Refused(reason)) => {
                    info!(%to, %reason, "{what} refused by the peer");
                }
                Err(error) => info!(%to, %error, "{what} not delivered"),
            },
            MarketEvent::Expired { ads, offers } => {
                self.dropped_since_trim += ads + offers.len();
                debug!(ads, "capability ads expired");
                for job in offers {
                    info!(%job, "offer expired");
                }
            }
        }
    }

    fn on_command(&mut self, command: Command) {
        let now_ms = now().0;
        match command {
            Command::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Command::Peers(reply) => {
                let _ = reply.send(self.peers());
            }
            Command::Ads(reply) => {
                let ctx = self.market.context();
                let local = self.market.local_passes();
                let ads = self
                    .market
                    .view()
                    .ads()
                    .map(|e| {
                        let mut ad = api::Ad::from(e);
                        ad.challenge_passed_at_ms = local.get(&e.ad().node).map(|t| t.0);
                        ad.newest_pass_at_ms = ctx.newest_pass(e.ad(), &[]).map(|t| t.0);
                        ad.attestation_verdict = e.ad().attestation.as_ref().map(|_| {
                            ctx.attestation
                                .verify(e.ad())
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        });
                        ad
                    })
                    .collect();
                let _ = reply.send(ads);
            }
            Command::Offers(reply) => {
                let _ = reply.send(self.market.view().offers().map(api::Offer::from).collect());
            }
            Command::Bids(reply) => {
                let bids = self
                    .market
                    .received_bids()
                    .into_iter()
                    .map(|(b, id)| api::ReceivedBid {
                        job_id: b.job_id.to_string(),
                        task: b.task,
                        worker: b.worker.to_string(),
                        price: b.price,
                        id: id.to_string(),
                    })
                    .collect();
                let _ = reply.send(bids);
            }
            Command::PublishOffer(template, reply) => {
                let _ = reply.send(self.publish_offer(template));
            }
            Command::SubmitJob(template, reply) => {
                let _ = reply.send(self.submit_job(template));
            }
            Command::Jobs(reply) => {
                let _ = reply.send(self.market.jobs().map(api::JobSummary::of).collect());
            }
            Command::Leases(reply) => {
                let held = self
                    .market
                    .leases()
                    .iter()
                    .map(|(k, l)| api::HeldLease::of(k, l))
                    .collect();
                let _ = reply.send(held);
            }
            Command::Job(id, reply) => {
                let _ = reply.send(self.job_detail(&id));
            }
            Command::JudgeJob(id, verdict, reply) => {
                let command = match verdict {
                    api::Verdict::Accept { part_ppm } => {
                        MarketCommand::Accept { job: id, part_ppm }
                    }
                    api::Verdict::Dispute { reason } => MarketCommand::Dispute { job: id, reason },
                    api::Verdict::Evaluate => MarketCommand::Evaluate(id),
                };
                let done = self.refuse_if_safe().and_then(|()| {
                    self.market
                        .command(now_ms, command)
                        .map_err(anyhow::Error::from)
                });
                self.drain();
                let detail = done
                    .and_then(|_| self.refuse_if_safe())
                    .and_then(|()| self.job_detail(&id));
                let _ = reply.send(detail);
            }
            Command::Metrics(reply) => {
                self.set_gauges();
                let _ = reply.send(());
            }
            Command::Partition(peers, reply) => {
                let _ = reply.send(self.partition(peers));
            }
            Command::Corrupt(on, reply) => {
                let _ = reply.send(if self.market_config.attestation.testnet {
                    self.corrupt.store(on, std::sync::atomic::Ordering::Relaxed);
                    warn!(on, "testnet fault: deliveries carry wrong outputs");
                    Ok(())
                } else {
                    Err(anyhow::anyhow!(
                        "only a testnet node (`node run --testnet`) takes this fault"
                    ))
                });
            }
            Command::Slow(slow, reply) => {
                let _ = reply.send(if self.market_config.attestation.testnet {
                    self.shaping
                        .set(Duration::from_millis(slow.delay_ms), slow.loss_ppm);
                    warn!(
                        delay_ms = slow.delay_ms,
                        loss_ppm = slow.loss_ppm,
                        "testnet fault: inbound bytes held on every TCP link"
                    );
                    Ok(())
                } else {
                    Err(anyhow::anyhow!(
                        "only a testnet node (`node run --testnet`) takes this fault"
                    ))
                });
            }
            Command::CancelJob(id, reply) => {
                let done = self.refuse_if_safe().and_then(|()| {
                    self.market
                        .command(now_ms, MarketCommand::Cancel(id))
                        .map_err(anyhow::Error::from)
                });
                self.drain();
                let done = done.and_then(|ok| self.refuse_if_safe().map(|()| ok));
                let summary = done.and_then(|_| {
                    self.market
                        .job(&id)
                        .map(api::JobSummary::of)
                        .context("the job is gone")
                });
                let _ = reply.send(summary);
            }
            Command::Explain(template, reply) => {
                let explained = self
                    .market
                    .explain(&template)
                    .into_iter()
                    .map(|(task, explanation)| api::TaskExplanation { task, explanation })
                    .collect();
                let _ = reply.send(Ok(explained));
            }
            Command::PublishAd(reply) => self.probe_machine(Some(reply)),
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
            Command::BlockChecked(origin, checked) => self.block_checked(origin, checked),
            Command::BlocksFetched(peer, checked, full) => {
                self.blocks_fetched(peer, checked, full);
            }
            Command::LedgerStatus(reply) => {
                let _ = reply.send(self.ledger_status());
            }
            Command::Balance(who, reply) => {
                let _ = reply.send(self.balance(who));
            }
            Command::LedgerBlocks(limit, reply) => {
                let _ = reply.send(self.block_list(limit));
            }
            Command::LedgerBlock(height, reply) => {
                let _ = reply.send(self.block_detail(height));
            }
            Command::WalletSend(to, amount, reply) => self.wallet_send(to, amount, reply),
            Command::WalletFaucet(reply) => self.wallet_faucet(reply),
            Command::Compute(n, reply) => self.compute(n, reply),
            Command::Computed(done, reply) => self.computed(*done, reply),
            Command::SettleSent {
                job,
                lock,
                tx,
                result,
            } => self.settle_sent(job, lock, tx, result),
            Command::Prove(id, reply) => {
                let _ = reply.send(self.prove(&id));
            }
            Command::Tx(id, reply) => {
                let _ = reply.send(self.tx_detail(&id));
            }
            Command::Escrow(job, reply) => {
                let _ = reply.send(self.escrow_of(&job));
            }
            Command::SubmitTx(signed, reply) => self.submit_foreign(*signed, reply),
            Command::ChallengeChecked(report, seed, reply) => {
                self.record_challenge(report, seed, reply);
            }
            Command::Software(software) => {
                info!(runtimes = ?software.0, collectives = ?software.1, "runtimes probed");
                self.software = Some(software);
                self.publish_ad_soon();
            }
            Command::Probed(n, probe, reply) => {
                if n > self.probe_applied {
                    self.probe_applied = n;
                    // The last good owner settings: what a broken file falls back to.
                    self.config.owner = probe.owner.clone();
                    self.probe = Some(*probe);
                }
                // Asked for (the API waits): now. Otherwise with whatever else changes the
                // ad in the next moment (the executor opening, the runtimes probed).
                match reply {
                    Some(reply) => {
                        let _ = reply.send(self.publish_ad());
                    }
                    None => self.publish_ad_soon(),
                }
            }
            Command::ExecutorReady => {
                self.executor_opened();
                self.publish_ad_soon();
            }
            Command::Ran {
                request_id,
                stage,
                detail,
            } => {
                if self.safe_mode.is_none() {
                    let ran = MarketCommand::Ran {
                        request_id: request_id.clone(),
                        stage,
                        detail,
                    };
                    match self.market.command(now_ms, ran) {
                        Ok(_) => debug!(%request_id, stage = stage.name(), "run reported"),
                        Err(e) => debug!(%request_id, error = %e, "run not reported"),
                    }
                    self.drain();
                }
            }
            Command::Sandboxed { request_id, device } => {
                if let Err(e) = self.groups.attach(&request_id, device) {
                    warn!(%request_id, error = %format!("{e:#}"), "group channel cannot reach the sandbox");
                }
            }
            Command::Prepared {
                request_id,
                outputs,
                usage,
                exit_code,
            } => {
                if self.safe_mode.is_none() {
                    let prepared = MarketCommand::Prepared {
                        request_id: request_id.clone(),
                        outputs,
                        usage,
                        exit_code,
                        hardware: self.hardware_summary(),
                    };
                    match self.market.command(now_ms, prepared) {
                        Ok(_) => info!(%request_id, "outputs sealed; manifest sent"),
                        Err(e) => warn!(%request_id, error = %e, "outputs not delivered"),
                    }
                    self.drain();
                }
            }
            Command::CheckpointSealed {
                request_id,
                seq,
                checkpoint,
            } => {
                if self.safe_mode.is_none() {
                    let sealed = MarketCommand::CheckpointSealed {
                        request_id: request_id.clone(),
                        seq,
                        checkpoint,
                    };
                    match self.market.command(now_ms, sealed) {
                        Ok(_) => debug!(%request_id, seq, "checkpoint sealed; note sent"),
                        Err(e) => debug!(%request_id, error = %e, "checkpoint not sent"),
                    }
                    self.drain();
                }
            }
            Command::CheckpointFetched(note, result) => self.checkpoint_fetched(*note, result),
            Command::Transfer {
                peer,
                request,
                reply,
            } => self.ask_transfer(peer, request, reply),
            Command::TransferServed(peer, channel, response) => {
                self.served_transfer(peer);
                self.answer_transfer(channel, response);
            }
            Command::Fetched(manifest, result) => self.fetched(*manifest, result),
            Command::ProductChecked(check, verdict) => self.product_checked(check, verdict),
            Command::Evaluated(run, report) => self.evaluated(run, *report),
        }
    }

    fn submit_job(&mut self, template: OfferTemplate) -> anyhow::Result<api::JobSummary> {
        self.refuse_if_safe()?;
        self.can_lock(&template)?;
        let nonce = *crate::keystore::random_bytes::<16>()?;
        let done = self
            .market
            .command(now().0, MarketCommand::Submit { template, nonce });
        self.drain();
        // Not saved, not acknowledged.
        self.refuse_if_safe()?;
        let cannabis_market::CommandOk::Submitted { job, .. } = done? else {
            anyhow::bail!("the market did not create a job");
        };
        self.market
            .job(&job)
            .map(api::JobSummary::of)
            .context("the job is gone")
    }

    fn publish_offer(&mut self, template: OfferTemplate) -> anyhow::Result<api::Published> {
        self.refuse_if_safe()?;
        let nonce = *crate::keystore::random_bytes::<16>()?;
        let done = self
            .market
            .command(now().0, MarketCommand::PublishOffer { template, nonce });
        self.drain();
        self.refuse_if_safe()?;
        let cannabis_market::CommandOk::Submitted { job, offer } = done? else {
            anyhow::bail!("the market did not publish the offer");
        };
        let published_at_us = self
            .published_at
            .remove(&job)
            .context("the offer was not published")?;
        Ok(api::Published {
            job_id: job.to_string(),
            id: offer.to_string(),
            published_at_us,
        })
    }

    fn job_detail(&self, id: &cannabis_protocol::Uuid) -> anyhow::Result<api::JobDetail> {
        let job = self
            .market
            .job(id)
            .ok_or_else(|| anyhow::anyhow!("this node published no job {id}"))?;
        let ctx = self.market.context();
        let mut detail = api::JobDetail::of(job, |spec| {
            cannabis_market::matching::explain(spec, self.market.worker_ads(), &ctx)
        });
        self.add_deliveries(id, &mut detail);
        detail.escrow = self
            .chain
            .as_ref()
            .and_then(|c| c.ledger().escrow(id).cloned());
        Ok(detail)
    }

    /// An opening of the executor ended: one that failed is tried again after the
    /// retry's wait (doubling), one that opened resets the wait.
    fn executor_opened(&mut self) {
        let failed = matches!(self.executor.borrow().as_deref(), Some(Err(_)));
        if !failed {
            self.reopen.reset();
            return;
        }
        info!(
            in_secs = self.reopen.wait().as_secs(),
            "the executor is tried again"
        );
        self.reopen.arm();
        self.reopen.double();
    }

    /// Opens the executor again, in the background, as at start.
    fn reopen_executor(&mut self) {
        if self.opening.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        self.opening = Some(open_executor(
            &self.config,
            &self.data_dir,
            &self.store,
            self.executor_open.clone(),
            self.self_tx.clone(),
        ));
    }

    fn status(&self) -> api::Status {
        let gossipsub = &self.swarm.behaviour().gossipsub;
        api::Status {
            address: self.address.to_string(),
            peer_id: self.swarm.local_peer_id().to_string(),
            listen_addrs: self.swarm.listeners().map(ToString::to_string).collect(),
            connected_peers: self.swarm.connected_peers().count(),
            mesh_peers: self
                .topics
                .own(&self.address)
                .iter()
                .map(|t| api::TopicPeers {
                    topic: self.topics.name(*t),
                    peers: gossipsub.mesh_peers(&self.topics.ident(*t).hash()).count(),
                })
                .collect(),
            ads: self.market.view().ad_count(),
            offers: self.market.view().offer_count(),
            uptime_secs: self.started.elapsed().as_secs(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            safe_mode: self.safe_mode.clone(),
            probing: self.software.is_none()
                || self.probe.is_none()
                || self.executor.borrow().is_none()
                || self.ad_due.is_some(),
            refused_peers: self.blocked.len(),
            executor: match self.executor.borrow().as_deref() {
                None => "opening".into(),
                Some(Ok(ex)) => ex.mode().describe(),
                Some(Err(why)) => format!("none: {why}"),
            },
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
                    .map(|c| c.iter().map(|l| l.addr.to_string()).collect())
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
                if self.graylisted(&peer_id) {
                    // Graylisted while away: refused from now on.
                    self.let_go(peer_id);
                    return;
                }
                self.dialing.remove(&peer_id);
                self.connections.entry(peer_id).or_default().push(Link {
                    id: connection_id,
                    addr: endpoint.get_remote_address().clone(),
                    dialed: endpoint.is_dialer(),
                    since: tokio::time::Instant::now(),
                });
                // A node that just started asks its first few peers for the live market;
                // gossip brings the rest. (Syncing the whole view with every peer made a
                // 100-node testnet spend most of its start-up serving the same pages.)
                if num_established.get() == 1 && self.synced.len() < SYNC_PEERS {
                    self.synced.insert(peer_id);
                    self.start_sync(peer_id);
                } else if self.resync.remove(&peer_id) {
                    self.start_sync(peer_id);
                }
                if num_established.get() == 1 {
                    self.blocks_on_connect(peer_id);
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
                    c.retain(|l| l.id != connection_id);
                }
                // A connection's buffers are freed in the middle of the heap, where glibc
                // keeps them: a node that met every peer at start and kept 30 held about
                // 5 MiB it no longer used until the next trim.
                self.dropped_since_trim += 1;
                debug!(peer = %peer_id, remaining = num_established, cause = ?cause, "connection closed");
                if num_established == 0 {
                    self.cancel_proving(&peer_id);
                    self.ping_rtt.remove(&peer_id);
                    self.connections.remove(&peer_id);
                }
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                debug!(peer = ?peer_id, error = %error, "dial failed");
                if let Some(peer) = peer_id {
                    self.dialing.remove(&peer);
                }
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
            BehaviourEvent::Transfer(e) => self.on_transfer(e),
            BehaviourEvent::Ledger(e) => self.on_ledger(e),
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
            || self.dialing.contains(&peer)
            || self.swarm.connected_peers().count() + self.dialing.len() >= TARGET_PEERS
        {
            return;
        }
        match self.swarm.dial(peer) {
            Ok(()) => {
                self.dialing.insert(peer);
            }
            Err(e) => debug!(%peer, error = %e, "cannot dial discovered peer"),
        }
    }

    /// Keeps the node's connections near what gossip needs. Kademlia's lookups connect to
    /// every peer they query, and in a network of a hundred nodes that is everyone: each
    /// connection then costs gossip, ping and keep-alive traffic for good. Above twice
    /// the aim, connections this node dialed to peers in none of its gossip meshes are let
    /// go. It never cuts a connection a peer made to it (that may be the peer's only one),
    /// nor its bootstrap peers; below half the aim it dials peers it knows.
    fn trim_connections(&mut self) {
        let connected = self.swarm.connected_peers().count();
        if connected < TARGET_PEERS / 2 {
            let known: Vec<PeerId> = self
                .swarm
                .behaviour_mut()
                .kad
                .kbuckets()
                .flat_map(|b| b.iter().map(|e| *e.node.key.preimage()).collect::<Vec<_>>())
                .collect();
            let few = known.len() < TARGET_PEERS;
            for peer in known {
                self.maybe_dial(peer);
            }
            for addr in self.config.bootstrap.clone() {
                self.dial_bootstrap(addr);
            }
            // Few peers known (the start-up lookup found nobody, say, its only peer too
            // busy to answer): look again rather than wait minutes for Kademlia's round.
            if few && connected > 0 {
                let _ = self.swarm.behaviour_mut().kad.bootstrap();
            }
        }
        let limit = 2 * TARGET_PEERS;
        let connected: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        if connected.len() <= limit {
            return;
        }
        let gossipsub = &self.swarm.behaviour().gossipsub;
        let meshed: std::collections::HashSet<PeerId> = gossipsub
            .topics()
            .flat_map(|t| gossipsub.mesh_peers(t).copied().collect::<Vec<_>>())
            .collect();
        let bootstrap: std::collections::HashSet<PeerId> = self
            .config
            .bootstrap
            .iter()
            .filter_map(|a| match a.iter().last() {
                Some(libp2p::multiaddr::Protocol::P2p(p)) => Some(p),
                _ => None,
            })
            .collect();
        // Nor a connection that carries live work: a group's channels (a stream that a cut
        // ends, stopping every rank), or the other side of a lease this node holds or
        // gave (renewals, reports and transfers, every few seconds while it lasts).
        let mut busy = self.groups.peers();
        let t = now().0;
        busy.extend(
            self.market
                .leases()
                .iter()
                .filter(|(key, lease)| self.market.leases().is_current(key, lease.epoch, t))
                .filter_map(|(_, lease)| swarm::peer_of(&lease.requester)),
        );
        busy.extend(
            self.market
                .jobs()
                .filter(|j| j.state() == cannabis_market::job::JobState::Open)
                .flat_map(|j| j.tasks().iter().flat_map(|task| task.ranks()))
                .filter(|a| a.expires_at > t)
                .filter_map(|a| swarm::peer_of(&a.worker)),
        );
        // Connections get a moment first: while lookups run at start-up, cutting the ones
        // they just made only makes the next lookup dial them again.
        let settled = tokio::time::Instant::now()
            .checked_sub(TRIM_GRACE)
            .unwrap_or_else(tokio::time::Instant::now);
        let excess = connected.len() - limit;
        let spare: Vec<PeerId> = connected
            .into_iter()
            .filter(|p| !meshed.contains(p) && !bootstrap.contains(p) && !busy.contains(p))
            .filter(|p| {
                self.connections
                    .get(p)
                    .is_some_and(|c| c.iter().all(|l| l.dialed && l.since <= settled))
            })
            .collect();
        for peer in spare.into_iter().take(excess) {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
    }

    /// Asks one connected peer it has not asked before (any peer once it has asked them
    /// all) for the live market, at the times of `CATCH_UP_SECS`.
    fn catch_up(&mut self) {
        let Some(due) = CATCH_UP_SECS.get(self.catch_ups) else {
            return;
        };
        if self.started.elapsed() < Duration::from_secs(*due) {
            return;
        }
        let mut peers = self.swarm.connected_peers().copied();
        let Some(first) = peers.next() else {
            return;
        };
        let peer = std::iter::once(first)
            .chain(peers)
            .find(|p| !self.synced.contains(p))
            .unwrap_or(first);
        self.catch_ups += 1;
        self.synced.insert(peer);
        debug!(%peer, "catch-up sync");
        self.start_sync(peer);
    }

    /// Lowers a peer's application score after a bad directed request or sync page.
    /// Lets application penalties fade (at `APP_DECAY` a second) and forgets the ones
    /// that have: a peer's penalty is a debt that is paid down, and throwaway ids leave
    /// nothing behind.
    fn decay_penalties(&mut self, over: Duration) {
        for (peer, score) in decay_scores(&mut self.app_scores, over) {
            self.swarm
                .behaviour_mut()
                .gossipsub
                .set_application_score(&peer, score);
        }
    }

    /// Whether `peer` is graylisted: nothing it asks is served, and it is disconnected.
    pub(super) fn graylisted(&self, peer: &PeerId) -> bool {
        self.swarm
            .behaviour()
            .gossipsub
            .peer_score(peer)
            .is_some_and(|s| s < swarm::GRAYLIST_THRESHOLD)
    }

    /// Disconnects graylisted peers, and refuses them at the handshake while they stay
    /// graylisted: they cost CPU and give nothing. One that comes back at once would
    /// otherwise get the identify, Kademlia and gossipsub exchanges of a new peer before
    /// it is let go again (gossipsub keeps a departed peer's score, undecayed, for an
    /// hour). A peer whose score is back above the threshold, or forgotten, may connect
    /// again. The list holds at most `MAX_BLOCKED` peers, the oldest let out first.
    fn drop_graylisted(&mut self) {
        let bad: Vec<PeerId> = self
            .connections
            .keys()
            .filter(|p| self.graylisted(p))
            .copied()
            .collect();
        for peer in bad {
            self.let_go(peer);
        }
        let mut blocked = std::mem::take(&mut self.blocked);
        blocked.retain(|peer| {
            let still = self.graylisted(peer);
            if !still && !self.partitioned.contains(peer) {
                debug!(%peer, "no longer graylisted: may connect again");
                self.swarm.behaviour_mut().blocked.unblock_peer(*peer);
            }
            still
        });
        self.blocked = blocked;
    }

    /// Lets a graylisted peer go at once (the upkeep finds any that fell below by their
    /// score decaying): the moment it is penalized below the threshold, not up to an upkeep
    /// later. A flood's key held on to for those seconds went on costing every node.
    pub(super) fn let_go_if_graylisted(&mut self, peer: PeerId) {
        if self.connections.contains_key(&peer) && self.graylisted(&peer) {
            self.let_go(peer);
        }
    }

    fn let_go(&mut self, peer: PeerId) {
        info!(%peer, "graylisted: disconnected");
        self.block(peer);
        let _ = self.swarm.disconnect_peer_id(peer);
    }

    fn block(&mut self, peer: PeerId) {
        if self.swarm.behaviour_mut().blocked.block_peer(peer) {
            self.blocked.push_back(peer);
            if self.blocked.len() > MAX_BLOCKED
                && let Some(oldest) = self.blocked.pop_front()
                && !self.partitioned.contains(&oldest)
            {
                self.swarm.behaviour_mut().blocked.unblock_peer(oldest);
            }
        }
    }

    /// The gauges `/metrics` reads from the node's state, set now.
    fn set_gauges(&mut self) {
        use crate::metrics::set_all;
        let m = &self.metrics;
        m.peers.set(self.swarm.connected_peers().count() as i64);
        m.ads.set(self.market.view().ad_count() as i64);
        m.offers.set(self.market.view().offer_count() as i64);
        let mut jobs = std::collections::BTreeMap::<String, i64>::new();
        let mut tasks = std::collections::BTreeMap::<String, i64>::new();
        let mut bids = 0;
        for j in self.market.jobs() {
            *jobs
                .entry(format!("{:?}", j.state()).to_lowercase())
                .or_default() += 1;
            for t in j.tasks() {
                *tasks.entry(t.status().word().to_string()).or_default() += 1;
                bids += t.bid_count() as i64;
            }
        }
        m.bids.set(bids);
        set_all(&m.jobs, "state", &jobs.into_iter().collect::<Vec<_>>());
        set_all(&m.tasks, "status", &tasks.into_iter().collect::<Vec<_>>());
        let mut leases = std::collections::BTreeMap::<String, i64>::new();
        for (_, l) in self.market.leases().iter() {
            let word = if l.is_live() { "current" } else { "ended" };
            *leases.entry(word.to_string()).or_default() += 1;
        }
        set_all(&m.leases, "state", &leases.into_iter().collect::<Vec<_>>());
        let store = std::fs::metadata(self.data_dir.join("node.redb")).map_or(0, |f| f.len());
        m.store_bytes.set(i64::try_from(store).unwrap_or(i64::MAX));
        let height = self.chain.as_ref().map_or(0, |c| c.ledger().height());
        m.ledger_height
            .set(i64::try_from(height).unwrap_or(i64::MAX));
    }

    /// A testnet partition: `peers` are refused (their connections dropped) until a later
    /// partition leaves them out; those it leaves out may connect again and are dialled.
    /// Enforced by the swarm's block list, on this node's side of every connection.
    fn partition(&mut self, peers: Vec<PeerId>) -> anyhow::Result<usize> {
        anyhow::ensure!(
            self.market_config.attestation.testnet,
            "only a testnet node (`node run --testnet`) takes a partition"
        );
        let new: std::collections::HashSet<PeerId> = peers.into_iter().collect();
        let healed: Vec<PeerId> = self.partitioned.difference(&new).copied().collect();
        for peer in &new {
            self.resync.remove(peer);
            self.swarm.behaviour_mut().blocked.block_peer(*peer);
            let _ = self.swarm.disconnect_peer_id(*peer);
        }
        self.partitioned = new;
        for peer in healed {
            if !self.blocked.contains(&peer) {
                self.swarm.behaviour_mut().blocked.unblock_peer(peer);
                self.resync.insert(peer);
                if let Err(e) = self.swarm.dial(peer) {
                    debug!(%peer, error = %e, "not dialled after the partition healed");
                }
            }
        }
        info!(peers = self.partitioned.len(), "testnet partition set");
        Ok(self.partitioned.len())
    }

    fn penalize(&mut self, peer: PeerId, by: f64, why: &str) {
        let score = self.app_scores.entry(peer).or_insert(0.0);
        *score -= by;
        let score = *score;
        self.swarm
            .behaviour_mut()
            .gossipsub
            .set_application_score(&peer, score);
        warn!(%peer, score, why, "peer penalized");
        self.let_go_if_graylisted(peer);
    }
}

/// What a group rank's node does with its held sandbox once the gang start is decided
/// (see [`crate::group`]): the executor releases it, or stops it with the reason.
fn group_starter(executor: handle::ExecutorSlot) -> crate::group::Starter {
    Arc::new(move |request_id: String, outcome: Result<(), String>| {
        let Some(Ok(ex)) = executor.borrow().as_deref().cloned() else {
            warn!(%request_id, "no executor to start the group's rank");
            return;
        };
        tokio::task::spawn_blocking(move || {
            let attempt = match run::attempt_for(&ex, &request_id) {
                Ok(Some(a)) => a,
                Ok(None) => return warn!(%request_id, "the group's rank has no attempt"),
                Err(e) => return warn!(%request_id, error = %e, "the group's rank not found"),
            };
            let done = match &outcome {
                Ok(()) => ex.release(&attempt.id),
                Err(why) => ex.stop(&attempt.id, why).map(|_| ()),
            };
            if let Err(e) = done {
                warn!(%request_id, error = %e, "the executor did not start or stop the group's rank");
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_penalties_fade_and_are_forgotten() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut scores = HashMap::from([(a, -200.0), (b, -20.0)]);
        let changed = decay_scores(&mut scores, Duration::from_secs(10));
        assert_eq!(changed.len(), 2);
        let left = scores[&a];
        assert!(left > -200.0 && left < -150.0, "{left}");
        // Long enough, and both are forgotten: gossipsub is told 0.
        let mut told = Vec::new();
        for _ in 0..60 {
            told = decay_scores(&mut scores, Duration::from_secs(10));
            if scores.is_empty() {
                break;
            }
        }
        assert!(scores.is_empty(), "{scores:?}");
        assert!(told.iter().all(|(_, s)| *s == 0.0));
    }
}
