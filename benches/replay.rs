//! Replay throughput on a real recording (opt125m, 23 105 events, bundled in data/traces):
//! decoding the file, the fidelity check, a what-if run under another configuration, and the
//! placement planner (`gpumem plan`: the iteration search and the placement).

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpumem::AllocatorConfig;
use gpumem::plan::{PlanOptions, plan};
use gpumem::recording::parse_recording;
use gpumem::replay::{ReplayOptions, replay};

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
    let check = ReplayOptions {
        check: true,
        ..ReplayOptions::default()
    };
    group.bench_function("check", |b| {
        b.iter(|| replay(black_box(&recording), &check).expect("replays"))
    });
    let what_if = ReplayOptions {
        config: Some(AllocatorConfig::parse("expandable_segments:True").expect("valid")),
        ..ReplayOptions::default()
    };
    group.bench_function("what_if_expandable", |b| {
        b.iter(|| replay(black_box(&recording), &what_if).expect("replays"))
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
