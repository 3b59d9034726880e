//! NVML through `nvml-wrapper`, loaded at run time: no build-time dependency on a driver,
//! and a clear error (never a panic) where there is none.
//!
//! A GPU in MIG mode is read through its MIG devices: each one's memory (its GPU
//! instance's) and processes; the parent lists no processes of its own, so none is counted
//! twice. The agent only reads MIG mode, never changes it.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};

use super::{GpuSample, GpuSource, MigSample, NodeSample, ProcessSample, SourceError};

/// NVML's `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLED: u32 = 1;

/// The node's GPUs as NVML reports them.
#[derive(Default)]
pub struct NvmlSource {
    /// The library, once initialised; dropped after a failure so that the next sample
    /// initialises it again (a driver reload or a GPU coming back is picked up).
    nvml: Option<Nvml>,
}

impl NvmlSource {
    /// A source that initialises NVML on first use.
    pub fn new() -> Self {
        NvmlSource::default()
    }
}

fn describe(e: &NvmlError) -> SourceError {
    match e {
        NvmlError::LibloadingError(_) => SourceError::LibraryMissing(e.to_string()),
        NvmlError::DriverNotLoaded => SourceError::DriverNotLoaded,
        NvmlError::GpuLost => SourceError::GpuLost,
        other => SourceError::Failed {
            source_name: "NVML",
            reason: other.to_string(),
        },
    }
}

fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// MPS's server process (`nvidia-cuda-mps-server`), which NVML lists beside its clients under
/// MPS, as `/proc/<pid>/comm` names it: cut to 15 bytes by the kernel.
pub const MPS_SERVER: &str = "nvidia-cuda-mps";

/// The container a process's memory is charged to: its own, but none for MPS's server, which
/// holds memory for every client pod on the GPU and runs in the MPS control daemon's pod
/// (charging it there would put the tenants' memory on the platform's pod).
fn charged_to(
    name: &str,
    container: impl FnOnce() -> Option<super::cgroup::ContainerRef>,
) -> Option<super::cgroup::ContainerRef> {
    (name != MPS_SERVER).then(container).flatten()
}

/// The processes using a device (a GPU or a MIG device), each once; on a MIG device, only
/// those of its compute instance (`compute_instance`) where NVML says which.
fn processes(device: &Device<'_>, compute_instance: Option<u32>) -> Vec<ProcessSample> {
    let mut processes: Vec<ProcessSample> = Vec::new();
    let compute = device.running_compute_processes().unwrap_or_default();
    let graphics = device.running_graphics_processes().unwrap_or_default();
    for p in compute.into_iter().chain(graphics) {
        let elsewhere = matches!(
            (compute_instance, p.compute_instance_id),
            (Some(mine), Some(its)) if mine != its
        );
        if elsewhere || processes.iter().any(|q| q.pid == p.pid) {
            continue;
        }
        let name = process_name(p.pid);
        processes.push(ProcessSample {
            pid: p.pid,
            container: charged_to(&name, || super::cgroup::container_of(p.pid)),
            name,
            used: match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            },
        });
    }
    processes
}

/// A MIG device's GPU and compute instance IDs (`nvmlDeviceGetGpuInstanceId`,
/// `nvmlDeviceGetComputeInstanceId`, which nvml-wrapper does not wrap).
#[allow(unsafe_code)]
fn instance_ids(nvml: &Nvml, mig: &Device<'_>) -> Result<(u32, u32), NvmlError> {
    let lib = nvml.lib();
    let mut ids: [std::os::raw::c_uint; 2] = [0; 2];
    for (sym, id) in [
        lib.nvmlDeviceGetGpuInstanceId.as_ref(),
        lib.nvmlDeviceGetComputeInstanceId.as_ref(),
    ]
    .into_iter()
    .zip(&mut ids)
    {
        let sym = nvml_sym(sym)?;
        // SAFETY: `mig` is a live MIG device handle of this library (it borrows `nvml`), and
        // the call only writes `id`, which outlives it.
        nvml_try(unsafe { sym(mig.handle(), id) })?;
    }
    Ok((ids[0], ids[1]))
}

