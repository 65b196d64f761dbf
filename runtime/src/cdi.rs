//! The NVIDIA CDI device map check.
//!
//! The administrator generates a CDI spec naming devices by UUID
//! (`nvidia-ctk cdi generate --device-name-strategy=uuid --format=json`) and pins a copy in
//! the node's configuration (`owner.cdi_map`). GPUs are advertised only while the pinned map
//! agrees with what NVML reports: every allowed GPU is in the map, and every GPU the map
//! names is present. A stale or mismatched map is refused with what to do; the node never
//! broadens or replaces the pinned copy itself. The check runs at every re-probe, so after a
//! reboot or a driver change nothing is advertised until the map is verified again.

use std::collections::BTreeSet;
use std::path::Path;

use cannabis_protocol::Gpu;
use serde::Deserialize;

/// How to regenerate and re-pin the map, for error messages.
pub const REGENERATE: &str = "regenerate it with `nvidia-ctk cdi generate --device-name-strategy=uuid \
--format=json --output=/etc/cdi/nvidia.json`, check the UUIDs against `cannabis probe`, and copy it \
to the path pinned in owner.cdi_map";

#[derive(Deserialize)]
struct Spec {
    kind: String,
    devices: Vec<Device>,
    #[serde(default, rename = "containerEdits")]
    edits: Edits,
}

#[derive(Deserialize)]
struct Device {
    name: String,
    #[serde(default, rename = "containerEdits")]
    edits: Edits,
}

#[derive(Default, Deserialize)]
struct Edits {
    #[serde(default, rename = "deviceNodes")]
    device_nodes: Vec<DeviceNode>,
}

#[derive(Deserialize)]
struct DeviceNode {
    path: String,
}

/// Why the map was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdiError {
    /// The pinned file cannot be read or parsed.
    #[error("the pinned CDI map {path} is unusable ({reason}); {REGENERATE}")]
    Unusable {
        /// The pinned path.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The map is not an NVIDIA GPU map.
    #[error("the pinned CDI map {path} is of kind {kind:?}, not nvidia.com/gpu; {REGENERATE}")]
    WrongKind {
        /// The pinned path.
        path: String,
        /// Its kind.
        kind: String,
    },
    /// The map and the probe disagree.
    #[error(
        "the pinned CDI map {path} does not match the GPUs present \
         (in the map but not present: {stale:?}; allowed but not in the map: {unmapped:?}); \
         it is stale, refused, and no GPU is advertised until it is re-pinned: {REGENERATE}"
    )]
    Mismatch {
        /// The pinned path.
        path: String,
        /// UUIDs the map names that the probe did not find.
        stale: Vec<String>,
        /// Allowed UUIDs the map does not name.
        unmapped: Vec<String>,
    },
}

