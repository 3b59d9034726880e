//! An archived recording's sidecar: a small JSON object beside it that says whose it is and
//! what happened, so that a listing (or a bucket's own tooling) needs no recording read.
//!
//! ```json
//! {"format": 1, "recording": "s3://bucket/p/prod/team-a/trainer-0/20261207T011203.250000Z-42.pickle.gz",
//!  "cluster": "prod", "node": "gpu-node-3", "namespace": "team-a", "pod": "trainer-0",
//!  "pod_uid": "…", "container": "trainer", "container_id": "…", "pid": 42,
//!  "time": 1796605923.25, "bytes": 229411, "device": 0, "oom_event": 19463,
//!  "oom": {"requested_bytes": 2147483648, "device_free_bytes": 1073741824,
//!          "reserved_bytes": 77309411328, "allocated_bytes": 60129542144},
//!  "pytorch_version": "2.11.0", "allocator_settings": "expandable_segments:True"}
//! ```
//!
//! `namespace` and `pod` are those of the key (`_host` and the node for a process in no
//! known pod); `oom` and `device` are absent where the recording holds no OOM. A reader
//! ignores fields it does not know, and refuses a `format` it does not.

use serde::{Deserialize, Serialize};

use super::address::RecordingKey;
use crate::ingest::recordings::{OomFigures, StoredRecording};

/// The sidecar's format.
pub const FORMAT: u32 = 1;
/// The most bytes of a sidecar read (one is a few hundred bytes).
pub const MAX_BYTES: u64 = 64 * 1024;

/// What a sidecar says of its recording.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sidecar {
    /// [`FORMAT`].
    pub format: u32,
    /// The recording's address.
    pub recording: String,
    /// The cluster its agent was told it is in.
    pub cluster: String,
    /// The node it was kept on.
    pub node: String,
    /// Its pod's namespace (`_host` for a process in no known pod).
    pub namespace: String,
    /// Its pod's name (the node's under `_host`).
    pub pod: String,
    /// Its pod's UID, where known.
    #[serde(default)]
    pub pod_uid: String,
    /// Its container's name, where known.
    #[serde(default)]
    pub container: String,
    /// Its container's ID, where known.
    #[serde(default)]
    pub container_id: String,
    /// The process's pid on its node.
    pub pid: u32,
    /// When the agent kept it, in Unix seconds.
    pub time: f64,
    /// Its size as archived (gzipped).
    pub bytes: u64,
    /// The device of its last OOM (its trace's index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<usize>,
    /// The index of its last OOM in that device's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_event: Option<usize>,
    /// Its last OOM's figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom: Option<OomFigures>,
    /// `torch.__version__`, as the process pushed it.
    #[serde(default)]
    pub pytorch_version: String,
    /// `PYTORCH_CUDA_ALLOC_CONF`, as the process pushed it.
    #[serde(default)]
    pub allocator_settings: String,
}

impl Sidecar {
    /// The sidecar of `kept`, archived at `recording` under `key`, from `node`.
    pub fn of(
        kept: &StoredRecording,
        key: &RecordingKey,
        recording: String,
        node: &str,
    ) -> Sidecar {
        Sidecar {
            format: FORMAT,
            recording,
            cluster: key.cluster.clone(),
            node: node.to_string(),
            namespace: key.namespace.clone(),
            pod: key.pod.clone(),
            pod_uid: kept.pod_uid.clone(),
            container: kept.container_name.clone(),
            container_id: kept.container_id.clone(),
            pid: kept.pid,
            time: kept.time,
            bytes: kept.bytes,
            device: kept.device,
            oom_event: kept.oom_event,
            oom: kept.oom,
            pytorch_version: kept.pytorch_version.clone(),
            allocator_settings: kept.allocator_settings.clone(),
        }
    }

    /// Reads a sidecar.
    ///
    /// # Errors
    /// Not JSON, not a sidecar, or of a format this release does not know.
    pub fn parse(bytes: &[u8]) -> Result<Sidecar, String> {
        let sidecar: Sidecar =
            serde_json::from_slice(bytes).map_err(|e| format!("not a sidecar: {e}"))?;
        if sidecar.format != FORMAT {
            return Err(format!(
                "a sidecar of format {} (this release reads {FORMAT})",
                sidecar.format
            ));
        }
        Ok(sidecar)
    }

    /// Where the view opens it: at its OOM, where it has one (`#device=D&event=E`).
    pub fn fragment(&self) -> String {
        match (self.device, self.oom_event) {
            (Some(device), Some(event)) => format!("#device={device}&event={event}"),
            _ => String::new(),
        }
    }
}
