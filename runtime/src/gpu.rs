//! GPUs, whole devices by UUID, through NVML. The source is a trait so that the paths a test
//! machine cannot take for real (two GPUs, a failing driver) are exercised with a fake.

use cannabis_protocol::{Gpu, GpuVendor};
use serde::Serialize;

/// What the GPU probe found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "status")]
pub enum GpuReport {
    /// No NVIDIA driver or library: a normal case on machines without NVIDIA GPUs.
    NoDriver {
        /// What the loader said.
        detail: String,
    },
    /// The driver answered.
    Devices {
        /// Driver version.
        driver_version: String,
        /// Highest CUDA version the driver supports (`major.minor`).
        cuda_version: String,
        /// Every device, allowed or not.
        gpus: Vec<Gpu>,
    },
    /// NVML is there but failed: reported, never a panic, and no GPU is advertised.
    Failed {
        /// The error.
        error: String,
    },
}

impl GpuReport {
    /// The devices found (none unless the driver answered).
    pub fn gpus(&self) -> &[Gpu] {
        match self {
            GpuReport::Devices { gpus, .. } => gpus,
            _ => &[],
        }
    }

    /// One line for humans.
    pub fn summary(&self) -> String {
        match self {
            GpuReport::NoDriver { .. } => "no NVIDIA GPU found (no NVIDIA driver)".into(),
            GpuReport::Devices {
                gpus,
                driver_version,
                cuda_version,
            } => format!(
                "{} NVIDIA GPU(s), driver {driver_version}, CUDA {cuda_version}",
                gpus.len()
            ),
            GpuReport::Failed { error } => format!("NVML error: {error}"),
        }
    }
}

/// A GPU as a source reports it, before the owner's allow-list is applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// UUID (`GPU-...`).
    pub uuid: String,
    /// Name.
    pub name: String,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Compute capability `major.minor`.
    pub compute_capability: String,
    /// Utilization in percent.
    pub utilization_pct: u8,
}

/// Errors a GPU source reports.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// No driver or library.
    #[error("{0}")]
    NoDriver(String),
    /// Anything else.
    #[error("{0}")]
    Failed(String),
}

/// Where GPU facts come from.
pub trait GpuSource {
    /// Driver version, CUDA version and devices.
    fn read(&self) -> Result<(String, String, Vec<Device>), SourceError>;
}

/// Probes through `source` and marks the devices the owner allows (by UUID).
pub fn probe(source: &dyn GpuSource, allowed: &[String]) -> GpuReport {
    match source.read() {
        Err(SourceError::NoDriver(detail)) => GpuReport::NoDriver { detail },
        Err(SourceError::Failed(error)) => GpuReport::Failed { error },
        Ok((driver_version, cuda_version, devices)) => GpuReport::Devices {
            gpus: devices
                .into_iter()
                .map(|d| Gpu {
                    allowed: allowed.iter().any(|a| a == &d.uuid),
                    uuid: d.uuid,
                    name: d.name,
                    vendor: GpuVendor::Nvidia,
                    memory_bytes: d.memory_bytes,
                    driver_version: driver_version.clone(),
                    toolkit_version: cuda_version.clone(),
                    compute_capability: d.compute_capability,
                    utilization_pct: d.utilization_pct,
                })
                .collect(),
            driver_version,
            cuda_version,
        },
    }
}

/// The real source: NVML, loaded at run time (no driver is a normal case).
pub struct Nvml;

impl GpuSource for Nvml {
    fn read(&self) -> Result<(String, String, Vec<Device>), SourceError> {
        use nvml_wrapper::error::NvmlError;
        let nvml = match nvml_wrapper::Nvml::init() {
            Ok(n) => n,
            Err(
                e @ (NvmlError::LibloadingError(_)
                | NvmlError::LibraryNotFound
                | NvmlError::DriverNotLoaded),
            ) => {
                return Err(SourceError::NoDriver(e.to_string()));
            }
            Err(e) => return Err(SourceError::Failed(e.to_string())),
        };
        let failed = |what: &str, e: NvmlError| SourceError::Failed(format!("{what}: {e}"));
        let driver = nvml
            .sys_driver_version()
            .map_err(|e| failed("driver version", e))?;
        let cuda = nvml
            .sys_cuda_driver_version()
            .map(|v| {
                format!(
                    "{}.{}",
                    nvml_wrapper::cuda_driver_version_major(v),
                    nvml_wrapper::cuda_driver_version_minor(v)
                )
            })
            .map_err(|e| failed("CUDA version", e))?;
        let count = nvml.device_count().map_err(|e| failed("device count", e))?;
        let mut devices = Vec::new();
        for i in 0..count {
            let d = nvml.device_by_index(i).map_err(|e| failed("device", e))?;
            let cc = d
                .cuda_compute_capability()
                .map(|c| format!("{}.{}", c.major, c.minor))
                .unwrap_or_default();
            devices.push(Device {
                uuid: d.uuid().map_err(|e| failed("uuid", e))?,
                name: d.name().map_err(|e| failed("name", e))?,
                memory_bytes: d.memory_info().map_err(|e| failed("memory", e))?.total,
                compute_capability: cc,
                utilization_pct: d
                    .utilization_rates()
                    .map(|u| u8::try_from(u.gpu.min(100)).unwrap_or(100))
                    .unwrap_or(0),
            });
        }
        Ok((driver, cuda, devices))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(Result<(String, String, Vec<Device>), SourceError>);

    impl GpuSource for Fake {
        fn read(&self) -> Result<(String, String, Vec<Device>), SourceError> {
            self.0.clone()
        }
    }

    fn device(uuid: &str) -> Device {
        Device {
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            memory_bytes: 141 << 30,
            compute_capability: "9.0".into(),
            utilization_pct: 3,
        }
    }

    #[test]
    fn two_gpus_yield_two_devices_with_uuids_and_the_allow_list() {
        let fake = Fake(Ok((
            "570.86".into(),
            "12.8".into(),
            vec![device("GPU-aaaa"), device("GPU-bbbb")],
        )));
        let r = probe(&fake, &["GPU-bbbb".to_string()]);
        let gpus = r.gpus();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].uuid, "GPU-aaaa");
        assert!(!gpus[0].allowed);
        assert!(gpus[1].allowed);
        assert_eq!(gpus[1].toolkit_version, "12.8");
        assert!(r.summary().contains("2 NVIDIA GPU"));
    }

    #[test]
    fn no_driver_and_failures_are_reported_not_fatal() {
        let none = probe(
            &Fake(Err(SourceError::NoDriver(
                "libnvidia-ml.so: not found".into(),
            ))),
            &[],
        );
        assert!(none.gpus().is_empty());
        assert_eq!(none.summary(), "no NVIDIA GPU found (no NVIDIA driver)");
        let failed = probe(&Fake(Err(SourceError::Failed("GPU is lost".into()))), &[]);
        assert!(failed.gpus().is_empty());
        assert!(failed.summary().contains("GPU is lost"));
    }

    #[test]
    fn real_nvml_on_this_machine_answers_without_panicking() {
        // CI machines have no NVIDIA driver: this must be the normal "no GPU" answer there,
        // and a real device list on a GPU machine.
        let r = probe(&Nvml, &[]);
        match &r {
            GpuReport::NoDriver { .. } => println!("no NVIDIA driver here: {}", r.summary()),
            GpuReport::Devices { gpus, .. } => {
                assert!(gpus.iter().all(|g| g.uuid.starts_with("GPU-")))
            }
            GpuReport::Failed { error } => println!("NVML present but failing: {error}"),
        }
    }
}
