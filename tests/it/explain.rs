//! `gpumem explain`: the figures at a real recording's OOM, derived again here from the
//! recording's own entries, and synthetic OOMs of each kind made by gpumem's allocator.

use std::process::Command;

use gpumem::allocator::AllocError;
use gpumem::allocator::TraceAction;
use gpumem::device::{SimConfig, SimDevice, StreamId};
use gpumem::explain::{At, CANDIDATES, Cause, Explanation, GC_CANDIDATES, Kind};
use gpumem::recording::{Recording, parse_recording, read_recording};
use gpumem::replay::Setup;
use gpumem::{AllocatorConfig, CachingAllocator};

use crate::common::{explain, succeeded};
use crate::support::traces::shared_traces;

/// The breakdown adds up to the reserved memory and, with free and outside, to the device.
fn assert_adds_up(e: &Explanation) {
    let b = &e.breakdown;
    let cached = b.requested
        + b.rounding
        + b.fragmented
        + b.other_streams
        + b.other_pools
        + b.pending_stream_frees;
    assert_eq!(cached, e.reserved, "{e:?}");
    if let (Some(free), Some(outside)) = (b.free, b.outside_allocator) {
        assert_eq!(cached + free + outside, e.total, "{e:?}");
    }
}

/// Reserved bytes and the live requests' bytes just after event `at`, from the entries alone,
/// for a trace that starts from an empty allocator.
fn from_entries(rec: &Recording, device: usize, at: usize) -> (u64, u64) {
    let (mut reserved, mut allocated) = (0i64, 0i64);
    for e in &rec.device_traces[device][..=at] {
        let size = e.size as i64;
        match e.action {
            TraceAction::SegmentAlloc | TraceAction::SegmentMap => reserved += size,
            TraceAction::SegmentFree | TraceAction::SegmentUnmap => reserved -= size,
            TraceAction::Alloc => allocated += size,
            TraceAction::FreeCompleted => allocated -= size,
            _ => {}
        }
    }
    (reserved as u64, allocated as u64)
}

#[test]
fn the_real_ooms_are_explained_with_the_recordings_own_figures() {
    let Some(dir) = shared_traces("the_real_ooms_are_explained_with_the_recordings_own_figures")
    else {
        return;
    };
    for (name, device, capacity) in [
        ("dit_discrete_diffusion_train_oom_complete.pickle", 0, None),
        (
            "qwen3_gnn_3gpu_expandable_oom_complete.pickle",
            1,
            Some(84_987_740_160),
        ),
    ] {
        let rec = read_recording(&dir.join(name)).expect("readable");
        let setup = Setup {
            device: device as u32,
            capacity,
            ..Setup::default()
        };
        let e = explain(&rec, At::FirstOom, setup).expect(name);
        let events = &rec.device_traces[device];
        let oom = events
            .iter()
            .position(|e| e.action == TraceAction::Oom)
            .expect("an OOM");
        assert_eq!(e.request.event, oom, "{name}");
        assert_eq!(e.request.bytes, events[oom].size, "{name}");
        assert_eq!(e.request.wanted.stream, events[oom].stream, "{name}");
        assert_eq!(
            e.breakdown.free,
            Some(events[oom].addr),
            "{name}: device_free"
        );
        assert!(e.divergence.is_none(), "{name}: replayed exactly");
        // The entries carry requested sizes: they sum to the live tensors' requests.
        let (reserved, requested) = from_entries(&rec, device, oom);
        assert_eq!(
            (e.reserved, e.breakdown.requested),
            (reserved, requested),
            "{name}"
        );
        assert_eq!(
            e.allocated,
            requested + e.breakdown.rounding + e.breakdown.pending_stream_frees
        );
        assert_eq!(e.available, Some(reserved + events[oom].addr), "{name}");
        assert_adds_up(&e);
        // Both are beyond any setting: live tensors and the request exceed what the job had.
        assert_eq!(e.kinds[0], Kind::TooBig, "{name}: {}", e.sentence);
        assert!(
            e.breakdown.requested + e.breakdown.rounding + e.request.wanted.rounded
                > reserved + events[oom].addr
        );
        assert!(e.candidates.is_empty(), "{name}: nothing to recommend");
        assert!(
            e.sentence.starts_with("No allocator setting avoids this"),
            "{}",
            e.sentence
        );
        assert!(e.largest_free_block < e.request.wanted.rounded, "{name}");
        // What pins the free memory, named by the file's own frames.
        assert!(!e.pinning.is_empty(), "{name}");
        let live: u64 = e.pinning.iter().map(|g| g.live_bytes).sum();
        assert!(live <= e.allocated, "{name}");
        // The files the recording's stacks name, normalised as sites are.
        let stacks = rec.event_stacks.iter().flatten().chain(
            rec.segments
                .iter()
                .flat_map(|s| s.blocks.iter().map(|b| &b.stack)),
        );
        let files: std::collections::HashSet<String> = stacks
            .flat_map(|&stack| rec.frames.frames_of(stack))
            .map(|&id| rec.frames.str(rec.frames.get(id).filename))
            .map(|f| gpumem::explain::site::normalised_path(f).into_owned())
            .collect();
        for g in &e.pinning {
            let file = g.frame.rsplit_once(':').map_or("", |(file, _)| file);
            assert!(file.ends_with(".py"), "{name}: {}", g.frame);
            assert!(files.contains(file), "{name}: {file} is the file's");
            assert!(g.pinned_free_bytes > 0 && g.blocks > 0, "{name}: {g:?}");
        }
        assert!(
            e.pinning
                .windows(2)
                .all(|w| w[0].pinned_free_bytes >= w[1].pinned_free_bytes),
            "{name}: most pinned first"
        );
        match capacity {
            Some(capacity) => {
                // 657 MiB of the Qwen3 job's device were held outside its allocator.
                assert_eq!(
                    e.breakdown.outside_allocator,
                    Some(capacity - reserved - events[oom].addr)
                );
                assert_eq!(e.breakdown.outside_allocator, Some(689_307_648));
            }
            // The DiT recording does not say how large its device was: outside is unknown.
            None => assert_eq!(
                (e.total_known, e.breakdown.outside_allocator),
                (false, None)
            ),
        }
    }
}

