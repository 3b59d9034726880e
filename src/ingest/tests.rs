//! The store's rules: refusals and their counts, the lifecycle of a pushed process, the caps.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::allocator::SegmentClass;
use crate::sources::{AllocatorKind, AllocatorSources};
use crate::telemetry::cgroup::{self, ContainerRef};
use crate::telemetry::pod_network::PodPeer;
use crate::telemetry::pod_processes::{NotInPod, PodProcess};

use super::limits::MAX_BODY_BYTES;
use super::refusal::Refusal;
use super::store::{
    IngestConfig, MAX_REASON_PUSHES, MAX_SEQ_JUMP, Peer, PushStore, REASON_REFILL, Sender,
};

fn payload(pid: u32, seq: u64, stats: serde_json::Value) -> Vec<u8> {
    serde_json::json!({
        "pid": pid, "seq": seq, "torch_version": "2.5.1",
        "devices": [{"index": 0, "uuid": "GPU-abc", "stats": stats}]
    })
    .to_string()
    .into_bytes()
}

fn ok() -> serde_json::Value {
    serde_json::json!({"allocated_bytes.all.current": 1, "reserved_bytes.all.current": 2})
}

fn with_reason(pid: u32, seq: u64, reason: &str, ooms: u64) -> Vec<u8> {
    serde_json::json!({
        "pid": pid, "seq": seq, "reason": reason,
        "devices": [{"index": 0, "uuid": "GPU-abc", "stats": {"num_ooms": ooms}}]
    })
    .to_string()
    .into_bytes()
}

fn no_pod(_: u32) -> Option<ContainerRef> {
    None
}

/// Every pid is alive with start time 1 (tests pass their own view to `expire_at`).
fn started_once(_: u32) -> Option<u64> {
    Some(1)
}

/// A socket peer whose start time at the accept is [`started_once`]'s.
fn peer(pid: u32) -> Peer {
    Peer {
        pid,
        start_time: Some(1),
        uid: None,
    }
}

fn config() -> IngestConfig {
    IngestConfig {
        resolve: no_pod,
        start_time: started_once,
        ..IngestConfig::default()
    }
}

fn store_with(config: IngestConfig) -> (PushStore, AllocatorSources) {
    let sources = AllocatorSources::default();
    (PushStore::new(config, sources.clone()), sources)
}

fn store(max_processes: usize) -> (PushStore, AllocatorSources) {
    store_with(IngestConfig {
        max_processes,
        ..config()
    })
}

fn pids(sources: &AllocatorSources) -> Vec<u32> {
    sources.snapshot().iter().map(|s| s.pid).collect()
}

#[test]
fn a_push_becomes_a_pytorch_allocator_source() {
    let (store, sources) = store(10);
    let stats = serde_json::json!({
        "allocated_bytes.large_pool.current": 4096, "reserved_bytes.large_pool.current": 8192,
        "num_ooms": 2, "some_future_key": 7
    });
    store.push(&payload(42, 1, stats)).expect("accepted");
    let list = sources.snapshot();
    assert_eq!(list.len(), 1);
    let s = &list[0];
    assert_eq!(
        (s.pid, s.gpu, s.allocator, s.uuid.as_str()),
        (42, 0, AllocatorKind::Pytorch, "GPU-abc")
    );
    assert_eq!(s.stats.allocated_bytes.large_pool.current(), 4096);
    assert_eq!(s.stats.num_ooms.get(), 2);
    assert!(
        s.last_oom_unix_seconds.is_some(),
        "an OOM in the first push is an OOM"
    );
    assert_eq!(store.tracked_processes(), 1);
}

#[test]
fn refusals_say_why_and_are_counted() {
    let (store, _) = store(2);
    let cases: Vec<(Vec<u8>, Refusal)> = vec![
        (b"{not json".to_vec(), Refusal::Malformed),
        (
            br#"{"pid": "x", "seq": 1, "devices": []}"#.to_vec(),
            Refusal::Malformed,
        ),
        (payload(0, 1, ok()), Refusal::Invalid),
        (
            payload(7, 1, serde_json::json!({"reserved_bytes.all.current": -5})),
            Refusal::Invalid,
        ),
        (
            payload(7, 1, serde_json::json!({"reserved_bytes.all.current": 1.5})),
            Refusal::Invalid,
        ),
        (vec![b' '; MAX_BODY_BYTES + 1], Refusal::TooLarge),
    ];
    for (body, refusal) in cases {
        let err = store.push(&body).expect_err("refused");
        assert_eq!(err.refusal, refusal, "{}", err.message);
        assert!(!err.message.is_empty());
    }
    store.push(&payload(7, 5, ok())).expect("accepted");
    let refusal = |body: Vec<u8>| store.push(&body).map_err(|e| e.refusal);
    assert_eq!(refusal(payload(7, 5, ok())), Err(Refusal::Stale));
    assert_eq!(refusal(payload(7, 6, ok())), Err(Refusal::RateLimited));
    store.push(&payload(8, 1, ok())).expect("second process");
    assert_eq!(refusal(payload(9, 1, ok())), Err(Refusal::Capacity));
    let counts: BTreeMap<_, _> = store.counts().into_iter().collect();
    assert_eq!(counts["accepted"], 2);
    assert_eq!(counts["malformed"], 2);
    assert_eq!(counts["invalid"], 3);
    assert_eq!(counts["too_large"], 1);
    assert_eq!(
        (counts["stale"], counts["rate_limited"], counts["capacity"]),
        (1, 1, 1)
    );
}

