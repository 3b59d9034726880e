//! Replaying real recordings: the fidelity check (every decision equals PyTorch's), the
//! what-if comparison, the end-state summaries, and bad inputs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpumem::AllocatorConfig;
use gpumem::recording::{Format, TraceError, parse_recording, read_recording, state_summary};
use gpumem::replay::{Mode, Setup, WhatIf};

use crate::common::{self, succeeded};
use crate::support::traces::shared_traces;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces")
        .join(name)
}

/// A device memory the qwen3 recording's address layout implies (79.15 GiB, an "80 GB"
/// GPU): its expandable segments' reservations sit 95 630 131 200 bytes apart, 9/8 of it in
/// 20 MiB pages. The recording itself does not say.
const QWEN3_DEVICE_BYTES: u64 = 84_987_740_160;

fn check(
    recording: &gpumem::recording::Recording,
    device: u32,
    capacity: Option<u64>,
) -> gpumem::replay::ReplayReport {
    let setup = Setup {
        device,
        capacity,
        ..Setup::default()
    };
    let report = common::replay_check(recording, setup).expect("replay runs");
    if let Some(d) = &report.divergence {
        panic!(
            "diverges at event {}: expected {}, got {}\n{}",
            d.index,
            d.expected,
            d.actual,
            d.context.join("\n")
        );
    }
    report
}

/// (file, events, allocs, segment allocs, start segments) — counts from the recordings'
/// documentation; every event is a compared decision.
const BUNDLED: [(&str, usize, u64, u64, usize); 5] = [
    ("cs336_attention_tiny_complete", 97, 36, 9, 0),
    ("opt125m_zo_fedtrain_complete", 23_105, 7_946, 61, 0),
    ("cs336_lm_fwd_bwd_step", 19_464, 6_488, 0, 999),
    ("cs336_lm_compiled_train", 6_486, 2_162, 0, 96),
    ("cs336_lm_forward_bf16", 2_811, 937, 0, 43),
];

#[test]
fn bundled_recordings_replay_exactly() {
    for (name, events, allocs, segment_allocs, start) in BUNDLED {
        let rec = read_recording(&data(&format!("{name}.noframes.json.gz"))).expect(name);
        let r = check(&rec, 0, None);
        assert_eq!(r.events, events, "{name}");
        assert_eq!(
            r.compared.total(),
            events as u64,
            "{name}: every event compared"
        );
        assert_eq!(r.compared.allocs, allocs, "{name}");
        assert_eq!(r.compared.segment_allocs, segment_allocs, "{name}");
        assert_eq!(r.start_segments, start, "{name}");
    }
}

#[test]
fn every_shared_recording_with_a_trace_replays_exactly() {
    let Some(dir) = shared_traces("every_shared_recording_with_a_trace_replays_exactly") else {
        return;
    };
    let (mut replayed, mut distinguished) = (0, 0);
    for entry in std::fs::read_dir(&dir).expect("readable") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "pickle") {
            continue;
        }
        let rec = read_recording(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for (device, events) in rec.device_traces.iter().enumerate() {
            if events.is_empty() {
                continue;
            }
            let r = check(&rec, device as u32, None);
            assert_eq!(
                r.compared.total(),
                events.len() as u64,
                "{}",
                path.display()
            );
            // Made by PyTorch 2.0 to 2.7: the address order reproduces each, alone or with
            // the counter order.
            let found = r.ordering.ordering.as_str();
            assert!(
                matches!(found, "address" | "both"),
                "{}: {found}",
                path.display()
            );
            distinguished += usize::from(found == "address");
            replayed += 1;
        }
    }
    // 14 recordings with a trace, one of them with three devices; the counter order places
    // blocks differently on 9 of them.
    assert!(replayed >= 17, "only {replayed} traces replayed");
    assert!(
        distinguished >= 9,
        "the orders differ on only {distinguished} traces"
    );
}

#[test]
fn oom_and_empty_cache_recordings_reproduce_at_the_same_event() {
    let Some(dir) = shared_traces("oom_and_empty_cache_recordings_reproduce_at_the_same_event")
    else {
        return;
    };
    let rec = read_recording(&dir.join("dit_discrete_diffusion_train_oom_complete.pickle"))
        .expect("readable");
    let r = check(&rec, 0, None);
    assert_eq!((r.compared.ooms, r.ooms), (1, 1));
    assert_eq!(r.compared.segment_frees, 6);
    let rec =
        read_recording(&dir.join("qwen2_7b_layerwise_calib_emptycache.pickle")).expect("readable");
    assert_eq!(check(&rec, 0, None).compared.segment_frees, 420);
    let rec =
        read_recording(&dir.join("llama_offload_inference_multistream.pickle")).expect("readable");
    let streams: std::collections::BTreeSet<gpumem::StreamId> =
        rec.device_traces[0].iter().map(|e| e.stream).collect();
    assert_eq!(streams.len(), 10);
    check(&rec, 0, None);
}

#[test]
fn expandable_recording_replays_exactly_on_all_three_devices() {
    let Some(dir) = shared_traces("expandable_recording_replays_exactly_on_all_three_devices")
    else {
        return;
    };
    let rec = read_recording(&dir.join("qwen3_gnn_3gpu_expandable_oom_complete.pickle"))
        .expect("readable");
    let config = rec.config.clone().expect("recorded settings");
    assert!(config.expandable_segments);
    // (events, segment maps and unmaps, OOMs) per device, from the recording's documentation.
    for (device, events, maps, ooms) in [(0, 6_445, 175, 0), (1, 596, 46, 1), (2, 882, 78, 0)] {
        // Without --capacity: the device memory is inferred from the reservations' spacing.
        let r = check(&rec, device, None);
        assert_eq!(r.compared.total(), events, "device {device}");
        assert_eq!(r.compared.segment_maps, maps, "device {device}");
        assert_eq!(r.compared.ooms, ooms, "device {device}");
        assert!(r.capacity_inferred, "device {device}: {} bytes", r.capacity);
        assert_eq!(
            gpumem::replay::capacity_for_reservation(95_630_131_200, 20 << 20),
            r.capacity,
            "device {device}"
        );
        assert!(r.capacity >= QWEN3_DEVICE_BYTES);
        // The value the user would pass reproduces it too.
        let given = check(&rec, device, Some(QWEN3_DEVICE_BYTES));
        assert!(!given.capacity_inferred);
        assert_eq!(given.compared, r.compared);
    }
    // On a device larger than the recorded one, the reservations no longer fit where the
    // recording put them, and the divergence says so.
    let setup = Setup {
        capacity: Some(80 << 30),
        ..Setup::default()
    };
    let d = common::replay_check(&rec, setup)
        .expect("runs")
        .divergence
        .expect("diverges");
    assert!(d.context.iter().any(|l| l.contains("--capacity")), "{d:?}");
}

