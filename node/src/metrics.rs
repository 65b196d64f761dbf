//! `/metrics`: what the node does, in Prometheus' text format. Counters move as the node
//! works (gossip in and out, by verdict and reason; bytes transferred; jobs ended and how
//! long they took); gauges are read from the node's state when scraped (peers, the market
//! it sees, its jobs and leases by state, the executor's attempts and refusals, the
//! store's size, the ledger's height).

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// One label.
pub type Labels = Vec<(&'static str, String)>;

/// The node's metrics; cheap to share (every handle is an `Arc` inside).
pub struct Metrics {
    registry: Registry,
    /// Connected peers.
    pub peers: Gauge,
    /// Gossip messages received, by verdict (`accepted`, `ignored`, `rejected`).
    pub gossip_in: Family<Labels, Counter>,
    /// Gossip messages rejected, by reason ([`cannabis_market::RejectReason::kind`]).
    pub gossip_rejected: Family<Labels, Counter>,
    /// Gossip messages this node published, by kind (`ad`, `offer`, `block`).
    pub gossip_out: Family<Labels, Counter>,
    /// Live capability ads known.
    pub ads: Gauge,
    /// Open offers known.
    pub offers: Gauge,
    /// Bids held for this node's jobs.
    pub bids: Gauge,
    /// This node's jobs (as a requester) that it keeps, by state.
    pub jobs: Family<Labels, Gauge>,
    /// Tasks of those jobs, by status.
    pub tasks: Family<Labels, Gauge>,
    /// Jobs that ended since the node started, by state.
    pub jobs_ended: Family<Labels, Counter>,
    /// Seconds from publication to completion of the jobs completed since the node started.
    pub job_seconds: Histogram,
    /// Leases this node holds as a worker, by state.
    pub leases: Family<Labels, Gauge>,
    /// The executor's attempts, by state.
    pub attempts: Family<Labels, Gauge>,
    /// Admissions the executor refused (of the attempts it keeps), by reason.
    pub refusals: Family<Labels, Gauge>,
    /// Bytes of packages and outputs transferred, by direction (`served`, `fetched`).
    pub transfer_bytes: Family<Labels, Counter>,
    /// Size of the node's store file, in bytes.
    pub store_bytes: Gauge,
    /// Seconds each write of the market's records to the store took (durable ones sync).
    pub store_write_seconds: Histogram,
    /// The last ledger block this node applied.
    pub ledger_height: Gauge,
    /// Each GPU's utilisation (NVML), by UUID, read at each scrape; no series on a
    /// machine without NVIDIA GPUs.
    pub gpu_utilization: Family<Labels, Gauge>,
}

impl Metrics {
    /// Every metric, registered under `cannabis_`.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("cannabis");
        let m = Self {
            peers: Gauge::default(),
            gossip_in: Family::default(),
            gossip_rejected: Family::default(),
            gossip_out: Family::default(),
            ads: Gauge::default(),
            offers: Gauge::default(),
            bids: Gauge::default(),
            jobs: Family::default(),
            tasks: Family::default(),
            jobs_ended: Family::default(),
            job_seconds: Histogram::new(exponential_buckets(1.0, 2.0, 16)),
            leases: Family::default(),
            attempts: Family::default(),
            refusals: Family::default(),
            transfer_bytes: Family::default(),
            store_bytes: Gauge::default(),
            store_write_seconds: Histogram::new(exponential_buckets(0.000_25, 2.0, 16)),
            ledger_height: Gauge::default(),
            gpu_utilization: Family::default(),
            registry: Registry::default(),
        };
        registry.register("peers", "Connected peers", m.peers.clone());
        registry.register(
            "gossip_messages_received",
            "Gossip messages received, by verdict",
            m.gossip_in.clone(),
        );
        registry.register(
            "gossip_messages_rejected",
            "Gossip messages rejected, by reason",
            m.gossip_rejected.clone(),
        );
        registry.register(
            "gossip_messages_published",
            "Gossip messages this node published, by kind",
            m.gossip_out.clone(),
        );
        registry.register("ads", "Live capability ads known", m.ads.clone());
        registry.register("offers", "Open offers known", m.offers.clone());
        registry.register("bids", "Bids held for this node's jobs", m.bids.clone());
        registry.register(
            "jobs",
            "This node's jobs it keeps, by state",
            m.jobs.clone(),
        );
        registry.register(
            "tasks",
            "Tasks of this node's jobs it keeps, by status",
            m.tasks.clone(),
        );
        registry.register(
            "store_write_seconds",
            "Seconds each write of the market's records to the store took",
            m.store_write_seconds.clone(),
        );
        registry.register(
            "jobs_ended",
            "Jobs of this node's that ended since it started, by state",
            m.jobs_ended.clone(),
        );
        registry.register(
            "job_completion_seconds",
            "Seconds from publication to completion of this node's jobs",
            m.job_seconds.clone(),
        );
        registry.register(
            "leases",
            "Leases this node holds as a worker, by state",
            m.leases.clone(),
        );
        registry.register(
            "attempts",
            "The executor's attempts, by state",
            m.attempts.clone(),
        );
        registry.register(
            "sandbox_refusals",
            "Admissions the executor refused, of the attempts it keeps, by reason",
            m.refusals.clone(),
        );
        registry.register(
            "transfer_bytes",
            "Bytes of packages and outputs transferred, by direction",
            m.transfer_bytes.clone(),
        );
        registry.register(
            "store_bytes",
            "Size of the node's store, in bytes",
            m.store_bytes.clone(),
        );
        registry.register(
            "ledger_height",
            "The last ledger block this node applied",
            m.ledger_height.clone(),
        );
        registry.register(
            "gpu_utilization_percent",
            "Each GPU's utilisation as NVML reports it, by UUID, when scraped",
            m.gpu_utilization.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// Sets the GPUs' utilisation from a probe: one series per device; none when the
    /// machine has no NVIDIA driver or NVML failed.
    pub fn set_gpus(&self, report: &cannabis_runtime::gpu::GpuReport) {
        let counts: Vec<(String, i64)> = report
            .gpus()
            .iter()
            .map(|g| (g.uuid.clone(), i64::from(g.utilization_pct)))
            .collect();
        set_all(&self.gpu_utilization, "gpu", &counts);
    }

    /// Prometheus' text exposition format (0.0.4), which every scraper and `promtool`
    /// read: the crate writes OpenMetrics, whose counter families are named without the
    /// `_total` their samples carry and which ends with `# EOF`; both are turned into the
    /// older format's spelling here.
    pub fn encode(&self) -> String {
        let mut open = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut open, &self.registry);
        let counters: std::collections::HashSet<&str> = open
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
            .collect();
        let mut text = String::with_capacity(open.len());
        for line in open.lines() {
            if line == "# EOF" {
                continue;
            }
            let family = line
                .strip_prefix("# HELP ")
                .or_else(|| line.strip_prefix("# TYPE "))
                .and_then(|rest| rest.split(' ').next());
            match family {
                Some(name) if counters.contains(name) => {
                    let (head, tail) = line.split_at(7 + name.len());
                    text.push_str(head);
                    text.push_str("_total");
                    text.push_str(tail);
                }
                _ => text.push_str(line),
            }
            text.push('\n');
        }
        text
    }
}

/// A label set of one label.
pub fn label(name: &'static str, value: impl Into<String>) -> Labels {
    vec![(name, value.into())]
}

/// A reason as a short label: its words up to the first detail (`busy: cpu asks ...` is
/// `busy`), at most 64 bytes, so that the label's values stay few.
pub fn reason_label(reason: &str) -> String {
    let head = reason
        .split([':', '(', '{', '\n'])
        .next()
        .unwrap_or("")
        .trim();
    let mut end = head.len().min(64);
    while !head.is_char_boundary(end) {
        end -= 1;
    }
    let head = &head[..end];
    if head.is_empty() {
        "other".into()
    } else {
        head.to_string()
    }
}

/// Sets a family of gauges to `counts`, zeroing the values it had that are not there.
pub fn set_all(family: &Family<Labels, Gauge>, name: &'static str, counts: &[(String, i64)]) {
    family.clear();
    for (value, n) in counts {
        family.get_or_create(&label(name, value.clone())).set(*n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_gpu_has_its_utilisation_and_a_machine_without_gpus_has_none() {
        use cannabis_runtime::gpu::GpuReport;
        let m = Metrics::new();
        let gpu = |uuid: &str, pct: u8| cannabis_protocol::Gpu {
            uuid: uuid.into(),
            name: "NVIDIA H100".into(),
            vendor: cannabis_protocol::GpuVendor::Nvidia,
            memory_bytes: 80 << 30,
            driver_version: "570.86".into(),
            toolkit_version: "12.8".into(),
            compute_capability: "9.0".into(),
            utilization_pct: pct,
            allowed: true,
        };
        m.set_gpus(&GpuReport::Devices {
            driver_version: "570.86".into(),
            cuda_version: "12.8".into(),
            gpus: vec![gpu("GPU-a", 97), gpu("GPU-b", 3)],
        });
        let text = m.encode();
        assert!(
            text.contains("cannabis_gpu_utilization_percent{gpu=\"GPU-a\"} 97"),
            "{text}"
        );
        assert!(
            text.contains("cannabis_gpu_utilization_percent{gpu=\"GPU-b\"} 3"),
            "{text}"
        );
        m.set_gpus(&GpuReport::NoDriver {
            detail: "libnvidia-ml.so.1: not found".into(),
        });
        assert!(!m.encode().contains("cannabis_gpu_utilization_percent{"));
    }

    #[test]
    fn the_text_names_every_family_and_labels_what_moved() {
        let m = Metrics::new();
        m.peers.set(3);
        m.gossip_in
            .get_or_create(&label("verdict", "accepted"))
            .inc();
        m.gossip_rejected
            .get_or_create(&label("reason", "unverifiable"))
            .inc();
        m.job_seconds.observe(12.0);
        let text = m.encode();
        for want in [
            "# TYPE cannabis_peers gauge",
            "# TYPE cannabis_gossip_messages_received_total counter",
            "# HELP cannabis_gossip_messages_received_total Gossip messages received",
            "cannabis_peers 3",
            "cannabis_gossip_messages_received_total{verdict=\"accepted\"} 1",
            "cannabis_gossip_messages_rejected_total{reason=\"unverifiable\"} 1",
            "# TYPE cannabis_job_completion_seconds histogram",
            "cannabis_job_completion_seconds_count 1",
            "# TYPE cannabis_ledger_height gauge",
        ] {
            assert!(text.contains(want), "{want:?} not in:\n{text}");
        }
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn reasons_are_cut_to_their_first_words() {
        assert_eq!(
            reason_label("busy: cpu asks 1000 millicores, 500 free"),
            "busy"
        );
        assert_eq!(reason_label(""), "other");
        assert_eq!(reason_label(&"é".repeat(100)).len(), 64);
    }
}
