//! The configuration keys of PyTorch 2.11 to 2.15 that change the allocator's decisions:
//! each key's effect on a simulated GPU (the retry chain's free-memory callbacks are in
//! `ipc.rs`).

use gpumem::DevicePtr;
use gpumem::allocator::{AllocError, TraceAction};

use crate::common::*;

fn segment_sizes(a: &gpumem::CachingAllocator<gpumem::SimDevice>) -> Vec<u64> {
    a.trace()
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::SegmentAlloc | TraceAction::SegmentMap
            )
        })
        .map(|e| e.size)
        .collect()
}

#[test]
fn large_segment_size_sizes_the_segments_of_mid_sized_requests() {
    let mut a = allocator(GIB, "large_segment_size_mb:12");
    malloc(&mut a, 3 * MIB, S0);
    // 1–10 MiB requests get the configured segment, smaller ones 2 MiB, larger their own.
    malloc(&mut a, 512, S0);
    malloc(&mut a, 11 * MIB, S0);
    assert_eq!(segment_sizes(&a), [12 * MIB, 2 * MIB, 12 * MIB]);
    // The default is 20 MiB.
    let mut a = allocator(GIB, "");
    malloc(&mut a, 3 * MIB, S0);
    assert_eq!(segment_sizes(&a), [20 * MIB]);
}

#[test]
fn large_segment_size_is_the_large_pools_expandable_page() {
    let mut a = allocator(GIB, "expandable_segments:True,large_segment_size_mb:12");
    malloc(&mut a, 3 * MIB, S0);
    // One page of 12 MiB is mapped for the 3 MiB request.
    assert_eq!(segment_sizes(&a), [12 * MIB]);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 12 * MIB as i64);
}

#[test]
fn max_non_split_rounding_moves_the_oversize_slack() {
    // A cached 150 MiB oversize block; a 120 MiB oversize request wastes 30 MiB on it.
    for (conf, reused) in [
        ("max_split_size_mb:100", false),
        ("max_split_size_mb:100,max_non_split_rounding_mb:40", true),
    ] {
        let mut a = allocator(GIB, conf);
        let p = malloc(&mut a, 150 * MIB, S0);
        free(&mut a, p);
        let q = malloc(&mut a, 120 * MIB, S0);
        assert_eq!(q == p, reused, "{conf}");
        let segments = if reused { 1 } else { 2 };
        assert_eq!(segment_sizes(&a).len(), segments, "{conf}");
    }
}

#[test]
fn throw_on_cudamalloc_oom_fails_at_the_fraction_without_the_retry_chain() {
    // A 100 MiB segment is cached; the fraction allows 200 MiB; a 150 MiB request needs
    // that segment released first.
    let run = |conf: &str| {
        let mut a = allocator(GIB, conf);
        let p = malloc(&mut a, 100 * MIB, S0);
        free(&mut a, p);
        let result = a.malloc(150 * MIB, S0);
        check(&a);
        (a, result)
    };
    let fraction = "per_process_memory_fraction:0.1953125";
    let (a, result) = run(fraction);
    assert!(
        result.is_ok(),
        "the retry chain releases the cache: {result:?}"
    );
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_oom_rejections"), 0);

    let (a, result) = run(&format!("{fraction},throw_on_cudamalloc_oom:True"));
    let Err(AllocError::OutOfMemory(oom)) = result else {
        panic!("refused at the fraction: {result:?}");
    };
    assert!(oom.rejected, "{oom}");
    assert!(oom.to_string().contains("throw_on_cudamalloc_oom"), "{oom}");
    assert_eq!(stat(&a, "num_oom_rejections"), 1);
    assert_eq!(stat(&a, "num_ooms"), 0, "not counted as an OOM");
    assert_eq!(stat(&a, "num_alloc_retries"), 0, "no flush was tried");
    assert_eq!(
        stat(&a, "reserved_bytes.all.current"),
        100 * MIB as i64,
        "cache kept"
    );
    assert!(!a.trace().iter().any(|e| e.action == TraceAction::Oom));

    // Without a fraction there is no limit to refuse at.
    let (a, result) = run("throw_on_cudamalloc_oom:True");
    assert!(result.is_ok());
    assert_eq!(stat(&a, "num_oom_rejections"), 0);
}

#[test]
fn per_process_memory_fraction_installs_the_limit() {
    let a = allocator(GIB, "per_process_memory_fraction:0.25");
    assert_eq!(a.allowed_memory_maximum(), Some(GIB / 4));
    let a = allocator(GIB, "per_process_memory_fraction:1.0");
    assert_eq!(a.allowed_memory_maximum(), None, "1.0 sets no limit");
    let mut a = allocator(GIB, "");
    a.set_allocator_settings("per_process_memory_fraction:0.5")
        .expect("valid");
    assert_eq!(
        a.allowed_memory_maximum(),
        Some(GIB / 2),
        "applied at run time"
    );
    let err = a.malloc(600 * MIB, S0).expect_err("past the limit");
    assert!(err.is_out_of_memory(), "{err}");
    a.set_allocator_settings("per_process_memory_fraction:1.0")
        .expect("valid");
    assert_eq!(a.allowed_memory_maximum(), None, "and 1.0 lifts it");
    malloc(&mut a, 600 * MIB, S0);
}

