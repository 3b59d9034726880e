//! Replay throughput on a real recording (opt125m, 23 105 events, bundled in data/traces):
//! decoding the file, the fidelity check, a what-if run under another configuration, and the
//! placement planner (`gpumem plan`: the iteration search and the placement).

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpumem::AllocatorConfig;
use gpumem::plan::{PlanOptions, plan};
use gpumem::recording::parse_recording;
use gpumem::replay::{Mode, Session, Setup, WhatIf};

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

criterion_group!(benches, replay_opt125m);
criterion_main!(benches);
