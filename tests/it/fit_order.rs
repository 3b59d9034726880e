//! The best-fit order among free blocks of equal size, under each PyTorch release's order,
//! on a simulated device that places segments out of creation order (with monotonic
//! addresses the orders coincide and these tests would prove nothing); and recordings made
//! under each order, which `replay --check` reproduces with no flag, naming the order it
//! found (Note [Finding the order]).

use std::process::Command;

use gpumem::allocator::{AllocError, FitOrder, MAX_ADDRESS};
use gpumem::device::{SimConfig, SimDevice};
use gpumem::recording::parse_recording;
use gpumem::replay::Setup;
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr};

use crate::common::{GIB, MIB, S0, check, free, malloc, succeeded, temp_dir};

fn allocator(order: FitOrder) -> CachingAllocator<SimDevice> {
    let device = SimDevice::new(SimConfig::with_capacity(16 * GIB));
    let mut a = CachingAllocator::with_fit_order(device, AllocatorConfig::default(), order);
    a.record_history(Some(10_000));
    a
}

fn base(a: &CachingAllocator<SimDevice>) -> u64 {
    a.device().config().base_address
}

/// Two whole 20 MiB segments, the first obtained at a high address, the second at a low
/// one, both cached: which one a 20 MiB request takes.
fn older_or_lower(order: FitOrder) -> (DevicePtr, DevicePtr, DevicePtr) {
    let mut a = allocator(order);
    let b = base(&a);
    a.device_mut().hint_addresses([b + 8 * GIB, b + GIB]);
    let older = malloc(&mut a, 20 * MIB, S0);
    let newer = malloc(&mut a, 20 * MIB, S0);
    assert!(older.0 > newer.0, "the device placed them as hinted");
    free(&mut a, older);
    free(&mut a, newer);
    (older, newer, malloc(&mut a, 20 * MIB, S0))
}

#[test]
fn since_2_12_the_older_segment_wins_over_the_lower_address() {
    let (older, newer, got) = older_or_lower(FitOrder::Address);
    assert_eq!(got, newer, "2.11: the lower address");
    for order in [FitOrder::BlockCounter, FitOrder::Counter] {
        let (older, _, got) = older_or_lower(order);
        assert_eq!(got, older, "{order:?}: the older segment");
    }
    assert_ne!(older, newer);
}

/// One 20 MiB segment cut into five 4 MiB pieces; the second piece and the untouched tail
/// are free: (the block a 4 MiB request takes, the second piece, the tail).
fn piece_or_tail(order: FitOrder) -> (DevicePtr, DevicePtr, DevicePtr) {
    let mut a = allocator(order);
    let pieces: Vec<DevicePtr> = (0..4).map(|_| malloc(&mut a, 4 * MIB, S0)).collect();
    free(&mut a, pieces[1]);
    let tail = DevicePtr(pieces[3].0 + 4 * MIB);
    (malloc(&mut a, 4 * MIB, S0), pieces[1], tail)
}

#[test]
fn in_2_12_a_split_piece_is_newer_than_the_tail_it_came_from() {
    // 2.13+: one segment, one counter: the lower address. 2.12: the piece handed out (and
    // freed) took a counter after the tail's.
    for order in [FitOrder::Address, FitOrder::Counter] {
        let (got, piece, _) = piece_or_tail(order);
        assert_eq!(got, piece, "{order:?}: the lower address");
    }
    let (got, _, tail) = piece_or_tail(FitOrder::BlockCounter);
    assert_eq!(got, tail, "2.12: the tail");
}

#[test]
fn counters_are_renumbered_in_order_before_they_wrap() {
    for order in [FitOrder::BlockCounter, FitOrder::Counter] {
        let mut a = allocator(order);
        a.set_next_counter(order.counter_limit() - 4);
        let b = base(&a);
        // Segments at descending addresses, so that only their counters order them.
        a.device_mut()
            .hint_addresses((0..8).map(|i| b + (16 - i) * GIB));
        let ptrs: Vec<DevicePtr> = (0..8).map(|_| malloc(&mut a, 20 * MIB, S0)).collect();
        for &p in ptrs.iter().rev() {
            free(&mut a, p);
        }
        // The oldest first, though they passed u32::MAX on the way.
        for &want in &ptrs {
            assert_eq!(malloc(&mut a, 20 * MIB, S0), want, "{order:?}");
        }
        check(&a);
    }
}

