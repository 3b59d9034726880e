//! NVML through `nvml-wrapper`, loaded at run time: no build-time dependency on a driver,
//! and a clear error (never a panic) where there is none.

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::{GpuSample, GpuSource, NodeSample, ProcessSample, SourceError};

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

impl NvmlSource {
    fn read(nvml: &Nvml) -> Result<NodeSample, NvmlError> {
        let mut gpus = Vec::new();
        for index in 0..nvml.device_count()? {
            let device = nvml.device_by_index(index)?;
            let memory = device.memory_info()?;
            let mut processes: Vec<ProcessSample> = Vec::new();
            let compute = device.running_compute_processes().unwrap_or_default();
            let graphics = device.running_graphics_processes().unwrap_or_default();
            for p in compute.into_iter().chain(graphics) {
                if processes.iter().any(|q| q.pid == p.pid) {
                    continue;
                }
                processes.push(ProcessSample {
                    pid: p.pid,
                    name: process_name(p.pid),
                    container: super::cgroup::container_of(p.pid),
                    used: match p.used_gpu_memory {
                        UsedGpuMemory::Used(bytes) => Some(bytes),
                        UsedGpuMemory::Unavailable => None,
                    },
                });
            }
            gpus.push(GpuSample {
                index,
                uuid: device.uuid()?,
                model: device.name()?,
                total: memory.total,
                used: memory.used,
                free: memory.free,
                reserved: Some(memory.reserved),
                processes,
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