#[test]
fn segments_by_size_stand_until_the_next_snapshot() {
    let (store, sources) = store(4);
    let mib = 1u64 << 20;
    let body = serde_json::json!({
        "pid": 5, "seq": 1,
        "devices": [{"index": 0, "uuid": "GPU-a", "stats": {},
                     "largest_free_block": 1024, "segments_by_size": [
            {"size": 32 * mib, "segments": 2, "free_bytes": 17 * mib},
            {"size": 2 * mib, "segments": 1, "free_bytes": mib}]}]
    });
    let start = Instant::now();
    store
        .push_at(body.to_string().as_bytes(), None, start)
        .expect("accepted");
    let expected = vec![
        SegmentClass {
            size: 2 * mib,
            segments: 1,
            free_bytes: mib,
        },
        SegmentClass {
            size: 32 * mib,
            segments: 2,
            free_bytes: 17 * mib,
        },
    ];
    let published = || {
        sources.snapshot()[0]
            .cache()
            .map(|c| c.segments_by_size)
            .unwrap_or_default()
    };
    assert_eq!(published(), expected, "sorted by size");
    let later = serde_json::json!({"pid": 5, "seq": 2,
        "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]});
    store
        .push_at(
            later.to_string().as_bytes(),
            None,
            start + Duration::from_secs(1),
        )
        .expect("accepted");
    assert_eq!(
        published(),
        expected,
        "a push without a snapshot keeps them"
    );
    let read_at = sources.snapshot()[0].cache().map(|c| c.read_at);
    assert_eq!(read_at, Some(start), "as old as the push that carried them");
    let newer = serde_json::json!({"pid": 5, "seq": 3,
        "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}, "largest_free_block": 0}]});
    let third = start + Duration::from_secs(2);
    store
        .push_at(newer.to_string().as_bytes(), None, third)
        .expect("accepted");
    let cache = sources.snapshot()[0].cache().expect("a snapshot's");
    assert_eq!(
        (
            cache.largest_free_block,
            cache.segments_by_size,
            cache.read_at
        ),
        (0, Vec::new(), third),
        "a newer snapshot replaces them all: no segments, nothing free"
    );
}

#[test]
fn an_ended_process_stays_for_its_grace_period_then_goes() {
    let (store, sources) = store_with(IngestConfig {
        ttl: Duration::from_secs(60),
        exited_grace: Duration::from_secs(120),
        ..config()
    });
    let start = Instant::now();
    let at = |s: u64| start + Duration::from_secs(s);
    store
        .push_at(&payload(1, 1, ok()), None, start)
        .expect("tcp");
    store
        .push_at(&payload(2, 1, ok()), Some(peer(40)), start)
        .expect("socket");
    store
        .push_at(&with_reason(3, 1, "exit", 0), None, start)
        .expect("exit");
    // Pid 40 vanishes at 10 s; pid 3 said it exits; pid 1 falls silent (ended at 60 s).
    let gone = |_: u32| None;
    store.expire_at(at(10), gone);
    assert_eq!(pids(&sources), [1, 3, 40], "all kept within their grace");
    store.expire_at(at(125), gone);
    assert_eq!(
        pids(&sources),
        [1, 40],
        "said it exits at 0 s: gone at 120 s"
    );
    store.expire_at(at(131), gone);
    assert_eq!(pids(&sources), [1], "vanished at 10 s: gone at 130 s");
    store.expire_at(at(179), gone);
    assert_eq!(pids(&sources), [1]);
    store.expire_at(at(181), gone);
    assert!(pids(&sources).is_empty(), "silent from 60 s: gone at 180 s");
    assert_eq!(store.tracked_processes(), 0);
}

#[test]
fn a_new_process_reusing_a_pid_starts_afresh() {
    use std::sync::atomic::{AtomicU64, Ordering};
    static START: AtomicU64 = AtomicU64::new(1);
    fn current(_: u32) -> Option<u64> {
        Some(START.load(Ordering::Relaxed))
    }
    let (store, sources) = store_with(IngestConfig {
        start_time: current,
        ..config()
    });
    let start = Instant::now();
    store
        .push_at(&with_reason(1, 900, "oom", 3), Some(peer(40)), start)
        .expect("first process");
    // Pid 40 now names another process: its seq 1 is not stale, and it carries nothing over.
    START.store(2, Ordering::Relaxed);
    store
        .push_at(
            &with_reason(1, 1, "interval", 0),
            Some(Peer {
                pid: 40,
                start_time: Some(2),
                uid: None,
            }),
            start,
        )
        .expect("a new process under the same pid");
    let list = sources.snapshot();
    assert_eq!(list.len(), 1, "one process per pid: no duplicate series");
    assert_eq!(list[0].stats.num_ooms.get(), 0);
    assert_eq!(list[0].last_oom_unix_seconds, None);
    // Expiry sees the start time change too: the process ended (seen at 10 s) although it
    // pushed a moment before, and goes after its grace period.
    store
        .push_at(
            &with_reason(1, 2, "interval", 0),
            Some(Peer {
                pid: 40,
                start_time: Some(2),
                uid: None,
            }),
            start + Duration::from_secs(9),
        )
        .expect("it goes on");
    START.store(3, Ordering::Relaxed);
    store.expire_at(start + Duration::from_secs(10), current);
    store.expire_at(start + Duration::from_secs(129), current);
    assert_eq!(sources.snapshot().len(), 1, "within its grace period");
    store.expire_at(start + Duration::from_secs(131), current);
    assert!(
        sources.snapshot().is_empty(),
        "ended when its start time changed"
    );
}

#[test]
fn a_tcp_push_cannot_take_over_a_socket_pusher() {
    let (store, sources) = store(10);
    let start = Instant::now();
    store
        .push_at(&payload(1, 1, ok()), Some(peer(40)), start)
        .expect("socket");
    let err = store
        .push_at(
            &payload(40, u64::MAX, ok()),
            None,
            start + Duration::from_secs(1),
        )
        .expect_err("refused");
    assert_eq!(err.refusal, Refusal::Conflict, "{}", err.message);
    store
        .push_at(
            &payload(1, 2, ok()),
            Some(peer(40)),
            start + Duration::from_secs(2),
        )
        .expect("the real process goes on");
    assert_eq!(pids(&sources), [40]);
}

#[test]
fn tcp_pushers_have_a_quota_of_their_own() {
    let (store, _) = store_with(IngestConfig {
        max_processes: 8,
        max_tcp_processes: 3,
        ..config()
    });
    let now = Instant::now();
    for pid in 1..=3 {
        store
            .push_at(&payload(pid, 1, ok()), None, now)
            .expect("tcp");
    }
    let err = store
        .push_at(&payload(4, 1, ok()), None, now)
        .expect_err("over the TCP quota");
    assert_eq!(err.refusal, Refusal::Capacity);
    assert!(err.message.contains("TCP"), "{}", err.message);
    for pid in 100..105 {
        store
            .push_at(&payload(1, 1, ok()), Some(peer(pid)), now)
            .expect("socket pushers still get in");
    }
    assert_eq!(store.tracked_processes(), 8);
}

/// A push of `devices` devices, each with a few size classes.
fn wide(pid: u32, seq: u64, devices: u32, reason: &str) -> Vec<u8> {
    let devices: Vec<_> = (0..devices)
        .map(|i| {
            serde_json::json!({
                "index": i, "uuid": format!("GPU-{i}"),
                "stats": {"allocated_bytes.all.current": 1, "num_ooms": u32::from(reason == "oom")},
                "largest_free_block": 1,
                "segments_by_size": (0..8)
                    .map(|b| serde_json::json!({"size": 1u64 << (21 + b), "segments": 1, "free_bytes": 0}))
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({"pid": pid, "seq": seq, "reason": reason, "devices": devices})
        .to_string()
        .into_bytes()
}

/// Issue 34, case 5: invented TCP pids once filled the whole series budget in a fraction of
/// a second, and a real job's first push and OOM push over the socket got `series_budget`.
#[test]
fn tcp_pushers_cannot_take_the_socket_pushers_series() {
    let config = config();
    let (store, sources) = store_with(config);
    let now = Instant::now();
    // One TCP identity: never past its quarter of TCP's share, however it grows.
    let err = store
        .push_at(&wide(1, 1, 16, "interval"), None, now)
        .expect_err("16 wide devices are past one TCP process's share");
    assert_eq!(err.refusal, Refusal::SeriesBudget, "{}", err.message);
    assert!(err.message.contains("625"), "{}", err.message);
    // Many identities: each gets its share until TCP's is spent.
    let mut pid = 100;
    let refused = loop {
        pid += 1;
        assert!(pid < 200, "the TCP share binds");
        if let Err(e) = store.push_at(&wide(pid, 1, 13, "interval"), None, now) {
            break e;
        }
    };
    assert_eq!(
        refused.refusal,
        Refusal::SeriesBudget,
        "{}",
        refused.message
    );
    assert!(refused.message.contains("TCP"), "{}", refused.message);
    let tcp = store.tcp_series();
    assert!(
        tcp <= config.max_tcp_series && tcp + 13 * 45 > config.max_tcp_series,
        "TCP holds {tcp} series, its share {}",
        config.max_tcp_series
    );
    // A real job over the socket: its first push (16 wide devices) and its OOM push.
    store
        .push_at(&wide(1, 1, 16, "interval"), Some(peer(5000)), now)
        .expect("a socket pusher's first push");
    store
        .push_at(
            &wide(1, 2, 16, "oom"),
            Some(peer(5000)),
            now + Duration::from_millis(10),
        )
        .expect("its OOM push");
    assert!(sources.snapshot().iter().any(|s| s.pid == 5000));
}

/// Issue 34, case 6: a socket connection's pid was fixed at connect time, so a process that
/// connected, forked and exited left a connection that pushed in the dead pid's name.
#[test]
fn a_socket_push_must_come_from_the_process_that_connected() {
    fn gone(_: u32) -> Option<u64> {
        None
    }
    let (store, sources) = store_with(config());
    let now = Instant::now();
    let connected = |start_time| Peer {
        pid: 40,
        start_time: Some(start_time),
        uid: None,
    };
    // The pid's process now started at tick 1 (`started_once`); the connection's at 2.
    let err = store
        .push_at(&payload(1, 1, ok()), Some(connected(2)), now)
        .expect_err("another process holds the pid now");
    assert_eq!(err.refusal, Refusal::Forbidden, "{}", err.message);
    assert!(err.message.contains("pid 40"), "{}", err.message);
    store
        .push_at(&payload(1, 1, ok()), Some(connected(1)), now)
        .expect("the same process");
    assert_eq!(pids(&sources), [40]);
    let (store, sources) = store_with(IngestConfig {
        start_time: gone,
        ..config()
    });
    let err = store
        .push_at(&payload(1, 1, ok()), Some(connected(1)), now)
        .expect_err("the process that connected is gone");
    assert_eq!(err.refusal, Refusal::Forbidden, "{}", err.message);
    // Gone by the accept already (under load), so its start time was never read: gone now
    // all the same (test-all caught an inherited connection pushing in this window).
    let err = store
        .push_at(
            &payload(1, 1, ok()),
            Some(Peer {
                pid: 40,
                start_time: None,
                uid: None,
            }),
            now,
        )
        .expect_err("the process that connected was gone by the accept");
    assert_eq!(err.refusal, Refusal::Forbidden, "{}", err.message);
    assert!(pids(&sources).is_empty());
}

#[test]
fn ended_processes_are_evicted_before_a_push_is_refused() {
    let (store, sources) = store_with(IngestConfig {
        max_processes: 2,
        ..config()
    });
    let start = Instant::now();
    store
        .push_at(&with_reason(1, 1, "exit", 1), None, start)
        .expect("ends at once");
    store
        .push_at(&payload(2, 1, ok()), None, start)
        .expect("live");
    store
        .push_at(&payload(3, 1, ok()), None, start + Duration::from_secs(1))
        .expect("takes the ended one's place");
    assert_eq!(pids(&sources), [2, 3]);
    let err = store
        .push_at(&payload(4, 1, ok()), None, start + Duration::from_secs(1))
        .expect_err("both live");
    assert_eq!(err.refusal, Refusal::Capacity);
}

#[test]
fn the_series_budget_bounds_every_push() {
    let one = super::payload::validate(&payload(1, 1, ok()))
        .expect("valid")
        .series();
    let (store, _) = store_with(IngestConfig {
        max_series: 2 * one,
        ..config()
    });
    let now = Instant::now();
    store
        .push_at(&payload(1, 1, ok()), None, now)
        .expect("one process's series");
    store
        .push_at(&payload(2, 1, ok()), None, now)
        .expect("two processes' series: the budget");
    let err = store
        .push_at(&payload(3, 1, ok()), None, now)
        .expect_err("over budget");
    assert_eq!(err.refusal, Refusal::SeriesBudget, "{}", err.message);
    // A process replacing its own series needs no more room.
    store
        .push_at(&payload(1, 2, ok()), None, now + Duration::from_secs(1))
        .expect("same size");
}

#[test]
fn sequence_numbers_and_urgent_pushes() {
    let (store, _) = store(10);
    let start = Instant::now();
    store
        .push_at(&payload(1, 10, ok()), None, start)
        .expect("first");
    let err = store
        .push_at(
            &payload(1, 11 + MAX_SEQ_JUMP, ok()),
            None,
            start + Duration::from_secs(1),
        )
        .expect_err("a huge jump");
    assert_eq!(err.refusal, Refusal::Invalid, "{}", err.message);
    // OOM and exit pushes get through the rate limit, a few of them (the first of these is
    // not early, and uses none of the allowance).
    let mut seq = 11;
    for _ in 0..=MAX_REASON_PUSHES {
        store
            .push_at(
                &with_reason(1, seq, "oom", seq),
                None,
                start + Duration::from_secs(1),
            )
            .expect("urgent");
        seq += 1;
    }
    let err = store
        .push_at(
            &with_reason(1, seq, "exit", seq),
            None,
            start + Duration::from_secs(1),
        )
        .expect_err("past the urgent allowance");
    assert_eq!(err.refusal, Refusal::RateLimited);
    // The allowance comes back, one push per REASON_REFILL: not a lifetime budget.
    let later = start + Duration::from_secs(1) + REASON_REFILL;
    store
        .push_at(&payload(1, seq, ok()), None, later)
        .expect("periodic");
    seq += 1;
    store
        .push_at(&with_reason(1, seq, "oom", seq), None, later)
        .expect("one urgent push given back");
    seq += 1;
    let err = store
        .push_at(&with_reason(1, seq, "oom", seq), None, later)
        .expect_err("only one");
    assert_eq!(err.refusal, Refusal::RateLimited);
    let much_later = later + REASON_REFILL * 2 * MAX_REASON_PUSHES;
    store
        .push_at(&payload(1, seq, ok()), None, much_later)
        .expect("periodic");
    for _ in 0..MAX_REASON_PUSHES {
        seq += 1;
        store
            .push_at(&with_reason(1, seq, "oom", seq), None, much_later)
            .expect("the whole allowance back, no more");
    }
    seq += 1;
    let err = store
        .push_at(&with_reason(1, seq, "oom", seq), None, much_later)
        .expect_err("the bucket holds no more than its size");
    assert_eq!(err.refusal, Refusal::RateLimited);
}

#[test]
fn pod_ooms_outlive_their_processes() {
    fn in_pod(pid: u32) -> Option<ContainerRef> {
        Some(ContainerRef {
            pod_uid: format!("5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c{pid:02}"),
            container_id: "ab".repeat(32),
            runtime: cgroup::Runtime::Containerd,
        })
    }
    let (store, sources) = store_with(IngestConfig {
        resolve: in_pod,
        oom_retention: Duration::from_secs(3600),
        ..config()
    });
    let start = Instant::now();
    store
        .push_at(&with_reason(1, 1, "interval", 0), Some(peer(30)), start)
        .expect("no OOM yet");
    assert!(store.report().pod_ooms.is_empty());
    store
        .push_at(&with_reason(1, 2, "oom", 1), Some(peer(30)), start)
        .expect("OOM");
    store
        .push_at(&with_reason(1, 3, "exit", 1), Some(peer(30)), start)
        .expect("exit");
    let ooms = store.report().pod_ooms;
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].ooms, 1, "counted once, not per push");
    assert!(ooms[0].pod_uid.ends_with("7c30"));
    let source = &sources.snapshot()[0];
    assert!(source.last_oom_unix_seconds.is_some());
    assert!(source.labels.iter().any(|(k, _)| k == "pod_uid"));
    // The process goes after its grace; the pod's count stays for its retention.
    store.expire_at(start + Duration::from_secs(600), |_| None);
    assert!(sources.snapshot().is_empty());
    assert_eq!(store.report().pod_ooms[0].ooms, 1);
    store.expire_at(start + Duration::from_secs(3601), |_| None);
    assert!(store.report().pod_ooms.is_empty());
}

#[test]
fn an_oom_dated_before_the_agent_started_is_not_counted_again() {
    fn in_pod(_: u32) -> Option<ContainerRef> {
        Some(ContainerRef {
            pod_uid: "5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30".into(),
            container_id: "ab".repeat(32),
            runtime: cgroup::Runtime::Containerd,
        })
    }
    let (store, sources) = store_with(IngestConfig {
        resolve: in_pod,
        ..config()
    });
    let body = serde_json::json!({"pid": 1, "seq": 1, "last_oom_unix_seconds": 1000.0,
        "devices": [{"index": 0, "uuid": "GPU-abc", "stats": {"num_ooms": 2}}]});
    store
        .push_at(body.to_string().as_bytes(), Some(peer(30)), Instant::now())
        .expect("accepted");
    assert!(
        store.report().pod_ooms.is_empty(),
        "its predecessor counted it"
    );
    assert_eq!(sources.snapshot()[0].last_oom_unix_seconds, Some(1000.0));
}

#[test]
fn a_refused_push_evicts_nothing() {
    let (store, sources) = store_with(IngestConfig {
        max_processes: 2,
        max_series: 60,
        ..config()
    });
    let start = Instant::now();
    store
        .push_at(&with_reason(1, 1, "exit", 1), None, start)
        .expect("ends at once, its OOM kept for the grace period");
    store
        .push_at(&payload(2, 1, ok()), None, start)
        .expect("live");
    // Too many series even with the ended process gone: refused, and the ended one stays.
    let many = serde_json::json!({"pid": 3, "seq": 1, "devices": [
        {"index": 0, "uuid": "a", "stats": {}}, {"index": 1, "uuid": "b", "stats": {}}]});
    let err = store
        .push_at(many.to_string().as_bytes(), None, start)
        .expect_err("over budget");
    assert_eq!(err.refusal, Refusal::SeriesBudget);
    assert_eq!(pids(&sources), [1, 2], "nothing evicted for a refused push");
}

#[test]
fn unattributed_pushes_tell_pid_reuse_by_their_start_time() {
    let (store, sources) = store(10);
    let start = Instant::now();
    let push = |seq: u64, start_time: u64, ooms: u64| {
        serde_json::json!({"pid": 1, "seq": seq, "start_time": start_time,
            "devices": [{"index": 0, "uuid": "u", "stats": {"num_ooms": ooms}}]})
        .to_string()
        .into_bytes()
    };
    store
        .push_at(&push(500, 100, 2), None, start)
        .expect("pid 1 of one container");
    // Another container's pid 1 (or another local user naming it): refused while the first
    // lives (issue 53, item 7: it took the job's series over), a push naming no start time
    // alike.
    let err = store
        .push_at(&push(1, 200, 0), None, start + Duration::from_secs(1))
        .expect_err("the first lives");
    assert_eq!(err.refusal, Refusal::Conflict, "{}", err.message);
    let anonymous = serde_json::json!({"pid": 1, "seq": 501,
        "devices": [{"index": 0, "uuid": "u", "stats": {"num_ooms": 5}}]});
    let err = store
        .push_at(anonymous.to_string().as_bytes(), None, start)
        .expect_err("no start time is no proof");
    assert_eq!(err.refusal, Refusal::Conflict, "{}", err.message);
    assert_eq!(sources.snapshot()[0].stats.num_ooms.get(), 2);
    // Once the first has been silent for its time to live, the other starts afresh: not
    // stale, and nothing of the first carried over.
    let later = start + IngestConfig::default().ttl + Duration::from_secs(1);
    store
        .push_at(&push(1, 200, 0), None, later)
        .expect("another process");
    let list = sources.snapshot();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].stats.num_ooms.get(), 0);
    assert_eq!(list[0].last_oom_unix_seconds, None);
    // The same one again is checked in order.
    let err = store
        .push_at(&push(1, 200, 0), None, later + Duration::from_secs(1))
        .expect_err("stale");
    assert_eq!(err.refusal, Refusal::Stale);
}

/// An OOM push of pid 9 on a device of 1 GiB: `pools` as pushed, `ooms` counted so far.
fn oom_push(seq: u64, ooms: u64, size: u64, free: u64, pools: serde_json::Value) -> Vec<u8> {
    serde_json::json!({
        "pid": 9, "seq": seq, "reason": "oom",
        "devices": [{"index": 0, "uuid": "GPU-abc", "stats": {"num_ooms": ooms},
                     "oom": {"size": size, "stream": 7, "device_total": 1u64 << 30,
                             "device_free": free, "pools": pools}}]
    })
    .to_string()
    .into_bytes()
}

#[test]
fn an_oom_push_tells_a_private_pools_cache_apart() {
    use crate::allocator::breakdown::Kind;
    let mib = 1u64 << 20;
    let (store, sources) = store(4);
    // 600 MiB cached free in a CUDA graph's pool on the request's own stream, 40 MiB in
    // the default pool: a 200 MiB request fails for the graph's cache.
    let pools = serde_json::json!([
        {"pool": "large", "stream": 7, "allocated": 200 * mib, "requested": 200 * mib,
         "pending_free": 0, "free": 40 * mib, "largest_free": 40 * mib, "segments_with_free": 1},
        {"pool": "large", "stream": 7, "allocated": 100 * mib, "requested": 100 * mib,
         "pending_free": 0, "free": 600 * mib, "largest_free": 600 * mib,
         "segments_with_free": 1, "private": true}
    ]);
    let push = |store: &PushStore, pools: serde_json::Value| {
        store.push_at(
            &oom_push(1, 1, 200 * mib, 20 * mib, pools),
            None,
            Instant::now(),
        )
    };
    push(&store, pools.clone()).expect("accepted");
    let oom = sources.snapshot()[0].last_oom().expect("explained");
    let b = &oom.breakdown;
    assert_eq!((b.fragmented, b.other_pools), (40 * mib, 600 * mib));
    assert_eq!(oom.kind, Kind::OtherPools, "{}", oom.why);
    assert!(oom.why.contains("600.00 MiB"), "{}", oom.why);
    // One kind of pool of a stream, listed twice, is refused; private or not tells two apart.
    let mut twice = pools.clone();
    twice.as_array_mut().expect("a list").push(pools[1].clone());
    assert!(push(&self::store(4).0, twice).is_err());
}

#[test]
fn an_oom_push_is_explained_with_the_cores_accounting() {
    use crate::allocator::breakdown::Kind;
    let mib = 1u64 << 20;
    let (store, sources) = store(4);
    // 300 MiB cached on the request's stream in pieces of at most 40 MiB, 100 MiB on another
    // stream, 512 MiB live: a 200 MiB request fails for fragmentation.
    let pools = serde_json::json!([
        {"pool": "large", "stream": 7, "allocated": 512 * mib, "requested": 500 * mib,
         "pending_free": 0, "free": 300 * mib, "largest_free": 40 * mib, "segments_with_free": 9},
        {"pool": "large", "stream": 3, "allocated": 0, "requested": 0,
         "pending_free": 0, "free": 100 * mib, "largest_free": 100 * mib, "segments_with_free": 1},
        {"pool": "small", "stream": 7, "allocated": 2 * mib, "requested": mib,
         "pending_free": 0, "free": 0, "largest_free": 0, "segments_with_free": 0}
    ]);
    let start = Instant::now();
    store
        .push_at(&oom_push(1, 1, 200 * mib, 60 * mib, pools), None, start)
        .expect("accepted");
    let oom = sources.snapshot()[0].last_oom().expect("explained");
    let b = &oom.breakdown;
    assert_eq!(b.requested, 501 * mib);
    assert_eq!(b.rounding, 13 * mib);
    assert_eq!(b.fragmented, 300 * mib);
    assert_eq!(b.other_streams, 100 * mib);
    assert_eq!(b.free, Some(60 * mib));
    // 1 GiB − 914 MiB reserved − 60 MiB free.
    assert_eq!(b.outside_allocator, Some(50 * mib));
    let sum = b.requested
        + b.rounding
        + b.fragmented
        + b.other_streams
        + b.other_pools
        + b.pending_stream_frees
        + b.free.unwrap_or(0)
        + b.outside_allocator.unwrap_or(0);
    assert_eq!(sum, 1 << 30, "the parts add up to the device");
    assert_eq!(oom.kind, Kind::Fragmentation, "{}", oom.why);
    assert!(oom.why.contains("40.00 MiB"), "{}", oom.why);

    // A later periodic push keeps the explanation; the next OOM without figures drops it.
    let ooms = |n: u64| serde_json::json!({ "num_ooms": n });
    store
        .push_at(
            &payload(9, 2, ooms(1)),
            None,
            start + Duration::from_secs(1),
        )
        .expect("accepted");
    assert!(sources.snapshot()[0].last_oom().is_some(), "it stands");
    store
        .push_at(
            &payload(9, 3, ooms(2)),
            None,
            start + Duration::from_secs(2),
        )
        .expect("accepted");
    assert!(
        sources.snapshot()[0].last_oom().is_none(),
        "an older OOM's explanation is not shown for a newer OOM"
    );

    // More than live tensors and the request can fit: too big, whatever is cached.
    let (store, sources) = store_with(config());
    let pools = serde_json::json!([
        {"pool": "large", "stream": 7, "allocated": 900 * mib, "requested": 900 * mib,
         "pending_free": 0, "free": 20 * mib, "largest_free": 20 * mib, "segments_with_free": 1}
    ]);
    store
        .push_at(&oom_push(1, 1, 400 * mib, 0, pools), None, start)
        .expect("accepted");
    let oom = sources.snapshot()[0].last_oom().expect("explained");
    assert_eq!(oom.kind, Kind::TooBig, "{}", oom.why);
}

#[test]
fn inconsistent_or_oversized_oom_figures_are_refused_by_name() {
    let mib = 1u64 << 20;
    let pool = |pool: &str,
                stream: u64,
                allocated: u64,
                requested: u64,
                free: u64,
                largest: u64,
                segs: u64| {
        serde_json::json!({"pool": pool, "stream": stream, "allocated": allocated,
            "requested": requested, "pending_free": 0, "free": free, "largest_free": largest,
            "segments_with_free": segs})
    };
    let huge = 1u64 << 59;
    for (pools, says) in [
        (
            serde_json::json!([pool("medium", 0, 0, 0, 0, 0, 0)]),
            "\"small\" or \"large\"",
        ),
        (
            serde_json::json!([
                pool("large", 0, 0, 0, 0, 0, 0),
                pool("large", 0, 0, 0, 0, 0, 0)
            ]),
            "listed twice",
        ),
        (
            serde_json::json!([pool("large", 0, mib, 2 * mib, 0, 0, 0)]),
            "requested exceeds",
        ),
        (
            serde_json::json!([pool("large", 0, 0, 0, mib, 2 * mib, 1)]),
            "largest_free exceeds",
        ),
        (
            serde_json::json!([pool("large", 0, 0, 0, mib, mib, 0)]),
            "segments with free",
        ),
        (
            // 2^53 - 1 segments sharing 1 MiB: none could hold a 512-byte block.
            serde_json::json!([pool("large", 0, 0, 0, mib, mib, (1u64 << 53) - 1)]),
            "segments with free",
        ),
        (
            serde_json::json!([pool("large", 0, 0, 0, mib, 512, 2049)]),
            "2049 segments with free bytes for 1048576 free bytes",
        ),
        (
            serde_json::json!([pool("large", 0, 0, 0, 1u64 << 60, 0, 1)]),
            "not below 2^60",
        ),
        (
            serde_json::json!([pool("large", 0, 2 << 30, 0, 0, 0, 0)]),
            "more than the device's",
        ),
        (
            serde_json::json!([
                pool("large", 0, huge, 0, 0, 0, 0),
                pool("large", 1, huge, 0, 0, 0, 0)
            ]),
            "reserved memory",
        ),
        (
            serde_json::Value::Array((0..65).map(|s| pool("large", s, 0, 0, 0, 0, 0)).collect()),
            "at most 64",
        ),
    ] {
        let (store, sources) = store(4);
        let err = store
            .push(&oom_push(1, 1, mib, 0, pools))
            .expect_err("refused");
        assert_eq!(err.refusal, Refusal::Invalid);
        assert!(err.message.contains(says), "{says}: {}", err.message);
        assert!(err.message.contains("oom"), "{}", err.message);
        assert!(sources.snapshot().is_empty(), "nothing kept");
    }
    // Issue 34, case 13: "the largest free block the request could use was" larger than the
    // request, with nothing to keep it whole. The push is kept (its OOM counted) but not
    // explained; where max_split_size keeps such blocks whole, it is.
    let mut body: serde_json::Value = serde_json::from_slice(&oom_push(
        1,
        1,
        3 * mib,
        0,
        serde_json::json!([pool("large", 7, 0, 0, 40 * mib, 40 * mib, 1)]),
    ))
    .expect("json");
    let (store, sources) = store(4);
    store
        .push(&serde_json::to_vec(&body).expect("json"))
        .expect("kept");
    let device = &sources.snapshot()[0];
    assert_eq!(device.stats.num_ooms.get(), 1);
    assert!(
        device.last_oom().is_none(),
        "no breakdown naming a 40 MiB free block"
    );
    body["devices"][0]["stats"]["max_split_size"] = serde_json::json!(20 * mib);
    body["devices"][0]["stats"]["num_ooms"] = serde_json::json!(2);
    body["seq"] = serde_json::json!(2);
    store
        .push(&serde_json::to_vec(&body).expect("json"))
        .expect("kept");
    assert!(
        sources.snapshot()[0].last_oom().is_some(),
        "a block that max_split_size keeps whole explains nothing away"
    );
    // Its series are counted in the budget: one per part.
    let body = oom_push(1, 1, mib, 0, serde_json::json!([]));
    let plain = with_reason(9, 1, "oom", 1);
    let with = super::payload::validate(&body).expect("valid").series();
    let without = super::payload::validate(&plain).expect("valid").series();
    assert_eq!(with - without, super::limits::OOM_BREAKDOWN_SERIES);
}

#[test]
fn an_explanation_kept_from_an_earlier_push_counts_in_the_series_budget() {
    // A plain push of one device: its series and the process's push age; an OOM's
    // explanation, while kept, adds one per part.
    let plain = 1 + super::limits::SERIES_PER_DEVICE;
    let (store, sources) = store_with(IngestConfig {
        max_series: plain + super::limits::OOM_BREAKDOWN_SERIES + plain - 1,
        ..config()
    });
    let now = Instant::now();
    let pools = serde_json::json!([]);
    store
        .push_at(&oom_push(1, 1, 1 << 20, 0, pools), None, now)
        .expect("fits");
    // The next push of pid 9 brings no OOM, but its explanation stands and is exported.
    store
        .push_at(
            &payload(9, 2, serde_json::json!({"num_ooms": 1})),
            None,
            now + Duration::from_secs(1),
        )
        .expect("the same series");
    assert!(sources.snapshot()[0].last_oom().is_some());
    let err = store
        .push_at(&payload(2, 1, ok()), None, now + Duration::from_secs(1))
        .expect_err("the kept series leave no room for another process");
    assert_eq!(err.refusal, Refusal::SeriesBudget, "{}", err.message);
}

/// Two pods, as the node knows them: pod a's processes 1 to 40 are host pids 7001 to 7040,
/// pod b's process 1 is host pid 8001; each started at tick 5.
fn two_pods(uid: &str, pid: u32, start_time: Option<u64>) -> Result<PodProcess, NotInPod> {
    let host = match (uid, pid) {
        ("uid-a", 1..=40) => 7000 + pid,
        ("uid-b", 1) => 8001,
        _ => 0,
    };
    if host == 0 || start_time.is_some_and(|t| t != 5) {
        return Err(NotInPod::Missing {
            pod_uid: uid.into(),
            pid,
            start_time,
        });
    }
    Ok(PodProcess {
        pid: host,
        start_time: 5,
        container: ContainerRef {
            pod_uid: uid.into(),
            container_id: format!("{:0<64}", uid.replace('-', "")),
            runtime: cgroup::Runtime::Containerd,
        },
    })
}

fn pod(name: &str) -> Sender {
    Sender::Pod(PodPeer {
        uid: format!("uid-{name}"),
        namespace: "team".into(),
        name: name.into(),
    })
}

fn from_pod(pid: u32, seq: u64, labels: serde_json::Value) -> Vec<u8> {
    serde_json::json!({
        "pid": pid, "seq": seq, "start_time": 5, "labels": labels,
        "devices": [{"index": 0, "uuid": "GPU-abc", "stats": ok()}]
    })
    .to_string()
    .into_bytes()
}

/// Issue 35: a pod's pushes name their own pod's processes and labels only, within the
/// pod's quota; the node's word replaces the payload's pid.
#[test]
fn pod_pushes_are_the_pods_own_within_its_quota() {
    let (store, sources) = store_with(IngestConfig {
        pod_process: two_pods,
        max_pod_processes: 3,
        ..config()
    });
    let now = Instant::now();
    let none = serde_json::json!({});
    store
        .push_at(&from_pod(1, 1, none.clone()), pod("a"), now)
        .expect("pod a's pid 1");
    store
        .push_at(&from_pod(1, 1, none.clone()), pod("b"), now)
        .expect("pod b's pid 1: another process");
    let list = sources.snapshot();
    let of = |pid: u32| list.iter().find(|s| s.pid == pid).expect("published");
    assert!(
        of(7001)
            .labels
            .contains(&("pod_uid".to_string(), "uid-a".to_string()))
    );
    assert!(
        of(8001)
            .labels
            .contains(&("pod_uid".to_string(), "uid-b".to_string()))
    );
    // The runtime named the pod: its namespace and name need no kubelet directory.
    for (name, value) in [("pod_namespace", "team"), ("pod_name", "a")] {
        assert!(
            of(7001)
                .labels
                .contains(&(name.to_string(), value.to_string())),
            "{name}"
        );
    }

    // Pod b claiming pod a's pid 2, or its labels.
    let err = store
        .push_at(&from_pod(2, 1, none.clone()), pod("b"), now)
        .expect_err("pid 2 is pod a's");
    assert_eq!(err.refusal, Refusal::NotInPod, "{}", err.message);
    for labels in [
        serde_json::json!({"pod_uid": "uid-a"}),
        serde_json::json!({"pod": "a"}),
        serde_json::json!({"namespace": "other-team"}),
    ] {
        let err = store
            .push_at(&from_pod(1, 2, labels.clone()), pod("b"), now)
            .expect_err("labels naming another pod");
        assert_eq!(err.refusal, Refusal::Forbidden, "{labels}: {}", err.message);
    }
    // Its own identity, said again, is no claim.
    store
        .push_at(
            &from_pod(1, 2, serde_json::json!({"pod": "b", "namespace": "team"})),
            pod("b"),
            now + Duration::from_secs(1),
        )
        .expect("pod b naming itself");

    // A loopback push cannot write a pod's process.
    let err = store
        .push_at(&payload(7001, 9, ok()), None, now + Duration::from_secs(2))
        .expect_err("pid 7001 is pod a's");
    assert_eq!(err.refusal, Refusal::Conflict, "{}", err.message);

    // Pod a fills its quota of three; pod b still pushes.
    for pid in [2, 3] {
        store
            .push_at(&from_pod(pid, 1, none.clone()), pod("a"), now)
            .expect("within pod a's quota");
    }
    let err = store
        .push_at(&from_pod(4, 1, none.clone()), pod("a"), now)
        .expect_err("past pod a's quota");
    assert_eq!(err.refusal, Refusal::Capacity, "{}", err.message);
    assert!(err.message.contains("uid-a"), "{}", err.message);
    store
        .push_at(
            &from_pod(1, 3, none),
            pod("b"),
            now + Duration::from_secs(3),
        )
        .expect("pod b is not held to pod a's quota");
    let Sender::Pod(b) = pod("b") else {
        unreachable!()
    };
    let err = store
        .push_from_pod(&from_pod(2, 1, serde_json::json!({})), b)
        .expect_err("pid 2 is pod a's");
    assert_eq!(err.refusal, Refusal::NotInPod);
    let counts: BTreeMap<_, _> = store.counts().into_iter().collect();
    assert_eq!(counts["not_in_pod"], 1, "counted under its reason");
}

/// The per-pod series share binds a pod's processes together.
#[test]
fn a_pods_series_share_binds_its_processes_together() {
    let (store, _) = store_with(IngestConfig {
        pod_process: two_pods,
        max_pod_series: 100,
        ..config()
    });
    let now = Instant::now();
    // One device's push is about 30 series: the fourth process passes 100.
    let mut refused = None;
    for pid in 1..=10 {
        if let Err(e) = store.push_at(&from_pod(pid, 1, serde_json::json!({})), pod("a"), now) {
            refused = Some((pid, e));
            break;
        }
    }
    let (pid, err) = refused.expect("the share binds");
    assert!(pid > 1, "one process fits");
    assert_eq!(err.refusal, Refusal::SeriesBudget, "{}", err.message);
    assert!(err.message.contains("uid-a"), "{}", err.message);
    store
        .push_at(&from_pod(1, 1, serde_json::json!({})), pod("b"), now)
        .expect("another pod's share is its own");
}

/// All pods together hold at most their share, however many pods push.
#[test]
fn the_pods_together_hold_their_share() {
    let (store, _) = store_with(IngestConfig {
        pod_process: two_pods,
        max_pod_network_processes: 2,
        ..config()
    });
    let now = Instant::now();
    let none = serde_json::json!({});
    store
        .push_at(&from_pod(1, 1, none.clone()), pod("a"), now)
        .expect("pod a");
    store
        .push_at(&from_pod(1, 1, none.clone()), pod("b"), now)
        .expect("pod b");
    let err = store
        .push_at(&from_pod(2, 1, none), pod("a"), now)
        .expect_err("past the pods' share");
    assert_eq!(err.refusal, Refusal::Capacity, "{}", err.message);
    assert!(err.message.contains("pod network"), "{}", err.message);
    // A socket pusher is not held to it.
    store
        .push_at(&payload(1, 1, ok()), Some(peer(9000)), now)
        .expect("a socket pusher");
}

/// Issue 53, item 12 (the flaky recordings test): with no grace period (`--exited-grace 0`)
/// the expiry tick dropped every tracked process, live ones too, so a job's upload between
/// its push and the next tick was refused as from a process that never pushed.
#[test]
fn no_grace_period_drops_ended_processes_only() {
    let (store, sources) = store_with(IngestConfig {
        exited_grace: Duration::ZERO,
        ..config()
    });
    let start = Instant::now();
    store
        .push_at(&payload(1, 1, ok()), None, start)
        .expect("live");
    store
        .push_at(&with_reason(2, 1, "exit", 0), None, start)
        .expect("ends at once");
    store.expire_at(start + Duration::from_millis(1), started_once);
    assert_eq!(
        pids(&sources),
        [1],
        "the live one stays, the ended one goes"
    );
    #[cfg(feature = "tools")]
    assert!(store.recording_owner(Sender::Unattributed, 1, None).is_ok());
    // Silent past its time to live, it has ended, and goes at once.
    store.expire_at(
        start + IngestConfig::default().ttl + Duration::from_secs(1),
        started_once,
    );
    assert!(pids(&sources).is_empty());
}
