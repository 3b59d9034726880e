//! Private pools in replay (Note [Replaying pools], Note [Inferred pools]): recordings made
//! by the core with pools replay exactly, with their pools recorded (2.12 on) or read off
//! their segments (before 2.12), and the same recording with the pools taken away diverges.

use gpumem::CachingAllocator;
use gpumem::allocator::{PoolId, PoolOptions, RouteKind, StreamFilter};
use gpumem::device::SimDevice;
use gpumem::recording::parse_recording;
use gpumem::replay::{Divergence, Setup, WhatIf};
use serde_json::{Value, json};

use crate::common::{
    GIB, MIB, S0, S1, allocator, check_replay, empty_cache, explain_text, free, malloc,
    replays_exactly, what_if,
};

const GRAPH: PoolId = PoolId(0, 1);

/// An allocator of `capacity` bytes under `conf` recording its history.
fn recording(capacity: u64, conf: &str) -> CachingAllocator<SimDevice> {
    let mut a = allocator(capacity, conf);
    a.record_history(Some(1 << 20));
    a
}

fn route(a: &mut CachingAllocator<SimDevice>, filter: StreamFilter, kind: RouteKind) {
    a.begin_allocate_to_pool(GRAPH, filter, kind)
        .expect("routed");
}

fn unroute(a: &mut CachingAllocator<SimDevice>) {
    a.end_allocate_to_pool(GRAPH).expect("was routed");
}

fn snapshot(a: &mut CachingAllocator<SimDevice>) -> Value {
    serde_json::to_value(a.snapshot()).expect("serialises")
}

/// Where `v` diverges; it must.
fn diverges(v: &Value) -> Divergence {
    check_replay(v)
        .divergence
        .expect("the recording cannot be replayed this way")
}

/// `v` as if every block and segment were the default pool's.
fn without_pools(mut v: Value) -> Value {
    for e in v["device_traces"][0].as_array_mut().expect("a trace") {
        e["pool_id"] = json!([0, 0]);
    }
    for s in v["segments"].as_array_mut().expect("segments") {
        s["segment_pool_id"] = json!([0, 0]);
    }
    v
}

/// `v` as PyTorch before 2.12 records it: trace entries without `pool_id`.
fn without_trace_pool_ids(mut v: Value) -> Value {
    for e in v["device_traces"][0].as_array_mut().expect("a trace") {
        e.as_object_mut().expect("an entry").remove("pool_id");
    }
    v
}

/// `v` replays exactly with its pools, recorded or (before 2.12) read off its segments, all
/// of which survive; without pools it diverges at a recorded `expected` event.
fn exact_and_not_without_pools(v: Value, expected: &str) {
    replays_exactly(&v);
    let r = replays_exactly(&without_trace_pool_ids(v.clone()));
    assert_eq!(r.inferred_pools.map(|i| i.assumed), Some(0));
    let d = diverges(&without_pools(v));
    assert!(d.expected.starts_with(expected), "{d:?}");
}

/// Whether any recorded event lies in `pool`.
fn has_events_in(v: &Value, pool: PoolId) -> bool {
    v["device_traces"][0]
        .as_array()
        .expect("a trace")
        .iter()
        .any(|e| e["pool_id"] == json!([pool.0, pool.1]))
}

#[test]
fn blocks_are_reused_only_within_their_pool_in_replay() {
    let mut a = recording(GIB, "");
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let p = malloc(&mut a, 4 * MIB, S0);
    free(&mut a, p);
    unroute(&mut a);
    // The pool's cached block is not the default request's: a segment of its own.
    let _d = malloc(&mut a, 4 * MIB, S0);
    let v = snapshot(&mut a);
    assert!(has_events_in(&v, GRAPH));
    replays_exactly(&v);
    let d = diverges(&without_pools(v.clone()));
    assert!(d.expected.starts_with("segment_alloc"), "{d:?}");
    // What-if keeps the pools apart too: under expandable segments each pool maps its own.
    let rec = parse_recording(v.to_string().as_bytes()).expect("reads");
    let expandable = WhatIf {
        config: Some(gpumem::AllocatorConfig::parse("expandable_segments:True").expect("valid")),
        ..WhatIf::default()
    };
    let r = what_if(&rec, Setup::default(), expandable).expect("what-if runs");
    assert_eq!((r.device_allocs, r.ooms), (2, 0), "{r:?}");
    // Before 2.12 the pools are read off the segments, which both survive.
    let r = replays_exactly(&without_trace_pool_ids(v));
    let inferred = r.inferred_pools.expect("pools inferred");
    assert_eq!(inferred.assumed, 0);
    assert!(inferred.from_segments > 0);
    assert!(
        r.notes.iter().any(|n| n.contains("records no pools")),
        "{:?}",
        r.notes
    );
}

