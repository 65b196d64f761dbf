//! Matching an offer's task against capability ads: which requirement each ad misses, and
//! for a whole market, how many ads qualify and which requirement excluded how many.
//!
//! Every requirement is checked on its own so the explanation counts each ad under every
//! requirement it misses ("GPU memory >= 24 GiB: 7 excluded"), not only under the first.

use std::collections::BTreeMap;

use cannabis_protocol::{
    AdapterKind, Address, CapabilityAd, Collective, GpuVendor, IsolationLayer, TaskSpec, Timestamp,
};
use serde::{Deserialize, Serialize};

use crate::attest::AttestationPolicy;

const GIB: u64 = 1 << 30;

/// One requirement a task puts on a worker's ad.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Requirement {
    /// The executor adapter.
    Adapter {
        /// Adapter the workload needs.
        adapter: AdapterKind,
    },
    /// CPU, in thousandths of a core.
    Cpu {
        /// Millicores per rank.
        millicores: u32,
    },
    /// Physical memory.
    Memory {
        /// Bytes per rank.
        bytes: u64,
    },
    /// Swap.
    Swap {
        /// Bytes per rank.
        bytes: u64,
    },
    /// Free storage for the work directory.
    Storage {
        /// Bytes per rank.
        bytes: u64,
    },
    /// Whole GPUs the owner allows.
    Gpus {
        /// GPUs per rank.
        count: u32,
    },
    /// GPUs of one vendor.
    GpuVendor {
        /// The vendor.
        vendor: GpuVendor,
        /// GPUs per rank.
        count: u32,
    },
    /// GPUs with at least this much memory each (of the vendor, if one is required).
    GpuMemory {
        /// Least bytes per GPU.
        bytes: u64,
        /// GPUs per rank.
        count: u32,
    },
    /// A runtime with a least version.
    Runtime {
        /// Runtime name.
        name: String,
        /// Least version.
        min_version: String,
    },
    /// A collective backend.
    Collective {
        /// The backend.
        collective: Collective,
    },
    /// An isolation layer the sandbox enforces.
    Isolation {
        /// The layer.
        layer: IsolationLayer,
    },
    /// Confidential-execution evidence.
    Confidential,
    /// A capability challenge passed recently enough, from a verifier that counts.
    Challenge {
        /// Oldest acceptable pass, in milliseconds.
        max_age_ms: u64,
    },
}

impl std::fmt::Display for Requirement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Requirement::Adapter { adapter } => write!(f, "adapter {}", kebab(adapter)),
            Requirement::Cpu { millicores } => {
                write!(
                    f,
                    "CPU >= {}.{:03} cores",
                    millicores / 1000,
                    millicores % 1000
                )
            }
            Requirement::Memory { bytes } => write!(f, "memory >= {}", size(*bytes)),
            Requirement::Swap { bytes } => write!(f, "swap >= {}", size(*bytes)),
            Requirement::Storage { bytes } => write!(f, "free storage >= {}", size(*bytes)),
            Requirement::Gpus { count } => write!(f, "allowed GPUs >= {count}"),
            Requirement::GpuVendor { vendor, count } => {
                write!(f, "{} GPUs >= {count}", kebab(vendor))
            }
            Requirement::GpuMemory { bytes, .. } => write!(f, "GPU memory >= {}", size(*bytes)),
            Requirement::Runtime { name, min_version } => write!(f, "{name} >= {min_version}"),
            Requirement::Collective { collective } => {
                write!(f, "collective {}", kebab(collective))
            }
            Requirement::Isolation { layer } => write!(f, "isolation {}", kebab(layer)),
            Requirement::Confidential => {
                write!(f, "confidential execution (evidence that verifies here)")
            }
            Requirement::Challenge { max_age_ms } => {
                write!(
                    f,
                    "capability challenge passed within {}",
                    duration(*max_age_ms)
                )
            }
        }
    }
}

