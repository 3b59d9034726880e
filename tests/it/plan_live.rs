//! Plans that hold in live jobs (issue 57). A live job's iterations are not the recorded
//! ones: requests come out of their recorded order, sizes change within their rounded class
//! and some across it, allocations are added and others missing, and the job runs one
//! iteration more or fewer than recorded. Issue 57 asks that the plan made from the
//! recording still serve at least 95 % of the requests the recorded iterations also have, and
//! that the job hold no more than the caching allocator does on the same live requests.
//! The live job runs on past its iterations as the recording does (what follows them, an
//! evaluation or the step that ran out of memory, counts for the peak, not for the share
//! served: no iteration has those requests).
//!
//! Each recording runs in three lengths and [`SEEDS`] perturbations of each: a handful of
//! seeds cannot tell a rule from luck. Issue 57's target holds on most runs, not on all
//! (docs/planning.md, "Plans in live jobs"): that test is ignored, and a floor catches a
//! follower that breaks.

use std::sync::Arc;

use gpumem::allocator::size::round_size;
use gpumem::allocator::{Plan, TraceAction};
use gpumem::device::{SimConfig, SimDevice, StreamId};
use gpumem::plan::{PlanOptions, evaluate, plan};
use gpumem::recording::{Recording, read_recording};
use gpumem::replay::Setup;
use gpumem::rng::XorShift;
use gpumem::{AllocatorConfig, CachingAllocator};

use crate::common::{hits_and_misses, session};
use crate::support::traces::shared_traces;

/// A live request (`recorded`: the recorded iterations have it, perhaps resized) or a free,
/// by id.
#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc {
        id: usize,
        size: u64,
        stream: StreamId,
        recorded: bool,
    },
    Free {
        id: usize,
    },
}

/// Device 0's default-pool requests and frees, with the event each comes from; requests
/// before event `iterations_end` are the recorded iterations' (after it: what the job did
/// next, which no iteration has).
fn ops_of(recording: &Recording, iterations_end: usize) -> Vec<(Op, usize)> {
    let mut live = std::collections::HashMap::new();
    let mut ops = Vec::new();
    for (event, e) in recording.trace(0).iter().enumerate() {
        if !e.pool.is_default() {
            continue;
        }
        match e.action {
            TraceAction::Alloc => {
                let id = event;
                live.insert(e.addr, id);
                let (size, stream, recorded) = (e.size, e.stream, event < iterations_end);
                ops.push((
                    Op::Alloc {
                        id,
                        size,
                        stream,
                        recorded,
                    },
                    event,
                ));
            }
            TraceAction::FreeRequested => {
                if let Some(id) = live.remove(&e.addr) {
                    ops.push((Op::Free { id }, event));
                }
            }
            _ => {}
        }
    }
    ops
}

/// Whether an op refers to `id`.
fn refers(op: &Op, to: usize) -> bool {
    match *op {
        Op::Alloc { id, .. } | Op::Free { id } => id == to,
    }
}