#[test]
fn a_pool_keeps_its_cache_until_released_and_then_gives_whole_segments_back() {
    let mut a = recording(GIB, "");
    a.create_pool(GRAPH, PoolOptions::default()).expect("new");
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let whole = malloc(&mut a, 30 * MIB, S0);
    let _kept = malloc(&mut a, 4 * MIB, S0);
    let freed = malloc(&mut a, 4 * MIB, S0);
    free(&mut a, whole);
    free(&mut a, freed);
    unroute(&mut a);
    // Referenced: the flush leaves the pool alone, and a default request of the same size
    // gets a segment of its own.
    empty_cache(&mut a);
    let _x = malloc(&mut a, 30 * MIB, S0);
    // The last references go: the flush frees the whole segment, not the split one.
    a.release_pool(GRAPH).expect("routed once");
    a.release_pool(GRAPH).expect("made once");
    empty_cache(&mut a);
    let v = snapshot(&mut a);
    let last = v["device_traces"][0]
        .as_array()
        .expect("a trace")
        .last()
        .cloned()
        .expect("events");
    assert_eq!(last["action"], "segment_free");
    assert_eq!(last["pool_id"], json!([0, 1]));
    replays_exactly(&v);
    diverges(&without_pools(v.clone()));
    // Before 2.12 the released segment's pool died with it: its events are assumed the
    // default pool's, the replay says so, and it cannot reproduce them.
    let untraced = without_trace_pool_ids(v);
    let r = check_replay(&untraced);
    let inferred = r.inferred_pools.expect("pools inferred");
    assert!(inferred.assumed > 0 && inferred.first_assumed.is_some());
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("released before the snapshot")),
        "{:?}",
        r.notes
    );
    assert!(r.divergence.is_some());
}

#[test]
fn a_default_request_served_from_a_use_on_oom_pool_replays_in_that_pool() {
    let mut a = recording(64 * MIB, "");
    let options = PoolOptions {
        use_on_oom: true,
        no_split: false,
    };
    a.create_pool(GRAPH, options).expect("new");
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let p = malloc(&mut a, 40 * MIB, S0);
    free(&mut a, p);
    unroute(&mut a);
    // 24 MiB left on the device: a 20 MiB segment for 10 MiB, then nothing for 30 MiB but
    // the pool's cached block.
    let _q = malloc(&mut a, 10 * MIB, S0);
    let r = malloc(&mut a, 30 * MIB, S0);
    assert_eq!(r, p, "served from the pool");
    let v = snapshot(&mut a);
    let trace = v["device_traces"][0].as_array().expect("a trace");
    let served = trace
        .iter()
        .rposition(|e| e["action"] == "alloc")
        .expect("allocations");
    assert_eq!(trace[served]["pool_id"], json!([0, 1]));
    replays_exactly(&v);
    // Read as a default request that no pool may serve, it runs out of memory.
    let mut default = v.clone();
    default["device_traces"][0][served]["pool_id"] = json!([0, 0]);
    let d = diverges(&default);
    assert_eq!(d.index, served, "{d:?}");
    assert!(d.actual.starts_with("oom"), "{d:?}");
}

