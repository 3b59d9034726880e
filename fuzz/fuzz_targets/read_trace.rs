//! Arbitrary bytes as a snapshot file: reading must fail cleanly or succeed, and whatever it
//! reads must summarise and replay (both modes) without a panic.

#![no_main]

use gpumem::trace::{ReplayOptions, parse_recording_with_limit, replay, state_summary};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(recording) = parse_recording_with_limit(data, 1 << 20) else {
        return;
    };
    let _ = state_summary(&recording);
    for device in 0..recording.device_traces.len().min(2) {
        for check in [false, true] {
            let options = ReplayOptions {
                device: device as u32,
                check,
                capacity: Some(1 << 34),
                series_points: 16,
                ..ReplayOptions::default()
            };
            let _ = replay(&recording, &options);
        }
    }
});