/// Reads and parses the pinned map.
fn read_spec(path: &Path) -> Result<Spec, CdiError> {
    let unusable = |reason: String| CdiError::Unusable {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| unusable(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| unusable(format!("not a JSON CDI spec: {e}")))
}

/// Checks the pinned map at `path` against the probed GPUs. On success returns the UUIDs
/// the map names.
pub fn check(path: &Path, probed: &[Gpu]) -> Result<BTreeSet<String>, CdiError> {
    let shown = path.display().to_string();
    let spec = read_spec(path)?;
    if spec.kind != "nvidia.com/gpu" {
        return Err(CdiError::WrongKind {
            path: shown,
            kind: spec.kind,
        });
    }
    let mapped: BTreeSet<String> = spec
        .devices
        .into_iter()
        .map(|d| d.name)
        .filter(|n| n.starts_with("GPU-"))
        .collect();
    let present: BTreeSet<&str> = probed.iter().map(|g| g.uuid.as_str()).collect();
    let stale: Vec<String> = mapped
        .iter()
        .filter(|u| !present.contains(u.as_str()))
        .cloned()
        .collect();
    let unmapped: Vec<String> = probed
        .iter()
        .filter(|g| g.allowed && !mapped.contains(&g.uuid))
        .map(|g| g.uuid.clone())
        .collect();
    if !stale.is_empty() || !unmapped.is_empty() {
        return Err(CdiError::Mismatch {
            path: shown,
            stale,
            unmapped,
        });
    }
    Ok(mapped)
}

/// The device nodes the pinned map gives the GPUs `uuids` (each device's own nodes, then
/// the map's common ones such as `/dev/nvidiactl` and `/dev/nvidia-uvm`), for a sandbox
/// that was granted exactly those GPUs. A UUID the map does not name is an error.
pub fn device_nodes(path: &Path, uuids: &[String]) -> Result<Vec<std::path::PathBuf>, CdiError> {
    let unusable = |reason: String| CdiError::Unusable {
        path: path.display().to_string(),
        reason,
    };
    let spec = read_spec(path)?;
    let mut nodes: Vec<std::path::PathBuf> = Vec::new();
    for uuid in uuids {
        let device = spec
            .devices
            .iter()
            .find(|d| &d.name == uuid)
            .ok_or_else(|| unusable(format!("it names no device {uuid}")))?;
        nodes.extend(
            device
                .edits
                .device_nodes
                .iter()
                .map(|n| n.path.clone().into()),
        );
    }
    nodes.extend(
        spec.edits
            .device_nodes
            .iter()
            .map(|n| n.path.clone().into()),
    );
    nodes.dedup();
    if let Some(bad) = nodes.iter().find(|n| !n.starts_with("/dev/")) {
        return Err(unusable(format!(
            "device node {} is not under /dev",
            bad.display()
        )));
    }
    Ok(nodes)
}

/// Applies the map to probed GPUs: with no pinned map, or a refused one, no GPU stays
/// allowed. Returns the refusal, if any, for the operator.
pub fn enforce(map: Option<&Path>, gpus: &mut [Gpu]) -> Option<String> {
    if !gpus.iter().any(|g| g.allowed) {
        return None;
    }
    let refusal = match map {
        None => Some(format!(
            "GPUs are allowed but no CDI device map is pinned (owner.cdi_map); {REGENERATE}"
        )),
        Some(path) => check(path, gpus).err().map(|e| e.to_string()),
    };
    if refusal.is_some() {
        for g in gpus.iter_mut() {
            g.allowed = false;
        }
    }
    refusal
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::GpuVendor;

    #[test]
    fn device_nodes_are_the_devices_own_then_the_common_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvidia.json");
        std::fs::write(
            &path,
            r#"{"kind": "nvidia.com/gpu",
                "devices": [
                  {"name": "GPU-a", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
                  {"name": "GPU-b", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}],
                "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}]}}"#,
        )
        .unwrap();
        let nodes = device_nodes(&path, &["GPU-b".into()]).unwrap();
        assert_eq!(
            nodes,
            ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"].map(std::path::PathBuf::from)
        );
        assert!(device_nodes(&path, &["GPU-x".into()]).is_err());
    }

    fn gpu(uuid: &str, allowed: bool) -> Gpu {
        Gpu {
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            vendor: GpuVendor::Nvidia,
            memory_bytes: 1 << 30,
            driver_version: "570".into(),
            toolkit_version: "12.8".into(),
            compute_capability: "9.0".into(),
            utilization_pct: 0,
            allowed,
        }
    }

    fn map(dir: &Path, names: &[&str]) -> std::path::PathBuf {
        let devices: Vec<String> = names
            .iter()
            .map(|n| format!(r#"{{"name": "{n}", "containerEdits": {{"deviceNodes": [{{"path": "/dev/nvidia0"}}]}}}}"#))
            .collect();
        let path = dir.join("nvidia.json");
        std::fs::write(
            &path,
            format!(
                r#"{{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{}]}}"#,
                devices.join(",")
            ),
        )
        .unwrap();
        path
    }

    #[test]
    fn a_matching_map_passes() {
        let dir = tempfile::tempdir().unwrap();
        let p = map(dir.path(), &["GPU-a", "GPU-b", "all"]);
        let mut gpus = vec![gpu("GPU-a", true), gpu("GPU-b", false)];
        assert_eq!(check(&p, &gpus).unwrap().len(), 2);
        assert_eq!(enforce(Some(&p), &mut gpus), None);
        assert!(gpus[0].allowed);
    }

    #[test]
    fn a_map_that_disagrees_is_refused_and_nothing_is_advertised() {
        let dir = tempfile::tempdir().unwrap();
        // After a driver change or a swapped card: the map names a GPU that is gone.
        let p = map(dir.path(), &["GPU-a", "GPU-old"]);
        let mut gpus = vec![gpu("GPU-a", true), gpu("GPU-new", true)];
        match check(&p, &gpus) {
            Err(CdiError::Mismatch {
                stale, unmapped, ..
            }) => {
                assert_eq!(stale, vec!["GPU-old".to_string()]);
                assert_eq!(unmapped, vec!["GPU-new".to_string()]);
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        let refusal = enforce(Some(&p), &mut gpus).unwrap();
        assert!(refusal.contains("nvidia-ctk cdi generate"), "{refusal}");
        assert!(gpus.iter().all(|g| !g.allowed));
        // The pinned file is left as it was.
        assert!(std::fs::read_to_string(&p).unwrap().contains("GPU-old"));
    }

    #[test]
    fn missing_unreadable_or_foreign_maps_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let gpus = vec![gpu("GPU-a", true)];
        assert!(matches!(
            check(&dir.path().join("none.json"), &gpus),
            Err(CdiError::Unusable { .. })
        ));
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "cdiVersion: 0.5.0\n").unwrap();
        assert!(matches!(check(&bad, &gpus), Err(CdiError::Unusable { .. })));
        let other = dir.path().join("other.json");
        std::fs::write(&other, r#"{"kind": "amd.com/gpu", "devices": []}"#).unwrap();
        assert!(matches!(
            check(&other, &gpus),
            Err(CdiError::WrongKind { .. })
        ));
        let mut allowed = gpus.clone();
        assert!(
            enforce(None, &mut allowed)
                .unwrap()
                .contains("no CDI device map")
        );
        assert!(!allowed[0].allowed);
    }
}