#[test]
fn a_segment_beyond_the_ordered_addresses_is_refused_and_given_back() {
    let config = SimConfig {
        base_address: MAX_ADDRESS - 32 * MIB,
        address_space: GIB,
        ..SimConfig::with_capacity(GIB)
    };
    let mut a = CachingAllocator::new(SimDevice::new(config), AllocatorConfig::default());
    let first = a.malloc(20 * MIB, S0).expect("below the bound");
    for _ in 0..3 {
        match a.malloc(30 * MIB, S0) {
            Err(AllocError::BeyondAddressBound { ptr, size }) => {
                assert!(ptr + size > MAX_ADDRESS);
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        check(&a);
        assert_eq!(
            a.device().stats().used_bytes,
            20 * MIB,
            "the refused segment given back"
        );
    }
    a.free(first).expect("live");
    a.empty_cache().expect("empty");
    assert_eq!(a.device().stats().used_bytes, 0, "everything given back");
}

/// A recording (snapshot JSON) of gpumem's allocator under `order`: `before` runs before
/// history is recorded (its segments are the recording's start state), `program` after.
fn recording(
    order: FitOrder,
    before: impl FnOnce(&mut CachingAllocator<SimDevice>) -> Vec<DevicePtr>,
    program: impl FnOnce(&mut CachingAllocator<SimDevice>, Vec<DevicePtr>),
) -> Vec<u8> {
    let mut a = allocator(order);
    a.record_history(None);
    let live = before(&mut a);
    a.record_history(Some(10_000));
    program(&mut a, live);
    serde_json::to_vec(&a.snapshot()).expect("serialises")
}

/// `gpumem replay --check --json` of a recording: device 0's result, and whether it passed.
fn check_cli(name: &str, json: &[u8], flags: &[&str]) -> (serde_json::Value, bool) {
    let dir = temp_dir(name);
    let path = dir.join("snapshot.json");
    std::fs::write(&path, json).expect("writes");
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["replay", "--check", "--json"])
        .args(flags)
        .arg(&path)
        .output()
        .expect("runs");
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (value[0].clone(), out.status.success())
}

/// What a recording's job does once history is on.
type Program = fn(&mut CachingAllocator<SimDevice>, Vec<DevicePtr>);

/// Two cached 20 MiB segments, the older at the higher address, then a 20 MiB request.
fn two_segments(a: &mut CachingAllocator<SimDevice>, _: Vec<DevicePtr>) {
    let b = base(a);
    a.device_mut().hint_addresses([b + 8 * GIB, b + GIB]);
    let older = malloc(a, 20 * MIB, S0);
    let newer = malloc(a, 20 * MIB, S0);
    free(a, older);
    free(a, newer);
    malloc(a, 20 * MIB, S0);
}

#[test]
fn replay_finds_the_order_that_made_a_recording() {
    let nothing = |_: &mut CachingAllocator<SimDevice>| Vec::new();
    let cases: [(&str, FitOrder, Program); 4] = [
        ("counter", FitOrder::Counter, two_segments),
        ("address", FitOrder::Address, two_segments),
        ("block_counter", FitOrder::BlockCounter, |a, _| {
            let pieces: Vec<DevicePtr> = (0..4).map(|_| malloc(a, 4 * MIB, S0)).collect();
            free(a, pieces[1]);
            malloc(a, 4 * MIB, S0);
        }),
        // Monotonic addresses: the orders coincide.
        ("both", FitOrder::Counter, |a, _| {
            let p: Vec<DevicePtr> = (0..3).map(|_| malloc(a, 20 * MIB, S0)).collect();
            p.into_iter().for_each(|p| free(a, p));
            malloc(a, 20 * MIB, S0);
        }),
    ];
    for (want, order, program) in cases {
        let json = recording(order, nothing, program);
        let (result, passed) = check_cli(want, &json, &[]);
        assert!(passed, "{want}: {result}");
        assert_eq!(result["ordering"], want, "{result}");
        assert_eq!(result["ordering_source"], "found");
        assert!(result["divergence"].is_null());
        let counter_order = if order == FitOrder::Address {
            serde_json::Value::Null
        } else {
            "known".into()
        };
        if want != "both" {
            assert_eq!(result["counter_order"], counter_order, "{want}");
        }
        // The library says the same, and a flag naming another release's order diverges.
        let rec = parse_recording(&json).expect("reads back");
        let report = crate::common::replay_check(&rec, Setup::default()).expect("replays");
        assert_eq!(report.ordering.ordering, want);
        if want != "both" {
            let other = if order == FitOrder::Address {
                "2.15"
            } else {
                "2.11"
            };
            let (flagged, passed) = check_cli(want, &json, &["--pytorch", other]);
            assert!(!passed, "{want} under --pytorch {other}: {flagged}");
            assert_eq!(flagged["ordering_source"], "flag");
        }
    }
}

/// Segments obtained before the recording began, listed by address in its start state: the
/// recording's own choices show the order they were obtained in.
#[test]
fn the_start_segments_order_is_derived_from_the_recordings_choices() {
    for (name, extra) in [("derived", false), ("partly_guessed", true)] {
        let json = recording(
            FitOrder::Counter,
            |a| {
                let b = base(a);
                // Obtained high, middle, low; a 40 MiB one (never tied with them) maybe.
                a.device_mut().hint_addresses([
                    b + 12 * GIB,
                    b + 8 * GIB,
                    b + 4 * GIB,
                    b + 16 * GIB,
                ]);
                let mut live: Vec<DevicePtr> = (0..3).map(|_| malloc(a, 20 * MIB, S0)).collect();
                if extra {
                    live.push(malloc(a, 40 * MIB, S0));
                }
                a.device_mut().clear_address_hints();
                live
            },
            |a, live| {
                // Cached in address order; each request takes the oldest left.
                for &p in live[..3].iter().rev() {
                    free(a, p);
                }
                for _ in 0..3 {
                    malloc(a, 20 * MIB, S0);
                }
            },
        );
        let (result, passed) = check_cli(name, &json, &[]);
        assert!(passed, "{name}: {result}");
        assert_eq!(result["ordering"], "counter", "{result}");
        assert_eq!(result["counter_order"], name, "{result}");
        let guessed = result["guessed_segments"].as_array().expect("a list").len();
        assert_eq!(guessed, usize::from(extra), "{result}");
        let (_, passed) = check_cli(name, &json, &["--pytorch", "2.11"]);
        assert!(!passed, "the address order cannot reproduce it");
    }
}

#[test]
fn a_recording_no_counter_order_explains_says_why() {
    // Made in the address order from a start state of two segments: a segment the trace
    // creates, lower, is taken over the older ones, which no order of counters explains.
    let json = recording(
        FitOrder::Address,
        |a| {
            let b = base(a);
            a.device_mut().hint_addresses([b + 8 * GIB, b + 9 * GIB]);
            vec![malloc(a, 20 * MIB, S0), malloc(a, 20 * MIB, S0)]
        },
        |a, live| {
            let b = base(a);
            a.device_mut().hint_addresses([b + GIB]);
            let newer = malloc(a, 20 * MIB, S0);
            live.into_iter().for_each(|p| free(a, p));
            free(a, newer);
            malloc(a, 20 * MIB, S0);
        },
    );
    let (result, passed) = check_cli("contradiction", &json, &["--pytorch", "2.15"]);
    assert!(!passed);
    assert_eq!(result["ordering"], "counter");
    let why = result["ordering_contradiction"].as_str().expect("a reason");
    assert!(why.contains("segment the trace created"), "{why}");
    let (result, passed) = check_cli("contradiction", &json, &[]);
    assert!(passed, "{result}");
    assert_eq!(result["ordering"], "address");
}

#[test]
fn every_command_takes_a_known_release_and_refuses_others() {
    let dir = temp_dir("pytorch-flag");
    let path = dir.join("snapshot.json");
    let json = recording(FitOrder::Counter, |_| Vec::new(), two_segments);
    std::fs::write(&path, json).expect("writes");
    let path = path.to_str().expect("utf-8");
    let bin = env!("CARGO_BIN_EXE_gpumem");
    for command in [
        vec!["replay", "--check", path],
        vec!["replay", path],
        vec!["explain", "--at", "peak", path],
        vec!["plan", path],
        vec!["view", path],
        vec![
            "simulate",
            "--steps",
            "1",
            "--layers",
            "1",
            "--capacity-gib",
            "1",
        ],
    ] {
        let bad = Command::new(bin)
            .args(&command)
            .args(["--pytorch", "2.16"])
            .output()
            .expect("runs");
        assert_eq!(bad.status.code(), Some(2), "{command:?}");
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(stderr.contains("2.0 to 2.15"), "{command:?}: {stderr}");
    }
    let ok = succeeded(Command::new(bin).args(["replay", "--check", path, "--pytorch", "2.13"]));
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(text.contains("as --pytorch asked"), "{text}");
}

/// The segments an operation released, in order.
fn released(a: &mut CachingAllocator<SimDevice>) -> Vec<u64> {
    a.take_trace()
        .into_iter()
        .filter(|e| e.action == gpumem::allocator::TraceAction::SegmentFree)
        .map(|e| e.addr)
        .collect()
}

/// An allocator under `order` and `conf` on `capacity` bytes with two cached whole segments
/// of `size` bytes, the older at the higher address; (older, newer).
fn two_cached(
    order: FitOrder,
    conf: &str,
    capacity: u64,
    size: u64,
) -> (CachingAllocator<SimDevice>, u64, u64) {
    let device = SimDevice::new(SimConfig::with_capacity(capacity));
    let config = AllocatorConfig::parse(conf).expect("valid");
    let mut a = CachingAllocator::with_fit_order(device, config, order);
    a.record_history(Some(10_000));
    let b = base(&a);
    a.device_mut().hint_addresses([b + 8 * GIB, b + GIB]);
    let older = malloc(&mut a, size, S0);
    let newer = malloc(&mut a, size, S0);
    free(&mut a, older);
    free(&mut a, newer);
    a.take_trace();
    (a, older.0, newer.0)
}

#[test]
fn releases_go_through_the_pools_in_their_order() {
    for order in [FitOrder::Address, FitOrder::Counter] {
        let up = |older, newer| match order {
            FitOrder::Address => vec![newer, older],
            _ => vec![older, newer],
        };
        // A flush (`release_blocks`) goes up the order.
        let (mut a, older, newer) = two_cached(order, "", 16 * GIB, 20 * MIB);
        a.empty_cache().expect("empties");
        assert_eq!(released(&mut a), up(older, newer), "{order:?}: empty_cache");
        // The release of oversize blocks walks down it from the largest below the request.
        let (mut a, older, newer) = two_cached(order, "max_split_size_mb:64", 300 * MIB, 100 * MIB);
        malloc(&mut a, 150 * MIB, S0);
        let mut down = up(older, newer);
        down.reverse();
        assert_eq!(released(&mut a), down, "{order:?}: oversize release");
        // Garbage collection goes up it (the two are equally old).
        let device = SimDevice::new(SimConfig::with_capacity(GIB));
        let config = AllocatorConfig::parse("garbage_collection_threshold:0.5").expect("valid");
        let mut a = CachingAllocator::with_fit_order(device, config, order);
        a.set_memory_fraction(0.5).expect("valid");
        a.record_history(Some(10_000));
        let b = base(&a);
        a.device_mut().hint_addresses([b + 8 * GIB, b + GIB]);
        let (older, newer) = (malloc(&mut a, 100 * MIB, S0), malloc(&mut a, 100 * MIB, S0));
        let kept = malloc(&mut a, 100 * MIB, S0);
        free(&mut a, older);
        free(&mut a, newer);
        a.take_trace();
        // 300 MiB reserved, above half the allowed 512 MiB: the next miss collects.
        malloc(&mut a, 120 * MIB, S0);
        assert_eq!(
            released(&mut a),
            up(older.0, newer.0),
            "{order:?}: garbage collection"
        );
        free(&mut a, kept);
    }
}

#[test]
fn a_plan_reuses_its_free_chunks_in_the_pools_order() {
    use gpumem::allocator::{Plan, PlanEntry, PlanMode};
    let persistent = PlanEntry {
        size: 4 * MIB,
        stream: gpumem::StreamId(0),
        offset: None,
        persistent: true,
    };
    let plan = std::sync::Arc::new(Plan {
        regions: Vec::new(),
        entries: vec![persistent, persistent],
        mode: PlanMode::Paged,
        saved_bytes: None,
    });
    for order in [FitOrder::Address, FitOrder::Counter] {
        // Whole-segment chunks: a device without virtual memory (paged chunks grow instead).
        let device = SimDevice::new(SimConfig {
            virtual_memory: false,
            ..SimConfig::with_capacity(16 * GIB)
        });
        let mut a = CachingAllocator::with_fit_order(device, AllocatorConfig::default(), order);
        a.set_plan(plan.clone()).expect("a valid plan");
        let b = base(&a);
        // Three chunks of two entries: the first high, the second low, the third between.
        a.device_mut()
            .hint_addresses([b + 8 * GIB, b + GIB, b + 4 * GIB]);
        let p: Vec<DevicePtr> = (0..6).map(|_| malloc(&mut a, 4 * MIB, S0)).collect();
        let chunks = [p[0].0, p[2].0, p[4].0];
        assert_eq!(
            chunks,
            [b + 8 * GIB, b + GIB, b + 4 * GIB],
            "placed as hinted"
        );
        // The first two wholly free, the current one's tail still taken.
        for &q in &p[..5] {
            free(&mut a, q);
        }
        let got = malloc(&mut a, 4 * MIB, S0);
        let want = match order {
            FitOrder::Address => chunks[1],
            _ => chunks[0],
        };
        assert_eq!(got.0, want, "{order:?}: the chunk reused");
        assert_eq!(
            a.stats().num_plan_hits.get(),
            7,
            "{order:?}: every request a hit"
        );
    }
}
