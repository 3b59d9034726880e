//! Polling a [`GpuSource`] on a thread of its own and publishing the latest report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{GpuSource, Heartbeat, NodeSample};

/// The latest word from a source.
#[derive(Clone, Debug, Default)]
pub struct SourceReport {
    /// The `source` label.
    pub source: &'static str,
    /// Whether the last sample succeeded.
    pub up: bool,
    /// The last successful sample while up (the last good one is dropped when the source
    /// goes down, so that stale figures are not served).
    pub sample: Option<NodeSample>,
    /// Why the source is down.
    pub error: Option<String>,
    /// How long the last sample took, in seconds.
    pub duration_seconds: f64,
}

impl SourceReport {
    /// The GPUs of its sample (none while it is down).
    pub fn gpus(&self) -> &[super::GpuSample] {
        self.sample.as_ref().map_or(&[], |node| &node.gpus)
    }

    /// A source read in `duration_seconds`, with its sample where it has one.
    pub fn up(source: &'static str, sample: Option<NodeSample>, duration_seconds: f64) -> Self {
        SourceReport {
            source,
            up: true,
            sample,
            error: None,
            duration_seconds,
        }
    }

    /// A source that could not be read, and why.
    pub fn down(source: &'static str, reason: String, duration_seconds: f64) -> Self {
        SourceReport {
            source,
            up: false,
            sample: None,
            error: Some(reason),
            duration_seconds,
        }
    }
}

/// Polls a source until dropped.
pub struct Poller {
    latest: Arc<Mutex<Arc<SourceReport>>>,
    heartbeat: Heartbeat,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Starts polling `source` every `interval` (the first sample is taken before this
    /// returns, so the first scrape has data).
    pub fn start(mut source: Box<dyn GpuSource>, interval: Duration) -> Poller {
        let heartbeat = Heartbeat::new(source.name(), Heartbeat::allowance_for(interval));
        let first = take_sample(source.as_mut(), None);
        heartbeat.beat();
        let latest = Arc::new(Mutex::new(Arc::new(first)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let latest = Arc::clone(&latest);
            let stop = Arc::clone(&stop);
            let heartbeat = heartbeat.clone();
            std::thread::Builder::new()
                .name(format!("gpumem-{}", source.name()))
                .spawn(move || {
                    while !sleep_unless_stopped(&stop, interval) {
                        let previous = current(&latest);
                        let report = take_sample(source.as_mut(), Some(&previous));
                        *latest.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(report);
                        heartbeat.beat();
                    }
                })
                .ok()
        };
        Poller {
            latest,
            heartbeat,
            stop,
            thread,
        }
    }

    /// The latest report; never waits for the source.
    pub fn latest(&self) -> Arc<SourceReport> {
        current(&self.latest)
    }

    /// Beaten after every sample (for `/healthz` and `/readyz`).
    pub fn heartbeat(&self) -> Heartbeat {
        self.heartbeat.clone()
    }

    /// A handle that reads the latest report, for collectors.
    pub fn reader(&self) -> impl Fn() -> Arc<SourceReport> + Send + Sync + 'static {
        let latest = Arc::clone(&self.latest);
        move || current(&latest)
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn current(latest: &Mutex<Arc<SourceReport>>) -> Arc<SourceReport> {
    Arc::clone(&latest.lock().unwrap_or_else(PoisonError::into_inner))
}

/// Sleeps `interval` in short steps; true if asked to stop meanwhile.
fn sleep_unless_stopped(stop: &AtomicBool, interval: Duration) -> bool {
    let deadline = Instant::now() + interval;
    loop {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(50)));
    }
}

/// Samples once, logging a change of state (down with its reason, or back up) once.
fn take_sample(source: &mut dyn GpuSource, previous: Option<&SourceReport>) -> SourceReport {
    let started = Instant::now();
    let result = source.sample();
    let duration_seconds = started.elapsed().as_secs_f64();
    let name = source.name();
    match result {
        Ok(sample) => {
            if previous.is_some_and(|p| !p.up) {
                tracing::info!(source = name, "source is back up");
            }
            SourceReport::up(name, Some(sample), duration_seconds)
        }
        Err(error) => {
            let reason = error.to_string();
            if previous.and_then(|p| p.error.as_deref()) != Some(reason.as_str()) {
                tracing::warn!(source = name, reason = %reason, "source is down; serving without it");
            }
            SourceReport::down(name, reason, duration_seconds)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;
    use crate::telemetry::{GpuSample, SourceError};

    /// Fails while `failing` is set, then reports one GPU.
    struct Flaky {
        failing: Arc<AtomicBool>,
        calls: Arc<AtomicU32>,
    }

    impl GpuSource for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }

        fn sample(&mut self) -> Result<NodeSample, SourceError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.failing.load(Ordering::Relaxed) {
                return Err(SourceError::GpuLost);
            }
            Ok(NodeSample {
                driver_version: "1".into(),
                simulated: true,
                gpus: vec![GpuSample {
                    index: 0,
                    uuid: "GPU-0".into(),
                    minor: Some(0),
                    model: "test".into(),
                    total: 10,
                    used: 4,
                    free: 6,
                    reserved: None,
                    processes: Vec::new(),
                    mig: Vec::new(),
                }],
            })
        }
    }

    #[test]
    fn a_failing_source_is_reported_down_and_recovers() {
        let failing = Arc::new(AtomicBool::new(true));
        let calls = Arc::new(AtomicU32::new(0));
        let poller = Poller::start(
            Box::new(Flaky {
                failing: Arc::clone(&failing),
                calls: Arc::clone(&calls),
            }),
            Duration::from_millis(5),
        );
        let first = poller.latest();
        assert!(!first.up);
        assert_eq!(
            first.error.as_deref(),
            Some(SourceError::GpuLost.to_string().as_str())
        );
        assert!(first.sample.is_none());
        failing.store(false, Ordering::Relaxed);
        let mut recovered = false;
        for _ in 0..400 {
            if poller.latest().up {
                recovered = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(recovered, "the poller picks the source up again");
        assert_eq!(
            poller.latest().sample.as_ref().map(|s| s.gpus.len()),
            Some(1)
        );
        drop(poller);
        let after = calls.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            calls.load(Ordering::Relaxed),
            after,
            "dropping stops the thread"
        );
    }
}