#[test]
fn a_no_split_pool_is_read_off_its_whole_blocks() {
    let mut a = recording(GIB, "");
    let options = PoolOptions {
        use_on_oom: false,
        no_split: true,
    };
    a.create_pool(GRAPH, options).expect("new");
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let _p = malloc(&mut a, 4 * MIB, S0);
    let _q = malloc(&mut a, 4 * MIB, S0);
    unroute(&mut a);
    let v = snapshot(&mut a);
    let segments = v["segments"].as_array().expect("segments");
    assert_eq!(segments.len(), 2, "each request took a whole segment");
    // In the default pool the first segment is split and serves the second request.
    exact_and_not_without_pools(v, "segment_alloc");
}

#[test]
fn expandable_segments_replay_per_pool() {
    let mut a = recording(GIB, "expandable_segments:True");
    let _d = malloc(&mut a, 4 * MIB, S0);
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let _g = malloc(&mut a, 4 * MIB, S0);
    unroute(&mut a);
    let _e = malloc(&mut a, 4 * MIB, S0);
    let v = snapshot(&mut a);
    // In one pool, the second request is served from the first page's free rest.
    exact_and_not_without_pools(v, "segment_map");
}

#[test]
fn an_oom_in_a_graph_pool_replays_without_the_flush_a_capture_skips() {
    let mut a = recording(64 * MIB, "");
    let cached = malloc(&mut a, 40 * MIB, S0);
    free(&mut a, cached);
    route(&mut a, StreamFilter::Streams(vec![S1]), RouteKind::Capture);
    assert!(a.malloc(40 * MIB, S1).is_err());
    unroute(&mut a);
    let v = snapshot(&mut a);
    let trace = v["device_traces"][0].as_array().expect("a trace");
    let oom = trace.last().expect("events");
    assert_eq!(
        (&oom["action"], &oom["pool_id"]),
        (&json!("oom"), &json!([0, 1]))
    );
    let r = replays_exactly(&v);
    assert_eq!(r.compared.ooms, 1);
    // A default request would have flushed the cached segment first.
    let d = diverges(&without_pools(v));
    assert!(d.actual.starts_with("segment_free"), "{d:?}");
}

/// gpumem's own recordings of random runs with MemPools replay exactly, with pools recorded:
/// allocations, frees used by other streams, routes, releases, flushes, OOMs. Captures are
/// left out: a recording does not show when one was under way (Note [Replaying pools]).
#[test]
fn random_runs_with_pools_replay_exactly() {
    use gpumem::ops::{Op, Run};
    use gpumem::rng::XorShift;

    let mut rng = XorShift::new(31);
    let (mut private_events, mut private_releases, mut ooms) = (0, 0, 0);
    for case in 0..40 {
        let mut run = Run::new();
        run.alloc.record_history(Some(1 << 20));
        for _ in 0..600 {
            let op = match Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64()) {
                Op::BeginPool { pool, .. } => Op::BeginPool {
                    pool,
                    capture: None,
                },
                // A pool's options are fixed when PyTorch makes it (ids are not reused); the
                // operations may switch `no_split` on midway, which a replay reading it off
                // the final state cannot follow.
                Op::CreatePool { pool, options } => Op::CreatePool {
                    pool,
                    options: PoolOptions {
                        no_split: false,
                        ..options
                    },
                },
                op @ (Op::Malloc { .. }
                | Op::Free { .. }
                | Op::RecordStream { .. }
                | Op::CompleteStream { .. }
                | Op::EmptyCache
                | Op::EndPool { .. }
                | Op::ReleasePool { .. }) => op,
                _ => continue,
            };
            run.apply(&op).expect("invariants hold");
        }
        let v = snapshot(&mut run.alloc);
        let r = check_replay(&v);
        if let Some(d) = &r.divergence {
            panic!(
                "case {case} diverges at #{}: expected {}, got {}\n{}",
                d.index,
                d.expected,
                d.actual,
                d.context.join("\n")
            );
        }
        for e in v["device_traces"][0].as_array().expect("a trace") {
            if e["pool_id"] != json!([0, 0]) {
                private_events += 1;
                private_releases += usize::from(e["action"] == "segment_free");
                ooms += usize::from(e["action"] == "oom");
            }
        }
    }
    eprintln!("{private_events} events, {private_releases} releases, {ooms} OOMs in private pools");
    // The runs reach what the replay of pools must follow.
    assert!(
        private_events > 1000 && private_releases > 10 && ooms > 0,
        "{private_events} events, {private_releases} releases, {ooms} OOMs in private pools"
    );
}

