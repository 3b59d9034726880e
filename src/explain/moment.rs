//! Which moment of which device to explain when the user names neither: the first
//! out-of-memory error of any device, else the peak of a device with a trace, else the state
//! a snapshot holds of a device it has segments of; each choice with the sentence that says
//! it.
//!
//! # Invariants
//! - A choice names a device the recording has a trace or segments of, and a moment that
//!   device has (an OOM only where its trace has one).
//! - A device named by the user is kept; only the moment is chosen for it.

use crate::allocator::TraceAction;
use crate::recording::Recording;

/// Which moment to explain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The recording's first `oom` entry.
    FirstOom,
    /// The event after which the allocator reserved the most (the first such, where the trace
    /// has no OOM to explain).
    PeakReserved,
    /// Just after this event (its index in the device's trace).
    Event(usize),
    /// The state the snapshot holds: after the trace's last event, or, in a snapshot taken
    /// without traces (`include_traces=False`), the only moment it has.
    Snapshot,
}

/// A device and moment to explain, and why they were chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The device.
    pub device: u32,
    /// The moment.
    pub at: At,
    /// Why this device, where the recording names several devices or not device 0 and the
    /// user named none.
    pub device_why: Option<String>,
    /// Why this moment, where the user named none and it is not an OOM.
    pub moment_why: Option<String>,
}

impl Choice {
    /// What was chosen and why, in a sentence; `None` where nothing needs saying.
    pub fn sentence(&self) -> Option<String> {
        match (&self.device_why, &self.moment_why) {
            (Some(device), Some(moment)) => Some(format!("{device}; {moment}")),
            (Some(why), None) | (None, Some(why)) => Some(why.clone()),
            (None, None) => None,
        }
    }
}

/// The device and moment to explain: `device` and `at` where given, else as the module
/// documentation says. `None` when the recording names no device at all.
pub fn choose(recording: &Recording, device: Option<u32>, at: Option<At>) -> Option<Choice> {
    let devices = recording.devices();
    let (device, device_why) = match device {
        Some(device) => (device, None),
        None => {
            let (device, why) = default_device(recording, &devices)?;
            let say = devices.len() > 1 || device != 0;
            (device, say.then_some(why))
        }
    };
    let trace = recording.trace(device);
    let (at, moment_why) = match at {
        Some(at) => (at, None),
        None if trace.is_empty() => (
            At::Snapshot,
            Some("no trace recorded: the state the snapshot holds".to_string()),
        ),
        None if trace.iter().any(|e| e.action == TraceAction::Oom) => (At::FirstOom, None),
        None => (
            At::PeakReserved,
            Some("no out-of-memory error in the trace: the moment of peak reserved memory".into()),
        ),
    };
    Some(Choice {
        device,
        at,
        device_why,
        moment_why,
    })
}

/// The device to explain and why: the one whose first OOM came first (by the recorded
/// time where every such OOM has one, else the lowest device), else the first with a trace,
/// else the first with segments.
fn default_device(recording: &Recording, devices: &[u32]) -> Option<(u32, String)> {
    let first_oom = |d: u32| {
        let trace = recording.trace(d);
        let i = trace.iter().position(|e| e.action == TraceAction::Oom)?;
        Some((d, i, trace[i].time_us))
    };
    let ooms: Vec<(u32, usize, Option<u64>)> =
        devices.iter().filter_map(|&d| first_oom(d)).collect();
    let timed = ooms.iter().all(|(_, _, t)| t.is_some());
    let first = ooms
        .iter()
        .min_by_key(|(d, _, t)| if timed { (*t, *d) } else { (None, *d) });
    if let Some(&(device, event, _)) = first {
        let others = match ooms.len() {
            1 => "the only device that ran out of memory".to_string(),
            n if timed => format!("the first of {n} devices that ran out of memory"),
            n => format!("the lowest of {n} devices that ran out of memory"),
        };
        return Some((
            device,
            format!(
                "device {device}: its out-of-memory error at event {event}, {others} (--device explains another)"
            ),
        ));
    }
    if let Some(device) = recording.traced_devices().next() {
        return Some((
            device,
            format!(
                "device {device}: no device ran out of memory; the first device with a trace (--device explains another)"
            ),
        ));
    }
    let device = *devices.first()?;
    let only = if devices.len() == 1 {
        "the only device the snapshot holds segments of"
    } else {
        "the first device the snapshot holds segments of"
    };
    Some((device, format!("device {device}: {only}")))
}

