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
