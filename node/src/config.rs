//! The node's configuration: a TOML file (`--config`), overridden by command-line flags.
//! Every field has a default, so no file is needed to start.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context as _;
use cannabis_protocol::{NetworkLimits, PriceSheet};
use libp2p::Multiaddr;
use serde::{Deserialize, Serialize};

/// Node configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Swarm listen addresses (TCP and QUIC).
    pub listen: Vec<Multiaddr>,
    /// Peers to dial at start and to bootstrap Kademlia from (`/ip4/.../tcp/.../p2p/...`).
    pub bootstrap: Vec<Multiaddr>,
    /// Discover peers on the local network with mDNS.
    pub mdns: bool,
    /// Act as a circuit relay for peers behind NAT.
    pub relay_server: bool,
    /// Addresses other nodes can reach this one at, announced as they are (for a node
    /// with a known public address). A relay without any announces its listen addresses:
    /// a relay must be reachable to be of use.
    pub external_addrs: Vec<Multiaddr>,
    /// Local API address. Keep it on loopback.
    pub api: SocketAddr,
    /// Connection limits.
    pub limits: Limits,
    /// Gossip and market-view settings.
    pub gossip: Gossip,
    /// How this node sizes and times the challenges it sets.
    pub challenge: ChallengeConfig,
    /// The owner's settings that go into the capability ad. Re-read from the file at every
    /// ad refresh, so the next ad follows the owner's changes.
    pub owner: Owner,
    /// What this node takes as a worker: custom code, longest job, which requesters.
    pub worker: cannabis_market::quote::WorkerPolicy,
    /// Lease timing for the jobs this node publishes.
    pub leases: cannabis_market::job::LeaseConfig,
    /// How the jobs this node publishes call for bids (see docs/architecture.md).
    pub fanin: cannabis_market::fanin::FaninConfig,
    /// The owner's limits for the local executor; each must stay within the
    /// administrator's ceilings (unset fields take the ceiling).
    pub executor: cannabis_runtime::exec::LimitsFile,
    /// The socket of a root supervisor that runs this node's work (`cannabis supervisor
    /// run`); without one the executor runs in the node's own process.
    pub supervisor: Option<std::path::PathBuf>,
    /// The embedded ledger: the network's genesis, and whether this node sequences it.
    pub ledger: LedgerConfig,
    /// The confidential-execution evidence this node's ads carry: none, or `"dev"` (an
    /// insecure stand-in that proves nothing, for testnets only: refused without
    /// `--testnet`). See docs/confidential.md.
    pub attestation: Option<cannabis_protocol::AttestationKind>,
    /// Whether this node is on a local testnet (`node run --testnet`): `dev` attestations
    /// count only there.
    #[serde(skip)]
    pub testnet: bool,
    /// The administrator's ceilings file (set by `node run --ceilings`, never by this
    /// file: the owner's settings cannot move their own ceiling).
    #[serde(skip)]
    pub ceilings: Option<std::path::PathBuf>,
    /// The file this configuration came from, if any.
    #[serde(skip)]
    pub source: Option<std::path::PathBuf>,
    /// The `cannabis` binary the executor's sandboxes re-execute: this process's own when
    /// unset (set by programs that embed the node, such as tests).
    #[serde(skip)]
    pub program: Option<std::path::PathBuf>,
}

impl NodeConfig {
    /// Pins the network parameters the genesis fixes: blocks only from its sequencer, and
    /// its fee terms on every offer this node publishes or takes. A configuration that
    /// names others is refused: two sources of one network parameter must agree.
    pub fn pin_to_genesis(&mut self, g: &cannabis_protocol::Genesis) -> anyhow::Result<()> {
        let seqs = &mut self.gossip.sequencers;
        anyhow::ensure!(
            seqs.is_empty() || *seqs == [g.sequencer],
            "gossip.sequencers names other sequencers than the genesis ({})",
            g.sequencer
        );
        *seqs = vec![g.sequencer];
        match &self.gossip.fee {
            Some(fee) => anyhow::ensure!(
                *fee == g.fee,
                "gossip.fee ({} bps to {}) is not the genesis' ({} bps to {})",
                fee.rate_bps,
                fee.recipient,
                g.fee.rate_bps,
                g.fee.recipient
            ),
            None => self.gossip.fee = Some(g.fee.clone()),
        }
        Ok(())
    }
}

/// The embedded ledger's settings.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerConfig {
    /// The network's genesis file (JSON, the same on every node). Without one the node
    /// keeps no ledger: it forwards blocks but holds no balances.
    pub genesis: Option<std::path::PathBuf>,
    /// Sequence the ledger: make its blocks. Only the node whose key the genesis names as
    /// sequencer may (`node run --ledger`).
    pub sequence: bool,
}

