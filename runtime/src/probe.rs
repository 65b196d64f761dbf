//! The host probe: CPU, memory, swap, free storage, OS and kernel, read from the kernel's
//! own reports (`/proc`, `statvfs`). Nothing is guessed: a value the system does not report
//! is left empty or zero and the probe says so in [`HostReport::missing`].

use std::path::Path;

use cannabis_protocol::{Hardware, OsInfo};

/// What the host probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostReport {
    /// CPU, memory, swap and storage. GPUs are probed separately.
    pub hardware: Hardware,
    /// Operating system and kernel.
    pub os: OsInfo,
    /// Facts the system did not report, with the reason.
    pub missing: Vec<String>,
}

/// Probes the host; `storage_dir` is where free space is measured (the data directory).
pub fn host(storage_dir: &Path) -> HostReport {
    let mut missing = Vec::new();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_else(|e| {
        missing.push(format!("memory and swap: /proc/meminfo: {e}"));
        String::new()
    });
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    if cpu_model.is_empty() {
        missing.push("cpu model: not in /proc/cpuinfo".into());
    }
    let cpu_cores = std::thread::available_parallelism()
        .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
        .unwrap_or_else(|e| {
            missing.push(format!("cpu cores: {e}"));
            0
        });
    let storage_bytes = match nix::sys::statvfs::statvfs(storage_dir) {
        Ok(s) => s.blocks_available().saturating_mul(s.fragment_size()),
        Err(e) => {
            missing.push(format!("free storage under {}: {e}", storage_dir.display()));
            0
        }
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let os_name = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        })
        .unwrap_or_else(|| std::env::consts::OS.to_string());
    HostReport {
        hardware: Hardware {
            cpu_model,
            cpu_cores,
            memory_bytes: meminfo_kib(&meminfo, "MemTotal").saturating_mul(1024),
            swap_bytes: meminfo_kib(&meminfo, "SwapTotal").saturating_mul(1024),
            storage_bytes,
            gpus: Vec::new(),
        },
        os: OsInfo {
            name: os_name,
            kernel,
        },
        missing,
    }
}

/// A `Key:   123 kB` line of `/proc/meminfo`, in KiB.
fn meminfo_kib(meminfo: &str, key: &str) -> u64 {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(':')))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_lines_parse() {
        let m = "MemTotal:       24576000 kB\nSwapTotal:             0 kB\n";
        assert_eq!(meminfo_kib(m, "MemTotal"), 24_576_000);
        assert_eq!(meminfo_kib(m, "SwapTotal"), 0);
        assert_eq!(meminfo_kib(m, "Missing"), 0);
    }

    #[test]
    fn this_host_reports_sane_facts() {
        let dir = tempfile::tempdir().unwrap();
        let r = host(dir.path());
        assert!(r.hardware.cpu_cores >= 1);
        assert!(r.hardware.memory_bytes > 64 << 20, "{r:?}");
        assert!(r.hardware.storage_bytes > 0, "{r:?}");
        assert!(!r.os.kernel.is_empty());
        assert!(r.hardware.gpus.is_empty());
    }
}

/// Everything `cannabis probe` reports: what the node would advertise, and what the kernel
/// offers the sandbox.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Probe {
    /// CPU, memory, swap, storage, OS (GPUs are in `gpus`).
    pub hardware: Hardware,
    /// OS and kernel.
    pub os: OsInfo,
    /// Facts the system did not report.
    pub missing: Vec<String>,
    /// The GPU probe's answer.
    pub gpus: crate::gpu::GpuReport,
    /// Why allowed GPUs are not advertised (no pinned CDI map, or a refused one).
    pub gpu_refusal: Option<String>,
    /// Runtimes found, with versions.
    pub runtimes: Vec<cannabis_protocol::Runtime>,
    /// Collective backends available (from the installed torch).
    pub collectives: Vec<cannabis_protocol::Collective>,
    /// Executor adapters this build runs.
    pub adapters: Vec<cannabis_protocol::AdapterKind>,
    /// Kernel features the sandbox builds on. Not advertised: the ad lists only the layers
    /// the sandbox has been verified to enforce.
    pub kernel: Vec<KernelFeature>,
}

