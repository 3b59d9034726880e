//! The pushed processes: who they are, what they last said, and for how long it is served.
//!
//! A process is known by its pid and, where the kernel named it (a Unix-socket push), by its
//! start time from `/proc/<pid>/stat`: a new process that reuses a dead one's pid starts
//! afresh. Its series are published as [`AllocatorSource`]s of kind
//! [`AllocatorKind::Pytorch`] or [`AllocatorKind::Xla`], so the one collector serves them
//! under the metric contract.
//!
//! # Lifecycle
//! A process is *live* until it is seen to end: its pid vanishes from `/proc` or changes
//! start time (kernel-named pids only: a payload's own pid may be another pid namespace's and
//! is never looked up), it sends its `"exit"` push, or it stays silent for `ttl`. Its last
//! series then stay for `exited_grace` (keep it at least two scrape intervals, so a job that
//! dies of an OOM is still scraped with its OOM), and go. A push that the kernel did not
//! attribute is known by its pid and the start time it gives, exactly, so two containers'
//! pid 1 do not merge into one process: while one is live the other is refused (`conflict`:
//! push over the socket instead), and a push without a start time is no job that gave one.
//! That word is unauthenticated (a local user can read a host job's start time in `/proc`):
//! loopback is for hosts without the socket, and its series and recordings are told apart
//! (the recordings' `loopback` tenant). Expiry runs on the agent's own tick
//! ([`PushStore::expire`]), not inside a scrape.
//!
//! # A push's phases
//! validate (`payload.rs`: the body against the schema and its bounds) → attribute
//! (`attribution.rs`: who sent it, as the kernel or the node knows it) → admit
//! (`admission.rs`: rank, order and rate against its pid's entry) → budget (`budget.rs`,
//! pure: the caps, and the ended processes to evict) → publish (`publish.rs`: its devices as
//! allocator sources, with what its last push keeps standing, and its pod's OOMs; the
//! store's `track` then keeps the process and republishes). Each phase is a function with its
//! own tests; the store holds the lock across the last three, and a refusal at any phase
//! changes nothing.
//!
//! # Invariants (budgets)
//! - At most `max_processes` processes are kept, live and ended together, of which at most
//!   `max_tcp_processes` pushed over TCP (so invented TCP pids cannot lock out socket
//!   pushers); their series together stay within `max_series`, the per-pod OOM counters
//!   included. Processes pushing over TCP hold at most `max_tcp_series` of them together
//!   and a quarter of that each, so the rest is always the socket pushers' (a job's first
//!   push, its OOM push) whatever TCP pushers invent. Processes of pods pushing from the pod
//!   network hold at most `max_pod_processes` and `max_pod_series` per pod and
//!   `max_pod_network_processes` and `max_pod_network_series` together (half the budget), so
//!   however many pods push, the socket's jobs keep the rest. When a cap is reached, ended
//!   processes are evicted first, oldest first; only then is a push refused.
//! - A pid the kernel attributed to a socket pusher is never written over TCP; sequence
//!   numbers only grow, and pushes keep to a rate, their OOM and exit pushes excepted
//!   (`admission.rs`).
//! - Per-pod OOM counters never decrease; one is dropped `oom_retention` after its last OOM,
//!   and at most `max_pods` are kept (the stalest evicted first).
//! - Every refusal has a reason, returned to the client and counted.

use std::collections::BTreeMap;
#[cfg(feature = "tools")]
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use rustc_hash::FxHashMap;

#[cfg(feature = "tools")]
use crate::metrics::contract::label;
use crate::sources::{
    AllocatorKind, AllocatorSource, AllocatorSources, HostPinned, IngestReport, PodOoms,
    PushedHost, PushedProcess, Pusher,
};
use crate::telemetry::pod_network::PodPeer;