/// A recording made by gpumem's allocator on a simulated device of `capacity` bytes (others
/// holding `outside` of it), driven by `program`, which ends in an OOM.
fn recorded(
    capacity: u64,
    outside: u64,
    program: impl FnOnce(&mut CachingAllocator<SimDevice>),
) -> Recording {
    parse_recording(&recorded_json(capacity, outside, program)).expect("reads back")
}

/// [`recorded`], as the snapshot's JSON.
pub(crate) fn recorded_json(
    capacity: u64,
    outside: u64,
    program: impl FnOnce(&mut CachingAllocator<SimDevice>),
) -> Vec<u8> {
    let mut device = SimDevice::new(SimConfig::with_capacity(capacity));
    device.set_other_process_bytes(outside);
    let mut alloc = CachingAllocator::new(device, AllocatorConfig::default());
    alloc.record_history(Some(1 << 20));
    program(&mut alloc);
    serde_json::to_vec(&alloc.snapshot()).expect("serialises")
}

const MIB: u64 = 1 << 20;

/// Splits a 900 MiB device's memory into a fragmentation OOM: an 800 MiB segment, cut into 40
/// blocks of 20 MiB with every other one freed (400 MiB cached, no piece over 20 MiB); the
/// 140 MiB request that then fails is returned.
pub(crate) fn fragment(a: &mut CachingAllocator<SimDevice>) -> AllocError {
    let s = StreamId::DEFAULT;
    let big = a.malloc(800 * MIB, s).expect("fits");
    a.free(big).expect("frees");
    let blocks: Vec<_> = (0..40)
        .map(|_| a.malloc(20 * MIB, s).expect("fits"))
        .collect();
    for b in blocks.iter().step_by(2) {
        a.free(*b).expect("frees");
    }
    a.malloc(140 * MIB, s).expect_err("out of memory")
}