/// The live job: the recording's requests from op `from` on perturbed as the module
/// documentation says (rates per request: 10 % reordered, 5 % resized across their class,
/// half the rest within it, 5 % extra, 5 % missing).
fn perturbed(ops: &[Op], from: usize, config: &AllocatorConfig, seed: u64) -> Vec<Op> {
    let mut rng = XorShift::new(seed);
    let mut chance = |percent: u64| rng.next_u64() % 100 < percent;
    let mut out: Vec<Op> = ops[..from].to_vec();
    let mut missing = std::collections::HashSet::new();
    let mut extra_id = usize::MAX / 2;
    // Extras waiting to be freed: (ops to go, id).
    let mut pending: Vec<(u32, usize)> = Vec::new();
    let mut sizes = XorShift::new(seed ^ 0x5eed);
    for &op in &ops[from..] {
        match op {
            Op::Alloc { id, .. } if chance(5) => {
                missing.insert(id);
            }
            Op::Alloc {
                id,
                size,
                stream,
                recorded,
            } => {
                let rounded = round_size(config, size);
                let size = if chance(5) {
                    // Across its class: a quarter larger or smaller, or so.
                    let percent = if sizes.next_u64().is_multiple_of(2) {
                        sizes.between(110, 140)
                    } else {
                        sizes.between(60, 90)
                    };
                    (size * percent / 100).max(1)
                } else if chance(50) {
                    let within = rounded.saturating_sub(sizes.next_u64() % 512).max(1);
                    if round_size(config, within) == rounded {
                        within
                    } else {
                        size
                    }
                } else {
                    size
                };
                out.push(Op::Alloc {
                    id,
                    size,
                    stream,
                    recorded,
                });
                if chance(5) {
                    extra_id += 1;
                    out.push(Op::Alloc {
                        id: extra_id,
                        size: sizes.between(4 << 10, 4 << 20),
                        stream,
                        recorded: false,
                    });
                    pending.push((sizes.between(1, 8) as u32, extra_id));
                }
            }
            Op::Free { id } if missing.contains(&id) => {}
            Op::Free { .. } => out.push(op),
        }
        pending.retain_mut(|(left, id)| {
            *left -= 1;
            if *left == 0 {
                out.push(Op::Free { id: *id });
            }
            *left > 0
        });
    }
    out.extend(pending.into_iter().map(|(_, id)| Op::Free { id }));
    // Out of order: a request swapped with the next one, where neither's free lies between.
    let allocs: Vec<usize> = (from..out.len())
        .filter(|&i| matches!(out[i], Op::Alloc { .. }))
        .collect();
    for pair in allocs.windows(2) {
        let (i, k) = (pair[0], pair[1]);
        let (Op::Alloc { id: a, .. }, Op::Alloc { id: b, .. }) = (out[i], out[k]) else {
            continue;
        };
        if chance(10)
            && !out[i + 1..k]
                .iter()
                .any(|op| refers(op, a) || refers(op, b))
        {
            out.swap(i, k);
        }
    }
    out
}

/// Requests of the recording the plan decided in a live run (hits and misses), the peak
/// reserved from op `from` on, and the segments obtained and freed from the driver in all.
struct Outcome {
    hits: u64,
    decided: u64,
    peak_reserved: i64,
    driver_calls: i64,
}

fn run(ops: &[Op], from: usize, config: &AllocatorConfig, plan: Option<Arc<Plan>>) -> Outcome {
    let device = SimDevice::new(SimConfig::with_capacity(80 << 30));
    let mut a = CachingAllocator::new(device, config.clone());
    if let Some(plan) = plan {
        a.set_plan(plan).expect("valid");
    }
    let mut ptrs = std::collections::HashMap::new();
    let (mut hits, mut decided) = (0, 0);
    for (i, op) in ops.iter().enumerate() {
        if i == from {
            a.reset_peak_stats();
        }
        match *op {
            Op::Alloc {
                id,
                size,
                stream,
                recorded,
            } => {
                let before = hits_and_misses(&a);
                let p = a.malloc(size, stream).expect("fits");
                ptrs.insert(id, p);
                let after = hits_and_misses(&a);
                if i >= from && recorded {
                    hits += (after.0 - before.0) as u64;
                    decided += (after.0 + after.1 - before.0 - before.1) as u64;
                }
            }
            Op::Free { id } => {
                if let Some(p) = ptrs.remove(&id) {
                    a.free(p).expect("live");
                }
            }
        }
    }
    a.check_invariants().expect("consistent");
    Outcome {
        hits,
        decided,
        peak_reserved: a.stats().reserved_bytes.all().peak,
        driver_calls: a.stats().num_device_alloc.get() + a.stats().num_device_free.get(),
    }
}

/// One live run against the caching allocator on the same requests.
struct Run {
    label: String,
    /// The share of the recorded iterations' requests the plan served.
    served: f64,
    peak_reserved: i64,
    caching_peak_reserved: i64,
}

