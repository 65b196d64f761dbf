//! The data a node's local API serves (JSON over HTTP on loopback; see
//! `docs/operator-guide.md`).

use cannabis_protocol::{AdapterKind, Amount, IsolationLayer, PriceSheet, Runtime};
use serde::{Deserialize, Serialize};

pub use cannabis_market::OfferTemplate;
use cannabis_market::{AdEntry, OfferEntry};

/// `GET /v1/status`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The node's `cpc1...` address.
    pub address: String,
    /// Its libp2p peer id.
    pub peer_id: String,
    /// Addresses the swarm listens on.
    pub listen_addrs: Vec<String>,
    /// Connected peers.
    pub connected_peers: usize,
    /// Peers in the gossip mesh of each topic.
    pub mesh_peers: Vec<TopicPeers>,
    /// Live capability ads in the view.
    pub ads: usize,
    /// Open offers in the view.
    pub offers: usize,
    /// Seconds since the node started.
    pub uptime_secs: u64,
    /// The binary's version.
    pub version: String,
    /// Why the node is in read-only safe mode (its store refused a write), if it is: it
    /// takes no gossip, market request or job until writes go through again.
    #[serde(default)]
    pub safe_mode: Option<String>,
    /// Whether the node is still finding out what it offers (its executor opening, its
    /// runtimes probed) or about to publish a new ad: what others see of it may change.
    #[serde(default)]
    pub probing: bool,
    /// Graylisted peers the node refuses at the handshake until their score recovers.
    #[serde(default)]
    pub refused_peers: usize,
    /// Where the node's work runs (its own process, or a supervisor's socket), or why it
    /// has none; `opening` at start.
    #[serde(default)]
    pub executor: String,
}

/// Mesh size of one topic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicPeers {
    /// Topic name.
    pub topic: String,
    /// Peers in the mesh.
    pub peers: usize,
}

/// One connected peer, `GET /v1/peers`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Peer {
    /// Its peer id.
    pub peer_id: String,
    /// Its `cpc1...` address, when its key is an ed25519 key.
    pub address: Option<String>,
    /// Remote addresses of its connections.
    pub addrs: Vec<String>,
    /// Its gossipsub peer score (negative after invalid messages).
    pub score: f64,
    /// Last ping round trip in microseconds, if measured.
    pub ping_us: Option<u64>,
}

/// One capability ad, `GET /v1/market/ads`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ad {
    /// The advertising node.
    pub node: String,
    /// Message id.
    pub id: String,
    /// Sequence number.
    pub seq: u64,
    /// Logical CPU cores.
    pub cpu_cores: u32,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Number of GPUs (allowed ones).
    pub gpus: usize,
    /// Adapters offered.
    pub adapters: Vec<AdapterKind>,
    /// Runtimes with versions.
    pub runtimes: Vec<Runtime>,
    /// Isolation layers the node's sandbox enforces (privilege separation included).
    #[serde(default)]
    pub isolation: Vec<IsolationLayer>,
    /// The owner's prices.
    pub prices: PriceSheet,
    /// Expiry, ms since the epoch.
    pub expires_at_ms: u64,
    /// When this node received it, µs since the epoch.
    pub received_at_us: u64,
    /// When this node last saw the node pass a capability challenge, ms since the epoch.
    pub challenge_passed_at_ms: Option<u64>,
    /// Signed challenge passes the ad carries.
    pub challenge_passes: Vec<PassSummary>,
    /// The newest pass that covers the ad's claim, from any verifier but the node itself
    /// (this node's own checks included), ms since the epoch.
    pub newest_pass_at_ms: Option<u64>,
    /// The confidential-execution evidence the ad carries, as shown to people (a `dev`
    /// attestation always says it is insecure).
    #[serde(default)]
    pub attestation: Option<String>,
    /// Whether that evidence verifies on this node, so that confidential jobs may go there;
    /// if not, why.
    #[serde(default)]
    pub attestation_verdict: Option<Result<(), String>>,
}

/// One signed challenge pass in an ad.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassSummary {
    /// Who set and checked it.
    pub verifier: String,
    /// Cores it was sized for.
    pub claimed_cores: u32,
    /// Matrix dimension.
    pub n: u32,
    /// When it passed, ms since the epoch.
    pub passed_at_ms: u64,
}