/// A wire enum's name as in the spec and the job file: its variant name in kebab case,
/// which is what serde's `rename_all = "kebab-case"` writes.
fn kebab<T: std::fmt::Debug>(v: &T) -> String {
    let mut out = String::new();
    for (i, c) in format!("{v:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

fn size(bytes: u64) -> String {
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else if bytes >= GIB {
        format!("{:.1} GiB", bytes as f64 / GIB as f64)
    } else if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} B")
    }
}

fn duration(ms: u64) -> String {
    match ms {
        ms if ms.is_multiple_of(86_400_000) && ms > 0 => format!("{} d", ms / 86_400_000),
        ms if ms.is_multiple_of(3_600_000) && ms > 0 => format!("{} h", ms / 3_600_000),
        ms if ms.is_multiple_of(60_000) && ms > 0 => format!("{} min", ms / 60_000),
        ms if ms.is_multiple_of(1000) => format!("{} s", ms / 1000),
        ms => format!("{ms} ms"),
    }
}

/// What the matcher knows besides the ads: the time, and challenges this node checked
/// itself.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    /// Now.
    pub now: Timestamp,
    /// This node's address: its own checks count as passes from it.
    pub me: Option<Address>,
    /// When each node last passed a challenge this node set.
    pub local_passes: &'a BTreeMap<Address, Timestamp>,
    /// Which confidential-execution evidence counts here.
    pub attestation: AttestationPolicy,
}

static NO_PASSES: BTreeMap<Address, Timestamp> = BTreeMap::new();

impl Default for Context<'_> {
    fn default() -> Self {
        Self {
            now: Timestamp::default(),
            me: None,
            local_passes: &NO_PASSES,
            attestation: AttestationPolicy::default(),
        }
    }
}

impl Context<'_> {
    /// The newest pass that counts for `ad` under `trusted` (empty: any verifier but the
    /// worker itself) and still covers the ad's claim: the challenge was sized for at least
    /// the cores the ad claims now.
    pub fn newest_pass(&self, ad: &CapabilityAd, trusted: &[Address]) -> Option<Timestamp> {
        let counts = |v: &Address| *v != ad.node && (trusted.is_empty() || trusted.contains(v));
        let signed = ad
            .passes()
            .filter(|p| counts(&p.verifier) && p.claimed_cores >= ad.hardware.cpu_cores)
            .map(|p| p.passed_at);
        let local = match self.me {
            Some(me) if counts(&me) => self.local_passes.get(&ad.node).copied(),
            _ => None,
        };
        signed
            .chain(local)
            .filter(|t| *t <= self.now.plus_ms(CLOCK_SKEW_MS))
            .max()
    }
}

/// Passes dated this far in the future still count (clock skew between nodes).
const CLOCK_SKEW_MS: u64 = 2 * 60_000;

/// Every requirement `task` puts on one worker, in a fixed order.
pub fn requirements(task: &TaskSpec) -> Vec<Requirement> {
    let r = &task.resources;
    let q = &task.requirements;
    let mut out = vec![Requirement::Adapter {
        adapter: task.workload.adapter,
    }];
    if r.cpu_millicores > 0 {
        out.push(Requirement::Cpu {
            millicores: r.cpu_millicores,
        });
    }
    if r.memory_bytes > 0 {
        out.push(Requirement::Memory {
            bytes: r.memory_bytes,
        });
    }
    if r.swap_bytes > 0 {
        out.push(Requirement::Swap {
            bytes: r.swap_bytes,
        });
    }
    if r.storage_bytes > 0 {
        out.push(Requirement::Storage {
            bytes: r.storage_bytes,
        });
    }
    if r.gpus > 0 {
        out.push(Requirement::Gpus { count: r.gpus });
        if let Some(vendor) = q.gpu_vendor {
            out.push(Requirement::GpuVendor {
                vendor,
                count: r.gpus,
            });
        }
        if q.min_gpu_memory_bytes > 0 {
            out.push(Requirement::GpuMemory {
                bytes: q.min_gpu_memory_bytes,
                count: r.gpus,
            });
        }
    }
    for rt in &q.runtimes {
        out.push(Requirement::Runtime {
            name: rt.name.clone(),
            min_version: rt.min_version.clone(),
        });
    }
    for &collective in &q.collectives {
        out.push(Requirement::Collective { collective });
    }
    for &layer in &q.isolation {
        out.push(Requirement::Isolation { layer });
    }
    if q.confidential {
        out.push(Requirement::Confidential);
    }
    if let Some(max_age_ms) = q.max_challenge_age_ms {
        out.push(Requirement::Challenge { max_age_ms });
    }
    out
}