impl Run {
    /// Where the run falls short of `target`, if it does.
    fn short_of(&self, target: Target) -> Option<String> {
        let allowed = self.caching_peak_reserved as f64 * target.peak;
        if self.served < target.served {
            Some(format!("{}: {:.3} served", self.label, self.served))
        } else if self.peak_reserved as f64 > allowed {
            Some(format!(
                "{}: {} bytes reserved, the caching allocator {}",
                self.label, self.peak_reserved, self.caching_peak_reserved
            ))
        } else {
            None
        }
    }
}

/// The live jobs of `recording` in three lengths (as recorded, one iteration fewer, one
/// more), [`SEEDS`] of each, each against the caching allocator.
fn holds_live(name: &str, recording: &Recording) -> Vec<Run> {
    let config = AllocatorConfig::default();
    let options = PlanOptions {
        config: Some(config.clone()),
        ..PlanOptions::default()
    };
    let mut planned = plan(recording, name, &options).expect("the recording repeats");
    assert!(
        planned.iterations >= 3,
        "{name}: {} iterations",
        planned.iterations
    );
    // What the plan saved on its evaluation, as `gpumem plan` writes it in the file.
    let session = session(recording, Setup::default()).expect("a session");
    let evaluated = Arc::new(planned.plan.clone());
    let evaluation = evaluate(
        &session,
        Some(config.clone()),
        &evaluated,
        planned.evaluated.clone(),
    )
    .expect("replays");
    planned.plan.saved_bytes = Some(evaluation.saved_bytes());
    let shared = Arc::new(planned.plan.clone());
    // The job starts at the planned iteration (a warm-up before it is another matter: its
    // requests would take the plan's ranges for good).
    let start = planned.events.start;
    let recorded: Vec<(Op, usize)> = ops_of(recording, planned.evaluated.end)
        .into_iter()
        .filter(|&(_, event)| event >= start)
        .collect();
    let from = recorded
        .iter()
        .position(|&(_, event)| event >= planned.evaluated.start)
        .expect("evaluated iterations");
    // Where the last evaluated iteration begins, by its requests.
    let allocs: Vec<usize> = (from..recorded.len())
        .filter(|&i| matches!(recorded[i].0, Op::Alloc { .. }))
        .collect();
    let last = allocs[allocs.len().saturating_sub(planned.period)];
    let ops: Vec<Op> = recorded.iter().map(|&(op, _)| op).collect();
    let fewer = ops[..last].to_vec();
    let mut more = ops.clone();
    let offset = usize::MAX / 4;
    let copied: std::collections::HashSet<usize> = ops[last..]
        .iter()
        .filter_map(|op| match *op {
            Op::Alloc { id, .. } => Some(id),
            Op::Free { .. } => None,
        })
        .collect();
    more.extend(ops[last..].iter().filter_map(|op| match *op {
        Op::Alloc {
            id,
            size,
            stream,
            recorded,
        } => Some(Op::Alloc {
            id: id + offset,
            size,
            stream,
            recorded,
        }),
        Op::Free { id } if copied.contains(&id) => Some(Op::Free { id: id + offset }),
        Op::Free { .. } => None,
    }));
    let mut runs = Vec::new();
    for (length, ops) in [
        ("as recorded", ops),
        ("one fewer", fewer),
        ("one more", more),
    ] {
        for seed in 1..=SEEDS {
            let live = perturbed(&ops, from, &config, seed * 7919);
            let planned = run(&live, from, &config, Some(shared.clone()));
            let caching = run(&live, from, &config, None);
            assert!(planned.decided > 0, "{name}: the plan decided no request");
            let served = planned.hits as f64 / planned.decided as f64;
            eprintln!(
                "{name} {length} seed {seed}: {} of {} requests served by the plan ({:.1} %); peak reserved {} MiB against the caching allocator's {} MiB; {} cudaMalloc and cudaFree against {}",
                planned.hits,
                planned.decided,
                100.0 * served,
                planned.peak_reserved >> 20,
                caching.peak_reserved >> 20,
                planned.driver_calls,
                caching.driver_calls,
            );
            runs.push(Run {
                label: format!("{name} {length} seed {seed}"),
                served,
                peak_reserved: planned.peak_reserved,
                caching_peak_reserved: caching.peak_reserved,
            });
        }
    }
    runs
}