#[test]
fn synthetic_ooms_are_told_apart_with_their_figures() {
    let s = StreamId::DEFAULT;
    // Fragmentation: 400 MiB cached, none of it in a piece as large as the request.
    let mut error = None;
    let fragmented_json = recorded_json(900 * MIB, 0, |a| error = Some(fragment(a)));
    let fragmented = parse_recording(&fragmented_json).expect("reads back");
    let e = explain(&fragmented, At::FirstOom, Setup::default()).expect("explains");
    // The allocator's own error says the same, from its blocks at the failure.
    let Some(AllocError::OutOfMemory(oom)) = error else {
        panic!("an out-of-memory error: {error:?}");
    };
    assert_eq!(oom.accounting.breakdown, e.breakdown);
    assert_eq!(oom.accounting.largest_free_block, e.largest_free_block);
    assert_eq!(oom.kinds, e.kinds);
    assert_eq!(oom.why, e.sentence);
    assert!(
        oom.to_string().ends_with(&format!("Why: {}", e.sentence)),
        "{oom}"
    );
    assert_adds_up(&e);
    assert_eq!(e.kinds[0], Kind::Fragmentation, "{}", e.sentence);
    assert_eq!(e.largest_free_block, 20 * MIB);
    assert!(e.breakdown.fragmented >= 400 * MIB, "{e:?}");
    assert!(e.sentence.contains("largest free block"), "{}", e.sentence);
    // A setting avoids it, and gpumem replay confirms each one that is said to.
    let avoiding: Vec<_> = e.candidates.iter().filter(|c| c.ooms == 0).collect();
    assert!(!avoiding.is_empty(), "{:?}", e.candidates);
    // Issue 38: the cause is fragmentation, and the sentence names the setting.
    assert_eq!(e.cause, Some(Cause::Fragmentation), "{}", e.cause_sentence);
    assert!(
        e.cause_sentence.contains(&avoiding[0].config),
        "{}",
        e.cause_sentence
    );
    assert!(
        e.candidates.iter().any(|c| c.ooms > 0),
        "not every setting helps: {:?}",
        e.candidates
    );
    // Every single setting, then the pairs and the triple of the three best keys; no
    // garbage-collection threshold without a memory fraction.
    assert_eq!(
        e.candidates.len(),
        CANDIDATES.len() + 4,
        "{:?}",
        e.candidates
    );
    assert!(
        e.candidates
            .iter()
            .all(|c| !c.config.contains("garbage_collection_threshold"))
    );
    // Settings in a configuration: its commas outside brackets, plus one.
    let settings = |c: &str| {
        let mut depth = 0i32;
        1 + c
            .chars()
            .filter(|&ch| {
                depth += i32::from(ch == '[') - i32::from(ch == ']');
                ch == ',' && depth == 0
            })
            .count()
    };
    assert_eq!(
        e.candidates
            .iter()
            .filter(|c| settings(&c.config) == 3)
            .count(),
        1,
        "one triple: {:?}",
        e.candidates
    );
    let available = e.available.expect("at an OOM");
    let file = std::env::temp_dir().join(format!("gpumem-frag-{}.json", std::process::id()));
    std::fs::write(&file, &fragmented_json).expect("write");
    for c in &avoiding {
        let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["replay", "--json", "--capacity"])
            .arg(e.total.to_string())
            .arg("--available")
            .arg(available.to_string())
            .args(["--config", &c.config])
            .arg(&file)
            .output()
            .expect("runs");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let row = &json[0]["results"][1];
        assert_eq!(row["config"], c.config);
        assert_eq!(row["ooms"], 0, "{}: {row}", c.config);
        // The recorded configuration itself runs out, as it did.
        assert!(
            json[0]["results"][0]["ooms"]
                .as_u64()
                .is_some_and(|o| o > 0)
        );
    }
    let _ = std::fs::remove_file(&file);

    // Frees waiting on another stream: in the breakdown at the moment they wait; before an
    // OOM the allocator synchronizes them away, so the request that needs them succeeds.
    let pending = recorded(900 * MIB, 0, |a| {
        let other = StreamId(7);
        let blocks: Vec<_> = (0..4)
            .map(|_| a.malloc(200 * MIB, s).expect("fits"))
            .collect();
        for b in &blocks[..3] {
            a.record_stream(*b, other);
            a.free(*b).expect("frees");
        }
        let _ = a
            .malloc(300 * MIB, s)
            .expect("the waiting frees are synchronized away");
    });
    let frees = pending.device_traces[0]
        .iter()
        .rposition(|e| e.action == TraceAction::FreeRequested)
        .expect("frees");
    let e = explain(&pending, At::Event(frees), Setup::default()).expect("explains");
    assert_adds_up(&e);
    assert_eq!(e.breakdown.pending_stream_frees, 600 * MIB);
    assert_eq!(e.kinds[0], Kind::PendingStreamFrees, "{}", e.sentence);

    // Outside the allocator: another process holds most of the device.
    let crowded = recorded(1024 * MIB, 700 * MIB, |a| {
        let _live = a.malloc(100 * MIB, s).expect("fits");
        assert!(a.malloc(400 * MIB, s).is_err(), "out of memory");
    });
    let e = explain(&crowded, At::FirstOom, Setup::default()).expect("explains");
    assert_adds_up(&e);
    assert_eq!(e.kinds[0], Kind::OutsideAllocator, "{}", e.sentence);
    assert_eq!(e.breakdown.outside_allocator, Some(700 * MIB));
    assert_eq!(e.available, Some(324 * MIB));

    // Under a memory fraction, garbage collection is among the settings tried.
    let limited = recorded(1024 * MIB, 0, |a| {
        a.set_memory_fraction(0.9).expect("a fraction");
        fragment(a);
    });
    let e = explain(&limited, At::FirstOom, Setup::default()).expect("explains");
    assert_adds_up(&e);
    assert!(
        GC_CANDIDATES
            .iter()
            .all(|gc| e.candidates.iter().any(|c| c.config == *gc)),
        "{:?}",
        e.candidates
    );

    // Genuinely too big: more than the whole device.
    let huge = recorded(1024 * MIB, 0, |a| {
        let _live = a.malloc(100 * MIB, s).expect("fits");
        assert!(a.malloc(2048 * MIB, s).is_err(), "out of memory");
    });
    let e = explain(&huge, At::FirstOom, Setup::default()).expect("explains");
    assert_adds_up(&e);
    assert_eq!(e.kinds, [Kind::TooBig], "{}", e.sentence);
    assert!(
        e.candidates.is_empty(),
        "no setting is tried where none can work"
    );

    // No OOM: a clear error; another moment by index.
    let none = recorded(1024 * MIB, 0, |a| {
        let _ = a.malloc(MIB, s).expect("fits");
    });
    let err = explain(&none, At::FirstOom, Setup::default()).expect_err("nothing to explain");
    assert!(err.to_string().contains("no out-of-memory event"), "{err}");
    let e = explain(&none, At::Event(0), Setup::default()).expect("an event");
    assert_adds_up(&e);
    // The peak of reserved memory, found in the entries.
    let peaked = recorded(1024 * MIB, 0, |a| {
        let big = a.malloc(600 * MIB, s).expect("fits");
        a.free(big).expect("frees");
        a.empty_cache().expect("empties");
        let _ = a.malloc(100 * MIB, s).expect("fits");
    });
    let e = explain(&peaked, At::PeakReserved, Setup::default()).expect("the peak");
    assert_eq!(e.reserved, 600 * MIB, "{e:?}");
    assert_eq!(
        peaked.device_traces[0][e.request.event].action,
        TraceAction::SegmentAlloc
    );
    assert!(explain(&none, At::Event(99), Setup::default()).is_err());
}

