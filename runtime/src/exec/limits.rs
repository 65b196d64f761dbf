//! Capacity: the machine, the administrator's ceilings (a file the node only reads) and the
//! owner's settings, which must stay within the ceilings.

use std::path::{Path, PathBuf};

use cannabis_protocol::AdapterKind;
use cannabis_protocol::units::parse_size;
use serde::{Deserialize, Serialize};

/// Default path of the administrator's ceilings.
pub const DEFAULT_CEILINGS: &str = "/etc/cannabis/ceilings.toml";

/// Capacity figures.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Limits {
    /// CPU in thousandths of a core.
    pub cpu_millicores: u64,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Swap in bytes.
    pub swap_bytes: u64,
    /// Processes (and threads) across all attempts.
    pub processes: u64,
    /// Work-directory bytes across all attempts.
    pub storage_bytes: u64,
    /// GPUs that may be given out, by UUID.
    pub gpus: Vec<String>,
    /// Adapters that may run.
    pub adapters: Vec<AdapterKind>,
    /// Whether requesters' own programs (the `process` adapter) may run.
    pub custom_code: bool,
}

/// A limits file, every field optional: the ceilings file, or the owner's `[executor]`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsFile {
    /// Cores, fractions allowed.
    pub cpu: Option<f64>,
    /// Memory, e.g. `"16GiB"`.
    pub memory: Option<String>,
    /// Swap, e.g. `"0"`.
    pub swap: Option<String>,
    /// Processes.
    pub processes: Option<u64>,
    /// Work-directory storage, e.g. `"50GiB"`.
    pub storage: Option<String>,
    /// GPU UUIDs.
    pub gpus: Option<Vec<String>>,
    /// Adapters.
    pub adapters: Option<Vec<AdapterKind>>,
    /// Custom code.
    pub custom_code: Option<bool>,
    /// First host uid for sandboxes when the node runs as root (ceilings file only).
    pub sandbox_uid: Option<u32>,
}

/// The administrator's ceilings, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ceilings {
    /// The limits (never above the machine).
    pub limits: Limits,
    /// The file they came from; `None` when there is none (the machine is the ceiling).
    pub source: Option<PathBuf>,
    /// First host uid for sandboxes.
    pub sandbox_uid: u32,
}

/// Default first sandbox uid: far above any login or container range.
pub const DEFAULT_SANDBOX_UID: u32 = 1_900_000_000;

impl LimitsFile {
    /// Parses `text` (TOML).
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    fn resolve(&self, base: &Limits, who: &str) -> Result<Limits, String> {
        let size = |field: &str, v: &Option<String>, d: u64| -> Result<u64, String> {
            v.as_deref().map_or(Ok(d), |t| {
                parse_size(t).map_err(|e| format!("{who}{field}: {e}"))
            })
        };
        let cpu_millicores = match self.cpu {
            None => base.cpu_millicores,
            Some(c) if c.is_finite() && c > 0.0 => (c * 1000.0).round() as u64,
            Some(c) => return Err(format!("{who}cpu: {c} is not a positive number of cores")),
        };
        Ok(Limits {
            cpu_millicores,
            memory_bytes: size("memory", &self.memory, base.memory_bytes)?,
            swap_bytes: size("swap", &self.swap, base.swap_bytes)?,
            processes: self.processes.unwrap_or(base.processes),
            storage_bytes: size("storage", &self.storage, base.storage_bytes)?,
            gpus: self.gpus.clone().unwrap_or_else(|| base.gpus.clone()),
            adapters: self
                .adapters
                .clone()
                .unwrap_or_else(|| base.adapters.clone()),
            custom_code: self.custom_code.unwrap_or(base.custom_code),
        })
    }
}