#[test]
fn pickle_and_json_copies_decode_to_the_same_recording() {
    let Some(dir) = shared_traces("pickle_and_json_copies_decode_to_the_same_recording") else {
        return;
    };
    for name in [
        "cs336_attention_tiny_complete",
        "opt125m_zo_fedtrain_complete",
    ] {
        let pickled = read_recording(&dir.join(format!("{name}.pickle"))).expect("pickle");
        let json = read_recording(&data(&format!("{name}.noframes.json.gz"))).expect("json");
        // The pickles have stacks, the JSON copies none.
        let mut unstacked = pickled.segments.clone();
        for b in unstacked.iter_mut().flat_map(|s| s.blocks.iter_mut()) {
            b.stack = gpumem::recording::StackId::EMPTY;
        }
        assert_eq!(unstacked, json.segments, "{name}");
        assert!(pickled.frames.frame_count() > 0, "{name}: frames kept");
        assert_eq!(pickled.device_traces, json.device_traces, "{name}");
        assert_eq!(pickled.config, json.config, "{name}");
    }
}

/// Rewrites one event of a bundled recording and checks that replay points at it.
fn diverges_at(edit: impl Fn(&mut serde_json::Value) -> usize) {
    let bytes =
        std::fs::read(data("cs336_attention_tiny_complete.noframes.json.gz")).expect("data");
    let mut json = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut json)
        .expect("gzip");
    let mut doc: serde_json::Value = serde_json::from_str(&json).expect("json");
    let index = edit(&mut doc);
    let rec = parse_recording(doc.to_string().as_bytes()).expect("still valid");
    let report = common::replay_check(&rec, Setup::default()).expect("replay runs");
    let d = report.divergence.expect("the edit is caught");
    assert_eq!(d.index, index, "{d:?}");
}

#[test]
fn a_changed_decision_is_reported_where_it_happens() {
    // Event 5 allocates a 512 MiB block that events 9 and 10 free: move all three.
    diverges_at(|doc| {
        for i in [5, 9, 10] {
            let e = &mut doc["device_traces"][0][i];
            assert_eq!(e["size"], 536_870_912);
            e["addr"] = (e["addr"].as_u64().expect("addr") + 512).into();
        }
        5
    });
    // A segment of another size than the allocator would take.
    diverges_at(|doc| {
        let e = &mut doc["device_traces"][0][0];
        assert_eq!(e["action"], "segment_alloc");
        e["size"] = (e["size"].as_u64().expect("size") * 2).into();
        0
    });
    // An empty_cache the allocator would not have needed to release that segment.
    diverges_at(|doc| {
        let events = doc["device_traces"][0].as_array_mut().expect("events");
        let seg = events[0].clone();
        let mut free = seg.clone();
        free["action"] = "segment_free".into();
        events.insert(1, free);
        1
    });
}

#[test]
fn what_if_compares_configurations() {
    let rec = read_recording(&data("opt125m_zo_fedtrain_complete.noframes.json.gz")).expect("data");
    let run = |conf: Option<&str>| {
        let what_if = WhatIf {
            config: conf.map(|c| AllocatorConfig::parse(c).expect("valid")),
            ..WhatIf::default()
        };
        common::session(&rec, Setup::default())
            .and_then(|s| s.replay(&Mode::WhatIf(what_if), 100, &mut |_, _| {}))
            .expect("replay runs")
    };
    let recorded = run(None);
    let checked = check(&rec, 0, None);
    assert_eq!(recorded.peak_reserved, checked.peak_reserved);
    assert_eq!(recorded.peak_allocated, checked.peak_allocated);
    assert_eq!(recorded.device_allocs, 61);
    assert!(recorded.reserved_ratio() > 1.0);
    let expandable = run(Some("expandable_segments:True"));
    assert!(expandable.peak_reserved < recorded.peak_reserved);
    let rounded = run(Some("roundup_power2_divisions:4"));
    assert!(
        rounded.peak_allocated > recorded.peak_allocated,
        "coarser rounding costs bytes"
    );
    assert!(recorded.series.len() >= 100);
    use gpumem::view::timeline::{Run, svg};
    let runs = [
        Run {
            name: "recorded",
            points: &recorded.series,
        },
        Run {
            name: "expandable",
            points: &expandable.series,
        },
    ];
    let svg = svg("opt125m", &runs);
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 4);
    assert_eq!(svg.matches("class=\"band\"").count(), 2);
    // Each point holds the most of its stretch: the series' peak is the replay's.
    let most = |f: fn(&gpumem::replay::SeriesPoint) -> u64| recorded.series.iter().map(f).max();
    assert_eq!(most(|p| p.reserved), Some(recorded.peak_reserved));
    assert_eq!(most(|p| p.allocated), Some(recorded.peak_allocated));
}

#[test]
fn a_smaller_device_runs_out_of_memory_in_what_if() {
    let rec = read_recording(&data("opt125m_zo_fedtrain_complete.noframes.json.gz")).expect("data");
    let setup = Setup {
        capacity: Some(1 << 30),
        ..Setup::default()
    };
    let r = common::what_if(&rec, setup, WhatIf::default()).expect("replay runs");
    assert!(r.ooms > 0 && r.alloc_retries > 0, "{r:?}");
    assert!(r.peak_reserved <= 1 << 30);
}

#[test]
fn end_state_files_load_and_summarise() {
    let verl = read_recording(&data("state_verl_vllm_qwen2.noframes.json.gz")).expect("verl");
    assert_eq!(verl.format, Format::Newest);
    let text = state_summary(&verl);
    assert!(text.contains("127 segments"), "{text}");
    assert!(text.contains("68 in private pools"), "{text}");
    assert!(text.contains("9 pending free"), "{text}");
    let old = read_recording(&data(
        "state_oldformat_flexgen_opt1p3b_oom.noframes.json.gz",
    ))
    .expect("oldest layout");
    assert_eq!(old.format, Format::Oldest);
    assert_eq!(old.segments.len(), 176);
    assert_eq!(
        old.segments.iter().map(|s| s.blocks.len()).sum::<usize>(),
        463
    );
    // Its only event is a snapshot marker, which the rebuilt state must reproduce.
    assert_eq!(check(&old, 0, None).compared.snapshots, 1);
    if let Some(dir) = shared_traces("the legacy-list part of end_state_files_load_and_summarise") {
        let legacy = read_recording(&dir.join("state_legacy_segment_list.pickle")).expect("legacy");
        assert_eq!(legacy.format, Format::LegacyList);
        assert_eq!(legacy.segments.len(), 255);
        assert!(state_summary(&legacy).contains("255 segments (123 large, 132 small)"));
    }
}