impl LedgerConfig {
    /// Reads and checks the genesis file, if one is set.
    pub fn load_genesis(&self) -> anyhow::Result<Option<cannabis_protocol::Genesis>> {
        let Some(path) = &self.genesis else {
            anyhow::ensure!(
                !self.sequence,
                "ledger.sequence (--ledger) needs the network's genesis (ledger.genesis, --genesis)"
            );
            return Ok(None);
        };
        let text = std::fs::read(path)
            .with_context(|| format!("reading the genesis {}", path.display()))?;
        let genesis: cannabis_protocol::Genesis = serde_json::from_slice(&text)
            .with_context(|| format!("reading the genesis {}", path.display()))?;
        genesis
            .validate()
            .with_context(|| format!("the genesis {} is not valid", path.display()))?;
        Ok(Some(genesis))
    }
}

/// Sizing of the capability challenges this node sets (see docs/security.md).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChallengeConfig {
    /// Matrix dimension.
    pub size: u32,
    /// Integer operations per second expected of one claimed core.
    pub ops_per_core_per_sec: u64,
    /// Work for an honest node, in milliseconds.
    pub target_ms: u64,
    /// Deadline as a multiple of that.
    pub slack: u64,
    /// Shortest deadline, in milliseconds.
    pub min_deadline_ms: u64,
}

impl Default for ChallengeConfig {
    fn default() -> Self {
        let s = cannabis_protocol::challenge::Sizing::default();
        Self {
            size: s.n,
            ops_per_core_per_sec: s.ops_per_core_per_sec,
            target_ms: s.target_ms,
            slack: s.slack,
            min_deadline_ms: s.min_deadline_ms,
        }
    }
}

impl ChallengeConfig {
    /// The sizing these settings describe.
    pub fn sizing(&self) -> cannabis_protocol::challenge::Sizing {
        cannabis_protocol::challenge::Sizing {
            n: self.size,
            ops_per_core_per_sec: self.ops_per_core_per_sec,
            target_ms: self.target_ms,
            slack: self.slack,
            min_deadline_ms: self.min_deadline_ms,
        }
    }
}

/// Owner settings advertised in the capability ad.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Owner {
    /// GPUs (by UUID, `GPU-...`) the owner allows jobs on; none unless listed.
    pub allowed_gpus: Vec<String>,
    /// The administrator-pinned NVIDIA CDI device map (JSON, devices named by UUID). Allowed
    /// GPUs are advertised only while it matches the GPUs present.
    pub cdi_map: Option<std::path::PathBuf>,
    /// Bandwidth caps.
    pub network: NetworkLimits,
    /// Prices in base units. A field the file leaves out keeps its default (see
    /// [`default_prices`]), so a partial sheet never prices anything at 0 by accident.
    #[serde(deserialize_with = "prices_over_defaults")]
    pub prices: PriceSheet,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PartialPrices {
    cpu_core_hour: Option<cannabis_protocol::Amount>,
    memory_gib_hour: Option<cannabis_protocol::Amount>,
    gpu_hour: Option<Vec<cannabis_protocol::GpuPrice>>,
    minimum_job: Option<cannabis_protocol::Amount>,
}

fn prices_over_defaults<'de, D: serde::Deserializer<'de>>(d: D) -> Result<PriceSheet, D::Error> {
    let p = PartialPrices::deserialize(d)?;
    let base = default_prices();
    Ok(PriceSheet {
        cpu_core_hour: p.cpu_core_hour.unwrap_or(base.cpu_core_hour),
        memory_gib_hour: p.memory_gib_hour.unwrap_or(base.memory_gib_hour),
        gpu_hour: p.gpu_hour.unwrap_or(base.gpu_hour),
        minimum_job: p.minimum_job.unwrap_or(base.minimum_job),
    })
}

/// The price sheet of a node whose owner set none: it never works for nothing. Per hour:
/// 1,000 base units a core and 100 a GiB of memory; at least 100 a job (so the 1% fee of
/// even the smallest job is a whole base unit). GPUs have no default price: a GPU is
/// rented only at a price its owner set (`[[owner.prices.gpu_hour]]`).
pub fn default_prices() -> PriceSheet {
    PriceSheet {
        cpu_core_hour: cannabis_protocol::Amount(1_000),
        memory_gib_hour: cannabis_protocol::Amount(100),
        gpu_hour: Vec::new(),
        minimum_job: cannabis_protocol::Amount(100),
    }
}

impl Default for Owner {
    fn default() -> Self {
        Self {
            allowed_gpus: Vec::new(),
            cdi_map: None,
            network: NetworkLimits::default(),
            prices: default_prices(),
        }
    }
}