impl From<&AdEntry> for Ad {
    fn from(e: &AdEntry) -> Self {
        let ad = e.ad();
        Self {
            node: ad.node.to_string(),
            id: e.id().to_string(),
            seq: ad.seq,
            cpu_cores: ad.hardware.cpu_cores,
            memory_bytes: ad.hardware.memory_bytes,
            gpus: ad.hardware.gpus.iter().filter(|g| g.allowed).count(),
            adapters: ad.adapters.clone(),
            runtimes: ad.runtimes.clone(),
            isolation: ad.isolation.clone(),
            prices: ad.prices.clone(),
            expires_at_ms: ad.expires_at.0,
            received_at_us: e.received_at_us(),
            challenge_passed_at_ms: None,
            challenge_passes: ad
                .passes()
                .map(|p| PassSummary {
                    verifier: p.verifier.to_string(),
                    claimed_cores: p.claimed_cores,
                    n: p.n,
                    passed_at_ms: p.passed_at.0,
                })
                .collect(),
            newest_pass_at_ms: None,
            attestation: ad
                .attestation
                .as_ref()
                .map(|a| cannabis_market::attest::describe(a).to_string()),
            attestation_verdict: None,
        }
    }
}

/// One open offer, `GET /v1/market/offers`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// Job id.
    pub job_id: String,
    /// Message id.
    pub id: String,
    /// The requester.
    pub requester: String,
    /// Total budget, fee included.
    pub budget: Amount,
    /// Number of tasks.
    pub tasks: usize,
    /// Largest group size of any task.
    pub max_group_size: u32,
    /// Bids taken until, ms since the epoch.
    pub expires_at_ms: u64,
    /// Results due, ms since the epoch.
    pub deadline_ms: u64,
    /// When this node received it, µs since the epoch.
    pub received_at_us: u64,
}

impl From<&OfferEntry> for Offer {
    fn from(e: &OfferEntry) -> Self {
        let offer = e.offer();
        Self {
            job_id: offer.job_id.to_string(),
            id: e.id().to_string(),
            requester: offer.requester.to_string(),
            budget: offer.budget,
            tasks: offer.tasks.len(),
            max_group_size: offer.tasks.iter().map(|t| t.group_size).max().unwrap_or(0),
            expires_at_ms: offer.expires_at.0,
            deadline_ms: offer.deadline.0,
            received_at_us: e.received_at_us(),
        }
    }
}

/// `POST /v1/offers` answer: what was published.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Published {
    /// Job id.
    pub job_id: String,
    /// Message id.
    pub id: String,
    /// When the node published it, µs since the epoch.
    pub published_at_us: u64,
}

/// `POST /v1/peers/{peer}/ping` answer: request-response round trips.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PingReport {
    /// The peer.
    pub peer_id: String,
    /// Each round trip in microseconds, in order.
    pub rtt_us: Vec<u64>,
}

/// A bid this node received for one of its offers, `GET /v1/market/bids`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceivedBid {
    /// Job id.
    pub job_id: String,
    /// Task index.
    pub task: u32,
    /// The bidding worker.
    pub worker: String,
    /// Quoted price.
    pub price: Amount,
    /// Message id.
    pub id: String,
}

/// `GET /v1/jobs`: one job this node published.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSummary {
    /// Job id.
    pub job_id: String,
    /// A name for people.
    pub name: String,
    /// Overall state.
    pub state: cannabis_market::job::JobState,
    /// What each task is doing, in task order (e.g. `running`, `bidding`).
    pub tasks: Vec<String>,
    /// Total budget, fee included.
    pub budget: Amount,
    /// Committed to live leases plus spent on deliveries (`None`: the sums do not add up,
    /// a defect the node reports instead of hiding).
    pub used: Option<Amount>,
    /// Bids received, all tasks.
    pub bids: usize,
    /// Bids taken until, ms since the epoch.
    pub bids_until_ms: u64,
    /// Results due, ms since the epoch.
    pub deadline_ms: u64,
}