/// One kernel feature and whether this machine has it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KernelFeature {
    /// Name.
    pub name: &'static str,
    /// Available here; `None` when the system does not say.
    pub available: Option<bool>,
    /// What was read.
    pub detail: String,
}

/// The GPUs to advertise: probed through `source`, the owner's `allowed` UUIDs marked, and
/// allowed only while the pinned CDI map (`cdi_map`) verifies. Returns the report, the GPU
/// list and the reason allowed GPUs were withdrawn, if they were.
pub fn gpus(
    source: &dyn crate::gpu::GpuSource,
    allowed: &[String],
    cdi_map: Option<&Path>,
) -> (
    crate::gpu::GpuReport,
    Vec<cannabis_protocol::Gpu>,
    Option<String>,
) {
    let report = crate::gpu::probe(source, allowed);
    let mut list = report.gpus().to_vec();
    let refusal = crate::cdi::enforce(cdi_map, &mut list);
    (report, list, refusal)
}

/// Probes everything: host, GPUs (see [`gpus`]), runtimes and kernel features.
pub fn probe(
    storage_dir: &Path,
    source: &dyn crate::gpu::GpuSource,
    allowed: &[String],
    cdi_map: Option<&Path>,
) -> Probe {
    let host = host(storage_dir);
    let (gpu_report, list, gpu_refusal) = gpus(source, allowed, cdi_map);
    let mut hardware = host.hardware;
    hardware.gpus = list;
    let (runtimes, collectives) = runtimes();
    Probe {
        hardware,
        os: host.os,
        missing: host.missing,
        gpus: gpu_report,
        gpu_refusal,
        runtimes,
        collectives,
        adapters: vec![cannabis_protocol::AdapterKind::Synthetic],
        kernel: kernel_features(),
    }
}

/// Runs a command with a time limit; its trimmed stdout, or `None` when it is missing,
/// fails or runs too long.
fn run_with_timeout(program: &str, args: &[&str], timeout: std::time::Duration) -> Option<String> {
    use std::io::Read as _;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) if std::time::Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
    let mut out = String::new();
    child.stdout.take()?.read_to_string(&mut out).ok()?;
    Some(out.trim().to_string())
}

/// One run of python3 says its version and, when torch imports, torch's build and
/// collectives (one process: on machines where `python3` is a shim, each start costs more
/// than the probe itself).
const PYTHON_PROBE: &str = r#"
import json, platform
r = {"python": platform.python_version()}
try:
    import torch, torch.distributed as d
    r.update(torch=torch.__version__, cuda=torch.version.cuda,
             hip=getattr(torch.version, "hip", None),
             nccl=d.is_available() and d.is_nccl_available(),
             gloo=d.is_available() and d.is_gloo_available())
except Exception:
    pass
print(json.dumps(r))
"#;

/// What [`PYTHON_PROBE`] prints.
#[derive(serde::Deserialize)]
struct PythonProbe {
    python: String,
    torch: Option<String>,
    cuda: Option<String>,
    hip: Option<String>,
    #[serde(default)]
    nccl: bool,
    #[serde(default)]
    gloo: bool,
}

/// python3 and torch (with its CUDA or ROCm build and collectives), when installed. Runs
/// `python3` (importing torch can take seconds), so callers keep it off latency-sensitive
/// threads.
pub fn runtimes() -> (
    Vec<cannabis_protocol::Runtime>,
    Vec<cannabis_protocol::Collective>,
) {
    use cannabis_protocol::{Collective, Runtime};
    let mut runtimes = Vec::new();
    let mut collectives = Vec::new();
    let probe = run_with_timeout(
        "python3",
        &["-c", PYTHON_PROBE],
        std::time::Duration::from_secs(60),
    )
    .and_then(|out| serde_json::from_str::<PythonProbe>(out.lines().last()?).ok());
    let Some(p) = probe else {
        return (runtimes, collectives);
    };
    let runtime = |name: &str, version: String| Runtime {
        name: name.into(),
        version,
    };
    runtimes.push(runtime("python3", p.python));
    runtimes.extend(p.torch.map(|v| runtime("torch", v)));
    runtimes.extend(p.cuda.map(|v| runtime("cuda", v)));
    runtimes.extend(p.hip.map(|v| runtime("rocm", v)));
    if p.gloo {
        collectives.push(Collective::Gloo);
    }
    if p.nccl {
        collectives.push(Collective::Nccl);
    }
    (runtimes, collectives)
}

