//! `cannabis probe` and `cannabis challenge`: what this machine would advertise, and the
//! capability challenge run against it.

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;
use cannabis_node::NodeConfig;
use cannabis_protocol::Digest;
use cannabis_protocol::challenge::{Challenge, Claim, Sizing};
use cannabis_runtime::gpu::{GpuReport, Nvml};
use serde::Serialize;

use crate::cli::Format;
use crate::output::{self, out};
use cannabis_node::keystore::random_bytes;

#[derive(Serialize)]
struct ProbeOutput {
    #[serde(flatten)]
    probe: cannabis_runtime::probe::Probe,
    network: cannabis_protocol::NetworkLimits,
    prices: cannabis_protocol::PriceSheet,
}

pub(super) fn probe(config: Option<&Path>, data_dir: &Path, format: Format) -> anyhow::Result<()> {
    let config = match config {
        Some(path) => NodeConfig::from_file(path)?,
        None => NodeConfig::default(),
    };
    // Free storage is measured where the node keeps its data (or the nearest existing parent).
    let mut storage_dir = data_dir.to_path_buf();
    while !storage_dir.exists() {
        if !storage_dir.pop() {
            storage_dir = std::env::temp_dir();
            break;
        }
    }
    let p = cannabis_runtime::probe::probe(
        &storage_dir,
        &Nvml,
        &config.owner.allowed_gpus,
        config.owner.cdi_map.as_deref(),
    );
    let owner = config.owner;
    if format.json {
        return output::json(&ProbeOutput {
            probe: p,
            network: owner.network,
            prices: owner.prices,
        });
    }
    let h = &p.hardware;
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30));
    let list = |v: Vec<String>| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    let cap = |v: Option<u64>| v.map_or("not capped".to_string(), |b| format!("{b} B/s"));
    output::table(&[
        ("cpu", format!("{} ({} cores)", h.cpu_model, h.cpu_cores)),
        ("memory", gib(h.memory_bytes)),
        ("swap", gib(h.swap_bytes)),
        (
            "free storage",
            format!("{} under {}", gib(h.storage_bytes), storage_dir.display()),
        ),
        ("os", format!("{}, kernel {}", p.os.name, p.os.kernel)),
        ("gpus", p.gpus.summary()),
    ])?;
    for g in h.gpus.iter() {
        out!(
            "  {}  {}  {}  cc {}  {}%  driver {}  CUDA {}  {}",
            g.uuid,
            g.name,
            gib(g.memory_bytes),
            g.compute_capability,
            g.utilization_pct,
            g.driver_version,
            g.toolkit_version,
            if g.allowed {
                "allowed"
            } else {
                "not allowed (add to owner.allowed_gpus)"
            }
        )?;
    }
    if let GpuReport::NoDriver { detail } = &p.gpus {
        out!("  ({detail})")?;
    }
    if let Some(refusal) = &p.gpu_refusal {
        out!("  not advertised: {refusal}")?;
    }
    output::table(&[
        (
            "runtimes",
            list(
                p.runtimes
                    .iter()
                    .map(|r| format!("{} {}", r.name, r.version))
                    .collect(),
            ),
        ),
        (
            "collectives",
            list(
                p.collectives
                    .iter()
                    .map(|c| format!("{c:?}").to_lowercase())
                    .collect(),
            ),
        ),
        (
            "adapters",
            list(
                p.adapters
                    .iter()
                    .map(|a| format!("{a:?}").to_lowercase())
                    .collect(),
            ),
        ),
        ("upload", cap(owner.network.upload_bytes_per_sec)),
        ("download", cap(owner.network.download_bytes_per_sec)),
        (
            "prices",
            format!(
                "{} per core-hour, {} per GiB-hour, minimum job {}{}",
                owner.prices.cpu_core_hour,
                owner.prices.memory_gib_hour,
                owner.prices.minimum_job,
                owner
                    .prices
                    .gpu_hour
                    .iter()
                    .map(|g| format!(", {} per {} GPU-hour", g.price, g.model))
                    .collect::<String>()
            ),
        ),
    ])?;
    out!("kernel support for the sandbox (not advertised until the sandbox enforces it):")?;
    for k in &p.kernel {
        let yes = match k.available {
            Some(true) => "yes",
            Some(false) => "no",
            None => "?",
        };
        out!("  {:<16} {:<4} {}", k.name, yes, k.detail)?;
    }
    for m in &p.missing {
        out!("not reported: {m}")?;
    }
    Ok(())
}

#[derive(Serialize)]
struct ChallengeReport {
    n: u32,
    rounds: u32,
    threads: usize,
    prover_ops: u128,
    prove_ms: f64,
    verify_ms: f64,
    ratio: f64,
    ops_per_sec: f64,
    deadline_ms: u64,
    passed: bool,
}

pub(super) fn challenge(size: u32, rounds: Option<u32>, format: Format) -> anyhow::Result<()> {
    let threads = cannabis_runtime::challenge::available_threads();
    let claim = Claim {
        cpu_cores: u32::try_from(threads.get()).unwrap_or(u32::MAX),
    };
    let sizing = Sizing {
        n: size,
        ..Sizing::default()
    };
    let seed = Digest(*random_bytes::<32>()?);
    let c = match rounds {
        Some(r) => Challenge::new(seed, size, r)?,
        None => sizing.challenge(seed, &claim)?,
    };
    let started = Instant::now();
    let answer = cannabis_runtime::challenge::prove(&c, threads);
    let prove = started.elapsed();
    let started = Instant::now();
    let verdict = c.verify(&answer, &Digest(*random_bytes::<32>()?));
    let verify = started.elapsed();
    let deadline_ms = sizing.deadline_ms(&c, &claim);
    let passed = verdict.is_ok() && (prove.as_millis() as u64) <= deadline_ms;
    let r = ChallengeReport {
        n: c.n,
        rounds: c.rounds,
        threads: threads.get(),
        prover_ops: c.prover_ops(),
        prove_ms: prove.as_secs_f64() * 1e3,
        verify_ms: verify.as_secs_f64() * 1e3,
        ratio: prove.as_secs_f64() / verify.as_secs_f64().max(1e-9),
        ops_per_sec: c.prover_ops() as f64 / prove.as_secs_f64().max(1e-9),
        deadline_ms,
        passed,
    };
    if format.json {
        output::json(&r)?;
    } else {
        output::table(&[
            (
                "challenge",
                format!("n = {}, {} rounds, {} threads", r.n, r.rounds, r.threads),
            ),
            (
                "prover",
                format!("{:.1} ms ({:.2e} integer ops/s)", r.prove_ms, r.ops_per_sec),
            ),
            ("verifier", format!("{:.1} ms", r.verify_ms)),
            ("prover / verifier", format!("{:.1}x", r.ratio)),
            ("deadline for this claim", format!("{} ms", r.deadline_ms)),
            (
                "result",
                if r.passed {
                    "passed".into()
                } else {
                    format!("FAILED: {verdict:?}")
                },
            ),
        ])?;
    }
    verdict.context("the answer did not verify")?;
    anyhow::ensure!(
        passed,
        "the answer came after the deadline ({deadline_ms} ms)"
    );
    Ok(())
}