use super::admission::{Admission, Allowance, Entry, admit};
pub use super::admission::{MAX_REASON_PUSHES, MAX_SEQ_JUMP, REASON_REFILL};
use super::attribution::{Identity, Origin, attribute};
pub use super::attribution::{Peer, Sender};
use super::budget::{self, Holder};
pub use super::config::IngestConfig;
use super::payload::{Reason, ValidPush, validate};
use super::publish::{PodCount, PodOom, count_pod_ooms, kept_series, pushed_sources};
#[cfg(feature = "tools")]
use super::recordings::{RecordingStore, Tenant, Uploader};
use super::refusal::{Refusal, Rejected};

struct Tracked {
    seq: u64,
    last: Instant,
    /// Who vouches for its pid (for all but TCP pushers, `/proc/<pid>` is this process).
    origin: Origin,
    /// Its start time, where the pid is a host pid and `/proc` said.
    start_time: Option<u64>,
    /// When it was seen to end.
    ended: Option<Instant>,
    allowance: Allowance,
    /// OOMs it counted at its last push, over its devices.
    ooms: u64,
    series: usize,
    sources: Vec<Arc<AllocatorSource>>,
    /// Its pinned host memory as its last push said (a push without it clears it).
    host: Option<HostPinned>,
}

impl Tracked {
    /// When it ended, or will have if it stays silent.
    fn end(&self, ttl: Duration) -> Instant {
        let silent = self.last + ttl;
        self.ended.map_or(silent, |ended| ended.min(silent))
    }

    /// Its entry, as admission reads it.
    fn entry(&self, ttl: Duration) -> Entry<'_> {
        Entry {
            origin: &self.origin,
            start_time: self.start_time,
            seq: self.seq,
            last: self.last,
            allowance: self.allowance,
            end: self.end(ttl),
        }
    }
}

#[derive(Default)]
struct State {
    tracked: FxHashMap<u32, Tracked>,
    pods: BTreeMap<(String, String), PodCount>,
}