/// Whether `ad` meets `req` for `task`.
pub fn meets(req: &Requirement, task: &TaskSpec, ad: &CapabilityAd, ctx: &Context<'_>) -> bool {
    let hw = &ad.hardware;
    let allowed = || hw.gpus.iter().filter(|g| g.allowed);
    let vendor = task.requirements.gpu_vendor;
    match req {
        Requirement::Adapter { adapter } => ad.adapters.contains(adapter),
        Requirement::Cpu { millicores } => u64::from(hw.cpu_cores) * 1000 >= u64::from(*millicores),
        Requirement::Memory { bytes } => hw.memory_bytes >= *bytes,
        Requirement::Swap { bytes } => hw.swap_bytes >= *bytes,
        Requirement::Storage { bytes } => hw.storage_bytes >= *bytes,
        Requirement::Gpus { count } => allowed().count() >= *count as usize,
        Requirement::GpuVendor { vendor, count } => {
            allowed().filter(|g| g.vendor == *vendor).count() >= *count as usize
        }
        Requirement::GpuMemory { bytes, count } => {
            allowed()
                .filter(|g| vendor.is_none_or(|v| g.vendor == v) && g.memory_bytes >= *bytes)
                .count()
                >= *count as usize
        }
        Requirement::Runtime { name, min_version } => ad
            .runtimes
            .iter()
            .any(|r| r.name == *name && version_at_least(&r.version, min_version)),
        Requirement::Collective { collective } => ad.collectives.contains(collective),
        Requirement::Isolation { layer } => ad.isolation.contains(layer),
        Requirement::Confidential => ctx.attestation.verify(ad).is_ok(),
        Requirement::Challenge { max_age_ms } => ctx
            .newest_pass(ad, &task.requirements.challenge_verifiers)
            .is_some_and(|t| ctx.now.ms_since(t) <= *max_age_ms),
    }
}

/// A task's requirements, listed once, to match many ads against.
#[derive(Clone, Debug)]
pub struct Matcher<'t> {
    task: &'t TaskSpec,
    requirements: Vec<Requirement>,
}

impl<'t> Matcher<'t> {
    /// The matcher of `task`.
    pub fn new(task: &'t TaskSpec) -> Self {
        Self {
            task,
            requirements: requirements(task),
        }
    }

    /// Whether `ad` meets every requirement.
    pub fn qualifies(&self, ad: &CapabilityAd, ctx: &Context<'_>) -> bool {
        self.requirements
            .iter()
            .all(|r| meets(r, self.task, ad, ctx))
    }
}

/// The requirements of `task` that `ad` misses; empty when it qualifies.
pub fn unmet(task: &TaskSpec, ad: &CapabilityAd, ctx: &Context<'_>) -> Vec<Requirement> {
    requirements(task)
        .into_iter()
        .filter(|r| !meets(r, task, ad, ctx))
        .collect()
}

/// Whether `have` is at least `want`, comparing dotted numbers numerically (`2.10 >= 2.9`).
/// Anything after the numbers (`+cu124`, `rc1`) is ignored; a missing part counts as 0.
pub fn version_at_least(have: &str, want: &str) -> bool {
    fn parts(v: &str) -> Vec<u64> {
        v.split(|c: char| !c.is_ascii_digit() && c != '.')
            .next()
            .unwrap_or("")
            .split('.')
            .map_while(|p| p.parse().ok())
            .collect()
    }
    let (h, w) = (parts(have), parts(want));
    if h.is_empty() && !w.is_empty() {
        return false;
    }
    let n = h.len().max(w.len());
    let get = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
    for i in 0..n {
        match get(&h, i).cmp(&get(&w, i)) {
            std::cmp::Ordering::Greater => return true,
            std::cmp::Ordering::Less => return false,
            std::cmp::Ordering::Equal => {}
        }
    }
    true
}

