//! The events of the bundled recordings, as the benchmarks replay them (`allocator`'s
//! `recorded` group and `hot_path`'s instruction counts read them alike).

use std::collections::HashMap;
use std::path::Path;

use gpumem::allocator::TraceAction;

/// The recordings replayed: (name, file under `data/traces`).
pub const RECORDINGS: [(&str, &str); 2] = [
    ("opt125m", "opt125m_zo_fedtrain_complete.noframes.json.gz"),
    ("lm_fwd_bwd", "cs336_lm_fwd_bwd_step.noframes.json.gz"),
];

/// One event of a recording: allocate `size` bytes into a slot, or free a slot.
#[derive(Clone, Copy)]
pub enum Event {
    Alloc { slot: usize, size: u64 },
    Free { slot: usize },
}

/// The allocations and frees of a bundled recording's first device, each live block in its
/// own slot, ending with frees of whatever is still live; and the number of slots.
pub fn recorded_events(file: &str) -> (Vec<Event>, usize) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces")
        .join(file);
    let recording = gpumem::recording::read_recording(&path).expect("bundled recording");
    let mut events = Vec::new();
    let mut live = HashMap::new();
    let mut slots = 0;
    for event in &recording.device_traces[0] {
        match event.action {
            TraceAction::Alloc => {
                live.insert(event.addr, slots);
                events.push(Event::Alloc {
                    slot: slots,
                    size: event.size,
                });
                slots += 1;
            }
            // Frees of blocks allocated before the trace began have no slot: skipped.
            TraceAction::FreeRequested => {
                if let Some(slot) = live.remove(&event.addr) {
                    events.push(Event::Free { slot });
                }
            }
            _ => {}
        }
    }
    let mut left: Vec<usize> = live.into_values().collect();
    left.sort_unstable();
    events.extend(left.into_iter().map(|slot| Event::Free { slot }));
    (events, slots)
}
