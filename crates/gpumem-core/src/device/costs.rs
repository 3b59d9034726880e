//! `DriverCosts`: what each driver call costs, the table a [`SimDevice`](super::SimDevice)
//! charges its clock from.
//!
//! One table per GPU kind. Each entry is a cost as a function of the call's size (points
//! measured at a few sizes, straight lines between them) and says where its figures come
//! from: measured on a GPU by `scripts/gpu-check.sh`, or a documented public figure. The
//! entries follow what the allocator does, so that each can be measured as it happens:
//! a new physical handle is created, mapped and given access in one go (`page_in`); a handle
//! already created is mapped again elsewhere when a plan lends a page (`remap`).
//!
//! Driver calls are counted as the driver receives them ([`Call::calls`]): a page in is three
//! calls (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`), a remap two.
//!
//! # Invariants
//! - A valid table ([`DriverCosts::validate`]) has every call, each with 1 to
//!   [`MAX_POINTS`] points of strictly increasing size and costs of at most [`MAX_COST_NS`].
//! - A cost is never negative, and never below the cost at the nearest measured size for
//!   sizes beyond the last point (the last segment's slope goes on, or stays flat if it fell).

use serde::{Deserialize, Serialize};

/// The most points one call's curve may have.
pub const MAX_POINTS: usize = 16;
/// The largest cost a point may name: 10 s.
pub const MAX_COST_NS: u64 = 10_000_000_000;

/// A driver call the simulated device charges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Call {
    /// `cudaMalloc` of a segment.
    Malloc,
    /// `cudaFree` of a segment.
    Free,
    /// A device-wide or stream synchronisation (also what malloc and free imply, unless their
    /// own figure includes it).
    Synchronize,
    /// An event's create, record, query or synchronize.
    Event,
    /// `cudaMemGetInfo`.
    MemGetInfo,
    /// A new physical handle: `cuMemCreate`, `cuMemMap` and `cuMemSetAccess`.
    PageIn,
    /// A handle created before, mapped at another address: `cuMemMap`, `cuMemSetAccess`.
    Remap,
    /// `cuMemUnmap` of one handle's mapping.
    Unmap,
    /// `cuMemRelease` of a handle.
    Release,
}

impl Call {
    /// Every call, in the table's order.
    pub const ALL: [Call; 9] = [
        Call::Malloc,
        Call::Free,
        Call::Synchronize,
        Call::Event,
        Call::MemGetInfo,
        Call::PageIn,
        Call::Remap,
        Call::Unmap,
        Call::Release,
    ];

    /// How many calls the driver receives for one of these.
    pub fn calls(self) -> u64 {
        match self {
            Call::PageIn => 3,
            Call::Remap => 2,
            _ => 1,
        }
    }

    /// Its name in a table file.
    pub fn name(self) -> &'static str {
        match self {
            Call::Malloc => "malloc",
            Call::Free => "free",
            Call::Synchronize => "synchronize",
            Call::Event => "event",
            Call::MemGetInfo => "mem_get_info",
            Call::PageIn => "page_in",
            Call::Remap => "remap",
            Call::Unmap => "unmap",
            Call::Release => "release",
        }
    }
}

/// Where an entry's figures come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Source {
    /// Measured on a GPU (which one, by what, when).
    Measured(String),
    /// A documented public figure (where it is documented).
    Public(String),
}

/// One call's cost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallCost {
    /// `(bytes, nanoseconds)`, sizes strictly increasing; a call without a size has one
    /// point (its size is then ignored).
    pub points: Vec<(u64, u64)>,
    /// Whether the figure includes the device-wide synchronisation the call implies
    /// (`cudaMalloc` and `cudaFree` timed from the host on an idle GPU do); if not, the
    /// device charges a [`Call::Synchronize`] on top.
    #[serde(default)]
    pub includes_synchronize: bool,
    /// Where the figures come from.
    pub source: Source,
}

impl CallCost {
    fn flat(ns: u64, source: Source) -> CallCost {
        CallCost {
            points: vec![(0, ns)],
            includes_synchronize: false,
            source,
        }
    }

