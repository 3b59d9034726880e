//! Arbitrary bytes as a snapshot file: reading must fail cleanly or succeed within the read
//! limits (the same `ReadLimits` the commands take, set small), and whatever it reads must
//! summarise, walk its stacks, replay (both modes) and plan (a valid plan, then followed in a
//! replay) without a panic.

#![no_main]

use gpumem::plan::{PlanOptions, plan};
use gpumem::recording::{ReadLimits, parse_recording_with, state_summary};
use gpumem::replay::{Mode, Session, Setup, WhatIf};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = ReadLimits {
        max_input_bytes: 1 << 20,
        max_memory_bytes: 64 << 20,
    };
    let (result, cost) = parse_recording_with(data, limits);
    assert!(cost.peak_bytes <= limits.max_memory_bytes + (1 << 20), "{cost:?}");
    let Ok(recording) = result else {
        return;
    };
    let _ = state_summary(&recording);
    for stacks in &recording.event_stacks {
        for &stack in stacks {
            for &frame in recording.frames.frames_of(stack) {
                let f = recording.frames.get(frame);
                let _ = (recording.frames.str(f.filename), recording.frames.str(f.name));
            }
        }
    }
    let recording = std::sync::Arc::new(recording);
    for device in 0..recording.device_traces.len().min(2) {
        let setup = Setup {
            device: device as u32,
            capacity: Some(1 << 34),
            ..Setup::default()
        };
        let Ok(session) = Session::new(std::sync::Arc::clone(&recording), setup) else {
            continue;
        };
        for mode in [Mode::WhatIf(WhatIf::default()), Mode::CHECK] {
            let _ = session.replay(&mode, 16, &mut |_, _| {});
        }
        // The planner, and what it plans: a valid plan, followed without a panic.
        let options = PlanOptions {
            device: device as u32,
            ..PlanOptions::default()
        };
        if let Ok(planned) = plan(&recording, "fuzz", &options) {
            assert!(planned.plan.validate().is_ok(), "{:?}", planned.plan.validate());
            let followed = WhatIf {
                window: Some(planned.evaluated.clone()),
                plan: Some(std::sync::Arc::new(planned.plan)),
                ..WhatIf::default()
            };
            let _ = session.replay(&Mode::WhatIf(followed), 0, &mut |_, _| {});
        }
    }
});