/// `GET /v1/jobs/{id}`: a job with every task, lease and event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobDetail {
    /// The summary.
    pub summary: JobSummary,
    /// Per task.
    pub tasks: Vec<TaskDetail>,
    /// What happened, oldest first.
    pub history: Vec<cannabis_market::job::Event>,
    /// Budget not spent (what goes back once the job is over; `None`: the sums do not add
    /// up).
    pub refund: Option<Amount>,
    /// Where the budget stands with settlement (`unsettled` on a node with no ledger).
    #[serde(default)]
    pub escrowed: cannabis_market::job::Escrowed,
    /// The job's escrow as this node's ledger holds it: the lock, each assignment's stage
    /// (a delivery's review window ends `review_window_ms` after its `at`), what was paid
    /// and refunded.
    #[serde(default)]
    pub escrow: Option<cannabis_market::ledger::Escrow>,
    /// The evaluation terms the offer pinned, if any.
    #[serde(default)]
    pub evaluation_terms: Option<cannabis_protocol::EvaluationTerms>,
    /// The requester's evaluation of the deliveries, when the offer has terms.
    #[serde(default)]
    pub evaluation: Option<EvaluationView>,
    /// Spot checks: the rate, the job this one re-runs a task of (for a check job), and
    /// each checked task's runs and verdict.
    #[serde(default)]
    pub spot: cannabis_market::spot::SpotChecks,
}

/// Where a job's evaluation stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvaluationView {
    /// The run asked last (each one by hand is a new run).
    pub run: u32,
    /// Whether that run is still going.
    pub running: bool,
    /// Its signed report, once made: the message id...
    pub report_id: Option<String>,
    /// ...the whole signed report (its envelope, in hex: the evidence a resolver checks
    /// with the requester's key)...
    pub signed: Option<String>,
    /// ...and what it says.
    pub report: Option<cannabis_protocol::Evaluation>,
}

impl EvaluationView {
    /// The view of a job's evaluation.
    pub fn of(e: &cannabis_market::job::Evaluating) -> Self {
        use cannabis_market::job::Evaluating;
        match e {
            Evaluating::Running { run, .. } => Self {
                run: *run,
                running: true,
                report_id: None,
                signed: None,
                report: None,
            },
            Evaluating::Done { run, report } => {
                let opened = report.verify().ok();
                Self {
                    run: *run,
                    running: false,
                    report_id: opened.as_ref().map(|o| o.id.to_string()),
                    signed: Some(hex::encode(report.to_bytes())),
                    report: opened.map(|o| o.body),
                }
            }
        }
    }
}

/// One task of a [`JobDetail`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskDetail {
    /// Name.
    pub name: String,
    /// Status and, when it ended, why.
    pub status: cannabis_market::job::TaskStatus,
    /// Workers the task needs at once.
    pub group_size: u32,
    /// Whether it requires confidential execution (workers whose evidence verifies).
    #[serde(default)]
    pub confidential: bool,
    /// Its budget.
    pub budget: Amount,
    /// Committed to live leases.
    pub committed: Amount,
    /// Spent on deliveries.
    pub spent: Amount,
    /// Bids held, cheapest first: worker and price.
    pub bids: Vec<(String, Amount)>,
    /// Workers that declined, with their reasons.
    pub declines: Vec<(String, String)>,
    /// The current attempt, one per rank.
    pub ranks: Vec<cannabis_market::job::Assignment>,
    /// Placements made.
    pub attempts: u32,
    /// Runs that failed after their leases became current.
    pub failures: u32,
    /// When nobody has bid (or nobody could be placed): how the known ads match.
    pub explanation: Option<cannabis_market::matching::Explanation>,
    /// Outputs of ranks that delivered, as their signed manifests name them, and where
    /// this node keeps them.
    #[serde(default)]
    pub delivered: Vec<DeliveredOutput>,
    /// Outputs on their way here, per rank.
    #[serde(default)]
    pub transfers: Vec<Transfer>,
    /// The latest checkpoint kept of each rank, by rank (a task that declares one): what
    /// a rank placed again resumes from.
    #[serde(default)]
    pub checkpoints: std::collections::BTreeMap<u32, cannabis_market::job::KeptCheckpoint>,
}