    /// Its cost at `size` bytes, in nanoseconds.
    pub fn ns(&self, size: u64) -> u64 {
        let points = &self.points;
        let Some(&(first_size, first_ns)) = points.first() else {
            return 0;
        };
        if size <= first_size || points.len() == 1 {
            return first_ns;
        }
        // The segment that holds `size`, or the last one (extended beyond it).
        let at = points
            .partition_point(|&(s, _)| s < size)
            .min(points.len() - 1);
        let ((s0, n0), (s1, n1)) = (points[at - 1], points[at]);
        let line = n0 as f64 + (n1 as f64 - n0 as f64) * (size - s0) as f64 / (s1 - s0) as f64;
        let floor = if size > s1 { n1 } else { 0 };
        (line.max(0.0).min(u64::MAX as f64) as u64).max(floor)
    }
}

/// A GPU kind's table of driver call costs. See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverCosts {
    /// The GPU kind, as its name reads (`NVIDIA H200`).
    pub gpu: String,
    /// Each call's cost, by its name.
    pub calls: std::collections::BTreeMap<Call, CallCost>,
}

/// Why a table cannot price a clock.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CostsError {
    /// A call has no entry.
    #[error("no cost for {0}")]
    Missing(&'static str),
    /// A call's points are out of bounds.
    #[error("{call}: {why}")]
    Points {
        /// The call.
        call: &'static str,
        /// What is wrong with them.
        why: String,
    },
}

const V100_NSYS: &str = "V100, nsys over 7.2 M calls (performance notes §1.1)";
const VMM_PUBLIC: &str =
    "the range small public projects report for a 2 MiB page, not vetted (performance notes §1.3)";
const EVENTS_PUBLIC: &str =
    "record and query loop without timing, 0.47 µs (performance notes §1.4)";
const MEM_GET_INFO_PUBLIC: &str = "7 to 12 µs on B200/B300 (performance notes §1.1)";
const SYNC_PUBLIC: &str = "an idle device's synchronisation, of the order of 10 µs (performance notes §1.1: cudaFree's minimum 1.7 µs, average 21.5 µs)";
const H200_MEASURED: &str =
    "NVIDIA H200, scripts/gpu-check.sh (tests/it/gpu.rs timings, 50 calls), 2026-12";

impl DriverCosts {
    /// An H200: malloc, free and a page in as `scripts/gpu-check.sh` measured them; the
    /// rest public figures. The default.
    pub fn h200() -> DriverCosts {
        let mut costs = DriverCosts::public();
        costs.gpu = "NVIDIA H200".into();
        let measured = |size: u64, ns: u64| CallCost {
            points: vec![(size, ns)],
            includes_synchronize: true,
            source: Source::Measured(H200_MEASURED.into()),
        };
        costs.calls.insert(Call::Malloc, measured(2 << 20, 62_300));
        costs.calls.insert(Call::Free, measured(2 << 20, 47_900));
        costs.calls.insert(
            Call::PageIn,
            CallCost {
                includes_synchronize: false,
                ..measured(20 << 20, 199_500)
            },
        );
        costs
    }

    /// Public figures only (gpumem's clock before the GPU check measured one).
    pub fn public() -> DriverCosts {
        let public = |ns: u64, what: &str| CallCost::flat(ns, Source::Public(what.into()));
        let calls = [
            (Call::Malloc, public(2_400, V100_NSYS)),
            (Call::Free, public(2_000, V100_NSYS)),
            (Call::Synchronize, public(10_000, SYNC_PUBLIC)),
            (Call::Event, public(500, EVENTS_PUBLIC)),
            (Call::MemGetInfo, public(10_000, MEM_GET_INFO_PUBLIC)),
            (Call::PageIn, public(40_000, VMM_PUBLIC)),
            (Call::Remap, public(20_000, VMM_PUBLIC)),
            (Call::Unmap, public(20_000, VMM_PUBLIC)),
            (Call::Release, public(20_000, VMM_PUBLIC)),
        ];
        DriverCosts {
            gpu: "public figures".into(),
            calls: calls.into_iter().collect(),
        }
    }

