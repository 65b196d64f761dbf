//! The command line: one binary, a subcommand for each thing a user does.

use std::net::SocketAddr;
use std::path::PathBuf;

use cannabis_node::logging::LogFormat;
use cannabis_protocol::Amount;
use clap::{Args, Parser, Subcommand};
use libp2p::Multiaddr;

/// A peer-to-peer compute market node: contribute idle GPUs and CPUs, publish budgeted
/// jobs, run local testnets.
#[derive(Debug, Parser)]
#[command(name = "cannabis", version, propagate_version = true)]
pub(crate) struct Cli {
    /// Where the node keeps its keys and records. Default: $XDG_DATA_HOME/cannabis or
    /// ~/.local/share/cannabis.
    #[arg(long, global = true, env = "CANNABIS_DATA_DIR", value_name = "DIR")]
    pub(crate) data_dir: Option<PathBuf>,

    /// Log format (logs go to stderr; RUST_LOG sets the level).
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a node and talk to a running one.
    #[command(subcommand)]
    Node(NodeCommand),
    /// What the running node sees of the market.
    #[command(subcommand)]
    Market(MarketCommand),
    /// Local testnets of real node processes on loopback.
    #[command(subcommand)]
    Testnet(TestnetCommand),
    /// Show what this node would advertise: hardware, GPUs, runtimes, owner settings.
    Probe {
        /// Configuration file whose [owner] section (allowed GPUs, limits, prices) applies.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(flatten)]
        format: Format,
    },
    /// Run the capability challenge on this machine: prove, verify, and time both.
    Challenge {
        /// Matrix dimension.
        #[arg(long, default_value_t = 1024)]
        size: u32,
        /// Products to sum; by default sized for this machine's cores (about 2 s of work).
        #[arg(long)]
        rounds: Option<u32>,
        #[command(flatten)]
        format: Format,
    },
    /// Create and inspect this node's identity keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Work with jobs: see what a budget pays before publishing.
    #[command(subcommand)]
    Job(JobCommand),
    /// Walk one job through the whole protocol in-process and show every step.
    Demo(DemoArgs),
    /// Run work locally through the executor and sandbox the node uses.
    #[command(subcommand)]
    Exec(ExecCommand),
    /// The root supervisor that owns the executor for an unprivileged node.
    #[command(subcommand)]
    Supervisor(SupervisorCommand),
    /// The embedded ledger: its status, blocks, and figures.
    #[command(subcommand)]
    Ledger(LedgerCommand),
    /// This node's account on the ledger: balance, transfers, the testnet faucet.
    #[command(subcommand)]
    Wallet(WalletCommand),
}