#[test]
fn bad_inputs_get_clear_errors() {
    let tiny = std::fs::read(data("cs336_attention_tiny_complete.noframes.json.gz")).expect("data");
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&tiny[..]), &mut json)
        .expect("gz");
    // Truncated JSON and truncated gzip.
    assert!(matches!(
        parse_recording(&json[..json.len() / 2]),
        Err(TraceError::Json(_))
    ));
    assert!(matches!(
        parse_recording(&tiny[..tiny.len() / 2]),
        Err(TraceError::Gzip(_))
    ));
    // Wrong types, with the path of the field.
    let mut doc: serde_json::Value = serde_json::from_slice(&json).expect("json");
    doc["device_traces"][0][3]["size"] = "big".into();
    let err = parse_recording(doc.to_string().as_bytes()).expect_err("wrong type");
    assert_eq!(
        err.to_string(),
        "at $.device_traces[0][3].size: expected an int, found a string"
    );
    let err = parse_recording(b"{\"segments\": 3}").expect_err("not a list");
    assert_eq!(
        err.to_string(),
        "at $.segments: expected a list, found an int"
    );
    let err = parse_recording(b"GIF89a").expect_err("not a snapshot");
    assert!(matches!(err, TraceError::UnknownFormat(_)), "{err}");
    // A pickle that names a class.
    let err =
        parse_recording(b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.")
            .expect_err("refused");
    assert!(err.to_string().contains("names a class"), "{err}");
    // A size field claiming 2 GiB.
    let err = parse_recording(b"\x80\x04X\x00\x00\x00\x80abc.").expect_err("refused");
    assert!(err.to_string().contains("truncated"), "{err}");
    // A gzip bomb: a pickle of 64 Mi Nones against a 1 MiB limit (zeros alone are refused
    // at their first byte, as no snapshot).
    let mut bomb = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    bomb.write_all(b"\x80\x04(").expect("compress");
    bomb.write_all(&vec![b'N'; 64 << 20]).expect("compress");
    let bomb = bomb.finish().expect("compress");
    assert!(bomb.len() < 1 << 20);
    let err = gpumem::recording::parse_recording_with_limit(&bomb, 1 << 20).expect_err("bomb");
    assert!(
        matches!(
            err,
            TraceError::TooLarge {
                decompressed: true,
                ..
            }
        ),
        "{err}"
    );
}

/// A pickle that references one list of events many times through its memo: each reference
/// costs a few bytes, and materialising them all would need unbounded memory.
#[test]
fn memo_amplification_is_refused() {
    // {"segments": [], "device_traces": [L, L, ... x 50 000]} with L = [event] * 1000, L shared.
    let mut p: Vec<u8> = b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces](".to_vec();
    // L: a list of 1000 references to one event dict, memoized as entry 0.
    p.extend_from_slice(b"](}(\x8c\x06action\x8c\x05alloc\x8c\x04addrK\x00\x8c\x04sizeK\x01u\x94");
    for _ in 0..999 {
        p.extend_from_slice(b"h\x00");
    }
    p.extend_from_slice(b"e\x94");
    for _ in 0..49_999 {
        p.extend_from_slice(b"h\x01");
    }
    p.extend_from_slice(b"eu.");
    assert!(p.len() < 200_000);
    let err = parse_recording(&p).expect_err("refused");
    assert!(err.to_string().contains("more references"), "{err}");
}

/// One dict padded with `pairs` filler pairs (DUPs, a byte each) and read as `refs` events
/// through the memo (two bytes each): the reproducer of a reader whose dict lookups scan.
fn padded_dict_pickle(pairs: usize, refs: usize) -> Vec<u8> {
    let s = |x: &str| [&[0x8c, x.len() as u8], x.as_bytes()].concat();
    let mut p = b"\x80\x04}(".to_vec();
    p.extend(s("segments"));
    p.push(b']');
    p.extend(s("device_traces"));
    p.extend(b"]](}q\x00(N");
    p.extend(std::iter::repeat_n(b'2', 2 * pairs - 1));
    p.extend(s("action"));
    p.extend(s("user_defined"));
    p.extend(s("size"));
    p.extend(b"K\x00u");
    for _ in 1..refs {
        p.extend(b"h\x00");
    }
    p.extend(b"ea");
    p.extend(s("junk"));
    p.push(b'(');
    p.extend(std::iter::repeat_n(b'N', refs));
    p.extend(b"lu.");
    p
}

/// Reading costs work (opcodes plus dict entries looked at) and memory in proportion to the
/// decoded input, whatever its shape: `(work per byte, held bytes per byte)` of each input.
fn costs_per_byte(inputs: &[Vec<u8>]) -> Vec<(f64, f64)> {
    inputs
        .iter()
        .map(|p| {
            let (result, cost) = gpumem::recording::parse_recording_with(p, Default::default());
            result.unwrap_or_else(|e| panic!("{} bytes: {e}", p.len()));
            assert_eq!(cost.input_bytes, p.len() as u64);
            let bytes = cost.input_bytes as f64;
            (cost.work as f64 / bytes, cost.peak_bytes as f64 / bytes)
        })
        .collect()
}

#[test]
fn a_dict_read_many_times_costs_its_size_once() {
    let inputs: Vec<_> = [10_000, 20_000, 40_000, 80_000]
        .iter()
        .map(|&n| padded_dict_pickle(n, n))
        .collect();
    let (first, _) = parse_recording_with_events(&inputs[3]);
    assert_eq!(first, 80_000, "every reference is an event");
    let costs = costs_per_byte(&inputs);
    for (i, &(work, held)) in costs.iter().enumerate() {
        // Quadratic lookups would make the work per byte double with each doubling.
        assert!(work < 8.0, "input {i}: {work:.1} work a byte");
        assert!(held < 64.0, "input {i}: {held:.1} bytes held a byte");
        assert!(
            work < costs[0].0 * 1.25 + 0.5,
            "work per byte grows: {costs:?}"
        );
    }
}

fn parse_recording_with_events(p: &[u8]) -> (usize, usize) {
    let rec = parse_recording(p).expect("readable");
    (rec.device_traces[0].len(), rec.segments.len())
}