/// Which ads qualify for a task, and why the others do not.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Explanation {
    /// Ads looked at.
    pub considered: usize,
    /// Nodes whose ad meets every requirement, in address order.
    pub qualified: Vec<Address>,
    /// For each requirement some ad missed: the requirement and how many ads missed it
    /// (an ad that misses several counts under each).
    pub excluded: Vec<Exclusion>,
    /// Workers the task needs at once (its group size).
    pub needed: u32,
}

/// One line of an [`Explanation`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exclusion {
    /// The requirement.
    pub requirement: Requirement,
    /// Its text, e.g. "GPU memory >= 24 GiB".
    pub text: String,
    /// How many ads missed it.
    pub excluded: usize,
}

impl Explanation {
    /// Whether enough workers qualify for the group.
    pub fn feasible(&self) -> bool {
        self.qualified.len() >= self.needed as usize
    }
}

impl std::fmt::Display for Explanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} of {} known workers qualify ({} needed)",
            self.qualified.len(),
            self.considered,
            self.needed
        )?;
        for e in &self.excluded {
            writeln!(f, "  {}: {} excluded", e.text, e.excluded)?;
        }
        Ok(())
    }
}

/// Matches `task` against `ads` and explains the outcome.
pub fn explain<'a>(
    task: &TaskSpec,
    ads: impl IntoIterator<Item = &'a CapabilityAd>,
    ctx: &Context<'_>,
) -> Explanation {
    let reqs = requirements(task);
    let mut counts = vec![0usize; reqs.len()];
    let mut out = Explanation {
        needed: task.group_size,
        ..Explanation::default()
    };
    for ad in ads {
        out.considered += 1;
        let mut ok = true;
        for (i, r) in reqs.iter().enumerate() {
            if !meets(r, task, ad, ctx) {
                ok = false;
                counts[i] += 1;
            }
        }
        if ok {
            out.qualified.push(ad.node);
        }
    }
    out.qualified.sort();
    out.excluded = reqs
        .into_iter()
        .zip(counts)
        .filter(|(_, n)| *n > 0)
        .map(|(requirement, excluded)| Exclusion {
            text: requirement.to_string(),
            requirement,
            excluded,
        })
        .collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::*;

    const NOW: Timestamp = Timestamp(10_000_000);

    fn keys(n: u8) -> Keypair {
        Keypair::from_secret([n; 32])
    }

    fn gpu(vendor: GpuVendor, gib: u64, allowed: bool) -> Gpu {
        Gpu {
            uuid: format!("GPU-{gib}"),
            name: "card".into(),
            vendor,
            memory_bytes: gib * GIB,
            driver_version: "550".into(),
            toolkit_version: "12.4".into(),
            compute_capability: "8.9".into(),
            utilization_pct: 0,
            allowed,
        }
    }

    fn ad(node: u8) -> CapabilityAd {
        CapabilityAd {
            node: keys(node).address(),
            seq: 1,
            issued_at: Timestamp(NOW.0 - 1000),
            expires_at: NOW.plus_ms(60_000),
            delivery: DeliveryIdentity::from_secret([1; 32]).recipient(),
            hardware: Hardware {
                cpu_model: "cpu".into(),
                cpu_cores: 8,
                memory_bytes: 32 * GIB,
                swap_bytes: 0,
                storage_bytes: 100 * GIB,
                gpus: vec![
                    gpu(GpuVendor::Nvidia, 24, true),
                    gpu(GpuVendor::Amd, 48, false),
                ],
            },
            os: OsInfo {
                name: "linux".into(),
                kernel: "6".into(),
            },
            runtimes: vec![Runtime {
                name: "torch".into(),
                version: "2.5.1+cu124".into(),
            }],
            adapters: vec![AdapterKind::Process, AdapterKind::Synthetic],
            collectives: vec![Collective::Gloo],
            isolation: vec![IsolationLayer::NetworkNamespace],
            network: NetworkLimits::default(),
            prices: PriceSheet::default(),
            attestation: None,
            challenges: Vec::new(),
        }
    }

    fn task() -> TaskSpec {
        TaskSpec {
            restarts: 0,
            name: "t".into(),
            workload: Workload {
                adapter: AdapterKind::Process,
                digest: Digest([0; 32]),
                entrypoint: vec!["run".into()],
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources {
                cpu_millicores: 4000,
                memory_bytes: 16 * GIB,
                swap_bytes: 0,
                processes: 64,
                storage_bytes: 10 * GIB,
                gpus: 1,
            },
            requirements: Requirements {
                gpu_vendor: Some(GpuVendor::Nvidia),
                min_gpu_memory_bytes: 16 * GIB,
                runtimes: vec![RuntimeRequirement {
                    name: "torch".into(),
                    min_version: "2.4".into(),
                }],
                collectives: vec![Collective::Gloo],
                isolation: vec![IsolationLayer::NetworkNamespace],
                ..Requirements::default()
            },
            group_size: 1,
            depends_on: Vec::new(),
            budget: Amount(1000),
            checkpoint: None,
        }
    }

    fn pass(verifier: u8, worker: &CapabilityAd, cores: u32, at: u64) -> Signed<ChallengePass> {
        Signed::sign(
            &keys(verifier),
            &ChallengePass {
                verifier: keys(verifier).address(),
                worker: worker.node,
                seed: Digest([verifier; 32]),
                n: 256,
                rounds: 4,
                claimed_cores: cores,
                took_ms: 100,
                deadline_ms: 1000,
                passed_at: Timestamp(at),
            },
        )
    }

    fn ctx() -> Context<'static> {
        Context {
            now: NOW,
            ..Context::default()
        }
    }

    #[test]
    fn a_matching_ad_meets_every_requirement() {
        assert_eq!(unmet(&task(), &ad(1), &ctx()), Vec::<Requirement>::new());
    }

    #[test]
    fn each_requirement_excludes_on_its_own() {
        let t = task();
        let c = ctx();
        type Change = Box<dyn Fn(&mut CapabilityAd)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|a| a.adapters.clear()), "adapter process"),
            (Box::new(|a| a.hardware.cpu_cores = 3), "CPU >= 4.000 cores"),
            (
                Box::new(|a| a.hardware.memory_bytes = GIB),
                "memory >= 16 GiB",
            ),
            (
                Box::new(|a| a.hardware.storage_bytes = GIB),
                "free storage >= 10 GiB",
            ),
            (
                Box::new(|a| a.runtimes[0].version = "2.3.9".into()),
                "torch >= 2.4",
            ),
            (Box::new(|a| a.collectives.clear()), "collective gloo"),
            (
                Box::new(|a| a.isolation.clear()),
                "isolation network-namespace",
            ),
        ];
        for (change, text) in cases {
            let mut a = ad(1);
            change(&mut a);
            let missed: Vec<String> = unmet(&t, &a, &c).iter().map(|r| r.to_string()).collect();
            assert_eq!(missed, vec![text.to_string()]);
        }
    }

    #[test]
    fn gpus_count_only_when_allowed_and_of_the_vendor_and_size() {
        let c = ctx();
        let mut t = task();
        let mut a = ad(1);
        a.hardware.gpus[0].allowed = false;
        let missed: Vec<String> = unmet(&t, &a, &c).iter().map(|r| r.to_string()).collect();
        assert_eq!(
            missed,
            [
                "allowed GPUs >= 1",
                "nvidia GPUs >= 1",
                "GPU memory >= 16 GiB"
            ]
        );
        // The 48 GiB card is AMD: big enough, wrong vendor.
        let mut a = ad(1);
        a.hardware.gpus[1].allowed = true;
        t.requirements.min_gpu_memory_bytes = 40 * GIB;
        assert_eq!(
            unmet(&t, &a, &c),
            vec![Requirement::GpuMemory {
                bytes: 40 * GIB,
                count: 1
            }]
        );
        t.requirements.gpu_vendor = None;
        assert!(unmet(&t, &a, &c).is_empty());
    }

    #[test]
    fn versions_compare_numerically() {
        assert!(version_at_least("2.10.0", "2.9"));
        assert!(version_at_least("2.5.1+cu124", "2.5.1"));
        assert!(version_at_least("3.11", "3.11.0"));
        assert!(!version_at_least("3.9.18", "3.10"));
        assert!(!version_at_least("unknown", "1"));
        assert!(version_at_least("anything", ""));
    }

    #[test]
    fn a_challenge_pass_counts_until_it_is_too_old() {
        let mut t = task();
        t.requirements.max_challenge_age_ms = Some(3_600_000);
        let c = ctx();
        let mut a = ad(1);
        let req = Requirement::Challenge {
            max_age_ms: 3_600_000,
        };
        assert_eq!(unmet(&t, &a, &c), vec![req.clone()]);
        a.challenges = vec![pass(2, &a, 8, NOW.0 - 3_600_000)];
        assert!(unmet(&t, &a, &c).is_empty());
        a.challenges = vec![pass(2, &a, 8, NOW.0 - 3_600_001)];
        assert_eq!(unmet(&t, &a, &c), vec![req.clone()]);
        // A pass sized for fewer cores than the ad claims now does not cover the claim.
        a.challenges = vec![pass(2, &a, 4, NOW.0)];
        assert_eq!(unmet(&t, &a, &c), vec![req]);
    }

    #[test]
    fn only_trusted_verifiers_count_when_named() {
        let mut t = task();
        t.requirements.max_challenge_age_ms = Some(60_000);
        let mut a = ad(1);
        a.challenges = vec![pass(2, &a, 8, NOW.0)];
        let c = ctx();
        assert!(unmet(&t, &a, &c).is_empty());
        t.requirements.challenge_verifiers = vec![keys(3).address()];
        assert_eq!(unmet(&t, &a, &c).len(), 1);
        a.challenges.push(pass(3, &a, 8, NOW.0 - 1000));
        assert!(unmet(&t, &a, &c).is_empty());
    }

    #[test]
    fn a_check_this_node_made_counts_as_its_own_pass() {
        let mut t = task();
        t.requirements.max_challenge_age_ms = Some(60_000);
        let a = ad(1);
        let mut c = ctx();
        c.me = Some(keys(9).address());
        assert_eq!(unmet(&t, &a, &c).len(), 1);
        let passes = BTreeMap::from([(a.node, Timestamp(NOW.0 - 10))]);
        c.local_passes = &passes;
        assert!(unmet(&t, &a, &c).is_empty());
        t.requirements.challenge_verifiers = vec![keys(3).address()];
        assert_eq!(unmet(&t, &a, &c).len(), 1, "not a trusted verifier");
    }

    #[test]
    fn explanation_counts_every_missed_requirement() {
        let t = task();
        let mut ads = vec![ad(1), ad(2), ad(3), ad(4)];
        ads[1].hardware.gpus[0].memory_bytes = 8 * GIB;
        ads[2].hardware.gpus[0].memory_bytes = 8 * GIB;
        ads[2].collectives.clear();
        ads[3].adapters = vec![AdapterKind::Synthetic];
        let e = explain(&t, &ads, &ctx());
        assert_eq!(e.considered, 4);
        assert_eq!(e.qualified, vec![ads[0].node]);
        let lines: Vec<(String, usize)> = e
            .excluded
            .iter()
            .map(|x| (x.text.clone(), x.excluded))
            .collect();
        assert_eq!(
            lines,
            [
                ("adapter process".to_string(), 1),
                ("GPU memory >= 16 GiB".to_string(), 2),
                ("collective gloo".to_string(), 1)
            ]
        );
        assert!(e.feasible());
        let mut group = t.clone();
        group.group_size = 2;
        assert!(!explain(&group, &ads, &ctx()).feasible());
        assert!(e.to_string().contains("GPU memory >= 16 GiB: 2 excluded"));
    }
}