/// A capture's own pool (`(capture id, 0)`).
const CAPTURE: PoolId = PoolId(5, 0);

/// A recording whose OOM comes with 40 MiB cached in a CUDA graph's pool: the graph was
/// captured (its pool keeps its cache while the graph lives), 8 MiB live take a 20 MiB
/// segment, then a default request of 40 MiB finds the 64 MiB device full.
pub(crate) fn graph_oom_recording() -> Value {
    let mut a = recording(64 * MIB, "");
    a.begin_allocate_to_pool(CAPTURE, StreamFilter::Streams(vec![S0]), RouteKind::Capture)
        .expect("a capture");
    let scratch = malloc(&mut a, 40 * MIB, S0);
    free(&mut a, scratch);
    a.end_allocate_to_pool(CAPTURE).expect("captured");
    let _live = malloc(&mut a, 8 * MIB, S0);
    assert!(
        a.malloc(40 * MIB, S0).is_err(),
        "the graph's cache is not the request's"
    );
    snapshot(&mut a)
}

#[test]
fn an_oom_beside_a_graph_pools_cache_is_explained_as_such() {
    use crate::common::explain;
    use crate::common::succeeded;
    use gpumem::explain::At;
    use std::process::Command;

    let v = graph_oom_recording();
    replays_exactly(&v);
    let rec = parse_recording(v.to_string().as_bytes()).expect("reads");
    let e = explain(&rec, At::FirstOom, Setup::default()).expect("explains");
    assert_eq!(e.request.pool_id, PoolId::DEFAULT);
    assert_eq!(e.breakdown.other_pools, 40 * MIB);
    assert_eq!(
        e.breakdown.fragmented,
        12 * MIB,
        "the default pool's 20 MiB segment's rest"
    );
    assert_eq!(
        e.kinds[0],
        gpumem::allocator::breakdown::Kind::OtherPools,
        "{}",
        e.sentence
    );
    assert!(e.sentence.contains("40.00 MiB"), "{}", e.sentence);
    let pools = &e.private_pools;
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!(
        (pools[0].id, pools[0].kind, pools[0].free),
        (CAPTURE, "graph", 40 * MIB)
    );
    assert!(
        e.candidates.is_empty(),
        "no setting reaches a graph's cache"
    );

    let dir = crate::common::temp_dir("graph-oom");
    let file = dir.join("graph-oom.json");
    std::fs::write(&file, v.to_string()).expect("write");
    let text = explain_text(&file);
    for said in [
        "pool (5, 0) (a CUDA graph's own pool): 40.00 MiB in 1 segments, 40.00 MiB cached free",
        "cached, free, other pools (CUDA graphs, MemPools)",
        "empty_cache() frees",
    ] {
        assert!(text.contains(said), "{said:?} in:\n{text}");
    }
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["explain", "--json"])
            .arg(&file),
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["breakdown"]["other_pools"], 40 * MIB);
    assert_eq!(json["kinds"][0], "other_pools");
    assert_eq!(json["private_pools"][0]["id"], json!([5, 0]));
    assert_eq!(json["private_pools"][0]["kind"], "graph");

    // The web view: the explanation's pools and the map's marked segment.
    let (_view, port) = crate::view::spawn_view(&file, &dir.join("view.log"));
    let browser = crate::browser::Browser::start();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    let row = crate::agent::wait_for(std::time::Duration::from_secs(60), || {
        let text = browser.eval(
            "const r = document.querySelector('#private-pools tr[data-pool=\"5,0\"]'); return r ? r.textContent : null;",
        );
        text.as_str().map(str::to_string)
    })
    .expect("the explanation lists the graph's pool");
    assert!(
        row.contains("(5, 0)") && row.contains("CUDA graph") && row.contains("40.00 MiB"),
        "{row}"
    );
    let part = browser.eval(
        "const r = document.querySelector('#breakdown tr[data-part^=\"cached, free, other pools\"]'); return r ? r.textContent : null;",
    );
    assert!(
        part.as_str().is_some_and(|t| t.contains("40.00 MiB")),
        "{part}"
    );
    let marked = crate::agent::wait_for(std::time::Duration::from_secs(60), || {
        browser
            .eval("return document.querySelectorAll('#map-recorded g.segment.private[data-pool=\"5,0\"]').length;")
            .as_u64()
            .filter(|&n| n > 0)
    })
    .expect("the map marks the graph's segment");
    assert_eq!(marked, 1);
    assert_eq!(browser.console_errors(), Vec::<String>::new());
    browser.screenshot("view-graph-oom.png");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_trace_that_starts_with_private_pool_segments_replays_exactly() {
    // The ring buffer keeps the last 12 events: the graph's and the MemPool's segments were
    // made before them, and the start state rebuilt from the snapshot holds them in their
    // pools.
    let mut a = allocator(GIB, "");
    a.record_history(Some(12));
    let mem_pool = PoolId(0, 2);
    a.create_pool(mem_pool, PoolOptions::default())
        .expect("new");
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let g = malloc(&mut a, 6 * MIB, S0);
    let _kept = malloc(&mut a, 6 * MIB, S0);
    unroute(&mut a);
    a.begin_allocate_to_pool(
        mem_pool,
        StreamFilter::Streams(vec![S1]),
        RouteKind::MemPool,
    )
    .expect("routed");
    let m = malloc(&mut a, 3 * MIB, S1);
    a.end_allocate_to_pool(mem_pool).expect("routed");
    let d = malloc(&mut a, 6 * MIB, S0);
    for p in [g, m, d] {
        free(&mut a, p);
    }
    // The trace's own events: default requests that must not take the pools' free blocks,
    // and requests routed into them that must.
    for _ in 0..2 {
        let p = malloc(&mut a, 6 * MIB, S0);
        route(&mut a, StreamFilter::Any, RouteKind::MemPool);
        let q = malloc(&mut a, 6 * MIB, S0);
        unroute(&mut a);
        free(&mut a, p);
        free(&mut a, q);
    }
    let v = snapshot(&mut a);
    let r = replays_exactly(&v);
    assert!(r.start_segments >= 3, "{r:?}");
    assert!(has_events_in(&v, GRAPH));
    diverges(&without_pools(v.clone()));
    // Before 2.12, the same from the segments, which all survive.
    let r = replays_exactly(&without_trace_pool_ids(v));
    assert_eq!(r.inferred_pools.map(|i| i.assumed), Some(0));
}