#[test]
fn the_command_prints_the_sentence_and_the_json_every_figure() {
    let s = StreamId::DEFAULT;
    let rec_json = {
        let mut device = SimDevice::new(SimConfig::with_capacity(1024 * MIB));
        device.set_other_process_bytes(700 * MIB);
        let mut a = CachingAllocator::new(device, AllocatorConfig::default());
        a.record_history(Some(1000));
        let _live = a.malloc(100 * MIB, s).expect("fits");
        assert!(a.malloc(400 * MIB, s).is_err());
        serde_json::to_vec(&a.snapshot()).expect("json")
    };
    let dir = crate::common::temp_dir("explain");
    let file = dir.join("oom.json");
    std::fs::write(&file, rec_json).expect("write");
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .arg("explain")
            .args(extra)
            .arg(&file)
            .output()
            .expect("runs")
    };
    let text = run(&[]);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.status.success(),
        "{}",
        String::from_utf8_lossy(&text.stderr)
    );
    assert!(stdout.contains("held outside the allocator"), "{stdout}");
    assert!(
        stdout.contains("outside the allocator") && stdout.contains("700.00 MiB"),
        "{stdout}"
    );
    let json = run(&["--json"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    assert_eq!(v["breakdown"]["outside_allocator"], 700 * MIB);
    assert_eq!(v["kinds"][0], "outside_allocator");
    assert_eq!(v["request"]["bytes"], 400 * MIB);
    let bad = run(&["--at", "later"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr)
            .contains("neither `oom`, `peak`, `snapshot` nor an event index")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every scalar of `json` by its dotted path (`breakdown.free`, `candidates.0.ooms`).
fn scalars(json: &serde_json::Value, prefix: &str, out: &mut Vec<(String, serde_json::Value)>) {
    let path = |key: &str| {
        if prefix.is_empty() {
            key.to_string()
        } else {
            format!("{prefix}.{key}")
        }
    };
    match json {
        serde_json::Value::Object(map) => map.iter().for_each(|(k, v)| scalars(v, &path(k), out)),
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .for_each(|(i, v)| scalars(v, &path(&i.to_string()), out)),
        scalar => out.push((prefix.to_string(), scalar.clone())),
    }
}

/// Opens `page` in Chromium and checks it against `json`: every figure the page shows (its
/// `data-field` elements) equals the JSON's, every scalar of the JSON is shown (but those
/// whose paths `hidden` names: details and frame lists), strings are shown as text, the
/// console has no errors, and no markup from the recording came alive.
pub(crate) fn check_page(
    browser: &crate::browser::Browser,
    page: &std::path::Path,
    json: &serde_json::Value,
    shot: &str,
    hidden: &dyn Fn(&str) -> bool,
) {
    browser.open(&format!("file://{}", page.display()));
    let shown = browser.eval(
        "return Array.from(document.querySelectorAll('[data-field]')).map(e => \
         [e.dataset.field, e.dataset.value, (e.querySelector('summary') || e).textContent]);",
    );
    let shown = shown.as_array().expect("a list");
    let mut expected = Vec::new();
    scalars(json, "", &mut expected);
    let expected: std::collections::BTreeMap<_, _> = expected
        .into_iter()
        .filter(|(path, _)| !hidden(path))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for entry in shown {
        let field = entry[0].as_str().expect("a field");
        let value = entry[1].as_str().expect("a value");
        let text = entry[2].as_str().expect("text");
        let want = expected
            .get(field)
            .unwrap_or_else(|| panic!("the page shows {field}, which the JSON lacks"));
        match want {
            serde_json::Value::String(s) => {
                assert_eq!(value, s, "{field}");
                assert_eq!(text.trim(), s, "{field} as text");
            }
            other => assert_eq!(value, other.to_string(), "{field}"),
        }
        assert!(seen.insert(field.to_string()), "{field} shown twice");
    }
    let missing: Vec<_> = expected.keys().filter(|k| !seen.contains(*k)).collect();
    assert!(missing.is_empty(), "the page lacks {missing:?}");
    let alive =
        browser.eval("return document.querySelectorAll('script,img,iframe,object').length;");
    assert_eq!(alive, 0, "no element came from the recording's strings");
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    let png = browser.screenshot(shot);
    assert!(std::fs::metadata(&png).expect("screenshot").len() > 1000);
}

#[test]
fn the_html_page_shows_the_json_figures_in_chromium() {
    // The fragmentation OOM (candidates that avoid it), its frames hostile markup.
    let json = recorded_json(900 * MIB, 0, |a| {
        fragment(a);
    });
    let mut doc: serde_json::Value = serde_json::from_slice(&json).expect("json");
    let hostile = serde_json::json!([{
        "filename": "/job/<img src=x onerror=\"document.title='owned'\">.py",
        "line": 7,
        "name": "</td><script>document.title='owned'</script>'&",
    }]);
    for entry in doc["device_traces"][0].as_array_mut().expect("a trace") {
        entry["frames"] = hostile.clone();
    }
    let dir = crate::common::temp_dir("explain-page");
    let file = dir.join("frag <b>&.json");
    std::fs::write(&file, serde_json::to_vec(&doc).expect("json")).expect("write");
    let browser = crate::browser::Browser::start();
    // An OOM beside a CUDA graph's cache: its pools' table and the request's pool id.
    let graph = dir.join("graph-oom.json");
    let graph_json = crate::replay_pools::graph_oom_recording();
    std::fs::write(&graph, graph_json.to_string()).expect("write");
    let mut cases = vec![
        (file.clone(), "explain-fragmentation.png"),
        (graph, "explain-graph-pool.png"),
    ];
    if let Some(shared) =
        shared_traces("the DiT page of the_html_page_shows_the_json_figures_in_chromium")
    {
        cases.push((
            shared.join("dit_discrete_diffusion_train_oom_complete.pickle"),
            "explain-dit.png",
        ));
    }
    for (trace, shot) in cases {
        let page = dir.join(format!("{shot}.html"));
        let out = succeeded(
            Command::new(env!("CARGO_BIN_EXE_gpumem"))
                .args(["explain", "--json", "--html"])
                .arg(&page)
                .arg(&trace),
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        check_page(&browser, &page, &json, shot, &|path| {
            let detail = path.starts_with("divergence.") && path != "divergence.index";
            let stack = (path.starts_with("pinning.") || path.starts_with("growth.kept_at."))
                && path.contains(".frames.");
            detail || stack
        });
        if shot == "explain-fragmentation.png" {
            assert_eq!(json["kinds"][0], "fragmentation");
            assert!(json["candidates"].as_array().is_some_and(|c| !c.is_empty()));
            let frame = json["pinning"][0]["frame"].as_str().expect("a frame");
            assert!(
                frame.contains("<script>"),
                "the hostile frame is named: {frame}"
            );
            assert_ne!(browser.eval("return document.title;"), "owned");
            let confirm = browser.eval("return document.getElementById('confirm').textContent;");
            // The command, pasted into a shell as the page shows it, confirms the setting.
            let command = confirm
                .as_str()
                .and_then(|c| c.strip_prefix("gpumem "))
                .unwrap_or_else(|| panic!("a gpumem command: {confirm}"));
            let out = succeeded(
                Command::new("sh")
                    .arg("-c")
                    .arg(format!("\"$GPUMEM\" {command} --json"))
                    .env("GPUMEM", env!("CARGO_BIN_EXE_gpumem")),
            );
            let replayed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
            assert_eq!(
                replayed[0]["results"][1]["ooms"], 0,
                "{command}: {replayed}"
            );
            assert_eq!(
                replayed[0]["results"][1]["config"],
                json["candidates"][0]["config"]
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 38: a loop whose every iteration keeps 1 MiB beside a 256 MiB working set it frees
/// runs a 1 GiB device out of memory. `explain` names the growth at the OOM (no setting
/// avoids it), and from a moment long before it predicts the iteration the device fills in,
/// within one of the iteration that failed.
#[test]
fn growth_is_told_apart_and_when_it_fills_predicted() {
    let s = StreamId::DEFAULT;
    let mut failed_in = None;
    let json = recorded_json(1024 * MIB, 0, |a| {
        let mut kept = Vec::new();
        for iteration in 1..=2000 {
            let step = (|| {
                kept.push(a.malloc(MIB, s)?);
                let working = a.malloc(256 * MIB, s)?;
                a.free(working)
            })();
            if step.is_err() {
                failed_in = Some(iteration);
                break;
            }
        }
    });
    let failed_in = failed_in.expect("the device fills");
    let recording = parse_recording(&json).expect("reads back");
    let at_oom = explain(&recording, At::FirstOom, Setup::default()).expect("explains");
    assert_eq!(
        at_oom.cause,
        Some(Cause::Growth),
        "{}",
        at_oom.cause_sentence
    );
    assert!(at_oom.candidates.is_empty(), "{:?}", at_oom.candidates);
    let g = at_oom.growth.as_ref().expect("iterations");
    assert_eq!(g.allocations_per_iteration, 2, "{g:?}");
    assert_eq!(g.kept_per_iteration, MIB, "{g:?}");
    assert_eq!(g.kept_allocations_per_iteration, 1, "{g:?}");
    assert_eq!(g.iterations_keeping, g.iterations, "{g:?}");
    assert!(
        at_oom
            .cause_sentence
            .contains("No allocator setting avoids that"),
        "{}",
        at_oom.cause_sentence
    );

    // From the end of iteration 100 (its working set freed), on a device known to hold 1 GiB.
    let events = &recording.device_traces[0];
    let moment = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.action == TraceAction::FreeCompleted)
        .nth(99)
        .map(|(i, _)| i)
        .expect("100 iterations");
    let early = explain(
        &recording,
        At::Event(moment),
        Setup {
            capacity: Some(1024 * MIB),
            ..Setup::default()
        },
    )
    .expect("explains");
    assert_eq!(early.cause, Some(Cause::Growth), "{}", early.cause_sentence);
    let g = early.growth.as_ref().expect("iterations");
    assert_eq!(g.fills_bytes, Some(1024 * MIB));
    let predicted = g.fills_at_iteration.expect("a prediction");
    assert!(
        predicted.abs_diff(failed_in) <= 1,
        "predicted iteration {predicted}, failed in {failed_in}: {g:?}"
    );
    assert!(
        early
            .cause_sentence
            .contains(&format!("fill in iteration {predicted}")),
        "{}",
        early.cause_sentence
    );
}

/// Issue 38: the DiT recording's OOM is growth: its iterations each keep what the planner
/// finds outliving an iteration (the same allocations, found apart), no setting avoids it,
/// and the device fills in the iteration that failed.
#[test]
fn the_dit_oom_is_named_growth() {
    let Some(dir) = shared_traces("the_dit_oom_is_named_growth") else {
        return;
    };
    let recording = read_recording(&dir.join("dit_discrete_diffusion_train_oom_complete.pickle"))
        .expect("reads");
    let e = explain(&recording, At::FirstOom, Setup::default()).expect("explains");
    let g = e.growth.as_ref().expect("iterations");
    let planned = gpumem::plan::plan(&recording, "dit", &gpumem::plan::PlanOptions::default())
        .expect("plans");
    assert_eq!(g.allocations_per_iteration, planned.period, "{g:?}");
    assert_eq!(g.kept_per_iteration, planned.persistent_bytes, "{g:?}");
    assert_eq!(
        g.kept_allocations_per_iteration,
        planned.plan.entries.iter().filter(|p| p.persistent).count(),
        "{g:?}"
    );
    assert_eq!(e.cause, Some(Cause::Growth), "{}", e.cause_sentence);
    assert!(e.candidates.is_empty(), "{:?}", e.candidates);
    // The iteration that failed is the one after the complete ones.
    assert_eq!(g.fills_at_iteration, Some(g.iterations as u64 + 1), "{g:?}");
    let top = &g.kept_at[0];
    assert!(
        top.frame.ends_with(" in forward") || top.frame.contains(".py:"),
        "{top:?}"
    );
    assert!(
        e.cause_sentence.contains(&top.frame),
        "{}",
        e.cause_sentence
    );
    assert!(
        e.cause_sentence
            .contains("No allocator setting avoids that"),
        "{}",
        e.cause_sentence
    );
}

/// Issue 54, item 6: without `--device`, `explain` explains the first OOM of any device (the
/// 3-GPU recording's device 1, which alone ran out of memory) and the only device a legacy
/// snapshot holds (device 1), in text, JSON and HTML, saying which device and why; the
/// view opens where `explain` would.
#[test]
fn without_a_device_the_device_that_ran_out_of_memory_is_explained() {
    let Some(dir) =
        shared_traces("without_a_device_the_device_that_ran_out_of_memory_is_explained")
    else {
        return;
    };
    let out_dir = crate::common::temp_dir("explain-device");
    for (name, event, says) in [
        (
            "qwen3_gnn_3gpu_expandable_oom_complete.pickle",
            Some(421),
            "only device that ran out of memory",
        ),
        (
            "state_legacy_segment_list.pickle",
            None,
            "only device the snapshot holds segments of",
        ),
    ] {
        let trace = dir.join(name);
        let recording = read_recording(&trace).expect("readable");
        let page = out_dir.join(format!("{name}.html"));
        let json = succeeded(
            Command::new(env!("CARGO_BIN_EXE_gpumem"))
                .args(["explain", "--json", "--html"])
                .arg(&page)
                .arg(&trace),
        );
        let e: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON alone");
        assert_eq!(e["device"], 1, "{name}");
        let chosen = e["chosen"].as_str().expect("says why");
        assert!(
            chosen.starts_with("device 1: ") && chosen.contains(says),
            "{chosen}"
        );
        match event {
            Some(event) => {
                assert_eq!(e["request"]["event"], event, "{name}");
                let oom = recording.device_traces[1]
                    .iter()
                    .position(|e| e.action == TraceAction::Oom);
                assert_eq!(oom, Some(event), "{name}: the trace's own first OOM");
            }
            None => assert_eq!(e["request"]["hypothetical"], true, "{name}"),
        }
        let text = succeeded(
            Command::new(env!("CARGO_BIN_EXE_gpumem"))
                .arg("explain")
                .arg(&trace),
        );
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(text.starts_with(chosen), "{name}: {text}");
        assert!(text.contains("device 1, "), "{name}: {text}");
        let html = std::fs::read_to_string(&page).expect("the page");
        let escaped = gpumem::view::escape(chosen);
        assert!(
            html.contains(&format!("data-field=\"chosen\" data-value=\"{escaped}\"")),
            "{name}"
        );
        // The view opens at the same moment.
        let view = gpumem::view::recording::RecordingView::new(
            std::sync::Arc::new(recording),
            name.to_string(),
            Setup::default(),
        );
        let first = view.overview().first.expect("a moment");
        assert_eq!(
            (first.device, first.event),
            (1, event.unwrap_or(0)),
            "{name}"
        );
        assert_eq!(
            first.why.as_deref(),
            Some(chosen.split("; ").next().unwrap_or_default())
        );
    }
    // A device named is kept: device 0 of the 3-GPU recording has no OOM, its peak is shown.
    let zero = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["explain", "--json", "--device", "0"])
            .arg(dir.join("qwen3_gnn_3gpu_expandable_oom_complete.pickle")),
    );
    let e: serde_json::Value = serde_json::from_slice(&zero.stdout).expect("JSON alone");
    assert_eq!(e["device"], 0);
    assert_eq!(
        e["chosen"],
        "no out-of-memory error in the trace: the moment of peak reserved memory"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

/// Issue 54, item 6: `plan` without `--device` plans the device whose repeating iteration
/// covers the most allocations and says so; a single-device recording says nothing.
#[test]
fn without_a_device_plan_takes_the_device_it_plans_best() {
    let Some(dir) = shared_traces("without_a_device_plan_takes_the_device_it_plans_best") else {
        return;
    };
    let trace = dir.join("qwen3_gnn_3gpu_expandable_oom_complete.pickle");
    let recording = read_recording(&trace).expect("readable");
    let covered = |device: u32| {
        gpumem::plan::plan(
            &recording,
            "qwen3",
            &gpumem::plan::PlanOptions {
                device,
                ..gpumem::plan::PlanOptions::default()
            },
        )
        .map_or(0, |p| p.period * p.iterations)
    };
    let best = (0..3u32)
        .max_by_key(|&d| (covered(d), std::cmp::Reverse(d)))
        .expect("three devices");
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["plan", "--json"])
            .arg(&trace),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["plan"]["device"], best);
    let chosen = v["chosen"].as_str().expect("says which device and why");
    assert!(chosen.starts_with(&format!("device {best}: ")), "{chosen}");
    let single = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["plan", "--json"])
            .arg(dir.join("dit_discrete_diffusion_train_oom_complete.pickle")),
    );
    let v: serde_json::Value = serde_json::from_slice(&single.stdout).expect("json");
    assert!(v.get("chosen").is_none(), "{}", v["chosen"]);
}

/// Issue 61, item 3: sites read the same across environments, and an allocation with C++
/// frames only (the backward pass, about half of a training step's) is named by its autograd
/// node and operator, not by the unwinder's own frame.
#[test]
fn sites_are_normalised_and_backward_allocations_named() {
    let Some(dir) = shared_traces("sites_are_normalised_and_backward_allocations_named") else {
        return;
    };
    let recording = read_recording(&dir.join("cs336_lm_fullstep_ctx128.pickle")).expect("reads");
    let stacks = &recording.event_stacks[0];
    let sites: std::collections::BTreeSet<String> = recording.device_traces[0]
        .iter()
        .zip(stacks)
        .filter(|(e, _)| e.action == TraceAction::Alloc)
        .map(|(_, &stack)| gpumem::explain::site::site_of(&recording, stack))
        .collect();
    assert!(
        sites.iter().all(|s| !s.starts_with("??")
            && !s.contains("site-packages/")
            && !s.contains("/home/")),
        "{sites:#?}"
    );
    assert!(
        sites
            .iter()
            .any(|s| s.starts_with("backward: ") && s.contains("(aten::")),
        "{sites:#?}"
    );
    assert!(
        sites
            .iter()
            .any(|s| s.starts_with("~/") && s.contains(".py:")),
        "the program's own lines, its home as ~: {sites:#?}"
    );
    // Explain's groups carry them.
    let e = explain(&recording, At::PeakReserved, Setup::default()).expect("explains");
    assert!(!e.pinning.is_empty());
    for group in &e.pinning {
        let f = &group.frame;
        assert!(
            !f.starts_with("??") && !f.contains("site-packages/") && !f.contains("/home/"),
            "{group:?}"
        );
    }
}