/// One output a rank delivered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveredOutput {
    /// The rank.
    pub rank: u32,
    /// The epoch it ran at.
    pub epoch: u64,
    /// The output's name.
    pub name: String,
    /// SHA-256 of its bytes, hex.
    pub digest: String,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Where the node keeps it once fetched and checked.
    pub path: String,
    /// Whether it was fetched and checked.
    pub fetched: bool,
    /// The workload's exit code, from the manifest.
    pub exit_code: Option<i32>,
    /// The worker's wall time for the run, ms.
    pub wall_ms: u64,
    /// CPU time of the run's processes together, ms, as the worker's cgroups counted it
    /// (0 where its kernel does not count it).
    #[serde(default)]
    pub cpu_ms: u64,
    /// The run's peak memory in bytes, as the worker's cgroups counted it (0 where its
    /// kernel does not count it).
    #[serde(default)]
    pub peak_memory_bytes: u64,
}

/// A rank's outputs on their way here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// The rank.
    pub rank: u32,
    /// Bytes (of ciphertext) here.
    pub bytes: u64,
    /// Bytes in all.
    pub total: u64,
    /// Bytes per second so far.
    pub rate_bps: u64,
    /// Seconds left at that rate (`None` before any byte came).
    pub eta_secs: Option<u64>,
}

/// `POST /v1/jobs/explain`: how each task of a template matches the ads this node knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskExplanation {
    /// Task name.
    pub task: String,
    /// The explanation.
    pub explanation: cannabis_market::matching::Explanation,
}

/// `GET /v1/leases`: a lease this node holds (or held lately) as a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldLease {
    /// Job id.
    pub job_id: String,
    /// Task index.
    pub task: u32,
    /// Rank.
    pub rank: u32,
    /// The lease.
    pub lease: cannabis_market::lease::Lease,
}

/// An error body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// What went wrong and what to do.
    pub error: String,
}

/// `POST /v1/peers/{peer}/challenge` answer: a capability challenge this node set a peer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChallengeReport {
    /// The peer challenged.
    pub peer_id: String,
    /// Its address.
    pub address: String,
    /// Cores its ad claims.
    pub claimed_cores: u32,
    /// Matrix dimension.
    pub n: u32,
    /// Products summed.
    pub rounds: u32,
    /// Time from request to answer, ms.
    pub took_ms: u64,
    /// Deadline for the claim, ms.
    pub deadline_ms: u64,
    /// Time this node spent verifying, ms.
    pub verify_ms: u64,
    /// Whether the answer was right and on time.
    pub passed: bool,
    /// Why it failed, if it did.
    pub failure: Option<String>,
}

impl JobSummary {
    /// The summary of a job.
    pub fn of(job: &cannabis_market::job::Job) -> Self {
        Self {
            job_id: job.id().to_string(),
            name: job.name().to_string(),
            state: job.state(),
            tasks: job
                .tasks()
                .iter()
                .map(|t| t.status().word().to_string())
                .collect(),
            budget: job.offer().budget,
            used: job.used().ok(),
            bids: job.tasks().iter().map(|t| t.bid_count()).sum(),
            bids_until_ms: job.offer().expires_at.0,
            deadline_ms: job.offer().deadline.0,
        }
    }
}

