//! The node's side of the local executor: the machine's capacity, the administrator's
//! ceilings, the owner's limits, and the journal in the node's store.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cannabis_protocol::AdapterKind;
use cannabis_runtime::exec::{
    Ceilings, DEFAULT_CEILINGS, Executor, ExecutorConfig, Journal, Limits, LimitsFile,
};

/// Processes the machine offers when nothing else says.
const DEFAULT_PROCESSES: u64 = 4096;

/// What this machine has: every core, memory, swap, the free storage under `data_dir`,
/// its GPUs, and every adapter this executor implements.
pub fn machine_limits(data_dir: &Path, gpus: Vec<String>) -> Limits {
    let host = cannabis_runtime::probe::host(data_dir);
    Limits {
        cpu_millicores: u64::from(host.hardware.cpu_cores.max(1)) * 1000,
        memory_bytes: host.hardware.memory_bytes,
        swap_bytes: host.hardware.swap_bytes,
        processes: DEFAULT_PROCESSES,
        storage_bytes: host.hardware.storage_bytes,
        gpus,
        adapters: vec![AdapterKind::Process, AdapterKind::Synthetic],
        custom_code: true,
    }
}

/// The ceilings file: the given path, else the default.
pub fn ceilings_path(flag: Option<&Path>) -> PathBuf {
    flag.map_or_else(|| PathBuf::from(DEFAULT_CEILINGS), Path::to_path_buf)
}

/// Opens an executor under `dir` with the ceilings at `ceilings` and the owner's limits.
/// `cdi_map` is the owner's pinned NVIDIA CDI map, from which granted GPUs' device nodes
/// come.
pub fn open(
    dir: &Path,
    machine: &Limits,
    ceilings: &Path,
    owner: &LimitsFile,
    cdi_map: Option<&Path>,
    journal: Arc<dyn Journal>,
) -> Result<Executor, String> {
    let ceilings = Ceilings::load(ceilings, machine)?;
    let owner = ceilings.owner(owner)?;
    let program = std::env::current_exe().map_err(|e| format!("finding this binary: {e}"))?;
    let mut cfg = ExecutorConfig::new(dir.to_path_buf(), program, ceilings, owner);
    cfg.cdi_map = cdi_map.map(Path::to_path_buf);
    Executor::open(cfg, journal).map_err(|e| e.to_string())
}
