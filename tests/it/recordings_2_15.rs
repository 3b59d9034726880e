//! Recordings of PyTorch 2.12 to 2.15: every field they gained read (trace `pool_id`,
//! `compile_context`, `user_metadata`, `forward_frames`, FX frames, the newer settings),
//! replayed and explained, and shown in the view; FX frames interned like plain ones in both
//! readers; snapshots without a trace explained; traces recorded with `skip_actions`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use gpumem::allocator::PoolId;
use gpumem::explain::At;
use gpumem::recording::{parse_recording, read_recording};
use gpumem::replay::{ReplayError, Setup};

use crate::agent::wait_for;
use crate::browser::Browser;
use crate::common::{explain, replay_check, succeeded};
use crate::support::traces::shared_traces;

const MIB: u64 = 1 << 20;
const COMPILE: &str = "torch/_dynamo frame 0/1: __compiled_fn_7 (graph 2)";

/// The fragmentation OOM of the explain tests, its trace entries and frames dressed as 2.15
/// writes them: every entry with `pool_id`, allocations with a compile context, user
/// metadata, forward frames and a stack whose frame carries its FX node; newer settings in
/// the string.
fn snapshot_2_15() -> serde_json::Value {
    let json = crate::explain::recorded_json(900 * MIB, 0, |a| {
        crate::explain::fragment(a);
    });
    let mut v: serde_json::Value = serde_json::from_slice(&json).expect("json");
    for (i, e) in v["device_traces"][0]
        .as_array_mut()
        .expect("a trace")
        .iter_mut()
        .enumerate()
    {
        e["pool_id"] = serde_json::json!([0, 0]);
        e["compile_context"] = "N/A".into();
        e["user_metadata"] = "".into();
        // PyTorch records the context of the thread that allocated, for an `oom` too.
        if e["action"] == "alloc" || e["action"] == "oom" {
            e["compile_context"] = COMPILE.into();
            e["user_metadata"] = format!("step=3 layer={}", i % 4).into();
            e["forward_frames"] =
                serde_json::json!(["model.py:40 in forward", "model.py:12 in block"]);
            e["frames"] = serde_json::json!([
                {"filename": "/model/fx_graph.py", "line": 7, "name": "forward",
                 "fx_node_op": "call_function", "fx_node_name": format!("mm_{}", i % 3),
                 "fx_original_trace": "File \"model.py\", line 12, in block\n    y = x @ w",
                 "fx_node_info": null},
                {"filename": "/usr/lib/python3/site-packages/torch/_inductor/run.py",
                 "line": 99, "name": "run"}
            ]);
        }
    }
    v["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] =
        "graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:64,pinned_max_cached_size_mb:512,pinned_free_catch_all:True".into();
    v["allocator_settings"]["graph_capture_record_stream_reuse"] = true.into();
    v["external_annotations"] = serde_json::json!([
        {"device": 0, "time_us": 1, "stage": "START", "name": "train_step"}
    ]);
    v
}

#[test]
fn a_2_15_snapshot_reads_replays_and_explains_with_its_context() {
    let v = snapshot_2_15();
    let rec = parse_recording(v.to_string().as_bytes()).expect("reads");
    assert!(rec.trace_pool_ids);
    assert!(
        rec.settings_problems.is_empty(),
        "{:?}",
        rec.settings_problems
    );
    let config = rec.config.as_ref().expect("settings");
    assert!(config.graph_capture_record_stream_reuse && config.pinned.free_catch_all);
    assert_eq!(config.pinned.reserve_segment_size, 64 * MIB);
    // Contexts are interned: a few distinct ones for every allocation.
    let contexts = &rec.event_contexts[0];
    assert_eq!(contexts.len(), rec.device_traces[0].len());
    let distinct: std::collections::BTreeSet<_> = contexts.iter().collect();
    assert_eq!(distinct.len(), 5, "none, and four layers: {distinct:?}");
    // The FX frame is a frame of its own, described with its node.
    let alloc = rec.device_traces[0]
        .iter()
        .position(|e| e.action == gpumem::allocator::TraceAction::Alloc)
        .expect("an allocation");
    let frames = rec.frames.frames_of(rec.event_stacks[0][alloc]);
    assert_eq!(frames.len(), 2);
    assert!(
        rec.frames
            .describe(frames[0])
            .ends_with("[fx call_function mm_0]")
            || rec
                .frames
                .describe(frames[0])
                .contains("[fx call_function mm_"),
        "{}",
        rec.frames.describe(frames[0])
    );

    let r = replay_check(&rec, Setup::default()).expect("replays");
    assert!(r.divergence.is_none(), "{:?}", r.divergence);
    assert_eq!(r.compared.total(), rec.device_traces[0].len() as u64);

    let e = explain(&rec, At::FirstOom, Setup::default()).expect("explains");
    assert!(
        e.request
            .context
            .iter()
            .any(|l| l == &format!("compile context: {COMPILE}")),
        "{:?}",
        e.request.context
    );
    let group = e.pinning.first().expect("live blocks pin the free memory");
    assert!(
        group.frame.contains("[fx call_function mm_"),
        "{}",
        group.frame
    );
    assert!(
        group
            .context
            .iter()
            .any(|l| l.starts_with("user metadata: step=3"))
            && group
                .context
                .iter()
                .any(|l| l == "forward: model.py:12 in block"),
        "{:?}",
        group.context
    );
    // The command line's text, JSON and page show them too.
    let dir = std::env::temp_dir().join(format!("gpumem-2-15-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("compiled.json");
    std::fs::write(&file, v.to_string()).expect("write");
    let page = dir.join("compiled.html");
    let gpumem = env!("CARGO_BIN_EXE_gpumem");
    let text = succeeded(
        Command::new(gpumem)
            .arg("explain")
            .arg(&file)
            .arg("--html")
            .arg(&page),
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("compile context: {COMPILE}")),
        "{text}"
    );
    assert!(text.contains("forward: model.py:40 in forward"), "{text}");
    let json = succeeded(Command::new(gpumem).arg("explain").arg(&file).arg("--json"));
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    assert_eq!(
        json["request"]["context"][0],
        format!("compile context: {COMPILE}")
    );
    let html = std::fs::read_to_string(&page).expect("page");
    assert!(
        html.contains("compile context: torch/_dynamo frame 0/1"),
        "the page"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_view_shows_a_compiled_allocations_context() {
    let dir = std::env::temp_dir().join(format!("gpumem-2-15-view-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("compiled.json");
    std::fs::write(&file, snapshot_2_15().to_string()).expect("write");
    let (_view, port) = crate::view::spawn_view(&file, &dir.join("view.log"));
    let browser = Browser::start();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    let top = wait_for(Duration::from_secs(60), || {
        let text = browser
            .eval("const t = document.getElementById('top'); return t ? t.textContent : '';");
        text.as_str()
            .filter(|t| t.contains("compile context"))
            .map(str::to_string)
    })
    .expect("the largest live blocks show their allocation's context");
    assert!(top.contains(COMPILE), "{top}");
    assert!(top.contains("[fx call_function mm_"), "{top}");
    wait_for(Duration::from_secs(60), || {
        (browser.eval("return document.getElementById('explain').hidden;") == false).then_some(())
    })
    .expect("the OOM is explained");
    assert_eq!(browser.console_errors(), Vec::<String>::new());
    browser.screenshot("view-2-15-context.png");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A snapshot of `json`'s recording without its trace (`include_traces=False`), its first
/// segment in a private pool.
fn traceless(mut v: serde_json::Value) -> serde_json::Value {
    v["device_traces"] = serde_json::json!([]);
    for s in v["segments"]
        .as_array_mut()
        .expect("segments")
        .iter_mut()
        .take(1)
    {
        s["segment_pool_id"] = serde_json::json!([0, 1]);
    }
    v
}

#[test]
fn a_snapshot_without_a_trace_is_explained_and_viewed() {
    let v = traceless(snapshot_2_15());
    let rec = parse_recording(v.to_string().as_bytes()).expect("reads");
    let e = explain(&rec, At::Snapshot, Setup::default()).expect("explains the state");
    assert!(e.request.hypothetical);
    // The recording's one segment is now a MemPool's: its 20 MiB pieces are no default
    // request's, so the smallest large request (just past the small pool's sizes) finds
    // nothing, and the 400 MiB cached sit in another pool.
    assert_eq!(v["segments"].as_array().map(Vec::len), Some(1));
    assert_eq!(e.request.wanted.rounded, MIB + 512);
    assert_eq!(e.largest_free_block, 0);
    let pools = &e.private_pools;
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!(
        (pools[0].id, pools[0].kind, pools[0].segments),
        (PoolId(0, 1), "mem_pool", 1)
    );
    assert!(
        e.reserved > 0 && e.breakdown.other_pools >= 400 * MIB && e.breakdown.fragmented == 0,
        "{e:?}"
    );
    // The other moments need a trace.
    for at in [At::FirstOom, At::Event(0)] {
        assert!(explain(&rec, at, Setup::default()).is_err());
    }

    let dir = std::env::temp_dir().join(format!("gpumem-traceless-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("state.json");
    std::fs::write(&file, v.to_string()).expect("write");
    let text = crate::common::explain_text(&file);
    assert!(text.contains("no trace recorded"), "{text}");
    assert!(
        text.contains("pool (0, 1) (a MemPool or shared graph pool)")
            && text.contains("in 1 segments"),
        "{text}"
    );

    let (_view, port) = crate::view::spawn_view(&file, &dir.join("view.log"));
    let browser = Browser::start();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    let rows = wait_for(Duration::from_secs(60), || {
        browser
            .eval("const svg = document.querySelector('#map-recorded svg'); return svg ? svg.querySelectorAll('g.segment').length : null;")
            .as_u64()
    })
    .expect("the map of the state");
    assert_eq!(rows as usize, rec.segments.len());
    wait_for(Duration::from_secs(60), || {
        (browser.eval("return document.getElementById('explain').hidden;") == false).then_some(())
    })
    .expect("the state explained");
    assert_eq!(
        browser.eval("return document.getElementById('error').textContent;"),
        ""
    );
    browser.screenshot("view-traceless.png");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_shared_traceless_snapshot_is_explained() {
    let Some(dir) = shared_traces("the_shared_traceless_snapshot_is_explained") else {
        return;
    };
    let rec = read_recording(&dir.join("state_verl_vllm_qwen2.pickle")).expect("reads");
    let e = explain(&rec, At::Snapshot, Setup::default()).expect("explains");
    // Its two MemPools (or shared graph pools), named, hold 68 of its 127 segments.
    let pools = &e.private_pools;
    let ids: Vec<PoolId> = pools.iter().map(|p| p.id).collect();
    assert_eq!(ids.len(), 2, "{pools:?}");
    assert!(
        ids.contains(&PoolId(0, 1)) && ids.contains(&PoolId(0, 2)),
        "{ids:?}"
    );
    assert!(pools.iter().all(|p| p.kind == "mem_pool"));
    assert_eq!(pools.iter().map(|p| p.segments).sum::<usize>(), 68);
    // The figures add up to what the snapshot holds.
    let reserved: u64 = rec.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(e.reserved, reserved);
    let pending: u64 = rec
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == gpumem::allocator::BlockState::ActivePendingFree)
        .map(|b| b.size)
        .sum();
    assert_eq!(e.breakdown.pending_stream_frees, pending);
}

/// The 2.15 snapshot with every entry of `action` removed.
fn without(action: &str) -> gpumem::recording::Recording {
    let mut v = snapshot_2_15();
    v["device_traces"][0]
        .as_array_mut()
        .expect("a trace")
        .retain(|e| e["action"] != action);
    parse_recording(v.to_string().as_bytes()).expect("reads")
}

#[test]
fn traces_recorded_with_skip_actions_replay_where_they_can() {
    // Frees complete at once here: either half of them is enough to replay exactly.
    for skipped in ["free_completed", "free_requested", "snapshot"] {
        let rec = without(skipped);
        let r = replay_check(&rec, Setup::default()).expect("replays");
        assert!(r.divergence.is_none(), "{skipped}: {:?}", r.divergence);
        assert_eq!(r.compared.total(), rec.device_traces[0].len() as u64);
        let said = r.notes.iter().any(|n| n.contains(skipped));
        assert_eq!(said, skipped != "snapshot", "{skipped}: {:?}", r.notes);
    }
    // Without allocations there is nothing to replay: refused, saying why.
    let err = replay_check(&without("alloc"), Setup::default()).expect_err("no allocations");
    assert!(matches!(err, ReplayError::SkippedActions { .. }), "{err}");
    assert!(err.to_string().contains("skip_actions"), "{err}");
}

/// Generates a snapshot of `entries` events with `gen-snapshot.py` (FX fields with `fx`).
fn generated(path: &Path, fx: bool) {
    let extra: &[&str] = if fx {
        &["--stacks", "50", "--fx"]
    } else {
        &["--stacks", "50"]
    };
    crate::replay::generate_snapshot(3000, 12, extra, path);
}

#[test]
fn fx_frames_are_interned_in_both_readers_like_plain_frames() {
    let dir = std::env::temp_dir().join(format!("gpumem-fx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (plain, fx) = (dir.join("plain.pickle"), dir.join("fx.pickle"));
    generated(&plain, false);
    generated(&fx, true);
    let (a, b) = (
        read_recording(&plain).expect("reads"),
        read_recording(&fx).expect("reads"),
    );
    // The same frames and stacks, each FX frame once.
    assert_eq!(a.frames.frame_count(), b.frames.frame_count());
    assert_eq!(a.frames.stack_count(), b.frames.stack_count());
    let stack = b.event_stacks[0][0];
    assert!(
        b.frames
            .frames_of(stack)
            .iter()
            .all(|&f| b.frames.get(f).fx.is_some()),
        "every frame carries its node"
    );
    // The pickle's fast path and the generic path (the JSON copy) agree.
    let json = dir.join("fx.json");
    let converted = Command::new("python3")
        .args([
            "-c",
            "import json, pickle, sys; json.dump(pickle.load(open(sys.argv[1], 'rb')), open(sys.argv[2], 'w'))",
        ])
        .arg(&fx)
        .arg(&json)
        .status()
        .expect("python3");
    assert!(converted.success());
    let c = read_recording(&json).expect("reads");
    assert_eq!(c.frames.frame_count(), b.frames.frame_count());
    let describe = |r: &gpumem::recording::Recording, i: usize| -> Vec<String> {
        let s = r.event_stacks[0][i];
        r.frames
            .frames_of(s)
            .iter()
            .map(|&f| r.frames.describe(f))
            .collect()
    };
    for i in [0, 1, 1000, 2999] {
        assert_eq!(describe(&b, i), describe(&c, i), "event {i}");
    }
    let r = replay_check(&b, Setup::default()).expect("replays");
    assert!(r.divergence.is_none(), "{:?}", r.divergence);
    let _ = std::fs::remove_dir_all(&dir);
}