impl JobDetail {
    /// A job in full; `explain(task)` says how the known ads match a task, when nobody bid
    /// on it or it could not be placed.
    pub fn of(
        job: &cannabis_market::job::Job,
        explain: impl Fn(&cannabis_protocol::TaskSpec) -> cannabis_market::matching::Explanation,
    ) -> Self {
        use cannabis_market::job::{Failure, TaskStatus};
        let tasks = job
            .tasks()
            .iter()
            .zip(&job.offer().tasks)
            .map(|(task, spec)| {
                let mut bids: Vec<(String, Amount)> = task
                    .bids()
                    .map(|c| (c.bid.worker.to_string(), c.bid.price))
                    .collect();
                bids.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
                let unplaced = matches!(
                    task.status(),
                    TaskStatus::Failed(Failure::Unplaceable { .. })
                );
                TaskDetail {
                    name: spec.name.clone(),
                    status: task.status().clone(),
                    group_size: spec.group_size,
                    confidential: spec.requirements.confidential,
                    budget: task.budget(),
                    committed: task.committed(),
                    spent: task.spent(),
                    bids,
                    declines: task
                        .declines()
                        .iter()
                        .map(|(w, r)| (w.to_string(), r.clone()))
                        .collect(),
                    ranks: task.ranks().to_vec(),
                    attempts: task.attempts(),
                    failures: task.failures(),
                    explanation: (task.bid_count() == 0 || unplaced).then(|| explain(spec)),
                    delivered: Vec::new(),
                    transfers: Vec::new(),
                    checkpoints: task.checkpoints().clone(),
                }
            })
            .collect();
        Self {
            summary: JobSummary::of(job),
            tasks,
            history: job.history().to_vec(),
            refund: job.refund().ok(),
            escrowed: job.escrow().clone(),
            escrow: None,
            evaluation_terms: job.offer().evaluation.clone(),
            evaluation: job.evaluation().map(EvaluationView::of),
            spot: job.spot().clone(),
        }
    }
}

impl HeldLease {
    /// One lease a worker holds.
    pub fn of(
        key: &cannabis_market::lease::AssignmentKey,
        lease: &cannabis_market::lease::Lease,
    ) -> Self {
        Self {
            job_id: key.0.to_string(),
            task: key.1,
            rank: key.2,
            lease: lease.clone(),
        }
    }
}

/// `GET /v1/ledger`: the embedded ledger as this node holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerStatus {
    /// The network's name, from its genesis.
    pub network: String,
    /// The genesis id (the parent of block 1).
    pub genesis: String,
    /// The last block this node applied (0: none yet).
    pub height: u64,
    /// Its hash.
    pub tip: String,
    /// Its time, ms since the epoch.
    pub time_ms: u64,
    /// The sequencer's address.
    pub sequencer: String,
    /// Whether this node is the sequencer.
    pub sequencing: bool,
    /// Transactions waiting for a block (on the sequencer).
    pub waiting: usize,
    /// The token's supply.
    pub supply: Amount,
    /// The network's fee terms: rate in basis points, and recipient.
    pub fee_rate_bps: u16,
    /// Who receives the fee.
    pub fee_recipient: String,
    /// Who resolves disputes.
    pub resolver: String,
    /// The testnet faucet's account, if the network has one.
    pub faucet: Option<String>,
    /// What is left of the proof-of-compute reward pool.
    pub reward_pool: Amount,
    /// The least gas price a transaction may offer (base units per gas).
    #[serde(default)]
    pub min_gas_price: u64,
}

/// `GET /v1/wallet/{address}`: an account as of the node's last block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Balance {
    /// The account.
    pub address: String,
    /// Its balance, vested or not.
    pub balance: Amount,
    /// What it can spend now.
    pub spendable: Amount,
    /// What is still vesting.
    pub vesting: Amount,
    /// The nonce its next transaction carries.
    pub nonce: u64,
    /// The height this is as of.
    pub height: u64,
    /// As a worker: valid proof-of-compute results the ledger took.
    #[serde(default)]
    pub results: u64,
    /// As a worker: assignments paid in full.
    #[serde(default)]
    pub paid: u64,
    /// As a worker: disputes settled against it.
    #[serde(default)]
    pub strikes: u64,
}

/// A block, in short.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSummary {
    /// Its height.
    pub height: u64,
    /// Its hash.
    pub hash: String,
    /// Its parent's hash.
    pub prev_hash: String,
    /// Its time, ms since the epoch.
    pub time_ms: u64,
    /// How many transactions it holds.
    pub txs: u32,
    /// How many proof-of-compute results.
    pub compute_count: u32,
    /// The Merkle root over their ids.
    pub compute_root: String,
}

/// `GET /v1/ledger/blocks/{height}`: a block with its transactions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockDetail {
    /// The block.
    pub block: BlockSummary,
    /// Its transactions, in order.
    pub transactions: Vec<TxSummary>,
}