impl Ceilings {
    /// Reads the ceilings at `path`, never above `machine`. A missing file means the
    /// machine is the ceiling.
    pub fn load(path: &Path, machine: &Limits) -> Result<Self, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self {
                    limits: machine.clone(),
                    source: None,
                    sandbox_uid: DEFAULT_SANDBOX_UID,
                });
            }
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let file = LimitsFile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let asked = file
            .resolve(machine, "")
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            limits: Limits {
                cpu_millicores: asked.cpu_millicores.min(machine.cpu_millicores),
                memory_bytes: asked.memory_bytes.min(machine.memory_bytes),
                swap_bytes: asked.swap_bytes.min(machine.swap_bytes),
                processes: asked.processes,
                storage_bytes: asked.storage_bytes.min(machine.storage_bytes),
                gpus: asked
                    .gpus
                    .into_iter()
                    .filter(|g| machine.gpus.contains(g))
                    .collect(),
                adapters: asked.adapters,
                custom_code: asked.custom_code,
            },
            source: Some(path.to_path_buf()),
            sandbox_uid: file.sandbox_uid.unwrap_or(DEFAULT_SANDBOX_UID),
        })
    }

    /// The owner's settings resolved within these ceilings: an unset field takes the
    /// ceiling; a field above it is an error that names both.
    pub fn owner(&self, owner: &LimitsFile) -> Result<Limits, String> {
        let o = owner.resolve(&self.limits, "executor.")?;
        let c = &self.limits;
        let from = self.source.as_ref().map_or_else(
            || "this machine".to_string(),
            |p| format!("the administrator's ceiling in {}", p.display()),
        );
        let over = |field: &str, asked: u64, ceiling: u64| -> Result<(), String> {
            if asked > ceiling {
                Err(format!(
                    "executor.{field} = {asked} is above {from} ({ceiling}); lower it or ask the administrator"
                ))
            } else {
                Ok(())
            }
        };
        over("cpu (millicores)", o.cpu_millicores, c.cpu_millicores)?;
        over("memory (bytes)", o.memory_bytes, c.memory_bytes)?;
        over("swap (bytes)", o.swap_bytes, c.swap_bytes)?;
        over("processes", o.processes, c.processes)?;
        over("storage (bytes)", o.storage_bytes, c.storage_bytes)?;
        if let Some(g) = o.gpus.iter().find(|g| !c.gpus.contains(g)) {
            return Err(format!("executor.gpus: {g} is not allowed by {from}"));
        }
        if let Some(a) = o.adapters.iter().find(|a| !c.adapters.contains(a)) {
            return Err(format!("executor.adapters: {a:?} is not allowed by {from}"));
        }
        if o.custom_code && !c.custom_code {
            return Err(format!(
                "executor.custom_code = true is not allowed by {from}"
            ));
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Limits {
        Limits {
            cpu_millicores: 4000,
            memory_bytes: 16 << 30,
            swap_bytes: 0,
            processes: 4096,
            storage_bytes: 100 << 30,
            gpus: vec!["GPU-a".into(), "GPU-b".into()],
            adapters: vec![AdapterKind::Process, AdapterKind::Synthetic],
            custom_code: true,
        }
    }

    #[test]
    fn no_file_means_the_machine_is_the_ceiling() {
        let c = Ceilings::load(Path::new("/nonexistent/ceilings.toml"), &machine()).unwrap();
        assert_eq!(c.limits, machine());
        assert_eq!(c.source, None);
    }

    #[test]
    fn ceilings_never_exceed_the_machine_and_owners_stay_within() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ceilings.toml");
        std::fs::write(
            &path,
            "cpu = 64\nmemory = \"8GiB\"\ngpus = [\"GPU-b\", \"GPU-x\"]\nadapters = [\"synthetic\"]\ncustom_code = false\n",
        )
        .unwrap();
        let c = Ceilings::load(&path, &machine()).unwrap();
        assert_eq!(c.limits.cpu_millicores, 4000, "never above the machine");
        assert_eq!(c.limits.memory_bytes, 8 << 30);
        assert_eq!(c.limits.gpus, ["GPU-b"], "unknown GPUs are dropped");

        let owner = c.owner(&LimitsFile::default()).unwrap();
        assert_eq!(owner, c.limits, "unset owner fields take the ceiling");
        let lower = LimitsFile::parse("memory = \"2GiB\"\ncpu = 1.5").unwrap();
        let o = c.owner(&lower).unwrap();
        assert_eq!((o.memory_bytes, o.cpu_millicores), (2 << 30, 1500));

        for (text, word) in [
            ("memory = \"9GiB\"", "memory"),
            ("custom_code = true", "custom_code"),
            ("adapters = [\"process\"]", "adapters"),
            ("gpus = [\"GPU-a\"]", "gpus"),
        ] {
            let err = c.owner(&LimitsFile::parse(text).unwrap()).unwrap_err();
            assert!(err.contains(word), "{err}");
            assert!(err.contains("ceilings.toml"), "{err}");
        }
        assert!(LimitsFile::parse("bogus = 1").is_err());
    }
}