/// One MIG device of a GPU.
fn mig_device(nvml: &Nvml, index: u32, mig: &Device<'_>) -> Result<MigSample, NvmlError> {
    let memory = mig.memory_info()?;
    let (gpu_instance, compute_instance) = instance_ids(nvml, mig)?;
    Ok(MigSample {
        index,
        uuid: mig.uuid()?,
        gpu_instance,
        compute_instance,
        profile: MigSample::profile_of(&mig.name()?),
        total: memory.total,
        used: memory.used,
        free: memory.free,
        processes: processes(mig, Some(compute_instance)),
    })
}

/// The MIG devices of a GPU: none unless MIG mode is on. A MIG device that cannot be read is
/// left out with a warning (the GPU and its other MIG devices are still read); a process is
/// listed once, on the first MIG device that names it.
fn mig_devices(nvml: &Nvml, device: &Device<'_>) -> Result<Vec<MigSample>, NvmlError> {
    match device.mig_mode() {
        Ok(mode) if mode.current == MIG_ENABLED => {}
        // GPUs without MIG, and drivers older than MIG, say so.
        Ok(_) | Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => {
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    }
    let mut migs: Vec<MigSample> = Vec::new();
    for index in 0..device.mig_device_count()? {
        let read = match device.mig_device_by_index(index) {
            Ok(mig) => mig_device(nvml, index, &mig),
            // A slot no instance occupies.
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => Err(e),
        };
        match read {
            Ok(mut mig) => {
                mig.processes.retain(|p| {
                    !migs
                        .iter()
                        .any(|m| m.processes.iter().any(|q| q.pid == p.pid))
                });
                migs.push(mig);
            }
            Err(e @ (NvmlError::GpuLost | NvmlError::DriverNotLoaded)) => return Err(e),
            Err(e) => tracing::warn!(mig = index, error = %e, "a MIG device could not be read"),
        }
    }
    Ok(migs)
}

impl NvmlSource {
    fn read(nvml: &Nvml) -> Result<NodeSample, NvmlError> {
        let mut gpus = Vec::new();
        for index in 0..nvml.device_count()? {
            let device = nvml.device_by_index(index)?;
            let memory = device.memory_info()?;
            let mig = mig_devices(nvml, &device)?;
            gpus.push(GpuSample {
                index,
                uuid: device.uuid()?,
                // Not every platform has one (nvml-wrapper reads it on Linux only).
                minor: device.minor_number().ok(),
                model: device.name()?,
                total: memory.total,
                used: memory.used,
                free: memory.free,
                reserved: Some(memory.reserved),
                processes: if mig.is_empty() {
                    processes(&device, None)
                } else {
                    Vec::new()
                },
                mig,
            });
        }
        Ok(NodeSample {
            driver_version: nvml.sys_driver_version()?,
            simulated: false,
            gpus,
        })
    }
}

impl GpuSource for NvmlSource {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn sample(&mut self) -> Result<NodeSample, SourceError> {
        if self.nvml.is_none() {
            self.nvml = Some(Nvml::init().map_err(|e| describe(&e))?);
        }
        let nvml = self.nvml.as_ref().expect("initialised above");
        Self::read(nvml).map_err(|e| {
            self.nvml = None;
            describe(&e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mig_devices_profile_is_read_off_its_name() {
        assert_eq!(
            MigSample::profile_of("NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
            "1g.5gb"
        );
        assert_eq!(
            MigSample::profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me"),
            "1g.10gb+me"
        );
        assert_eq!(
            MigSample::profile_of("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb"),
            "3g.20gb"
        );
        assert_eq!(MigSample::profile_of("NVIDIA H200"), "");
    }

    #[test]
    fn mps_server_is_charged_to_no_pod() {
        use super::super::cgroup::{ContainerRef, Runtime};
        let in_pod = || {
            Some(ContainerRef {
                pod_uid: "u".into(),
                container_id: "c".into(),
                runtime: Runtime::Containerd,
            })
        };
        // As the kernel names it: "nvidia-cuda-mps-server" cut to 15 bytes.
        assert_eq!(charged_to("nvidia-cuda-mps", in_pod), None);
        assert_eq!(charged_to("python3", in_pod), in_pod());
    }

    #[test]
    fn without_a_driver_sampling_fails_with_a_reason() {
        // This machine has no NVIDIA driver; where one exists the sample succeeds instead.
        let mut source = NvmlSource::new();
        match source.sample() {
            Ok(node) => assert!(!node.simulated),
            Err(e) => {
                let reason = e.to_string();
                assert!(
                    reason.contains("NVML") || reason.contains("driver"),
                    "{reason}"
                );
            }
        }
    }
}