/// Perturbations of each recording and length.
const SEEDS: u64 = 30;

/// What a live job asks of its plan: the share of the recorded requests it serves, and its
/// peak reserved at most `peak` times the caching allocator's.
#[derive(Clone, Copy)]
struct Target {
    served: f64,
    peak: f64,
}

/// Issue 57's: 95 % served, never above the caching allocator.
const ISSUE: Target = Target {
    served: 0.95,
    peak: 1.0,
};

/// A floor against regressions: the share of each recording's runs that meet issue 57's
/// target, and what every run meets.
struct Floor {
    share: f64,
    each: Target,
}

/// What holds now (docs/planning.md, "Plans in live jobs"): 4 runs in 5 of each recording
/// meet issue 57's target, and none serves less than 90 % or holds more than 5/4 of the
/// caching allocator's peak. It catches a follower that breaks, not one a few runs worse.
const NOW: Floor = Floor {
    share: 0.8,
    each: Target {
        served: 0.9,
        peak: 1.25,
    },
};

const BUNDLED: [&str; 2] = [
    "cs336_lm_compiled_train.noframes.json.gz",
    "cs336_lm_forward_bf16.noframes.json.gz",
];

const SHARED: [&str; 3] = [
    "cnn_counterfactual_eor.pickle",
    "qwen3_gnn_3gpu_expandable_oom_complete.pickle",
    "toy_transformer_train.pickle",
];

fn bundled(file: &str) -> Recording {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces")
        .join(file);
    read_recording(&path).expect("a bundled recording")
}

/// The runs of each bundled recording, and of each shared one where they are here.
fn live_runs(test: &str) -> Vec<(&'static str, Vec<Run>)> {
    let mut runs: Vec<(&str, Vec<Run>)> = BUNDLED
        .iter()
        .map(|&file| (file, holds_live(file, &bundled(file))))
        .collect();
    if let Some(dir) = shared_traces(test) {
        for name in SHARED {
            let recording = read_recording(&dir.join(name)).expect("reads");
            runs.push((name, holds_live(name, &recording)));
        }
    }
    runs
}

#[test]
fn perturbed_live_jobs_mostly_follow_their_plan() {
    let mut short = Vec::new();
    for (name, runs) in live_runs("perturbed_live_jobs_mostly_follow_their_plan") {
        short.extend(runs.iter().filter_map(|r| r.short_of(NOW.each)));
        let meet = runs.iter().filter(|r| r.short_of(ISSUE).is_none()).count();
        eprintln!(
            "{name}: {meet} of {} runs meet issue 57's target",
            runs.len()
        );
        if (meet as f64) < NOW.share * runs.len() as f64 {
            short.push(format!("{name}: {meet} of {} runs meet it", runs.len()));
        }
    }
    assert!(short.is_empty(), "{short:#?}");
}

#[test]
#[ignore = "issue 57, open: 414 of 450 runs meet the target (docs/planning.md); run with --ignored"]
fn plans_hold_in_live_jobs() {
    let runs: Vec<Run> = (live_runs("plans_hold_in_live_jobs").into_iter())
        .flat_map(|(_, runs)| runs)
        .collect();
    let short: Vec<String> = runs.iter().filter_map(|r| r.short_of(ISSUE)).collect();
    assert!(
        short.is_empty(),
        "{} of {} runs: {short:#?}",
        short.len(),
        runs.len()
    );
}