#[derive(Debug, Subcommand)]
pub(crate) enum WalletCommand {
    /// An account's balance, what of it is spendable and still vesting (this node's by
    /// default), as of the node's last block.
    Balance {
        /// A `cpc1...` address.
        address: Option<String>,
        #[command(flatten)]
        format: Format,
    },
    /// Send base units from this node's account (the network fee is charged apart).
    Send {
        /// The receiver's `cpc1...` address.
        to: String,
        /// The amount, in base units.
        amount: cannabis_protocol::Amount,
        /// Wait until a block holds it, up to this many seconds (0: return once the
        /// sequencer kept it).
        #[arg(long, default_value_t = 30)]
        wait: u64,
        #[command(flatten)]
        format: Format,
    },
    /// Ask the testnet's faucet for a grant to this node's account.
    Faucet {
        /// Wait until a block holds it, up to this many seconds (0: do not wait).
        #[arg(long, default_value_t = 30)]
        wait: u64,
        #[command(flatten)]
        format: Format,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum LedgerCommand {
    /// The ledger as the running node holds it: network, height, sequencer, fee terms.
    Status {
        #[command(flatten)]
        format: Format,
    },
    /// The newest blocks.
    Blocks {
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        #[command(flatten)]
        format: Format,
    },
    /// One block with its transactions.
    Block {
        /// Its height.
        height: u64,
        #[command(flatten)]
        format: Format,
    },
    /// Settle a disputed delivery, as the network's resolver: signed with the keys of
    /// `--data-dir` (on a testnet, its `founder/`), sent through the running node at
    /// `--via` (docs/settlement.md).
    Resolve {
        /// The job id.
        job: String,
        /// The task index.
        #[arg(long, default_value_t = 0)]
        task: u32,
        /// The rank.
        #[arg(long, default_value_t = 0)]
        rank: u32,
        /// What the worker side gets of the agreed price, its fee included: the whole
        /// price clears the worker, less is a strike on its rating, 0 rejects the delivery.
        #[arg(long)]
        award: cannabis_protocol::Amount,
        /// The data directory of a running node to submit through.
        #[arg(long, value_name = "DIR")]
        via: PathBuf,
        /// Wait until a block holds it, up to this many seconds (0: do not wait).
        #[arg(long, default_value_t = 30)]
        wait: u64,
        #[command(flatten)]
        format: Format,
    },
    /// A transaction the ledger took, and the block holding it.
    Tx {
        /// Its id.
        id: String,
        #[command(flatten)]
        format: Format,
    },
    /// Compute the proof-of-compute task the newest block seeds for this node and send its
    /// result (`SUBMIT_RESULT`): a valid result earns a share of the block's reward.
    Compute {
        /// Matrix dimension.
        #[arg(long, default_value_t = 1024)]
        size: u32,
        /// Wait until a block holds it, up to this many seconds (0: do not wait).
        #[arg(long, default_value_t = 30)]
        wait: u64,
        #[command(flatten)]
        format: Format,
    },
    /// Where a result is in the ledger: its block and the inclusion proof of its id in the
    /// block's compute_root (JSON, for `verify-proof`).
    Prove {
        /// The result's id.
        result: String,
        /// Write the proof here (default: print it).
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Check a proof from `prove` against the block this node holds at its height.
    VerifyProof {
        /// The proof file.
        file: PathBuf,
    },
    /// Measure what a sequencer commits durably per second (signature checks on every
    /// core, blocks proposed, applied and committed to a redb file one fsync each), and
    /// compute_root over many results against SHA-256 of the same bytes.
    Bench {
        /// Directory for the bench's block file (emptied first).
        #[arg(long, default_value = ".ledger-bench")]
        dir: PathBuf,
        /// Signed transfers to commit.
        #[arg(long, default_value_t = 50_000)]
        txs: usize,
        /// Accounts sending them.
        #[arg(long, default_value_t = 1_000)]
        accounts: usize,
        /// Most transactions per block (blocks are also capped at 1 MiB: about 2,900
        /// transfers).
        #[arg(long, default_value_t = 5_000)]
        block_txs: u32,
        /// Compute results for the compute_root figure.
        #[arg(long, default_value_t = 100_000)]
        results: usize,
        #[command(flatten)]
        format: Format,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum SupervisorCommand {
    /// Run the supervisor (as root): the executor, the sandboxes, the ceilings and the
    /// journal, served to the node user on a local socket.
    Run(SupervisorRunArgs),
    /// The supervisor's state: the owner's switch and limits, layers, capacity held.
    Status {
        #[command(flatten)]
        socket: SupervisorSocket,
        #[command(flatten)]
        format: Format,
    },
    /// Set the owner's limits from a file (the `[executor]` keys: cpu, memory, swap,
    /// processes, storage, gpus, adapters, custom_code); each must stay within the
    /// administrator's ceilings, or nothing changes.
    Limits {
        /// The limits file (TOML).
        file: PathBuf,
        #[command(flatten)]
        socket: SupervisorSocket,
        #[command(flatten)]
        format: Format,
    },
    /// Measure what the socket adds: admissions and output reads through a supervisor
    /// against the same executor called in-process, in the same run (root).
    Bench {
        /// Admissions (and output reads) per path.
        #[arg(long, default_value_t = 30)]
        runs: u32,
        #[command(flatten)]
        format: Format,
    },
    /// Release a quarantined attempt or a leftover after the idle and storage checks
    /// (the administrator's: root only).
    Clear {
        /// The attempt (or leftover) id.
        id: String,
        #[command(flatten)]
        socket: SupervisorSocket,
    },
}

#[derive(Debug, Args)]
pub(crate) struct SupervisorSocket {
    /// The supervisor's socket.
    #[arg(long, value_name = "PATH", default_value = cannabis_node::supervisor::DEFAULT_SOCKET)]
    pub(crate) socket: PathBuf,
}

#[derive(Debug, Args)]
pub(crate) struct SupervisorRunArgs {
    /// The user the node runs as (a name or a uid): the one unprivileged caller allowed.
    #[arg(long, value_name = "USER")]
    pub(crate) node_user: String,
    #[command(flatten)]
    pub(crate) socket: SupervisorSocket,
    /// The supervisor's directory: its journal, attempts and spool.
    #[arg(long, value_name = "DIR", default_value = cannabis_node::supervisor::DEFAULT_DIR)]
    pub(crate) dir: PathBuf,
    /// The administrator's ceilings file (read only, never written).
    #[arg(long, value_name = "FILE", default_value = cannabis_runtime::exec::DEFAULT_CEILINGS)]
    pub(crate) ceilings: PathBuf,
    /// The owner's limits at start (TOML, the `[executor]` keys); within the ceilings.
    #[arg(long, value_name = "FILE")]
    pub(crate) limits: Option<PathBuf>,
    /// The administrator-pinned NVIDIA CDI map: granted GPUs' device nodes come from it.
    #[arg(long, value_name = "FILE")]
    pub(crate) cdi_map: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum ExecCommand {
    /// Run one task of a job file here, in the sandbox, and show what happened: for
    /// contributors to test their setup and for requesters to try a job before publishing.
    Run(ExecRunArgs),
    /// Measure the sandbox's start-up against a plain spawn and bubblewrap, and the
    /// synthetic task against a plain f32 matrix product.
    Bench {
        /// Spawns per variant.
        #[arg(long, default_value_t = 200)]
        runs: u32,
        /// Matrix dimension of the synthetic comparison.
        #[arg(long, default_value_t = 1024)]
        size: u32,
        #[command(flatten)]
        format: Format,
    },
    /// Measure the synthetic task: generating its matrices, each product kernel this CPU
    /// runs against a plain f32 product, hashing, checking a delivered product with
    /// Freivalds' method, and the capability challenge's proof against its check.
    BenchSynthetic {
        /// Matrix dimensions, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [1024u32, 2048])]
        sizes: Vec<u32>,
        /// Timed runs per figure (the median is shown).
        #[arg(long, default_value_t = 5)]
        runs: u32,
        #[command(flatten)]
        format: Format,
    },
    /// The synthetic task itself (what the sandbox runs): writes its result as JSON.
    #[command(hide = true)]
    Synthetic {
        /// Seed, 64 hex digits.
        #[arg(long)]
        seed: String,
        /// Matrix dimension.
        #[arg(long)]
        size: u32,
        /// Where to write the result.
        #[arg(long)]
        out: PathBuf,
        /// Where to write the product (`4 n^2` bytes: little-endian i32, row-major).
        #[arg(long)]
        product: Option<PathBuf>,
    },
    /// A rank's command under its restart budget (what the sandbox runs for a task that
    /// allows restarts): every rank restarts when one fails, in rounds, until the budget
    /// is spent. Reads RANK, WORLD_SIZE and MASTER_ADDR (a group of one without them).
    #[command(hide = true)]
    Rank {
        /// Restarts allowed after the first round.
        #[arg(long)]
        restarts: u32,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

#[derive(Debug, Args)]
pub(crate) struct ExecRunArgs {
    /// The job file (the same file `cannabis job submit` takes).
    pub(crate) file: PathBuf,
    /// Which task to run (by name); needed when the file has several.
    #[arg(long)]
    pub(crate) task: Option<String>,
    /// Seed of a synthetic task, 64 hex digits; random by default.
    #[arg(long)]
    pub(crate) seed: Option<String>,
    /// A local file for an input pinned by digest only (repeatable).
    #[arg(long = "input", value_name = "NAME=PATH")]
    pub(crate) inputs: Vec<String>,
    /// Where to copy the outputs, stdout and stderr.
    #[arg(long, value_name = "DIR", default_value = "cannabis-out")]
    pub(crate) out: PathBuf,
    /// Run on the running node's executor (its ceilings, limits and journal) instead of a
    /// private one.
    #[arg(long)]
    pub(crate) on_node: bool,
    /// Request id (the same id never runs twice); a fresh one by default.
    #[arg(long)]
    pub(crate) request_id: Option<String>,
    /// Configuration file whose [executor] section limits the run.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// The administrator's ceilings file.
    #[arg(long, value_name = "FILE")]
    pub(crate) ceilings: Option<PathBuf>,
    /// Return as soon as the attempt is admitted (with --on-node).
    #[arg(long)]
    pub(crate) detach: bool,
    #[command(flatten)]
    pub(crate) format: Format,
}

#[derive(Debug, Subcommand)]
pub(crate) enum NodeCommand {
    /// Join the network: run the swarm, the market view and the local API until Ctrl-C.
    Run(RunArgs),
    /// The running node's identity, addresses, peers and market counts.
    Status {
        #[command(flatten)]
        format: Format,
    },
    /// Where the running node's web dashboard is, and the token file to log in with.
    Dashboard {
        #[command(flatten)]
        format: Format,
    },
    /// The running node's connected peers, with their gossip scores.
    Peers {
        #[command(flatten)]
        format: Format,
    },
    /// Set a peer the capability challenge, sized to the cores its ad claims, and check it.
    Challenge(ChallengeArgs),
    /// The local executor's attempts with their states (one attempt in full with its id).
    Jobs {
        /// An attempt id.
        id: Option<String>,
        #[command(flatten)]
        format: Format,
    },
    /// Take no new work until `resume`; running work goes on.
    Pause,
    /// Let current work finish and take nothing new.
    Drain,
    /// Record a stop for all current work, then kill it; take nothing new until `resume`.
    Stop,
    /// Take work again after pause, drain or stop.
    Resume,
    /// Set the owner's limits for work from a file (the `[executor]` keys: cpu, memory,
    /// swap, processes, storage, gpus, adapters, custom_code); each must stay within the
    /// administrator's ceilings, or nothing changes. Kept across restarts.
    Limits {
        /// The limits file (TOML).
        file: PathBuf,
    },
    /// Stop one attempt (recorded first; a finished attempt keeps its outcome).
    Cancel {
        /// The attempt id.
        id: String,
    },
    /// Retry a failed, cancelled or unknown attempt: an explicit decision, never automatic.
    Retry {
        /// The attempt id.
        id: String,
    },
    /// Release a quarantined attempt or a leftover after checking that its processes are
    /// gone and its storage is removed (administrator).
    Clear {
        /// The attempt id or leftover name.
        id: String,
    },
    /// Read an attempt's stdout, stderr or a declared output, in bounded chunks.
    Output {
        /// The attempt id.
        id: String,
        /// `stdout`, `stderr` or a declared output name.
        name: String,
        /// Start at this byte.
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// Write to this file instead of stdout (resumes at its current length).
        #[arg(long, value_name = "FILE")]
        to: Option<PathBuf>,
    },
    /// Measure request-response round trips from the running node to a peer.
    Ping {
        /// The peer's id (see `cannabis node peers`).
        peer: String,
        /// Round trips to make.
        #[arg(long, default_value_t = 10)]
        count: u32,
        #[command(flatten)]
        format: Format,
    },
}

#[derive(Debug, Args)]
pub(crate) struct ChallengeArgs {
    /// The peer's id (see `cannabis node peers`).
    pub(crate) peer: String,
    #[command(flatten)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// Configuration file (TOML); flags override it. Without one, defaults apply.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Listen address (repeatable), e.g. /ip4/0.0.0.0/tcp/4001 or /ip4/0.0.0.0/udp/4001/quic-v1.
    #[arg(long, value_name = "MULTIADDR")]
    pub(crate) listen: Vec<Multiaddr>,
    /// Peer to bootstrap from (repeatable), e.g. /ip4/203.0.113.5/tcp/4001/p2p/12D3Koo...
    #[arg(long, value_name = "MULTIADDR")]
    pub(crate) bootstrap: Vec<Multiaddr>,
    /// Do not discover peers on the local network with mDNS.
    #[arg(long)]
    pub(crate) no_mdns: bool,
    /// Act as a circuit relay for peers behind NAT.
    #[arg(long)]
    pub(crate) relay: bool,
    /// Local API address (loopback only).
    #[arg(long, value_name = "ADDR")]
    pub(crate) api: Option<SocketAddr>,
    /// Settings for a local testnet: many nodes share 127.0.0.1 without lowering each
    /// other's scores.
    #[arg(long)]
    pub(crate) testnet: bool,
    /// The administrator's ceilings file (read only, never written).
    #[arg(long, value_name = "FILE", default_value = cannabis_runtime::exec::DEFAULT_CEILINGS)]
    pub(crate) ceilings: PathBuf,
    /// Run work through the root supervisor listening on this socket (see `cannabis
    /// supervisor run`) instead of an executor in this process.
    #[arg(long, value_name = "SOCKET")]
    pub(crate) supervisor: Option<PathBuf>,
    /// The network's genesis file (JSON): the node keeps the ledger it starts.
    #[arg(long, value_name = "FILE")]
    pub(crate) genesis: Option<PathBuf>,
    /// Sequence the ledger (make its blocks): only the node the genesis names.
    #[arg(long)]
    pub(crate) ledger: bool,
}

fn duration_ms(text: &str) -> Result<u64, String> {
    cannabis_protocol::units::parse_duration_ms(text).map_err(|e| e.to_string())
}

#[derive(Debug, Subcommand)]
pub(crate) enum MarketCommand {
    /// Live capability ads.
    Ads {
        /// Only nodes that passed a capability challenge this recently (from any verifier
        /// but themselves, this node's own checks included), e.g. `1h`.
        #[arg(long, value_name = "DURATION", value_parser = duration_ms)]
        challenged_within: Option<u64>,
        #[command(flatten)]
        format: Format,
    },
    /// Open job offers.
    Offers {
        #[command(flatten)]
        format: Format,
    },
    /// Bids received for this node's offers.
    Bids {
        #[command(flatten)]
        format: Format,
    },
    /// Leases this node holds (or held lately) as a worker, with their epochs.
    Leases {
        #[command(flatten)]
        format: Format,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum TestnetCommand {
    /// Draw the figures of docs/benchmarks.md: offer propagation (p50, p99) and the
    /// request-response round trip against network size, each size a fresh testnet of
    /// real processes (`testnet bench`); and the offers per second the simulated market
    /// sustains against its number of nodes (`testnet sim --find-capacity`). Writes SVG
    /// charts and their data (JSON). Use a release build: minutes of work.
    Plot {
        /// Where to write propagation.svg, sim-capacity.svg and plots.json.
        #[arg(long, default_value = "docs/plots")]
        out: PathBuf,
        /// Testnet sizes to measure propagation at (comma-separated; `--sizes` alone:
        /// none).
        #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "10,50,100")]
        sizes: Vec<usize>,
        /// Offers each testnet publishes.
        #[arg(long, default_value_t = 20)]
        offers: usize,
        /// Simulated network sizes to find the capacity of (comma-separated; `--sim-nodes`
        /// alone: none).
        #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "25,50,100")]
        sim_nodes: Vec<usize>,
        /// Seconds of virtual time each capacity step publishes for (at least 4).
        #[arg(long, default_value_t = 4)]
        duration: u64,
        /// Directory for the testnets' data (emptied first).
        #[arg(long, default_value = ".testnet-plot")]
        dir: PathBuf,
    },
    /// Jobs through the real system, step by step: a testnet of real nodes (a ledger
    /// sequencer, workers of different cores and prices, a requester) in a fresh
    /// directory; a faucet grant; a synthetic job from bids to settlement; a
    /// proof-of-compute result proved in its block; the training example evaluated and
    /// paid; a 3-rank group over its private channel; a worker killed mid-run and its job
    /// placed again, resuming from its checkpoint. Exits 0 only if every step happened; stops every node and removes
    /// its files (as root: programs run in the sandbox).
    Demo {
        /// Number of nodes (at least 5).
        #[arg(long, default_value_t = 5)]
        nodes: usize,
        /// Keep the testnet's data and the jobs' files here instead of removing them
        /// (must not exist yet).
        #[arg(long)]
        keep: Option<PathBuf>,
    },
    /// Start N nodes on loopback, print where their APIs are, and stop them all on Ctrl-C.
    Up {
        /// Number of nodes.
        #[arg(long, default_value_t = 5)]
        nodes: usize,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Stop the testnet running from a directory.
    Down {
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Every node of a testnet: running, paused or stopped, its pid, peers and ledger
    /// height.
    Status {
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
        #[command(flatten)]
        format: Format,
    },
    /// Kill a node at once (SIGKILL), as a crash would: its peers see its connections
    /// drop, its leases lapse. `restart` brings it back.
    Kill {
        /// The node's index.
        node: usize,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Start a node again as it was started (stopping it first if it runs), with its data
    /// directory as it was left: it recovers from its store and catches up.
    Restart {
        /// The node's index.
        node: usize,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Freeze a node (SIGSTOP), as a hung process or a machine put to sleep: its sockets
    /// stay open and silent. `resume` lets it go on.
    Pause {
        /// The node's index.
        node: usize,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Run a scenario file: steps (submit a job, kill, restart, pause, resume, partition,
    /// heal, sleep) and assertions (a job's state, a node's peers, the ledgers agreeing)
    /// against a testnet, printing pass or fail for each; exits non-zero at the first
    /// failure. Without --dir, on a fresh testnet of the scenario's size, stopped and
    /// removed afterwards. Format: docs/testnet-guide.md; shipped: testnet/scenarios/.
    Scenario {
        /// The scenario file.
        file: PathBuf,
        /// A running testnet to run it on (default: a fresh one).
        #[arg(long)]
        dir: Option<PathBuf>,
        #[command(flatten)]
        format: Format,
    },
    /// Split the network: each group (comma-separated node indices, every node in one)
    /// is cut off from the others until `heal`. Enforced by connection gating in the
    /// nodes: each refuses and drops connections to the other sides' peers.
    Partition {
        /// The groups, e.g. `0,1 2,3`.
        #[arg(required = true, num_args = 2.., value_name = "NODES")]
        groups: Vec<String>,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Make a node deliver wrong outputs (the first byte of each flipped before it is
    /// hashed), as a worker that fabricates results would; `--off` makes it honest again.
    /// Enforced in the node, on a testnet only.
    Corrupt {
        /// The node's index.
        node: usize,
        /// Deliver right outputs again.
        #[arg(long)]
        off: bool,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Make a node's links slow and lossy: every byte it receives on TCP is held
    /// `--delay`, and a share `--loss` of them a retransmission timeout (200 ms) more, as
    /// TCP turns loss into lateness. `--delay 0 --loss 0` makes them plain again.
    /// Enforced in the node, on a testnet only.
    Slow {
        /// The node's index.
        node: usize,
        /// Added delay, milliseconds (at most 60000).
        #[arg(long, default_value_t = 0)]
        delay: u64,
        /// Share of the received data lost, from 0 to 1 (0.05 is 5%).
        #[arg(long, default_value_t = 0.0)]
        loss: f64,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// End a partition: every node may connect to every other again.
    Heal {
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Let a paused node go on (SIGCONT).
    Resume {
        /// The node's index.
        node: usize,
        /// Directory of the testnet's data.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
    },
    /// Attack a local testnet's nodes as one hostile party would, several attacks at once,
    /// for a while: an offer flood from one key, garbage and forged gossip, sync pages and
    /// greedy challenges without end, idle sockets. Loopback targets only.
    Attack {
        /// Nodes to attack (`/ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID`); default: every node of
        /// the testnet in --dir.
        #[arg(long = "target", value_name = "MULTIADDR")]
        targets: Vec<libp2p::Multiaddr>,
        /// Directory of the testnet to attack.
        #[arg(long, default_value = ".testnet")]
        dir: PathBuf,
        /// How long to attack, in seconds.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// Which attacks (comma-separated); default: all of them.
        #[arg(long, value_enum, value_delimiter = ',')]
        only: Vec<crate::cmd::AttackKind>,
        #[command(flatten)]
        format: Format,
    },
    /// Measure offer propagation, the request-response baseline and idle memory.
    Bench {
        /// Number of nodes.
        #[arg(long, default_value_t = 10)]
        nodes: usize,
        /// Offers to publish.
        #[arg(long, default_value_t = 20)]
        offers: usize,
        /// Request-response round trips for the baseline.
        #[arg(long, default_value_t = 200)]
        pings: u32,
        /// Directory of the testnet's data (emptied first).
        #[arg(long, default_value = ".testnet-bench")]
        dir: PathBuf,
        /// Then publish the offers again while `testnet attack` runs against every node,
        /// and compare propagation and memory with the calm run.
        #[arg(long)]
        hostile: bool,
        /// With --hostile: which attacks (comma-separated); default: all of them.
        #[arg(long, value_enum, value_delimiter = ',', requires = "hostile")]
        only: Vec<crate::cmd::AttackKind>,
        /// Size of the encrypted-transfer phase's output, MiB: one job's output delivered
        /// over loopback, against plain age encryption of the same bytes (0: skip it).
        #[arg(long, default_value_t = 256, value_name = "MIB")]
        transfer_mib: u64,
        /// Bytes the group-channel phase sends, MiB: through a two-rank group's channel,
        /// against the same client and server over a direct loopback connection (0: skip).
        #[arg(long, default_value_t = 64, value_name = "MIB")]
        channel_mib: u64,
        /// Then, with the testnet stopped, the sandbox's start-up against a plain spawn and
        /// bubblewrap (`exec bench`) and the ledger's durable transactions per second
        /// (`ledger bench`), each as that command measures it.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        format: Format,
    },
    /// Simulate the market in virtual time: simulated nodes and offers through the real
    /// state machines, over a network that delays, drops and duplicates, with crashing
    /// workers. Checks the invariants and reports throughput; also times placement of one
    /// offer against many ads.
    Sim {
        /// Simulated nodes.
        #[arg(long, default_value_t = 500)]
        nodes: usize,
        /// Offers published (with --rate: offers per second of virtual time instead).
        #[arg(long, default_value_t = 200)]
        offers: usize,
        /// Publish this many offers per second of virtual time, for --duration.
        #[arg(long)]
        rate: Option<f64>,
        /// How long to publish at --rate, in seconds of virtual time.
        #[arg(long, default_value_t = 10)]
        duration: u64,
        /// What is offered: `mixed` (task graphs, groups, GPUs, long runs, lost messages,
        /// crashes) or `capacity` (single tasks placed early, short runs).
        #[arg(long, value_enum, default_value_t = SimWorkload::Mixed)]
        workload: SimWorkload,
        /// Charge each node the CPU time the real node spends per message, from
        /// `--costs` or the calibration shipped with this binary.
        #[arg(long)]
        cpu: bool,
        /// Costs measured by `cannabis testnet calibrate` (JSON).
        #[arg(long, value_name = "FILE")]
        costs: Option<PathBuf>,
        /// Find the highest rate at which 95% of offers are placed before their deadline
        /// (capacity workload, CPU charged).
        #[arg(long)]
        find_capacity: bool,
        /// Topics offers travel on (default: 1 for the mixed workload; for capacity, one
        /// shard per 500 to 1,000 nodes).
        #[arg(long)]
        offer_shards: Option<u32>,
        /// Nodes that publish offers (default: one in 25 for the mixed workload; for
        /// capacity, one in 50, at most 200). Each holds every ad, so at 100,000 nodes
        /// memory asks for fewer.
        #[arg(long)]
        requesters: Option<usize>,
        /// Seed; the same seed gives the same run.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Ads for the placement figure (0: skip it).
        #[arg(long, default_value_t = 10_000)]
        placement_ads: usize,
        #[command(flatten)]
        format: Format,
    },
    /// Measure what the real node spends per message (the simulator's CPU model) and
    /// write it as JSON.
    Calibrate {
        /// Where to write the costs.
        #[arg(long, default_value = "calibration.json")]
        out: PathBuf,
        /// Directory for the short testnet the transport cost is measured on.
        #[arg(long, default_value = ".testnet-calibrate")]
        dir: PathBuf,
        #[command(flatten)]
        format: Format,
    },
}

/// What the simulator offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SimWorkload {
    /// Task graphs, groups, GPUs, long runs, with losses and crashes.
    Mixed,
    /// Single tasks placed early, short runs: the network's capacity.
    Capacity,
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeysCommand {
    /// Create the node's signing key and delivery (age) key in the data directory.
    New {
        /// Replace existing keys. The old files are kept beside the new ones, renamed with
        /// a `.replaced-<unix time>` suffix.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        format: Format,
    },
    /// Show the node's address, delivery recipient and key files.
    Show {
        #[command(flatten)]
        format: Format,
    },
    /// Print the node's `cpc1...` address alone.
    Address,
}

#[derive(Debug, Subcommand)]
pub(crate) enum JobCommand {
    /// Show what a total budget pays: the worker share and the 1% service fee.
    Quote {
        /// Total budget in integer base units, fee included (digits, `_` allowed).
        budget: Amount,
        /// Fee rate in basis points (100 = 1%, the founder fee).
        #[arg(long, default_value_t = cannabis_protocol::FOUNDER_FEE_BPS, value_name = "BPS")]
        fee_bps: u16,
        #[command(flatten)]
        format: Format,
    },
    /// Publish a job file (docs/requester-guide.md) from the running node: shows the
    /// budget, worker share and fee, and asks before publishing.
    Submit {
        /// The job file (TOML).
        file: PathBuf,
        /// Publish without asking (for scripts).
        #[arg(long)]
        yes: bool,
        /// Stop after the quote and the match against the ads this node knows.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        format: Format,
    },
    /// One job: each task's state and why, bids, leases with their epochs, history.
    Status {
        /// The job id.
        id: String,
        #[command(flatten)]
        format: Format,
    },
    /// The jobs this node published.
    List {
        #[command(flatten)]
        format: Format,
    },
    /// Cancel a job: every rank holding a lease is told; with a ledger, its escrow
    /// cancels the undelivered ranks and refunds what is left once the delivered settle.
    Cancel {
        /// The job id.
        id: String,
    },
    /// Accept what a job delivered: each delivered rank is paid from its escrow (its
    /// price, or `--part` of it), less the network's fee to its recipient; the rest of
    /// the lock comes back once every rank settled.
    Accept {
        /// The job id.
        id: String,
        /// The part of each price paid, in percent (up to 4 decimals): `100`, `62.5`.
        #[arg(long, value_name = "PERCENT", default_value = "100", value_parser = parse_percent)]
        part: u32,
        #[command(flatten)]
        format: Format,
    },
    /// Dispute what a job delivered, inside its review window: the money stays in
    /// escrow until the network's resolver settles it (docs/settlement.md).
    Dispute {
        /// The job id.
        id: String,
        /// Why, for the resolver (kept in the job's history).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        format: Format,
    },
    /// Evaluate what a job delivered again, by hand: the artifact checks, then the
    /// evaluator its job file names, in the sandbox on this node, on the delivered outputs
    /// and the held-out data. Its signed report accepts or disputes as an automatic one
    /// does. Waits for the report (up to the evaluator's time limit and a minute).
    Evaluate {
        /// The job id.
        id: String,
        #[command(flatten)]
        format: Format,
    },
    /// Write a job's delivered outputs into a folder, each checked against the digest its
    /// worker signed: `DIR/<output>` for one task of one rank, `DIR/rank-<r>/<output>` for
    /// a group, `DIR/<task name>/...` for several tasks. Fails naming any rank that has
    /// not delivered, unless `--wait`.
    Results {
        /// The job id.
        id: String,
        /// Only this task (its index).
        #[arg(long)]
        task: Option<u32>,
        /// The folder to write into (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Wait until every rank delivered and its outputs are here, with progress on
        /// standard error (bytes, rate, ETA; none with --json or off a terminal); fails
        /// if the job ends without them.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        format: Format,
    },
}

/// `62.5` (percent, up to 4 decimals) -> parts per million.
fn parse_percent(s: &str) -> Result<u32, String> {
    let s = s.trim().trim_end_matches('%');
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    if frac.len() > 4 || whole.is_empty() && frac.is_empty() {
        return Err(format!(
            "{s}: a percent with up to 4 decimals, such as 62.5"
        ));
    }
    let digits = |d: &str| d.chars().all(|c| c.is_ascii_digit());
    if !digits(whole) || !digits(frac) {
        return Err(format!(
            "{s}: a percent with up to 4 decimals, such as 62.5"
        ));
    }
    let whole: u32 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| format!("{s}: too large"))?
    };
    let frac: u32 = format!("{frac:0<4}").parse().unwrap_or(0);
    let ppm = whole
        .checked_mul(10_000)
        .and_then(|w| w.checked_add(frac))
        .filter(|p| *p <= 1_000_000)
        .ok_or_else(|| format!("{s}: a percent between 0 and 100"))?;
    Ok(ppm)
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Matrix size of the synthetic proof-of-compute task the demo worker runs.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub(crate) size: u32,
    #[command(flatten)]
    pub(crate) format: Format,
}

/// Output format flag shared by the commands that print data.
#[derive(Debug, Args, Clone, Copy)]
pub(crate) struct Format {
    /// Print JSON instead of a table, for scripts.
    #[arg(long)]
    pub(crate) json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