/// The pushed processes and the ingest's own counters.
pub struct PushStore {
    config: IngestConfig,
    sources: AllocatorSources,
    state: Mutex<State>,
    /// When the store was made (Unix seconds).
    started_unix: f64,
    accepted: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
    /// Where recordings its processes upload are kept, once the agent keeps them.
    #[cfg(feature = "tools")]
    recordings: OnceLock<Arc<RecordingStore>>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl PushStore {
    /// A store publishing into `sources` (the list the collector reads).
    pub fn new(config: IngestConfig, sources: AllocatorSources) -> PushStore {
        PushStore {
            config,
            sources,
            state: Mutex::new(State::default()),
            started_unix: unix_now(),
            accepted: AtomicU64::new(0),
            refused: Default::default(),
            #[cfg(feature = "tools")]
            recordings: OnceLock::new(),
        }
    }

    /// Keeps the recordings its processes upload in `store` (once; a second store is
    /// ignored).
    #[cfg(feature = "tools")]
    pub fn keep_recordings(&self, store: Arc<RecordingStore>) {
        let _ = self.recordings.set(store);
    }

    /// Where its processes' recordings are kept, where they are.
    #[cfg(feature = "tools")]
    pub fn recordings(&self) -> Option<&Arc<RecordingStore>> {
        self.recordings.get()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn refuse(&self, rejected: Rejected) -> Rejected {
        self.count_refusal(rejected.refusal);
        rejected
    }

    /// Counts a body refused before it reached the store (too large, truncated, forbidden).
    pub fn count_refusal(&self, refusal: Refusal) {
        let i = Refusal::ALL.iter().position(|r| *r == refusal).unwrap_or(0);
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Who an upload of a recording is from: a process this store tracks, known as its pushes
    /// are (the kernel's pid for a socket peer; a pod's process by the pid `pid` it has in the
    /// pod, told apart by `start_time`; from loopback, `pid` and `start_time` as given, which
    /// must be what its pushes said: a loopback sender naming only a pid is no other loopback
    /// job), with its tenant and the labels its pushes carry. A recording follows its
    /// process's pushes.
    ///
    /// # Errors
    /// A pid that is not the pod's (`not_in_pod`), or that has not pushed from there
    /// (`forbidden`).
    #[cfg(feature = "tools")]
    pub fn recording_owner(
        &self,
        sender: Sender,
        pid: u32,
        start_time: Option<u64>,
    ) -> Result<Uploader, Rejected> {
        // The uploader's start time: a process reusing a tracked pid is not it.
        let mut user = None;
        let (pid, origin, started) = match sender {
            Sender::Unattributed => (pid, Origin::Tcp, start_time),
            Sender::Process(peer) => {
                user = peer.uid;
                (peer.pid, Origin::Socket, peer.start_time)
            }
            Sender::Pod(pod) => {
                let found = (self.config.pod_process)(&pod.uid, pid, start_time)
                    .map_err(|e| Rejected::new(Refusal::NotInPod, e.to_string()))?;
                (found.pid, Origin::Pod(pod.uid), Some(found.start_time))
            }
        };
        let state = self.state();
        let tracked = state
            .tracked
            .get(&pid)
            .filter(|t| t.origin == origin && t.start_time == started);
        let Some(tracked) = tracked else {
            return Err(Rejected::new(
                Refusal::Forbidden,
                format!(
                    "pid {pid} (with start time {started:?}) has not pushed to this agent from there: a recording comes from a process that pushes, named as its pushes name it"
                ),
            ));
        };
        let first = tracked.sources.first();
        let labels = first.map(|s| s.labels.clone()).unwrap_or_default();
        // A socket peer shares with its pod (as from the pod network) or its user: a process
        // forking a crowd of pushers gains nothing.
        let pod_uid = labels
            .iter()
            .find_map(|(k, v)| (k == label::POD_UID && !v.is_empty()).then_some(v));
        let tenant = match (&origin, pod_uid, user) {
            (Origin::Socket, Some(pod), _) | (Origin::Pod(pod), ..) => Tenant::Pod(pod.clone()),
            (Origin::Socket, None, Some(uid)) => Tenant::User(uid),
            (Origin::Socket, None, None) => Tenant::Process(pid),
            (Origin::Tcp, ..) => Tenant::Loopback,
        };
        Ok(Uploader {
            pid,
            tenant,
            labels,
            pytorch_version: first.map(|s| s.version.clone()).unwrap_or_default(),
            allocator_settings: first.map(|s| s.config.clone()).unwrap_or_default(),
        })
    }

    /// Accepts a payload, or says why not.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push(&self, body: &[u8]) -> Result<(), Rejected> {
        self.push_from(body, None)
    }

    /// Accepts a payload from a process the kernel named (a Unix-socket peer): its pid
    /// replaces the payload's, which inside a container is the container's pid namespace's
    /// and so would not match the pids NVML reports. The pid must still be the process the
    /// connection was accepted from (its start time unchanged: see [`Peer`]), and its pod is
    /// read at each push.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push_from(&self, body: &[u8], peer: Option<Peer>) -> Result<(), Rejected> {
        self.push_at(body, peer, Instant::now())
            .map_err(|rejected| self.refuse(rejected))
    }

    /// Accepts a payload from a pod, known by its address on the pod network: the payload's
    /// pid must be one of the pod's processes in its own pid namespace (and its start time
    /// that process's), whose host pid replaces it; its labels may not name another pod.
    /// Reads `/proc` (a scan where the process is not known yet): call it off the async
    /// runtime.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push_from_pod(&self, body: &[u8], pod: PodPeer) -> Result<(), Rejected> {
        self.push_at(body, Sender::Pod(pod), Instant::now())
            .map_err(|rejected| self.refuse(rejected))
    }