/// Connection limits.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Most established connections in total.
    pub max_established: u32,
    /// Most established connections to one peer.
    pub max_established_per_peer: u32,
    /// Most incoming connections still handshaking.
    pub max_pending_incoming: u32,
    /// Most incoming connections still handshaking from one IP address (raise it for
    /// local testnets, where every node is on 127.0.0.1).
    pub max_pending_per_ip: u32,
    /// Seconds a connection may take to finish its handshake.
    pub handshake_timeout_secs: u64,
    /// Most outgoing connections still handshaking.
    pub max_pending_outgoing: u32,
    /// Seconds an idle connection stays open.
    pub idle_connection_timeout_secs: u64,
    /// Seconds a directed request may take.
    pub request_timeout_secs: u64,
}

/// Gossip and market-view settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Gossip {
    /// How long this node's capability ad stays valid.
    pub ad_ttl_secs: u64,
    /// How often the ad is re-made and re-published (before it expires).
    pub ad_refresh_secs: u64,
    /// Milliseconds between gossipsub heartbeats.
    pub heartbeat_millis: u64,
    /// Peers sharing one IP address before peer scores are lowered (raise it for local
    /// testnets, where every node is on 127.0.0.1).
    pub ip_colocation_threshold: f64,
    /// Topics job offers travel on: a network parameter, the same on every node (a power
    /// of two up to 1024). With more than one, a node hears only the offers whose bid calls
    /// can draw it (see docs/protocol.md, "Gossip topics"); 1 suits networks of up to a few
    /// thousand nodes.
    pub offer_shards: u32,
    /// The network's ledger sequencers: blocks are taken only from them (a network
    /// parameter, the same on every node; none: no blocks are taken).
    pub sequencers: Vec<cannabis_protocol::Address>,
    /// The network's fee terms: its rate in basis points and its recipient (a network
    /// parameter, the same on every node). This node's offers carry them, and as a worker
    /// it declines offers that carry others, with a signed reason. None: this node neither
    /// publishes nor takes offers. `cannabis testnet up` pins a testnet's own.
    pub fee: Option<cannabis_protocol::FeeTerms>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            listen: vec![
                "/ip4/0.0.0.0/tcp/4001".parse().expect("valid multiaddr"),
                "/ip4/0.0.0.0/udp/4001/quic-v1"
                    .parse()
                    .expect("valid multiaddr"),
            ],
            bootstrap: Vec::new(),
            mdns: true,
            relay_server: false,
            external_addrs: Vec::new(),
            api: SocketAddr::from(([127, 0, 0, 1], 4080)),
            limits: Limits::default(),
            gossip: Gossip::default(),
            challenge: ChallengeConfig::default(),
            owner: Owner::default(),
            worker: cannabis_market::quote::WorkerPolicy::default(),
            leases: cannabis_market::job::LeaseConfig::default(),
            fanin: cannabis_market::fanin::FaninConfig::default(),
            executor: cannabis_runtime::exec::LimitsFile::default(),
            supervisor: None,
            ledger: LedgerConfig::default(),
            program: None,
            ceilings: None,
            attestation: None,
            testnet: false,
            source: None,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_established: 256,
            max_established_per_peer: 2,
            max_pending_incoming: 64,
            max_pending_per_ip: 8,
            handshake_timeout_secs: 5,
            max_pending_outgoing: 64,
            idle_connection_timeout_secs: 300,
            request_timeout_secs: 10,
        }
    }
}

impl Default for Gossip {
    fn default() -> Self {
        Self {
            ad_ttl_secs: 600,
            ad_refresh_secs: 240,
            heartbeat_millis: 700,
            ip_colocation_threshold: 10.0,
            offer_shards: 1,
            sequencers: Vec::new(),
            fee: None,
        }
    }
}