#[test]
fn a_small_expandable_reserve_fails_larger_requests_as_out_of_memory() {
    let mut a = allocator(
        GIB,
        "expandable_segments:True,expandable_segments_reserve:0.25",
    );
    malloc(&mut a, 200 * MIB, S0);
    let err = a
        .malloc(300 * MIB, S1)
        .expect_err("a 256 MiB reserve cannot hold it");
    assert!(err.is_out_of_memory(), "{err}");
    check(&a);
    // The default reserve (9/8 of the device) holds it.
    let mut a = allocator(GIB, "expandable_segments:True");
    malloc(&mut a, 300 * MIB, S1);
}

/// A training workload's snapshot under `conf`, as JSON.
fn recorded_under(conf: &str) -> serde_json::Value {
    recorded_on(80 * GIB, conf)
}

/// [`recorded_under`] on a device of `capacity` bytes.
fn recorded_on(capacity: u64, conf: &str) -> serde_json::Value {
    use gpumem::demo::workload::{TrainingWorkload, finish_communication};
    let mut alloc = allocator(capacity, conf);
    alloc.record_history(Some(1 << 20));
    // Requests of each segment size class: 2 MiB, `large_segment_size`, their own.
    let held: Vec<DevicePtr> = [3 * MIB, 700 << 10, 15 * MIB, 5 * MIB]
        .into_iter()
        .map(|size| malloc(&mut alloc, size, S0))
        .collect();
    free(&mut alloc, held[0]);
    TrainingWorkload {
        steps: 6,
        ..TrainingWorkload::default()
    }
    .run(&mut alloc, finish_communication)
    .expect("runs");
    serde_json::to_value(alloc.snapshot()).expect("serialises")
}

#[test]
fn recorded_settings_strings_are_applied_by_replay() {
    for conf in [
        "large_segment_size_mb:12",
        "large_segment_size_mb:12,expandable_segments:True",
        "large_segment_size_mb:32,max_split_size_mb:40,max_non_split_rounding_mb:64",
    ] {
        let mut json = recorded_under(conf);
        let settings = &json["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"];
        assert_eq!(settings, conf, "the snapshot keeps the string");
        let r = check_replay(&json);
        assert!(r.divergence.is_none(), "{conf}: {:?}", r.divergence);
        assert!(
            r.compared.total() > 0 && r.notes.is_empty(),
            "{conf}: {:?}",
            r.notes
        );
        // Without the string the segment (or page) sizes differ at once.
        json["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = "".into();
        let r = check_replay(&json);
        assert!(
            r.divergence.is_some(),
            "{conf}: the string was what made it exact"
        );
    }
}

#[test]
fn an_unknown_key_in_the_recorded_settings_is_reported_not_fatal() {
    let mut json = recorded_under("large_segment_size_mb:12");
    json["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] =
        "some_key_from_2_16:7,large_segment_size_mb:12,expandable_segments_reserve:lots".into();
    let r = check_replay(&json);
    assert!(r.divergence.is_none(), "{:?}", r.divergence);
    assert_eq!(r.notes.len(), 2, "{:?}", r.notes);
    assert!(r.notes[0].contains("some_key_from_2_16"), "{:?}", r.notes);
    assert!(r.notes[1].contains("`lots`"), "{:?}", r.notes);
}

#[test]
fn a_per_class_reserve_is_replayed_with_the_default_and_said_so() {
    // Recorded on a device smaller than replay's default, so that its second reservation
    // sits inside the replay's first: the spacing that would measure the device.
    let mut json = recorded_on(24 * GIB, "expandable_segments:True");
    json.as_object_mut()
        .expect("a dict")
        .remove("simulated_device");
    let r = check_replay(&json);
    assert!(
        r.capacity_inferred,
        "without a reserve key the device is inferred"
    );
    // The largest device with the same reservation: 24 GiB up to a page's worth more.
    assert!(
        (24 * GIB..24 * GIB + 20 * MIB).contains(&r.capacity),
        "{}",
        r.capacity
    );
    json["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] =
        "expandable_segments:True,expandable_segments_reserve_by_class:[serve:0.5]".into();
    // A reserve key makes the reservations no measure of the device.
    let r = check_replay(&json);
    assert!(!r.capacity_inferred);
    let notes = r.notes.join("\n");
    assert!(notes.contains("reserve_by_class is set"), "{notes}");
    assert!(notes.contains("not inferred"), "{notes}");
}

#[test]
fn the_command_line_takes_2_15_keys_and_refuses_them_for_older_releases() {
    let dir = std::env::temp_dir().join(format!("gpumem-keys-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("recorded.json");
    std::fs::write(&file, recorded_under("").to_string()).expect("write");
    let gpumem = env!("CARGO_BIN_EXE_gpumem");
    let run = |args: &[&str]| {
        std::process::Command::new(gpumem)
            .arg("replay")
            .arg(&file)
            .args(args)
            .output()
            .expect("runs")
    };
    // The recipe's key, pasted as is: a what-if row of its own.
    let out = run(&["--config", "large_segment_size_mb:12", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = json[0]["results"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["config"], "large_segment_size_mb:12");
    // A release before 2.11 has no such key; a made-up key has none anywhere.
    for (args, needle) in [
        (
            &["--config", "large_segment_size_mb:12", "--pytorch", "2.10"][..],
            "not a key of PyTorch 2.10",
        ),
        (
            &["--config", "expandable_segments_page_size:4194304"][..],
            "unrecognized option `expandable_segments_page_size`",
        ),
        (&["--config", "max_split_size_mb:15"][..], "at least 20"),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