#[test]
fn a_pickle_of_nones_is_held_in_proportion_and_within_the_budget() {
    // ["N" * n]: 16 bytes a value on the stack and in the list, at most.
    let nones = |n: usize| {
        let mut p = b"\x80\x04(".to_vec();
        p.extend(std::iter::repeat_n(b'N', n));
        p.extend(b"l.");
        p
    };
    let sizes = [1 << 18, 1 << 20, 1 << 22];
    for n in sizes {
        // A list is no snapshot: the reading cost is what is measured.
        let (result, cost) = gpumem::recording::parse_recording_with(&nones(n), Default::default());
        assert!(
            matches!(result, Err(TraceError::Schema { .. })),
            "{result:?}"
        );
        let held = cost.peak_bytes as f64 / n as f64;
        let work = cost.work as f64 / n as f64;
        assert!(
            (15.0..=64.0).contains(&held),
            "{n}: {held:.1} bytes held a None"
        );
        assert!(work < 3.0, "{n}: {work:.1} work a None");
    }
    // Past the budget: a clear error at the offset it was crossed, not an abort.
    let limits = gpumem::recording::ReadLimits {
        max_memory_bytes: 8 << 20,
        ..Default::default()
    };
    let (result, _) = gpumem::recording::parse_recording_with(&nones(1 << 22), limits);
    let err = result.expect_err("over budget");
    assert!(
        matches!(err, TraceError::MemoryBudget { limit, offset } if limit == 8 << 20 && offset < 1 << 22),
        "{err}"
    );
    // The same through gzip (a 128 MiB pickle of Nones in 130 KB): refused, bounded.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&nones(128 << 20)).expect("compress");
    let gz = gz.finish().expect("compress");
    assert!(gz.len() < 1 << 20);
    let limits = gpumem::recording::ReadLimits {
        max_memory_bytes: 256 << 20,
        ..Default::default()
    };
    let (result, cost) = gpumem::recording::parse_recording_with(&gz, limits);
    assert!(
        matches!(result, Err(TraceError::MemoryBudget { .. })),
        "{result:?}"
    );
    // Checked every 4 096 opcodes: at most that many values past the budget.
    assert!(
        cost.peak_bytes <= (256 << 20) + 4096 * 32,
        "held {}",
        cost.peak_bytes
    );
}

#[test]
fn overlapping_segments_are_refused() {
    let doc = serde_json::json!({
        "segments": [
            {"device": 0, "address": 0x100000, "total_size": 2097152, "stream": 0, "segment_type": "small",
             "blocks": [{"address": 0x100000, "size": 2097152, "requested_size": 512, "state": "active_allocated"}]},
            {"device": 0, "address": 0x200000, "total_size": 2097152, "stream": 0, "segment_type": "small",
             "blocks": [{"address": 0x200000, "size": 2097152, "requested_size": 512, "state": "inactive"}]}
        ],
        "device_traces": [[{"action": "free_requested", "addr": 0x100000, "size": 512, "stream": 0}]]
    });
    let rec = parse_recording(doc.to_string().as_bytes()).expect("valid schema");
    let err = common::what_if(&rec, Setup::default(), WhatIf::default()).expect_err("inconsistent");
    assert!(err.to_string().contains("overlaps"), "{err}");
}

