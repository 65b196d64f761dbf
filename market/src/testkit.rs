//! Builders for tests and simulations: plausible ads, tasks and offers from a few numbers,
//! and [`net`], engines wired together in memory. Nothing here is used on a node's own
//! paths (it is behind the `testkit` feature).

pub mod net;

use cannabis_protocol::{
    AdapterKind, Address, Amount, CapabilityAd, Decline, DeliveryIdentity, Digest, FeeTerms, Gpu,
    GpuPrice, GpuVendor, Hardware, JobOffer, Keypair, NetworkLimits, OsInfo, PriceSheet,
    Requirements, Resources, Runtime, TaskSpec, Timestamp, Uuid, Workload, message_id,
};

use crate::job::{Bidding, Job, LeaseConfig};

const GIB: u64 = 1 << 30;

/// The key of simulated node `n`.
pub fn keys(n: u64) -> Keypair {
    let mut secret = [0u8; 32];
    secret[..8].copy_from_slice(&n.to_le_bytes());
    secret[31] = 0x5a;
    Keypair::from_secret(secret)
}

/// What a simulated worker has.
#[derive(Clone, Debug)]
pub struct Machine {
    /// CPU cores.
    pub cores: u32,
    /// Memory in GiB.
    pub memory_gib: u64,
    /// GPUs: vendor and memory in GiB.
    pub gpus: Vec<(GpuVendor, u64)>,
    /// torch version, if any.
    pub torch: Option<&'static str>,
    /// Price per core-hour.
    pub cpu_core_hour: u64,
    /// Price per GPU-hour.
    pub gpu_hour: u64,
    /// Whether its ad carries a `dev` attestation (testnets only).
    pub dev_attested: bool,
}

impl Default for Machine {
    fn default() -> Self {
        Self {
            cores: 8,
            memory_gib: 32,
            gpus: Vec::new(),
            torch: None,
            cpu_core_hour: 10,
            gpu_hour: 1000,
            dev_attested: false,
        }
    }
}

/// An ad for `machine` by `address`, valid from `now` for an hour.
pub fn ad(address: Address, machine: &Machine, now: Timestamp) -> CapabilityAd {
    let gpus: Vec<Gpu> = machine
        .gpus
        .iter()
        .enumerate()
        .map(|(i, (vendor, gib))| Gpu {
            uuid: format!("GPU-{i}"),
            name: format!("{vendor:?} {gib}G"),
            vendor: *vendor,
            memory_bytes: gib * GIB,
            driver_version: "550.54".into(),
            toolkit_version: "12.4".into(),
            compute_capability: "8.9".into(),
            utilization_pct: 0,
            allowed: true,
        })
        .collect();
    let gpu_hour = gpus
        .iter()
        .map(|g| GpuPrice {
            model: g.name.clone(),
            price: Amount(machine.gpu_hour),
        })
        .collect();
    CapabilityAd {
        node: address,
        seq: 1,
        issued_at: now,
        expires_at: now.plus_ms(3_600_000),
        delivery: DeliveryIdentity::from_secret([1; 32]).recipient(),
        hardware: Hardware {
            cpu_model: "simulated".into(),
            cpu_cores: machine.cores,
            memory_bytes: machine.memory_gib * GIB,
            swap_bytes: 0,
            storage_bytes: 500 * GIB,
            gpus,
        },
        os: OsInfo {
            name: "linux".into(),
            kernel: "6.8".into(),
        },
        runtimes: machine
            .torch
            .map(|v| {
                vec![Runtime {
                    name: "torch".into(),
                    version: v.into(),
                }]
            })
            .unwrap_or_default(),
        adapters: vec![
            AdapterKind::Process,
            AdapterKind::Synthetic,
            AdapterKind::Torchrun,
        ],
        collectives: vec![cannabis_protocol::Collective::Gloo],
        isolation: Vec::new(),
        network: NetworkLimits::default(),
        prices: PriceSheet {
            cpu_core_hour: Amount(machine.cpu_core_hour),
            memory_gib_hour: Amount(1),
            gpu_hour,
            minimum_job: Amount(1),
        },
        attestation: machine
            .dev_attested
            .then(|| crate::attest::dev_attestation(&address)),
        challenges: Vec::new(),
    }
}

