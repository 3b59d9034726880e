//! Replay throughput on a real recording (opt125m, 23 105 events, bundled in data/traces):
//! decoding the file, the fidelity check, a what-if run under another configuration, and the
//! placement planner (`gpumem plan`: the iteration search and the placement); and, on the
//! bundled cs336_lm_compiled_train, a job's requests served by the caching allocator beside
//! the same requests following the plan made of them (the follower's cost per request).

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpumem::allocator::{Plan, TraceAction};
use gpumem::device::{SimConfig, SimDevice, StreamId};
use gpumem::plan::{PlanOptions, plan};
use gpumem::recording::parse_recording;
use gpumem::replay::{Mode, Session, Setup, WhatIf};
use gpumem::{AllocatorConfig, CachingAllocator};

fn replay_opt125m(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces/opt125m_zo_fedtrain_complete.noframes.json.gz");
    let bytes = std::fs::read(path).expect("bundled recording");
    let recording = parse_recording(&bytes).expect("valid recording");
    let events = recording.device_traces[0].len() as u64;
    let mut group = c.benchmark_group("replay_opt125m");
    group.throughput(Throughput::Elements(events));
    group.bench_function("decode_json_gz", |b| {
        b.iter(|| parse_recording(black_box(&bytes)).expect("valid"))
    });
    // A new session each time: a what-if's cost includes finding how the recording reads.
    let shared = Arc::new(recording.clone());
    let session =
        || Session::new(Arc::clone(black_box(&shared)), Setup::default()).expect("device 0");
    group.bench_function("check", |b| b.iter(|| session().check().expect("replays")));
    let what_if = Mode::WhatIf(WhatIf {
        config: Some(AllocatorConfig::parse("expandable_segments:True").expect("valid")),
        ..WhatIf::default()
    });
    group.bench_function("what_if_expandable", |b| {
        b.iter(|| {
            session()
                .replay(&what_if, 0, &mut |_, _| {})
                .expect("replays")
        })
    });
    // The planner on the largest shared recording by events (this one): finding the
    // iteration and placing it, beside the replays above.
    let options = PlanOptions::default();
    group.bench_function("plan", |b| {
        b.iter(|| plan(black_box(&recording), "opt125m", &options).expect("plans"))
    });
    group.finish();
}

/// A request (`Some(size, stream)`) or a free of the request at that index.
type Op = (usize, Option<(u64, StreamId)>);

/// Runs `ops` on a fresh simulated device, following `plan` if given: its peak reserved.
fn serve(ops: &[Op], plan: Option<&Arc<Plan>>) -> i64 {
    let mut a = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(80 << 30)),
        AllocatorConfig::default(),
    );
    if let Some(plan) = plan {
        a.set_plan(Arc::clone(plan)).expect("a valid plan");
    }
    let mut ptrs = vec![None; ops.len()];
    for &(i, op) in ops {
        match op {
            Some((size, stream)) => ptrs[i] = Some(a.malloc(size, stream).expect("fits")),
            None => {
                if let Some(p) = ptrs[i].take() {
                    a.free(p).expect("live");
                }
            }
        }
    }
    a.stats().reserved_bytes.all().peak
}

fn follow_cs336(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces/cs336_lm_compiled_train.noframes.json.gz");
    let recording = gpumem::recording::read_recording(&path).expect("bundled recording");
    let planned = plan(&recording, "cs336", &PlanOptions::default()).expect("plans");
    let plan = Arc::new(planned.plan.clone());
    // Device 0's default-pool requests from the planned iteration on, and their frees.
    let trace = recording.trace(0);
    let mut index = std::collections::HashMap::new();
    let mut ops: Vec<Op> = Vec::new();
    for e in trace.iter().skip(planned.events.start) {
        if !e.pool.is_default() {
            continue;
        }
        match e.action {
            TraceAction::Alloc => {
                index.insert(e.addr, ops.len());
                ops.push((ops.len(), Some((e.size, e.stream))));
            }
            TraceAction::FreeRequested => {
                if let Some(i) = index.remove(&e.addr) {
                    ops.push((i, None));
                }
            }
            _ => {}
        }
    }
    let requests = ops.iter().filter(|op| op.1.is_some()).count() as u64;
    let mut group = c.benchmark_group("follow_cs336_compiled");
    group.throughput(Throughput::Elements(requests));
    group.bench_function("caching_allocator", |b| {
        b.iter(|| serve(black_box(&ops), None))
    });
    group.bench_function("following_its_plan", |b| {
        b.iter(|| serve(black_box(&ops), Some(&plan)))
    });
    group.finish();
}

criterion_group!(benches, replay_opt125m, follow_cs336);
criterion_main!(benches);