/// The kernel features the sandbox builds on.
fn kernel_features() -> Vec<KernelFeature> {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    let mut out = Vec::new();
    let userns = read("/proc/sys/user/max_user_namespaces");
    out.push(KernelFeature {
        name: "user namespaces",
        available: Some(userns.as_deref().is_ok_and(|v| v != "0")),
        detail: userns.map_or_else(|e| e.to_string(), |v| format!("max_user_namespaces {v}")),
    });
    let v2 = read("/sys/fs/cgroup/cgroup.controllers").unwrap_or_default();
    let v1: Vec<String> = read("/proc/cgroups")
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && f[1] != "0" && f[3] == "1").then(|| f[0].to_string())
        })
        .collect();
    for controller in ["memory", "pids", "cpu"] {
        let in_v2 = v2.split_whitespace().any(|c| c == controller);
        let in_v1 = v1.iter().any(|c| c == controller);
        out.push(KernelFeature {
            name: match controller {
                "memory" => "cgroup memory",
                "pids" => "cgroup pids",
                _ => "cgroup cpu",
            },
            available: Some(in_v2 || in_v1),
            detail: if in_v2 {
                "cgroup v2".into()
            } else if in_v1 {
                "cgroup v1 hierarchy".into()
            } else {
                "no controller".into()
            },
        });
    }
    let seccomp = read("/proc/sys/kernel/seccomp/actions_avail");
    out.push(KernelFeature {
        name: "seccomp",
        available: Some(seccomp.is_ok()),
        detail: seccomp.unwrap_or_else(|e| e.to_string()),
    });
    // The LSM list needs securityfs; without it the answer is unknown, not "no" (the
    // sandbox asks the kernel directly for the Landlock ABI).
    let lsm = read("/sys/kernel/security/lsm").unwrap_or_default();
    out.push(KernelFeature {
        name: "landlock",
        available: (!lsm.is_empty()).then(|| lsm.split(',').any(|m| m == "landlock")),
        detail: if lsm.is_empty() {
            "not determined: /sys/kernel/security/lsm is not readable".into()
        } else {
            format!("lsm: {lsm}")
        },
    });
    out
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    #[test]
    fn the_full_probe_on_this_machine_is_complete() {
        let dir = tempfile::tempdir().unwrap();
        let p = probe(dir.path(), &crate::gpu::Nvml, &[], None);
        assert!(p.hardware.cpu_cores >= 1 && p.hardware.memory_bytes > 0);
        assert!(!p.os.kernel.is_empty());
        assert!(!p.adapters.is_empty());
        assert_eq!(p.kernel.len(), 6);
        // Every machine of this kind has python3; torch is optional.
        if let Some(py) = p.runtimes.iter().find(|r| r.name == "python3") {
            assert!(py.version.starts_with('3'), "{py:?}");
        }
        // Nothing is allowed, so the list is exactly what the GPU probe found.
        assert_eq!(p.hardware.gpus, p.gpus.gpus());
        assert_eq!(p.gpu_refusal, None);
    }

    #[test]
    fn commands_that_hang_are_cut_off() {
        let started = std::time::Instant::now();
        assert_eq!(
            run_with_timeout("sleep", &["10"], std::time::Duration::from_millis(200)),
            None
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(
            run_with_timeout(
                "no-such-program-here",
                &[],
                std::time::Duration::from_secs(1)
            ),
            None
        );
        assert_eq!(
            run_with_timeout("echo", &["hi"], std::time::Duration::from_secs(5)).as_deref(),
            Some("hi")
        );
    }
}