#[test]
fn a_plan_leaves_private_pools_to_the_caching_allocator() {
    use crate::common::succeeded;
    use std::process::Command;

    // Ten iterations: activations in the default pool, a graph's scratch in its own pool.
    let mut a = recording(GIB, "");
    for _ in 0..10 {
        let acts: Vec<_> = [8, 3, 12, 1]
            .into_iter()
            .map(|m| malloc(&mut a, m * MIB + 4096, S0))
            .collect();
        route(&mut a, StreamFilter::Any, RouteKind::MemPool);
        let scratch = malloc(&mut a, 5 * MIB, S0);
        unroute(&mut a);
        free(&mut a, scratch);
        for p in acts.into_iter().rev() {
            free(&mut a, p);
        }
    }
    let v = snapshot(&mut a);
    replays_exactly(&v);
    let dir = crate::common::temp_dir("plan-pools");
    let file = dir.join("pools.json");
    std::fs::write(&file, v.to_string()).expect("write");
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .arg("plan")
            .arg(&file)
            .arg("-o")
            .arg(dir.join("plan.json"))
            .arg("--json"),
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // The iteration is the four default requests; the graph's scratch has no entry (its
    // requests never reach the plan, and its room would be reserved for nothing).
    assert_eq!(json["plan"]["period"], 4, "{}", json["plan"]);
    let entries = json["plan"]["plan"]["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), 4);
    assert!(entries.iter().all(|e| e["size"] != 5 * MIB), "{entries:?}");
    let planned = &json["evaluation"]["planned"];
    assert_eq!(planned["plan_misses"], 0, "{planned}");
    assert!(
        planned["plan_hits"].as_u64().is_some_and(|h| h > 0),
        "{planned}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_records_a_graph_and_a_mem_pool_that_replay_and_explain() {
    use crate::common::succeeded;
    use std::process::Command;

    let dir = crate::common::temp_dir("simulate-pools");
    let file = dir.join("pools.json");
    succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args([
                "simulate",
                "--private-pools",
                "--layers",
                "4",
                "--steps",
                "4",
            ])
            .args(["--max-seq", "1024", "--capacity-gib", "16", "--snapshot"])
            .arg(&file),
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&file).expect("written")).expect("json");
    assert!(has_events_in(&v, PoolId(1, 0)) && has_events_in(&v, PoolId(0, 1)));
    replays_exactly(&v);
    let text = explain_text(&file);
    assert!(
        text.contains("pool (1, 0) (a CUDA graph's own pool)")
            && text.contains("pool (0, 1) (a MemPool or shared graph pool)"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_released_pool_on_expandable_segments_replays_its_unmaps() {
    let mut a = recording(GIB, "expandable_segments:True");
    a.create_pool(GRAPH, PoolOptions::default()).expect("new");
    route(&mut a, StreamFilter::Any, RouteKind::MemPool);
    let p = malloc(&mut a, 30 * MIB, S0);
    unroute(&mut a);
    free(&mut a, p);
    let _d = malloc(&mut a, 4 * MIB, S0);
    // Referenced: a flush leaves the pool's pages mapped; released: the next unmaps them.
    empty_cache(&mut a);
    a.release_pool(GRAPH).expect("made once");
    a.release_pool(GRAPH).expect("routed once");
    empty_cache(&mut a);
    let v = snapshot(&mut a);
    let trace = v["device_traces"][0].as_array().expect("a trace");
    assert!(
        trace
            .iter()
            .any(|e| e["action"] == "segment_unmap" && e["pool_id"] == json!([0, 1])),
        "the pool's pages were unmapped"
    );
    replays_exactly(&v);
}

#[test]
fn settings_are_tried_where_the_request_fits_beside_a_graphs_cache() {
    use crate::common::explain;
    use gpumem::explain::At;

    // 80 MiB cached in a graph's pool; 60 MiB free in 20 MiB pieces between live blocks of
    // the default pool. The 40 MiB request fails; the graph's cache is the largest part, but
    // live tensors and the request (100 MiB) fit in the 120 MiB the job had beside it.
    let mut a = recording(200 * MIB, "");
    a.begin_allocate_to_pool(CAPTURE, StreamFilter::Streams(vec![S1]), RouteKind::Capture)
        .expect("a capture");
    let scratch = malloc(&mut a, 80 * MIB, S1);
    free(&mut a, scratch);
    a.end_allocate_to_pool(CAPTURE).expect("captured");
    let big = malloc(&mut a, 120 * MIB, S0);
    free(&mut a, big);
    let blocks: Vec<_> = (0..6).map(|_| malloc(&mut a, 20 * MIB, S0)).collect();
    for p in blocks.iter().step_by(2) {
        free(&mut a, *p);
    }
    assert!(a.malloc(40 * MIB, S0).is_err());
    let v = snapshot(&mut a);
    let rec = parse_recording(v.to_string().as_bytes()).expect("reads");
    let e = explain(&rec, At::FirstOom, Setup::default()).expect("explains");
    assert_eq!(
        (e.breakdown.other_pools, e.breakdown.fragmented),
        (80 * MIB, 60 * MIB)
    );
    assert_eq!(e.kinds[0], gpumem::allocator::breakdown::Kind::OtherPools);
    assert!(!e.candidates.is_empty(), "a setting may still avoid it");
}