/// A task of `group_size` ranks needing `cores` cores, `gpus` GPUs with at least
/// `gpu_memory_gib` each, worth `budget`.
pub fn task(
    name: &str,
    cores: u32,
    gpus: u32,
    gpu_memory_gib: u64,
    group_size: u32,
    budget: u64,
) -> TaskSpec {
    TaskSpec {
        restarts: 0,
        name: name.into(),
        workload: Workload {
            adapter: AdapterKind::Synthetic,
            digest: Digest([0; 32]),
            entrypoint: Vec::new(),
        },
        inputs: Vec::new(),
        outputs: Vec::new(),
        resources: Resources {
            cpu_millicores: cores * 1000,
            memory_bytes: GIB,
            swap_bytes: 0,
            processes: 64,
            storage_bytes: GIB,
            gpus,
        },
        requirements: Requirements {
            min_gpu_memory_bytes: gpu_memory_gib * GIB,
            ..Requirements::default()
        },
        group_size,
        depends_on: Vec::new(),
        budget: Amount(budget),
        checkpoint: None,
    }
}

/// An offer by `requester` with `tasks`, taking bids for `window_ms` from `now` and due
/// `deadline_ms` from `now`.
pub fn offer(
    requester: Address,
    job: u64,
    tasks: Vec<TaskSpec>,
    now: Timestamp,
    window_ms: u64,
    deadline_ms: u64,
) -> JobOffer {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&job.to_le_bytes());
    let budget = Amount(tasks.iter().map(|t| t.budget.0).sum());
    let nonce = Uuid::from_random(id);
    JobOffer {
        job_id: cannabis_protocol::job_id_of(&requester, &nonce),
        nonce,
        requester,
        seq: job,
        issued_at: now,
        expires_at: now.plus_ms(window_ms),
        deadline: now.plus_ms(deadline_ms),
        delivery: DeliveryIdentity::from_secret([2; 32]).recipient(),
        budget,
        fee: fee_terms(),
        review_window_ms: 60_000,
        acceptance: Vec::new(),
        evaluation: None,
        calls: vec![cannabis_protocol::BidCall::EVERYONE; tasks.len()],
        tasks,
    }
}

/// The job of `requester`'s offer number 1 of `tasks` (bids for a minute, due in an hour),
/// published at `now` with the default lease timing and bidding.
pub fn job(requester: Address, tasks: Vec<TaskSpec>, now: Timestamp) -> Job {
    let offer = offer(requester, 1, tasks, now, 60_000, 3_600_000);
    let id = message_id(&offer);
    Job::new(
        offer,
        id,
        "job".into(),
        LeaseConfig::default(),
        Bidding::default(),
        now,
    )
}

/// `worker`'s decline of task `task` of `job`'s offer, saying `reason`.
pub fn decline(job: &Job, task: u32, worker: Address, reason: String, now: Timestamp) -> Decline {
    Decline {
        job_id: job.id(),
        task,
        offer: job.offer_id(),
        worker,
        reason,
        issued_at: now,
    }
}

/// The fee terms of the test network: 1% to the address of [`keys`]`(0xfee)`.
pub fn fee_terms() -> FeeTerms {
    FeeTerms::founder(keys(0xfee).address())
}

/// A template of `tasks`, taking bids for `window_ms` and due `deadline_ms` after it is
/// submitted.
pub fn template(tasks: Vec<TaskSpec>, window_ms: u64, deadline_ms: u64) -> crate::OfferTemplate {
    crate::OfferTemplate {
        name: None,
        nonce: None,
        tasks,
        ttl_ms: window_ms,
        deadline_ms,
        review_window_ms: 60_000,
        acceptance: Vec::new(),
        evaluation: None,
        early: None,
        spot_check_ppm: 0,
    }
}

/// SplitMix64 (Steele, Lea and Flood, 2014), written out: a simulation seed must give the
/// same run after any dependency upgrade, which `rand`'s seeded generators do not promise.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next number.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True `p` percent of the time.
    pub fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}