#[test]
fn the_command_line_checks_and_fails_cleanly() {
    let bin = env!("CARGO_BIN_EXE_gpumem");
    let ok = Command::new(bin)
        .args(["replay", "--check"])
        .arg(data("cs336_attention_tiny_complete.noframes.json.gz"))
        .output()
        .expect("runs");
    assert!(ok.status.success(), "{ok:?}");
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(out.contains("97 events match the recording"), "{out}");

    let dir = std::env::temp_dir().join(format!("gpumem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let broken = dir.join("broken.json");
    std::fs::write(&broken, b"{\"segments\": [").expect("write");
    let bad = Command::new(bin)
        .args(["replay"])
        .arg(&broken)
        .output()
        .expect("runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("JSON error"));

    let svg = dir.join("plot.svg");
    let what_if = Command::new(bin)
        .args([
            "replay",
            "--json",
            "--config",
            "expandable_segments:True",
            "--plot",
        ])
        .arg(&svg)
        .arg(data("cs336_lm_forward_bf16.noframes.json.gz"))
        .output()
        .expect("runs");
    assert!(what_if.status.success(), "{what_if:?}");
    let json: serde_json::Value = serde_json::from_slice(&what_if.stdout).expect("json");
    assert_eq!(json[0]["results"].as_array().map(Vec::len), Some(2));
    assert!(
        std::fs::read_to_string(&svg)
            .expect("svg")
            .contains("<polyline")
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// gpumem's own snapshots replay exactly: a training workload under each configuration (GC,
/// oversize release, expandable segments, power-of-two rounding, an OOM, a trace window that
/// starts mid-run) is recorded, serialised, read back and checked.
#[test]
fn own_snapshots_round_trip_through_replay() {
    use gpumem::demo::workload::{TrainingWorkload, finish_communication};
    use gpumem::device::{SimConfig, SimDevice};

    for (conf, capacity_gib, fraction, history, steps) in [
        ("", 80, None, None, 10),
        (
            "max_split_size_mb:256,garbage_collection_threshold:0.6",
            60,
            Some(0.8),
            None,
            30,
        ),
        ("expandable_segments:True", 80, None, None, 10),
        (
            "roundup_power2_divisions:[64:8,>:4]",
            80,
            None,
            Some(3_000),
            10,
        ),
        ("max_split_size_mb:128", 48, None, Some(5_000), 30),
        ("", 20, None, None, 5),
    ] {
        let config = AllocatorConfig::parse(conf).expect("valid");
        let device = SimDevice::new(SimConfig::with_capacity(capacity_gib << 30));
        let mut alloc = gpumem::CachingAllocator::new(device, config);
        if let Some(f) = fraction {
            alloc.set_memory_fraction(f).expect("valid fraction");
        }
        alloc.record_history(Some(history.unwrap_or(1 << 20)));
        let workload = TrainingWorkload {
            steps,
            ..TrainingWorkload::default()
        };
        let report = workload
            .run(&mut alloc, finish_communication)
            .expect("runs");
        let json = serde_json::to_vec(&alloc.snapshot()).expect("serialises");
        let rec = parse_recording(&json).expect("reads back");
        let r = check(&rec, 0, None);
        let events = rec.device_traces[0].len() as u64;
        assert_eq!(r.compared.total(), events, "{conf}");
        let stats = alloc.memory_stats();
        if history.is_none() {
            assert_eq!(
                r.peak_reserved as i64, stats["reserved_bytes.all.peak"],
                "{conf}"
            );
            assert_eq!(r.ooms as i64, stats["num_ooms"], "{conf}");
        }
        if capacity_gib == 20 {
            assert!(
                report.oom.is_some() && r.compared.ooms == 1,
                "{conf}: an OOM to replay"
            );
        }
        if fraction.is_some() {
            assert!(
                stats["num_device_free"] > 0,
                "{conf}: garbage collection released segments"
            );
        }
    }
}

/// A what-if replay of `rec` under `conf` (its recorded configuration for `None`), from a
/// fresh start or from the recorded segments.
fn what_if(
    rec: &gpumem::recording::Recording,
    conf: Option<&str>,
    fresh_start: bool,
) -> gpumem::replay::ReplayReport {
    let what_if = WhatIf {
        config: conf.map(|c| AllocatorConfig::parse(c).expect("valid")),
        fresh_start,
        ..WhatIf::default()
    };
    common::what_if(rec, Setup::default(), what_if).expect("replay runs")
}

/// A fresh start sets the recorded cache aside: the blocks live at the trace's start are
/// allocated anew under each configuration. Here one live 12 MiB block sits in a recorded
/// 40 MiB segment: recorded, the segment is reserved; afresh, the block takes a 12 MiB segment
/// (large requests of 10 MiB and more get exact 2 MiB-rounded segments), or one 20 MiB page
/// with expandable segments.
#[test]
fn a_fresh_start_allocates_the_live_blocks_anew() {
    const MIB: u64 = 1 << 20;
    let base: u64 = 0x7f00_0000_0000;
    let doc = serde_json::json!({
        "segments": [{
            "device": 0, "address": base, "total_size": 40 * MIB, "allocated_size": 0,
            "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
            "segment_pool_id": [0, 0], "is_expandable": false,
            "blocks": [
                {"address": base, "size": 12 * MIB, "requested_size": 12 * MIB, "state": "inactive"},
                {"address": base + 12 * MIB, "size": 28 * MIB, "requested_size": 0, "state": "inactive"}
            ]
        }],
        "device_traces": [[
            {"action": "free_requested", "addr": base, "size": 12 * MIB, "stream": 0, "time_us": 1},
            {"action": "free_completed", "addr": base, "size": 12 * MIB, "stream": 0, "time_us": 2}
        ]]
    });
    let rec = parse_recording(doc.to_string().as_bytes()).expect("valid recording");
    let recorded = what_if(&rec, None, false);
    assert_eq!(
        (recorded.peak_reserved, recorded.peak_allocated),
        (40 * MIB, 12 * MIB)
    );
    let fresh = what_if(&rec, None, true);
    assert_eq!(
        (fresh.peak_reserved, fresh.peak_allocated),
        (12 * MIB, 12 * MIB)
    );
    assert_eq!(
        fresh.start_segments, 1,
        "the recording's start is still reported"
    );
    let expandable = what_if(&rec, Some("expandable_segments:True"), true);
    assert_eq!(expandable.peak_reserved, 20 * MIB);
    // On a device too small for the live block, the fresh start counts an OOM and goes on.
    let small = common::what_if(
        &rec,
        Setup {
            capacity: Some(8 * MIB),
            ..Setup::default()
        },
        WhatIf {
            fresh_start: true,
            ..WhatIf::default()
        },
    )
    .expect("replay runs");
    assert_eq!((small.ooms, small.peak_reserved), (1, 0));
    // The fidelity check never starts afresh: it must see the recorded segments.
    let checked = common::replay_check(&rec, Setup::default()).expect("replay runs");
    assert!(checked.divergence.is_none(), "{:?}", checked.divergence);
    assert_eq!(checked.peak_reserved, 40 * MIB);
}

/// On a real mid-run recording served entirely from its recorded cache, a fresh start has to
/// ask the device, and expandable segments then reserve less than the recorded configuration.
#[test]
fn a_fresh_start_on_a_mid_run_recording() {
    let rec = read_recording(&data("cs336_lm_compiled_train.noframes.json.gz")).expect("data");
    let recorded = what_if(&rec, None, false);
    assert_eq!(
        recorded.device_allocs, 0,
        "the recorded cache serves every request"
    );
    let fresh = what_if(&rec, None, true);
    assert!(fresh.device_allocs > 0);
    assert!(fresh.peak_reserved <= recorded.peak_reserved);
    let expandable = what_if(&rec, Some("expandable_segments:True"), true);
    assert!(
        expandable.peak_reserved < fresh.peak_reserved,
        "{} vs {}",
        expandable.peak_reserved,
        fresh.peak_reserved
    );
}

/// A snapshot's `max_split_size` obeys what `max_split_size_mb` requires: -1 (unlimited) or
/// at least `large_segment_size` (20 MiB unless the settings string sets it); 0 is refused
/// with the path of the bad value.
#[test]
fn a_recorded_max_split_size_of_zero_is_refused() {
    for (value, ok) in [
        (0i64, false),
        ((20 << 20) - 1, false),
        (20 << 20, true),
        (-1, true),
        ((20 << 20) + 1, true),
    ] {
        let doc = serde_json::json!({
            "segments": [], "device_traces": [[]],
            "allocator_settings": {"max_split_size": value},
        });
        let read = parse_recording(doc.to_string().as_bytes());
        assert_eq!(read.is_ok(), ok, "max_split_size {value}: {:?}", read.err());
        if let Err(e) = read {
            assert!(e.to_string().contains("max_split_size"), "{e}");
        }
    }
}

/// Frees deferred on two to four streams and completed together (at one malloc, and in the
/// synchronisation of an `empty_cache`) are listed by PyTorch in its hash map's order: the
/// check matches each batch as a set, in whatever order the recording lists it.
#[test]
fn frees_completed_together_match_in_any_order() {
    const MIB: u64 = 1 << 20;
    let base: u64 = 0x7f00_0000_0000;
    let others = [base + 0x1000_0000, base + 0x2000_0000, base + 0x3000_0000];
    let ev = |action: &str, addr: u64, size: u64, stream: u64| serde_json::json!({"action": action, "addr": addr, "size": size, "stream": stream});
    for streams in 2..=4usize {
        // Per extra stream, one segment with one block.
        let extra = &others[..streams - 1];
        let mut trace = vec![ev("segment_alloc", base, 20 * MIB, 0)];
        let blocks: Vec<u64> = (0..4).map(|i| base + i * 2 * MIB).collect();
        for &b in &blocks {
            trace.push(ev("alloc", b, 2 * MIB, 0));
        }
        for (s, &seg) in extra.iter().enumerate() {
            trace.push(ev("segment_alloc", seg, 20 * MIB, s as u64 + 1));
            trace.push(ev("alloc", seg, 2 * MIB, s as u64 + 1));
        }
        // Requests in one order (gpumem completes them in this order) ...
        for &b in &blocks[..3] {
            trace.push(ev("free_requested", b, 2 * MIB, 0));
        }
        for (s, &seg) in extra.iter().enumerate() {
            trace.push(ev("free_requested", seg, 2 * MIB, s as u64 + 1));
        }
        // ... completions in another, before the next malloc.
        for (s, &seg) in extra.iter().enumerate().rev() {
            trace.push(ev("free_completed", seg, 2 * MIB, s as u64 + 1));
        }
        for &b in [blocks[2], blocks[0], blocks[1]].iter() {
            trace.push(ev("free_completed", b, 2 * MIB, 0));
        }
        trace.push(ev("alloc", base, 2 * MIB, 0));
        // Two more deferred frees, completed together (reversed) by an empty_cache's
        // synchronisation, then the releases.
        trace.push(ev("free_requested", blocks[3], 2 * MIB, 0));
        trace.push(ev("free_requested", base, 2 * MIB, 0));
        trace.push(ev("free_completed", base, 2 * MIB, 0));
        trace.push(ev("free_completed", blocks[3], 2 * MIB, 0));
        trace.push(ev("segment_free", base, 20 * MIB, 0));
        for (s, &seg) in extra.iter().enumerate() {
            trace.push(ev("segment_free", seg, 20 * MIB, s as u64 + 1));
        }
        let events = trace.len();
        let doc = serde_json::json!({"segments": [], "device_traces": [trace]});
        let rec = parse_recording(doc.to_string().as_bytes()).expect("valid recording");
        let r = check(&rec, 0, None);
        assert_eq!(r.compared.total(), events as u64, "{streams} streams");
        assert_eq!(r.compared.segment_frees, streams as u64);
        // A batch that lacks a member still diverges.
        let mut broken = doc.clone();
        let list = broken["device_traces"][0].as_array_mut().expect("trace");
        let at = list
            .iter()
            .position(|e| e["action"] == "free_completed")
            .expect("a completion");
        list.remove(at);
        let rec = parse_recording(broken.to_string().as_bytes()).expect("valid recording");
        let report = common::replay_check(&rec, Setup::default());
        assert!(
            report.as_ref().map_or(true, |r| r.divergence.is_some()),
            "{streams} streams: a missing completion is a divergence"
        );
    }
}

/// A recording whose segment sits at an address no driver hands out (not 512-byte aligned;
/// found by the fuzzer): the check reports it cleanly instead of building a misaligned
/// segment (which the core's invariants, on in the tests, would catch as a panic).
#[test]
fn a_misaligned_recorded_segment_is_refused_cleanly() {
    const MIB: u64 = 1 << 20;
    let base: u64 = 0x7f00_0000_07cc;
    let doc = serde_json::json!({
        "segments": [{
            "device": 0, "address": base, "total_size": 2 * MIB, "allocated_size": 512,
            "active_size": 512, "requested_size": 4, "stream": 0, "segment_type": "small",
            "segment_pool_id": [0, 0], "is_expandable": false,
            "blocks": [
                {"address": base, "size": 512, "requested_size": 4, "state": "active_allocated"},
                {"address": base + 512, "size": 2 * MIB - 512, "requested_size": 0, "state": "inactive"}
            ]
        }],
        "device_traces": [[
            {"action": "free_requested", "addr": base, "size": 4, "stream": 0},
            {"action": "free_completed", "addr": base, "size": 4, "stream": 0}
        ]]
    });
    let rec = parse_recording(doc.to_string().as_bytes()).expect("valid recording");
    for check in [true, false] {
        let report = if check {
            common::replay_check(&rec, Setup::default())
        } else {
            common::what_if(&rec, Setup::default(), WhatIf::default())
        };
        match report {
            Err(e) => assert!(e.to_string().contains("does not fit"), "{e}"),
            Ok(report) => assert!(!check || report.divergence.is_some(), "{report:?}"),
        }
    }
}

/// Writes a snapshot of `entries` trace entries with `frames` frames each to `file`
/// (`scripts/gen-snapshot.py`, driven by this build's gpumem); its size.
pub(crate) fn generate_snapshot(entries: usize, frames: usize, extra: &[&str], file: &Path) -> u64 {
    succeeded(
        Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gen-snapshot.py"))
            .args([
                "--entries",
                &entries.to_string(),
                "--frames",
                &frames.to_string(),
            ])
            .args(extra)
            .args(["--gpumem", env!("CARGO_BIN_EXE_gpumem")])
            .arg(file),
    );
    std::fs::metadata(file).expect("written").len()
}

/// A generated recording with stacks (scripts/gen-snapshot.py, about 70 MB): `replay --check`
/// is exact on it, reads it with a progress bar only where stderr is a terminal, and keeps to
/// the limits given.
#[test]
fn a_large_recording_with_stacks_streams_within_its_limits() {
    let dir = std::env::temp_dir().join(format!("gpumem-large-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("large.pickle");
    let gpumem = env!("CARGO_BIN_EXE_gpumem");
    let size = generate_snapshot(20_000, 160, &[], &file);
    assert!(
        size > 64 << 20,
        "{size} bytes: past the progress bar's threshold"
    );

    let rec = read_recording(&file).expect("readable");
    assert_eq!(rec.device_traces[0].len(), 20_000);
    let stacks = &rec.event_stacks[0];
    assert!(stacks.iter().all(|&s| rec.frames.frames_of(s).len() == 160));
    assert!(
        rec.frames.stack_count() <= 2001,
        "at most the generator's 2000, interned"
    );
    let first = rec.frames.get(rec.frames.frames_of(stacks[0])[0]);
    assert!(
        rec.frames.str(first.filename).ends_with(".py")
            || rec.frames.str(first.filename).contains("lib")
    );

    let run = |args: &[&str]| {
        Command::new(gpumem)
            .arg("replay")
            .args(args)
            .arg(&file)
            .output()
            .expect("gpumem runs")
    };
    let checked = run(&["--check"]);
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert!(checked.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&checked.stdout).contains("20000 events match"));
    assert!(
        !stderr.contains("reading"),
        "no bar off a terminal: {stderr}"
    );
    // On a terminal (script(1) gives it one), the bar shows while reading.
    let command = format!("{gpumem} replay --check {}", file.display());
    let tty = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("TERM", "xterm")
        .output()
        .expect("script runs");
    let transcript = String::from_utf8_lossy(&tty.stdout);
    assert!(tty.status.success(), "{transcript}");
    assert!(
        transcript.contains("reading"),
        "a bar on a terminal: {transcript}"
    );
    // Limits: a clear refusal, saying which to raise.
    let small = run(&["--max-memory-bytes", "4MiB"]);
    let stderr = String::from_utf8_lossy(&small.stderr);
    assert!(!small.status.success());
    assert!(
        stderr.contains("memory budget of 4194304 bytes") && stderr.contains("--max-memory-bytes"),
        "{stderr}"
    );
    let short = run(&["--max-input-bytes", "1MiB"]);
    assert!(String::from_utf8_lossy(&short.stderr).contains("exceeds 1048576 bytes"));
    // Truncated or corrupted in the middle: a fast error with the byte offset.
    let bytes = std::fs::read(&file).expect("readable");
    let err = parse_recording(&bytes[..bytes.len() / 2]).expect_err("truncated");
    assert!(
        matches!(&err, TraceError::Pickle { offset, message } if *offset > 0 && message.contains("truncated")),
        "{err}"
    );
    let mut corrupt = bytes.clone();
    let at = corrupt.len() / 3;
    corrupt[at..at + 64].fill(b'c');
    let err = parse_recording(&corrupt).expect_err("corrupt");
    assert!(
        matches!(&err, TraceError::Pickle { offset, .. } if (*offset as usize).abs_diff(at) < 4096),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `available`: the what-if runs within the memory the job had, the rest of the device held
/// by others. Enough for the recording's own peak: no OOM; half of it: OOMs.
#[test]
fn what_if_runs_within_the_available_memory() {
    let rec = read_recording(&data("opt125m_zo_fedtrain_complete.noframes.json.gz")).expect("data");
    let what_if = |available: Option<u64>| {
        let expandable = WhatIf {
            config: Some(AllocatorConfig::parse("expandable_segments:True").expect("valid")),
            available,
            ..WhatIf::default()
        };
        common::what_if(&rec, Setup::default(), expandable).expect("replays")
    };
    let free = what_if(None);
    assert_eq!(free.ooms, 0);
    let enough = what_if(Some(free.peak_reserved + (64 << 20)));
    assert_eq!(enough.ooms, 0, "the recording's own peak fits");
    assert_eq!(
        enough.capacity, free.capacity,
        "the device is the same size"
    );
    let half = what_if(Some(free.peak_reserved / 2));
    assert!(half.ooms > 0, "half the peak cannot hold it");
    assert!(half.peak_reserved <= free.peak_reserved / 2);
    // The command line says so, and its JSON carries it.
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["replay", "--json", "--available"])
        .arg((free.peak_reserved / 2).to_string())
        .arg(data("opt125m_zo_fedtrain_complete.noframes.json.gz"))
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let row = &json[0]["results"][0];
    assert_eq!(row["available"], free.peak_reserved / 2);
    assert!(row["ooms"].as_u64().is_some_and(|o| o > 0), "{row}");
}

/// `replay --plot` in a real browser: labelled axes with several ticks, the file's name as
/// the title, a legend entry per run below the plotting area (clear of the data), a band per
/// run, no console errors.
#[test]
fn the_plot_opens_in_chromium_with_labelled_axes_and_a_legend_clear_of_the_data() {
    let dir = std::env::temp_dir().join(format!("gpumem-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let svg = dir.join("plot.svg");
    let trace = data("cs336_lm_forward_bf16.noframes.json.gz");
    succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["replay", "--config", "expandable_segments:True", "--plot"])
            .arg(&svg)
            .arg(&trace),
    );
    let browser = crate::browser::Browser::start();
    browser.open(&format!("file://{}", svg.display()));
    let seen = browser.eval(
        "const plot = document.getElementById('plot').getBBox(); \
         const legend = Array.from(document.querySelectorAll('.legend')).map(g => g.getBBox()); \
         return {title: document.getElementById('title').textContent, \
                 xlabel: document.getElementById('xlabel').textContent, \
                 ylabel: document.getElementById('ylabel').textContent, \
                 yticks: Array.from(document.querySelectorAll('.ytick text')).map(t => t.textContent), \
                 xticks: document.querySelectorAll('.xtick').length, \
                 bands: document.querySelectorAll('.band').length, \
                 legend: legend.length, \
                 clear: legend.every(b => b.y >= plot.y + plot.height + 20)};",
    );
    let name = trace.file_name().and_then(|n| n.to_str()).expect("a name");
    assert_eq!(seen["title"], name, "{seen}");
    // Time where the recording has it.
    let rec = read_recording(&trace).expect("data");
    let timed = rec
        .device_traces
        .iter()
        .flatten()
        .all(|e| e.time_us.is_some());
    assert_eq!(
        seen["xlabel"],
        if timed { "time (s)" } else { "event" },
        "{seen}"
    );
    assert_eq!(seen["ylabel"], "bytes", "{seen}");
    let yticks = seen["yticks"].as_array().expect("ticks");
    assert!(yticks.len() >= 4, "{seen}");
    assert!(
        yticks
            .iter()
            .all(|t| t.as_str().is_some_and(|t| t.ends_with("B"))),
        "binary units: {seen}"
    );
    assert!(seen["xticks"].as_u64().is_some_and(|n| n >= 4), "{seen}");
    assert_eq!(seen["bands"], 2, "{seen}");
    assert_eq!(seen["legend"], 2, "{seen}");
    assert_eq!(seen["clear"], true, "the legend is below the plot: {seen}");
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    browser.screenshot("replay-plot.png");
    std::fs::remove_dir_all(&dir).ok();
}

/// The one step-by-step replay: on its own allocator it goes back by starting again and lands
/// where a fresh cursor does; on the caller's it goes forward only, says so going back, and
/// hands the allocator back holding nothing.
#[test]
fn a_cursor_goes_back_on_its_own_allocator_and_only_forward_on_the_callers() {
    use gpumem::device::{SimConfig, SimDevice};
    use gpumem::replay::{Cursor, ReplayError};

    let rec = read_recording(&data("opt125m_zo_fedtrain_complete.noframes.json.gz")).expect("read");
    let session = common::session(&rec, Setup::default()).expect("a session");
    let mut cursor = session
        .cursor(&Mode::WhatIf(WhatIf::default()))
        .expect("cursor");
    cursor.seek(2_000).expect("forward");
    let reserved_at = |c: &Cursor<'_>| c.allocator().memory_stats()["reserved_bytes.all.current"];
    let at_2000 = reserved_at(&cursor);
    cursor.seek(5_000).expect("forward");
    cursor.seek(2_000).expect("back, by starting again");
    assert!((2_001..2_010).contains(&cursor.position()));
    assert_eq!(reserved_at(&cursor), at_2000);

    let alloc = gpumem::CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(64 << 30)),
        AllocatorConfig::default(),
    );
    let mut on = Cursor::on(&rec, 0, alloc).expect("on the caller's allocator");
    on.advance_to(3_000).expect("forward");
    // An operation's events go together (a malloc and the segment it obtained).
    let at = on.position();
    assert!((3_000..3_010).contains(&at), "{at}");
    // Anywhere from the last target to where the operation ended is where it stands.
    for again in [3_000, at] {
        on.advance_to(again).expect("no move");
        assert_eq!(on.position(), at);
    }
    match on.advance_to(1_000) {
        Err(ReplayError::Rewind { position, target }) => {
            assert_eq!((position, target), (at, 1_000))
        }
        other => panic!("going back on the caller's allocator: {:?}", other.err()),
    }
    on.advance_to(on.len()).expect("to the end");
    let back = on.finish().expect("finished");
    assert_eq!(back.memory_stats()["reserved_bytes.all.current"], 0);
}

/// A JSON number of 2^63 or more fits 64 bits unsigned: the refusal says what is wrong with
/// it (outside the signed range the schema's ints have), not that it is wider than 64 bits.
#[test]
fn an_int_past_the_signed_64_bit_range_is_named_so() {
    let text = r#"{"segments": [{"device": 0, "address": 0, "total_size": 9223372036854775808,
        "stream": 0, "segment_type": "large", "allocated_size": 0, "active_size": 0,
        "requested_size": 0, "blocks": []}], "device_traces": [[]]}"#;
    let error = parse_recording(text.as_bytes()).expect_err("refused");
    let message = error.to_string();
    assert!(
        message.contains("an int outside the signed 64-bit range"),
        "{message}"
    );
    assert!(message.contains("total_size"), "{message}");
}

/// Issue 54, item 7: on a recording with an OOM, a what-if without `--available` replays
/// within the memory the job had there (as `explain` reads it), so the recorded
/// configuration's row shows the recorded OOM, and the table says so; `--available` (the
/// whole device here) overrides it.
#[test]
fn what_ifs_of_a_recording_with_an_oom_run_within_the_jobs_memory() {
    let Some(dir) = shared_traces("what_ifs_of_a_recording_with_an_oom_run_within_the_jobs_memory")
    else {
        return;
    };
    let trace = dir.join("dit_discrete_diffusion_train_oom_complete.pickle");
    let recording = read_recording(&trace).expect("readable");
    let explained =
        crate::common::explain(&recording, gpumem::explain::At::FirstOom, Setup::default())
            .expect("explains");
    let had = explained.available.expect("the job's memory at its OOM");
    let run = |extra: &[&str]| {
        let out = succeeded(
            Command::new(env!("CARGO_BIN_EXE_gpumem"))
                .args(["replay", "--json", "--config", "expandable_segments:True"])
                .args(extra)
                .arg(&trace),
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v[0]["results"].as_array().expect("rows").clone()
    };
    let rows = run(&[]);
    let recorded = &rows[0];
    assert_eq!(recorded["config"], "(default)");
    assert!(recorded["ooms"].as_u64() >= Some(1), "{recorded}");
    assert_eq!(recorded["available"], had);
    assert_eq!(
        recorded["job_memory"]["event"], explained.request.event,
        "{recorded}"
    );
    let whole = explained.total.to_string();
    let free = run(&["--available", &whole]);
    assert_eq!(
        free[0]["ooms"], 0,
        "the whole device holds the recorded run"
    );
    assert!(free[0].get("job_memory").is_none());
    let text = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["replay", "--config", "expandable_segments:True"])
            .arg(&trace),
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("what the job had at its out-of-memory error"),
        "{text}"
    );
}

/// Issue 54, item 7, on a recording made here (no shared traces needed): a job that ran out
/// of memory on a 64 MiB device whose recording does not name the device. A what-if
/// replays within what the job had at the OOM (reserved plus the driver's free), so the
/// recorded configuration's OOM shows, not on the 80 GiB assumed; `available` overrides.
#[test]
fn a_what_if_takes_the_jobs_memory_at_its_oom() {
    use common::MIB;
    use gpumem::replay::JobMemory;

    let mut a = common::allocator(64 * MIB, "");
    let blocks: Vec<_> = (0..3)
        .map(|_| common::malloc(&mut a, 20 * MIB, common::S0))
        .collect();
    assert!(
        a.malloc(20 * MIB, common::S0).is_err(),
        "the device is full"
    );
    let mut doc = serde_json::to_value(a.snapshot()).expect("serialises");
    doc.as_object_mut()
        .expect("a snapshot")
        .remove("simulated_device");
    let rec = parse_recording(doc.to_string().as_bytes()).expect("reads back");
    let oom = rec.device_traces[0]
        .iter()
        .position(|e| e.action == gpumem::allocator::TraceAction::Oom)
        .expect("an OOM");
    let session = common::session(&rec, Setup::default()).expect("a session");
    let memory = session.job_memory().expect("replays").expect("an OOM");
    let free = rec.device_traces[0][oom].addr;
    assert_eq!(
        memory,
        JobMemory {
            event: oom,
            reserved: 60 * MIB,
            device_free: free
        }
    );
    let explained =
        gpumem::explain::explain(&session, gpumem::explain::At::FirstOom).expect("explains");
    assert_eq!(
        explained.available,
        Some(memory.bytes()),
        "as explain reads it"
    );
    let within = session
        .replay(&Mode::WhatIf(WhatIf::default()), 0, &mut |_, _| {})
        .expect("replays");
    assert_eq!((within.ooms, within.job_memory), (1, Some(memory)));
    assert_eq!(within.capacity, gpumem::replay::DEFAULT_CAPACITY);
    let whole = WhatIf::default().within(Some(within.capacity));
    let free_run = session
        .replay(&Mode::WhatIf(whole), 0, &mut |_, _| {})
        .expect("replays");
    assert_eq!((free_run.ooms, free_run.job_memory), (0, None));
    // The view's what-if timeline runs within it too, and its legend says so.
    let view = gpumem::view::recording::RecordingView::new(
        std::sync::Arc::new(rec),
        "oom".into(),
        Setup::default(),
    );
    let svg = view
        .timeline(0, Some("expandable_segments:True"))
        .expect("draws");
    let legend = format!(
        "expandable_segments:True, within the {} the job had at its OOM",
        gpumem::allocator::size::format_size(memory.bytes())
    );
    assert!(svg.contains(&legend), "{legend}: {svg}");
    drop(blocks);
}