    /// Checks the table against the bounds of the module documentation.
    ///
    /// # Errors
    /// The first [`CostsError`] found.
    pub fn validate(&self) -> Result<(), CostsError> {
        for call in Call::ALL {
            let cost = self
                .calls
                .get(&call)
                .ok_or(CostsError::Missing(call.name()))?;
            let bad = |why: String| CostsError::Points {
                call: call.name(),
                why,
            };
            let n = cost.points.len();
            if n == 0 || n > MAX_POINTS {
                return Err(bad(format!("{n} points (1 to {MAX_POINTS})")));
            }
            if let Some(w) = cost.points.windows(2).find(|w| w[0].0 >= w[1].0) {
                return Err(bad(format!(
                    "sizes must increase ({} then {})",
                    w[0].0, w[1].0
                )));
            }
            if let Some(&(size, ns)) = cost.points.iter().find(|p| p.1 > MAX_COST_NS) {
                return Err(bad(format!(
                    "{ns} ns at {size} bytes is over {MAX_COST_NS}"
                )));
            }
        }
        Ok(())
    }

    /// What one `call` of `size` bytes costs, in nanoseconds (0 for a call the table lacks:
    /// a table is validated before a device takes it).
    pub fn ns(&self, call: Call, size: u64) -> u64 {
        self.calls.get(&call).map_or(0, |c| c.ns(size))
    }

    /// Whether `call`'s figure includes the synchronisation it implies.
    pub fn includes_synchronize(&self, call: Call) -> bool {
        self.calls
            .get(&call)
            .is_some_and(|c| c.includes_synchronize)
    }
}

impl Default for DriverCosts {
    fn default() -> Self {
        DriverCosts::h200()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(points: &[(u64, u64)]) -> CallCost {
        CallCost {
            points: points.to_vec(),
            includes_synchronize: false,
            source: Source::Public("test".into()),
        }
    }

    #[test]
    fn costs_are_straight_lines_between_points_and_go_on_past_the_last() {
        let c = curve(&[(2 << 20, 60_000), (20 << 20, 200_000), (1 << 30, 5_000_000)]);
        assert_eq!(c.ns(0), 60_000, "flat below the first point");
        assert_eq!(c.ns(2 << 20), 60_000);
        assert_eq!(c.ns(11 << 20), 130_000, "halfway");
        assert_eq!(c.ns(20 << 20), 200_000);
        let slope = (5_000_000.0 - 200_000.0) / ((1u64 << 30) - (20 << 20)) as f64;
        let beyond = 5_000_000.0 + slope * (1u64 << 30) as f64;
        assert_eq!(c.ns(2 << 30), beyond as u64, "the last slope goes on");
        let falling = curve(&[(1, 10), (2, 5)]);
        assert_eq!(falling.ns(100), 5, "never below the last point beyond it");
        assert_eq!(curve(&[(0, 7)]).ns(u64::MAX), 7);
        assert!(c.ns(u64::MAX) >= 5_000_000);
    }

    #[test]
    fn the_built_in_tables_are_valid_and_say_where_figures_come_from() {
        for table in [DriverCosts::h200(), DriverCosts::public()] {
            table.validate().expect("valid");
        }
        let h200 = DriverCosts::h200();
        assert!(matches!(
            h200.calls[&Call::Malloc].source,
            Source::Measured(_)
        ));
        assert!(matches!(h200.calls[&Call::Unmap].source, Source::Public(_)));
        assert_eq!(h200.ns(Call::Malloc, 2 << 20), 62_300);
        assert!(h200.includes_synchronize(Call::Free));
        assert!(!DriverCosts::public().includes_synchronize(Call::Free));
    }

    #[test]
    fn bad_tables_are_refused_by_call() {
        let mut t = DriverCosts::public();
        t.calls.remove(&Call::Remap);
        assert_eq!(t.validate(), Err(CostsError::Missing("remap")));
        let cases: [(&[(u64, u64)], &str); 4] = [
            (&[], "0 points"),
            (&[(2, 1), (2, 3)], "sizes must increase"),
            (&[(0, MAX_COST_NS + 1)], "is over"),
            (&[(0, 1); MAX_POINTS + 1], "17 points"),
        ];
        for (points, why) in cases {
            let mut t = DriverCosts::public();
            t.calls.insert(Call::Unmap, curve(points));
            let e = t.validate().expect_err(why).to_string();
            assert!(e.starts_with("unmap: ") && e.contains(why), "{e}");
        }
    }

    #[test]
    fn a_table_reads_back_as_written() {
        let t = DriverCosts::h200();
        let text = serde_json::to_string(&t).expect("serializes");
        assert!(
            text.contains("\"page_in\"") && text.contains("\"measured\""),
            "{text}"
        );
        let back: DriverCosts = serde_json::from_str(&text).expect("reads");
        assert_eq!(back, t);
    }
}