impl NodeConfig {
    /// Reads a TOML file; unknown keys are an error that names them.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        let mut config: NodeConfig =
            toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))?;
        config.check()?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// Cross-field checks.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.gossip.ad_refresh_secs > 0
                && self.gossip.ad_refresh_secs < self.gossip.ad_ttl_secs,
            "gossip.ad_refresh_secs must be above 0 and below gossip.ad_ttl_secs, so ads are \
             refreshed before they expire"
        );
        anyhow::ensure!(
            self.limits.max_established_per_peer >= 1 && self.limits.max_established >= 1,
            "limits.max_established and limits.max_established_per_peer must be at least 1"
        );
        anyhow::ensure!(
            self.gossip.heartbeat_millis >= 100,
            "gossip.heartbeat_millis must be at least 100"
        );
        anyhow::ensure!(
            self.gossip.offer_shards.is_power_of_two()
                && self.gossip.offer_shards <= cannabis_protocol::draw::MAX_SHARDS,
            "gossip.offer_shards must be a power of two from 1 to 1024 (and the same on every node)"
        );
        if let Some(fee) = &self.gossip.fee {
            anyhow::ensure!(
                fee.rate_bps <= cannabis_protocol::BPS_DENOMINATOR,
                "gossip.fee.rate_bps must be at most 10000 (100%); the founder fee is 100 (1%)"
            );
        }
        Ok(())
    }

    /// Whether this node may carry the attestation it is set to (known only once it is
    /// started, with or without `--testnet`).
    pub fn check_attestation(&self) -> anyhow::Result<()> {
        match self.attestation {
            None => {}
            Some(cannabis_protocol::AttestationKind::Dev) => anyhow::ensure!(
                self.testnet,
                "attestation = \"dev\" is insecure (anyone can make it, it proves nothing) \
                 and allowed on a local testnet only (`node run --testnet`); remove it"
            ),
            Some(kind) => anyhow::bail!(
                "attestation = \"{}\": this build cannot produce that evidence yet; only \
                 \"dev\", on testnets (docs/confidential.md)",
                cannabis_market::attest::kind_name(kind)
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_their_own_checks() {
        NodeConfig::default().check().unwrap();
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = toml::from_str::<NodeConfig>("listne = []")
            .unwrap_err()
            .to_string();
        assert!(err.contains("listne"), "{err}");
    }

    #[test]
    fn owner_settings_parse() {
        let c: NodeConfig = toml::from_str(
            "[owner]\nallowed_gpus = [\"GPU-1\"]\n[owner.network]\nupload_bytes_per_sec = 1000\n\
             [owner.prices]\ncpu_core_hour = 5\ngpu_hour = [{ model = \"H200\", price = 900 }]\n",
        )
        .unwrap();
        assert_eq!(c.owner.allowed_gpus, vec!["GPU-1".to_string()]);
        assert_eq!(c.owner.network.upload_bytes_per_sec, Some(1000));
        assert_eq!(c.owner.prices.cpu_core_hour, cannabis_protocol::Amount(5));
        assert_eq!(
            c.owner.prices.gpu_hour[0].price,
            cannabis_protocol::Amount(900)
        );
        // What the file leaves out keeps the default sheet's value, never 0.
        assert_eq!(c.owner.prices.minimum_job, cannabis_protocol::Amount(100));
        assert_eq!(
            c.owner.prices.memory_gib_hour,
            cannabis_protocol::Amount(100)
        );
        let zero: NodeConfig = toml::from_str(
            "[owner.prices]\ncpu_core_hour = 0\nmemory_gib_hour = 0\nminimum_job = 0\n",
        )
        .unwrap();
        assert_eq!(
            zero.owner.prices.cpu_core_hour,
            cannabis_protocol::Amount(0)
        );
        assert_eq!(NodeConfig::default().owner.prices, default_prices());
    }

    #[test]
    fn testnet_node_files_parse_and_differ() {
        let configs: Vec<NodeConfig> = (0..8)
            .map(|i| {
                let recipient = cannabis_market::testkit::fee_terms().recipient.to_string();
                let mut c: NodeConfig =
                    toml::from_str(&cannabis_testnet::launcher::node_config(i, &recipient))
                        .unwrap();
                c.testnet = true; // as `testnet up` runs them
                c
            })
            .collect();
        assert!(configs.iter().all(|c| c.worker.custom_code
            && c.check().is_ok()
            && c.check_attestation().is_ok()
            && c.gossip.fee == Some(cannabis_market::testkit::fee_terms())));
        // Nodes 3 and 7 carry a dev attestation, which only a testnet allows.
        let attested: Vec<usize> = (0..8)
            .filter(|&i| configs[i].attestation.is_some())
            .collect();
        assert_eq!(attested, [3, 7]);
        let mut outside = configs[3].clone();
        outside.testnet = false;
        let e = outside.check_attestation().unwrap_err().to_string();
        assert!(e.contains("insecure") && e.contains("--testnet"), "{e}");
        let prices: std::collections::BTreeSet<u64> = configs
            .iter()
            .map(|c| c.owner.prices.cpu_core_hour.0)
            .collect();
        assert!(prices.len() >= 4, "{prices:?}");
        let cores: std::collections::BTreeSet<String> = configs
            .iter()
            .map(|c| format!("{:?}", c.executor.cpu))
            .collect();
        assert!(cores.len() >= 2, "{cores:?}");
    }

    #[test]
    fn partial_files_keep_defaults() {
        let c: NodeConfig =
            toml::from_str("mdns = false\n[limits]\nmax_established = 9\n").unwrap();
        assert!(!c.mdns);
        assert_eq!(c.limits.max_established, 9);
        assert_eq!(c.limits.max_established_per_peer, 2);
    }
}