/// The first event after which reserved memory is highest: segments allocated or mapped,
/// minus those freed or unmapped, from the trace's start (whatever the start state holds is
/// the same at every event).
pub fn peak_reserved_event(events: &[crate::allocator::TraceEntry]) -> Option<usize> {
    let mut reserved = 0i128;
    let mut peak = None;
    for (i, e) in events.iter().enumerate() {
        match e.action {
            TraceAction::SegmentAlloc | TraceAction::SegmentMap => reserved += i128::from(e.size),
            TraceAction::SegmentFree | TraceAction::SegmentUnmap => reserved -= i128::from(e.size),
            _ => {}
        }
        if peak.is_none_or(|(_, best)| reserved > best) {
            peak = Some((i, reserved));
        }
    }
    peak.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recording::parse_recording;

    /// A recording of `traces`, each a device's events as (action, time).
    fn recording(traces: &[&[(&str, Option<u64>)]]) -> Recording {
        let traces: Vec<Vec<serde_json::Value>> = traces
            .iter()
            .map(|t| {
                t.iter()
                    .enumerate()
                    .map(|(i, (action, time))| {
                        let addr = 0x20_0000 * (i as u64 + 1);
                        let mut e = serde_json::json!({"action": action, "addr": addr, "size": 512, "stream": 0});
                        if let Some(t) = time {
                            e["time_us"] = serde_json::json!(t);
                        }
                        e
                    })
                    .collect()
            })
            .collect();
        let doc = serde_json::json!({"segments": [], "device_traces": traces});
        parse_recording(doc.to_string().as_bytes()).expect("a valid recording")
    }

    #[test]
    fn the_first_oom_in_time_is_chosen_else_the_lowest_device() {
        let timed = recording(&[
            &[("alloc", Some(10)), ("oom", Some(50))],
            &[("alloc", Some(10))],
            &[("oom", Some(20))],
        ]);
        let c = choose(&timed, None, None).expect("a device");
        assert_eq!((c.device, c.at), (2, At::FirstOom));
        let why = c.device_why.expect("several devices: says why");
        assert!(
            why.starts_with("device 2: its out-of-memory error at event 0, the first of 2"),
            "{why}"
        );
        assert_eq!(c.moment_why, None);

        let untimed = recording(&[&[("alloc", None), ("oom", None)], &[("oom", None)]]);
        let c = choose(&untimed, None, None).expect("a device");
        assert_eq!(c.device, 0, "without times, the lowest device");
        assert!(c.device_why.expect("why").contains("the lowest of 2"));
    }

    #[test]
    fn without_an_oom_a_traced_device_and_its_peak_are_chosen() {
        let r = recording(&[&[], &[("alloc", None)]]);
        let c = choose(&r, None, None).expect("a device");
        assert_eq!((c.device, c.at), (1, At::PeakReserved));
        assert!(
            c.device_why
                .expect("device 1, not 0")
                .contains("no device ran out of memory")
        );
        assert!(
            c.moment_why
                .expect("why the peak")
                .contains("peak reserved")
        );
        // A device named is kept, its moment chosen; a moment named is kept too.
        let c = choose(&r, Some(0), None).expect("device 0");
        assert_eq!((c.device, c.at, c.device_why), (0, At::Snapshot, None));
        let c = choose(&r, None, Some(At::Event(0))).expect("a device");
        assert_eq!((c.device, c.at, c.moment_why), (1, At::Event(0), None));
        // A single device 0 needs no word on the device.
        let one = recording(&[&[("alloc", None), ("oom", None)]]);
        let c = choose(&one, None, None).expect("device 0");
        assert_eq!((c.device, c.sentence(), c.device_why), (0, None, None));
        assert_eq!(
            choose(&recording(&[]), None, None),
            None,
            "no device at all"
        );
    }
}
