//! A pod's processes by the pid they have in their own pid namespace: how a push from the pod
//! network, naming the pid the job sees (a container's), is tied to a host pid, which NVML
//! reports and `/proc` checks.
//!
//! The agent sees the host's processes (`hostPID`): a process is the pod's when its cgroup
//! names the pod ([`super::cgroup`]), and its container pid is the last of `NSpid` in
//! `/proc/<pid>/status`. Containers of one pod may each have their own pid namespace, so a
//! container pid can name several processes: the push's start time (clock ticks since boot,
//! the same in every namespace) picks one, and without it an ambiguous pid is refused.
//! Within a pod this proves that the process exists, not that it sent the push: any process
//! of the pod can push for any other of the same pod (never for another pod's).
//!
//! # Invariants
//! - A scan of `/proc` reads at most [`MAX_SCANNED`] processes and starts at least
//!   [`MIN_RESCAN`] after the last one ended, whatever pushes ask (a pod inventing pids costs the node no more than
//!   that); between scans a pid not found is refused and the job's next push finds it.
//! - A found process is checked again in `/proc` (its start time) before it is returned, so
//!   a scan's stale entry never names a pid that has been reused.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::cgroup::{self, ContainerRef};
use super::process;

/// Processes read by one scan of `/proc`.
pub const MAX_SCANNED: usize = 1 << 16;
/// The least time between two scans.
pub const MIN_RESCAN: Duration = Duration::from_millis(100);

/// A process of a pod, on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodProcess {
    /// Its pid on the host (the agent's pid namespace).
    pub pid: u32,
    /// Its start time (clock ticks since boot).
    pub start_time: u64,
    /// Its container.
    pub container: ContainerRef,
}

/// Why no process of the pod matches.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotInPod {
    /// No process of the pod has the pid (and start time).
    #[error("no process of pod {pod_uid} has pid {pid}{}", start_time.map(|t| format!(" started at tick {t}")).unwrap_or_default())]
    Missing {
        /// The pod.
        pod_uid: String,
        /// The container pid asked for.
        pid: u32,
        /// The start time asked for.
        start_time: Option<u64>,
    },
    /// Several processes of the pod have the pid (containers with their own pid namespace)
    /// and the push gave no start time.
    #[error(
        "pid {pid} names {count} processes of pod {pod_uid}; the push must give its start_time"
    )]
    Ambiguous {
        /// The pod.
        pod_uid: String,
        /// The container pid asked for.
        pid: u32,
        /// How many have it.
        count: usize,
    },
}

/// One process of a pod, as a scan found it.
#[derive(Clone, Debug)]
struct Entry {
    namespace_pid: u32,
    process: PodProcess,
}

/// The last scan: each pod's processes.
struct Scan {
    at: Instant,
    by_pod: HashMap<String, Vec<Entry>>,
}

static LAST_SCAN: Mutex<Option<Scan>> = Mutex::new(None);

/// The process of pod `pod_uid` whose own pid is `pid` (and which started at `start_time`,
/// where given), on the host.
///
/// # Errors
/// [`NotInPod`]: none matches, or several do and no start time was given.
pub fn find(pod_uid: &str, pid: u32, start_time: Option<u64>) -> Result<PodProcess, NotInPod> {
    let mut last = LAST_SCAN.lock().unwrap_or_else(PoisonError::into_inner);
    let now = Instant::now();
    if let Some(scan) = last.as_ref()
        && let Ok(found) = pick(scan, pod_uid, pid, start_time)
        && process::start_time(found.pid) == Some(found.start_time)
    {
        return Ok(found);
    }
    let due = last
        .as_ref()
        .is_none_or(|scan| now.saturating_duration_since(scan.at) >= MIN_RESCAN);
    if due {
        *last = Some(scan());
    }
    let scan = last.as_ref().expect("scanned above or before");
    pick(scan, pod_uid, pid, start_time)
}

/// The match in `scan`, from its entries alone.
fn pick(
    scan: &Scan,
    pod_uid: &str,
    pid: u32,
    start_time: Option<u64>,
) -> Result<PodProcess, NotInPod> {
    let mut matches = scan
        .by_pod
        .get(pod_uid)
        .into_iter()
        .flatten()
        .filter(|e| e.namespace_pid == pid)
        .filter(|e| start_time.is_none_or(|t| t == e.process.start_time));
    let first = matches.next().ok_or_else(|| NotInPod::Missing {
        pod_uid: pod_uid.to_string(),
        pid,
        start_time,
    })?;
    let others = matches.count();
    if others > 0 {
        return Err(NotInPod::Ambiguous {
            pod_uid: pod_uid.to_string(),
            pid,
            count: others + 1,
        });
    }
    Ok(first.process.clone())
}

/// Every pod's processes now, stamped when the scan ends (a long scan is not followed by
/// another at once).
fn scan() -> Scan {
    let mut by_pod: HashMap<String, Vec<Entry>> = HashMap::new();
    let pids = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .take(MAX_SCANNED);
    for host_pid in pids {
        let Some(container) = cgroup::container_of(host_pid) else {
            continue;
        };
        let (Some(namespace_pid), Some(start_time)) = (
            process::namespace_pid(host_pid),
            process::start_time(host_pid),
        ) else {
            continue;
        };
        by_pod
            .entry(container.pod_uid.clone())
            .or_default()
            .push(Entry {
                namespace_pid,
                process: PodProcess {
                    pid: host_pid,
                    start_time,
                    container,
                },
            });
    }
    Scan {
        at: Instant::now(),
        by_pod,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::cgroup::Runtime;

    fn entry(namespace_pid: u32, host: u32, start_time: u64, container: &str) -> Entry {
        Entry {
            namespace_pid,
            process: PodProcess {
                pid: host,
                start_time,
                container: ContainerRef {
                    pod_uid: "pod-a".into(),
                    container_id: container.into(),
                    runtime: Runtime::Containerd,
                },
            },
        }
    }

    #[test]
    fn a_pid_is_picked_by_pod_and_start_time() {
        let scan = Scan {
            at: Instant::now(),
            by_pod: HashMap::from([(
                "pod-a".to_string(),
                vec![
                    entry(1, 500, 10, "c1"),
                    entry(1, 600, 20, "c2"),
                    entry(7, 700, 30, "c2"),
                ],
            )]),
        };
        assert_eq!(pick(&scan, "pod-a", 7, None).expect("found").pid, 700);
        assert_eq!(pick(&scan, "pod-a", 7, Some(30)).expect("found").pid, 700);
        assert_eq!(pick(&scan, "pod-a", 1, Some(20)).expect("found").pid, 600);
        assert!(matches!(
            pick(&scan, "pod-a", 1, None),
            Err(NotInPod::Ambiguous { count: 2, .. })
        ));
        assert!(matches!(
            pick(&scan, "pod-a", 7, Some(31)),
            Err(NotInPod::Missing { .. })
        ));
        // Another pod's pids are never this pod's.
        assert!(matches!(
            pick(&scan, "pod-b", 7, None),
            Err(NotInPod::Missing { .. })
        ));
    }
}