/// A transaction, in short.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxSummary {
    /// Its id.
    pub id: String,
    /// Its type (`TRANSFER`, `ESCROW_LOCK`, ...).
    pub kind: String,
    /// The sender.
    pub from: String,
    /// The receiver, for transfers.
    pub to: Option<String>,
    /// The amount moved or locked.
    pub amount: Amount,
    /// The network fee.
    pub fee: Amount,
    /// The sender's nonce.
    pub nonce: u64,
}

/// `POST /v1/wallet/send`: a transfer from this node's account.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendRequest {
    /// The receiver's `cpc1...` address.
    pub to: String,
    /// The amount, in base units.
    pub amount: Amount,
}

/// `POST /v1/jobs/{id}/accept` and `/dispute`: the requester's verdict on what a job
/// delivered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "verdict")]
pub enum Verdict {
    /// Accept every delivered rank: `part_ppm` of each price is paid (1,000,000: all).
    Accept {
        /// The part, in parts per million.
        part_ppm: u32,
    },
    /// Dispute every delivered rank: the money stays in escrow until the resolver
    /// settles it.
    Dispute {
        /// Why (kept in the job's history, for the resolver).
        reason: String,
    },
    /// Evaluate the deliveries again (`POST /v1/jobs/{id}/evaluate`): a new run whose
    /// report accepts or disputes as an automatic one does.
    Evaluate,
}

/// `POST /v1/testnet/partition` (testnet nodes only): the peers this node refuses until
/// the next call, which replaces the list (empty: healed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    /// Peer ids.
    pub peers: Vec<String>,
}

/// `POST /v1/testnet/corrupt` (testnet nodes only): whether this node's deliveries carry
/// wrong outputs from now on (the first byte of each flipped before it is hashed), as a
/// worker that fabricates results would.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Corrupt {
    /// On or off.
    pub on: bool,
}

/// `POST /v1/testnet/slow` (testnet nodes only): every TCP link of the node has its
/// inbound bytes held `delay_ms` (at most 60,000), and a share `loss_ppm` (parts per
/// million) of them a retransmission timeout more, as TCP turns loss into lateness; both
/// zero for a plain link again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slow {
    /// Delay, milliseconds.
    pub delay_ms: u64,
    /// Loss, parts per million.
    pub loss_ppm: u32,
}

/// `POST /v1/ledger/submit`: a transaction signed elsewhere (by a key this node does not
/// hold, such as the network's resolver), for the node to hand its sequencer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitTx {
    /// The signed transaction's bytes (its envelope, as on the wire), in hex.
    pub tx: String,
}

/// A transaction the sequencer kept for a block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submitted {
    /// The transaction's id.
    pub id: String,
    /// Its sender.
    pub from: String,
    /// Its nonce.
    pub nonce: u64,
    /// The network fee it pays.
    pub fee: Amount,
}

/// `POST /v1/ledger/compute`: a proof-of-compute result this node computed and sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Computed {
    /// The `SUBMIT_RESULT` transaction.
    pub submitted: Submitted,
    /// The result's id (a leaf of its block's `compute_root`).
    pub result_id: String,
    /// The height of the block whose hash seeded the task.
    pub seed_height: u64,
    /// That block's hash.
    pub seed_hash: String,
    /// The task's matrix dimension.
    pub n: u32,
    /// SHA-256 of the product.
    pub result_hash: String,
    /// How long the product took, ms.
    pub ms: u64,
}

/// `GET /v1/ledger/results/{id}/proof`: where a result is in the ledger, and the
/// inclusion proof against its block's `compute_root` (RFC 9162).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResultProof {
    /// The result's id: the leaf.
    pub result_id: String,
    /// The block holding it.
    pub height: u64,
    /// That block's hash.
    pub block_hash: String,
    /// Its `compute_root`.
    pub compute_root: String,
    /// Its `compute_count`: the tree's size.
    pub compute_count: u32,
    /// The leaf's position.
    pub index: u64,
    /// Sibling hashes from the leaf up, hex.
    pub path: Vec<String>,
}

/// `GET /v1/ledger/txs/{id}`: a transaction the ledger took, and where.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxDetail {
    /// The transaction.
    pub tx: TxSummary,
    /// The block holding it.
    pub height: u64,
    /// That block's hash.
    pub block_hash: String,
    /// Its position in the block.
    pub index: usize,
}