    /// A push, in its phases: validate the body (`payload.rs`), attribute it to its sender
    /// (`attribution.rs`), admit it (order and rate), fit it in the budgets, evicting ended
    /// processes where that is enough (`budget.rs`), then publish it (`publish.rs`). A
    /// refusal at any phase changes nothing.
    pub(super) fn push_at(
        &self,
        body: &[u8],
        sender: impl Into<Sender>,
        now: Instant,
    ) -> Result<(), Rejected> {
        let mut push = validate(body)?;
        let who = attribute(&self.config, &mut push, sender.into())?;
        let mut state = self.state();
        let entry = state
            .tracked
            .get(&push.pid)
            .map(|t| t.entry(self.config.ttl));
        let admitted = admit(&self.config, entry, &push, &who, now)?;
        let series = self.budget(&mut state, &push, &who.origin, admitted.replaces, now)?;
        self.track(&mut state, push, who, admitted, series, now);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The series the push will hold (its own and what its process's last push keeps
    /// exporting, where it `replaces` it), once room is made for them.
    fn budget(
        &self,
        state: &mut State,
        push: &ValidPush,
        origin: &Origin,
        replaces: bool,
        now: Instant,
    ) -> Result<usize, Rejected> {
        let old = state.tracked.get(&push.pid).filter(|_| replaces);
        let series = push.series() + old.map_or(0, |t| kept_series(&t.sources, push));
        let ttl = self.config.ttl;
        let held: Vec<Holder<'_>> = state
            .tracked
            .iter()
            .map(|(&pid, t)| Holder {
                pid,
                origin: &t.origin,
                series: t.series,
                end: t.end(ttl),
            })
            .collect();
        let counters = state.pods.len();
        let evict = budget::room(&self.config, &held, counters, push.pid, origin, series, now)?;
        // The push is accepted and published right after: the evicted go with it.
        for pid in evict {
            state.tracked.remove(&pid);
        }
        Ok(series)
    }

    /// Tracks an admitted push holding `series` series (its sources, its OOMs, counted for
    /// its pod, its allowance and its end) and publishes the tracked processes' sources: the
    /// publish phase's part that needs the store (tested through it, `tests.rs`).
    fn track(
        &self,
        state: &mut State,
        mut push: ValidPush,
        who: Identity,
        admitted: Admission,
        series: usize,
        now: Instant,
    ) {
        let pid = push.pid;
        let old = state.tracked.get(&pid).filter(|_| admitted.replaces);
        let old_ooms = old.map_or(0, |t| t.ooms);
        let ooms = push.ooms().max(old_ooms);
        let new_ooms = ooms - old_ooms;
        let wall = unix_now();
        let last_oom_at = match push.last_oom_unix_seconds {
            // The job's own clock is the node's; never in the future.
            Some(t) => Some(t.min(wall)),
            None if new_ooms > 0 || push.reason == Reason::Oom => Some(wall),
            None => old
                .and_then(|t| t.sources.first())
                .and_then(|s| s.last_oom_unix_seconds),
        };
        let process = Pusher {
            pid,
            version: std::mem::take(&mut push.version),
            config: std::mem::take(&mut push.config),
            xla: std::mem::take(&mut push.xla),
            labels: who.labels(std::mem::take(&mut push.labels)),
            last_oom_unix_seconds: last_oom_at,
        };
        let before = old.map_or(&[][..], |t| &t.sources[..]);
        let sources = pushed_sources(&process, std::mem::take(&mut push.devices), before, now);
        // Only pushes that needed the allowance use it up.
        let mut allowance = old.map_or(Allowance::new(now), |t| t.allowance.at(now));
        allowance.spent += u32::from(admitted.urgent);
        let ended = old
            .and_then(|t| t.ended)
            .or_else(|| (push.reason == Reason::Exit).then_some(now));
        let fresh = old.is_none();
        // OOMs the job dates to before this agent started were counted by its predecessor.
        let counted = push
            .last_oom_unix_seconds
            .is_none_or(|t| t >= self.started_unix);
        if new_ooms > 0
            && counted
            && let Some(c) = &who.container
        {
            let oom = PodOom {
                new_ooms,
                fresh,
                dated: push.last_oom_unix_seconds,
                last_oom_at,
            };
            count_pod_ooms(&mut state.pods, c, oom, now);
        }
        state.tracked.insert(
            pid,
            Tracked {
                seq: push.seq,
                last: now,
                origin: who.origin,
                start_time: who.start_time,
                ended,
                allowance,
                ooms,
                series,
                sources,
                host: push.host,
            },
        );
        self.publish_sources(state);
    }

    /// Marks ended processes (vanished pids, silence), drops those past their grace period
    /// and pod OOM counts past their retention. The agent calls it on its own tick.
    pub fn expire(&self) {
        self.expire_at(Instant::now(), self.config.start_time);
    }

    pub(super) fn expire_at(&self, now: Instant, start_time: impl Fn(u32) -> Option<u64>) {
        let config = &self.config;
        let mut state = self.state();
        let before = state.tracked.len();
        for (&pid, t) in &mut state.tracked {
            if t.ended.is_none() && t.origin.host_pid() {
                let now_start = start_time(pid);
                let gone =
                    now_start.is_none() || (t.start_time.is_some() && now_start != t.start_time);
                if gone {
                    t.ended = Some(now);
                }
            }
        }
        // A live process (its end still ahead) stays whatever the grace: with a grace of 0,
        // `<` alone dropped live processes at every tick (a job between its push and its
        // upload among them).
        state.tracked.retain(|_, t| {
            let end = t.end(config.ttl);
            end > now || now.saturating_duration_since(end) < config.exited_grace
        });
        state
            .pods
            .retain(|_, p| now.saturating_duration_since(p.last) < config.oom_retention);
        while state.pods.len() > config.max_pods {
            let stalest = state
                .pods
                .iter()
                .min_by_key(|(_, p)| p.last)
                .map(|(k, _)| k.clone());
            if let Some(key) = stalest {
                state.pods.remove(&key);
            }
        }
        if state.tracked.len() != before {
            self.publish_sources(&state);
        }
    }

    /// Replaces the pushed sources in the collector's list by the tracked ones.
    fn publish_sources(&self, state: &State) {
        let mut pushed: Vec<_> = state
            .tracked
            .values()
            .flat_map(|t| t.sources.iter().cloned())
            .collect();
        pushed.sort_by_key(|s| (s.pid, s.gpu));
        self.sources
            .replace(&[AllocatorKind::Pytorch, AllocatorKind::Xla], pushed);
    }

    /// Processes kept now, live and ended.
    pub fn tracked_processes(&self) -> usize {
        self.state().tracked.len()
    }

    /// Series held by processes pushing over TCP.
    #[cfg(test)]
    pub(super) fn tcp_series(&self) -> usize {
        self.state()
            .tracked
            .values()
            .filter(|t| t.origin == Origin::Tcp)
            .map(|t| t.series)
            .sum()
    }

    /// (result label, count) for the ingest counter: `accepted`, then each refusal.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        let mut out = vec![("accepted", self.accepted.load(Ordering::Relaxed))];
        for (r, count) in Refusal::ALL.iter().zip(&self.refused) {
            out.push((r.label(), count.load(Ordering::Relaxed)));
        }
        out
    }

    /// What a scrape shows of the ingest.
    pub fn report(&self) -> IngestReport {
        let state = self.state();
        let mut processes: Vec<PushedProcess> = state
            .tracked
            .iter()
            .map(|(&pid, t)| PushedProcess {
                pid,
                last_push: t.last,
            })
            .collect();
        processes.sort_unstable_by_key(|p| p.pid);
        let pod_ooms = state
            .pods
            .iter()
            .map(|((pod_uid, container_id), p)| PodOoms {
                pod_uid: pod_uid.clone(),
                container_id: container_id.clone(),
                ooms: p.ooms,
            })
            .collect();
        let mut hosts: Vec<PushedHost> = state
            .tracked
            .iter()
            .filter_map(|(&pid, t)| {
                Some(PushedHost {
                    pid,
                    // A push lists at least one device, whose series carry its labels.
                    labels: t.sources.first()?.labels.clone(),
                    pinned: t.host?,
                })
            })
            .collect();
        hosts.sort_unstable_by_key(|h| h.pid);
        drop(state);
        IngestReport {
            results: self.counts(),
            processes,
            pod_ooms,
            hosts,
            #[cfg(feature = "tools")]
            recordings: self.recordings().map(|r| r.report()),
            #[cfg(not(feature = "tools"))]
            recordings: None,
        }
    }
}
