//! Allocator configuration in the `PYTORCH_CUDA_ALLOC_CONF` syntax.
//!
//! `option:value,option:value,...`, with PyTorch's lexer (`,` `:` `[` `]` are tokens, spaces
//! vanish) and the validation of the release the configuration follows (`pytorch`, 2.15 by
//! default), so users can paste what their jobs run with. Values are stored in the units the
//! allocator uses (bytes, not MiB).
//!
//! # Invariants
//! - Parsing is all or nothing: a string with an error leaves the configuration unchanged
//!   ([`AllocatorConfig::apply_lenient`], for a recording's string, applies each valid option
//!   and returns the reasons of the others instead).
//! - Keys are read in PyTorch's order: gpumem's `pytorch` first (its release's keys and rules
//!   apply to the rest), then `large_segment_size_mb`, then every other key in order. A key
//!   the release lacks is refused, naming the release that added it.
//! - Every successful parse first resets `max_split_size`, `roundup_power2_divisions` and
//!   `garbage_collection_threshold` to their defaults, and from 2.11
//!   `max_non_split_rounding_size` to `large_segment_size`, as PyTorch does; the other
//!   options keep the values an earlier parse gave them.
//! - `max_split_size` is `u64::MAX` (unlimited) or at least the release's floor (more than
//!   20 MiB up to 2.9, at least `large_segment_size` after); `large_segment_size` is more than
//!   10 MiB; every division is 0 or a power of two; the GC threshold is 0 (off) or strictly
//!   between 0 and 1; the memory fraction is within [0, 1].
//! - An option given twice takes its last value, as in PyTorch (whose parser overwrites).
//! - A malformed reserve value is ignored, its reason kept in `ignored`, as PyTorch logs and
//!   ignores it.
//! - [`Syntax::Gpumem`] is PyTorch's syntax plus gpumem's own keys (`plan:PATH`,
//!   `plan_record:N`, `pytorch:MAJOR.MINOR`: the release whose decisions the allocator
//!   follows), read from
//!   `GPUMEM_ALLOC_CONF` and gpumem's own snapshots; where only PyTorch's syntax is valid
//!   ([`Syntax::PyTorch`]: `PYTORCH_CUDA_ALLOC_CONF`, `_set_allocator_settings`, the command
//!   line's `--config`) gpumem's keys are refused by name. The plan's path is kept
//!   as given (it cannot hold `,` `:` `[` `]` or spaces, the syntax's separators); reading
//!   the file is the caller's business, the configuration stays pure.

use serde::Serialize;

/// The most trace events `plan_record` may ask for (64 bytes each while recorded).
pub const MAX_PLAN_RECORD: usize = 1 << 20;

/// Bytes in a MiB: option names say "mb" but mean MiB.
const MIB: u64 = 1 << 20;

/// Number of size intervals of `roundup_power2_divisions` (1 MiB, 2 MiB, ... 32 GiB and up).
pub const ROUNDUP_INTERVALS: usize = 16;

/// The smallest `max_split_size_mb` accepted is one more than this.
pub const MAX_SPLIT_SIZE_FLOOR_MB: i64 = 20;

/// Upper bound of `pinned_num_register_threads`.
const PINNED_MAX_REGISTER_THREADS: u64 = 128;

/// Bytes in a GiB (`expandable_segments_reserve:40G`).
const GIB: u64 = 1 << 30;

/// Default of `large_segment_size_mb` (PyTorch's `kLargeBuffer`): 20 MiB.
pub const DEFAULT_LARGE_SEGMENT_SIZE: u64 = 20 << 20;

/// `large_segment_size_mb` must exceed this (`kMinLargeAlloc` in MiB).
const LARGE_SEGMENT_FLOOR_MB: u64 = 10;

/// A PyTorch release whose allocator gpumem follows: 2.0 to 2.15 (`--pytorch`,
/// `pytorch:MAJOR.MINOR`). Releases differ in how the pools order free blocks of equal size
/// ([`crate::allocator::FitOrder::of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PyTorchVersion {
    minor: u8,
}

impl PyTorchVersion {
    /// The newest release gpumem knows: its default.
    pub const LATEST: PyTorchVersion = PyTorchVersion { minor: 15 };

    /// Release `major.minor`, if gpumem knows it (2.0 to 2.15).
    pub fn new(major: u32, minor: u32) -> Option<PyTorchVersion> {
        (major == 2 && minor <= u32::from(Self::LATEST.minor))
            .then_some(PyTorchVersion { minor: minor as u8 })
    }

    /// The minor release number (the major is 2).
    pub fn minor(self) -> u32 {
        u32::from(self.minor)
    }
}

impl Default for PyTorchVersion {
    fn default() -> Self {
        Self::LATEST
    }
}

impl std::fmt::Display for PyTorchVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "2.{}", self.minor)
    }
}

impl std::str::FromStr for PyTorchVersion {
    type Err = String;

    /// `MAJOR.MINOR`, 2.0 to 2.15; anything else is refused with the range.
    fn from_str(s: &str) -> Result<Self, String> {
        let refuse = || {
            format!(
                "PyTorch version `{s}` is not one gpumem follows: give 2.0 to {} as MAJOR.MINOR",
                Self::LATEST
            )
        };
        let (major, minor) = s.split_once('.').ok_or_else(refuse)?;
        // Plain decimal numbers without leading zeros, as releases are named.
        let number = |t: &str| {
            let plain = matches!(t.len(), 1..=2) && t.bytes().all(|b| b.is_ascii_digit());
            (plain && (t == "0" || !t.starts_with('0')))
                .then(|| t.parse::<u32>().ok())
                .flatten()
        };
        let (Some(major), Some(minor)) = (number(major), number(minor)) else {
            return Err(refuse());
        };
        PyTorchVersion::new(major, minor).ok_or_else(refuse)
    }
}

/// A configuration error that names the option at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid allocator configuration {input:?}: {reason}")]
pub struct ConfigError {
    /// The whole string that was parsed.
    pub input: String,
    /// What was wrong, naming the option.
    pub reason: String,
}

/// An `expandable_segments_reserve` value: how much address space each expandable segment
/// reserves, as a fraction of the device's memory (`0.5`) or in GiB (`40G`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReserveSpec {
    /// A positive fraction of the device's memory.
    Fraction(f64),
    /// A positive number of GiB.
    Gib(f64),
}

impl ReserveSpec {
    /// PyTorch's reading of a reserve value: a positive finite number, with a trailing `G`
    /// (or `g`) for GiB; anything else is `None` (PyTorch logs it and keeps its default).
    pub fn parse(token: &str) -> Option<ReserveSpec> {
        let (number, gib) = match token.strip_suffix(['G', 'g']) {
            Some(n) => (n, true),
            None => (token, false),
        };
        let value: f64 = number.parse().ok()?;
        (value.is_finite() && value > 0.0).then_some(if gib {
            ReserveSpec::Gib(value)
        } else {
            ReserveSpec::Fraction(value)
        })
    }

    /// The bytes it asks of a device of `total` bytes, never more than the 9/8 of it that a
    /// segment reserves by default (`clamp_reserve_bytes`).
    pub fn bytes(self, total: u64) -> u64 {
        let wanted = match self {
            ReserveSpec::Fraction(f) => f * total as f64,
            ReserveSpec::Gib(g) => g * GIB as f64,
        };
        (wanted as u64).min(default_reserve(total))
    }
}

impl std::fmt::Display for ReserveSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReserveSpec::Fraction(v) => write!(f, "{v}"),
            ReserveSpec::Gib(v) => write!(f, "{v}G"),
        }
    }
}

/// The address space an expandable segment reserves by default: 9/8 of the device.
pub fn default_reserve(total: u64) -> u64 {
    total.saturating_add(total / 8)
}

/// The pinned host allocator's keys. gpumem does not model the host allocator: they are
/// validated as each release does and kept, so that a pasted configuration is accepted and
/// a recording's settings are shown whole.
#[derive(Debug, Clone, PartialEq)]
pub struct PinnedSettings {
    /// `pinned_use_cuda_host_register`: malloc plus `cudaHostRegister`.
    pub use_cuda_host_register: bool,
    /// `pinned_num_register_threads`: a power of two, at most 128.
    pub num_register_threads: u64,
    /// `pinned_use_background_threads`: events processed on a thread of their own.
    pub use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb` in bytes (0: none).
    pub reserve_segment_size: u64,
    /// `pinned_max_round_threshold_mb` in bytes: no power-of-two rounding above it.
    pub max_round_threshold: u64,
    /// `pinned_max_cached_size_mb` in bytes: larger blocks are freed, not cached.
    pub max_cached_size: u64,
    /// `pinned_free_catch_all`.
    pub free_catch_all: bool,
}

impl Default for PinnedSettings {
    fn default() -> Self {
        PinnedSettings {
            use_cuda_host_register: false,
            num_register_threads: 1,
            use_background_threads: false,
            reserve_segment_size: 0,
            max_round_threshold: u64::MAX,
            max_cached_size: u64::MAX,
            free_catch_all: false,
        }
    }
}

/// The caching allocator's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks of this size or more are never split (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// Divisions per power-of-two interval for size rounding (0 or 1: plain 512-byte rounding).
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// Fraction of the allowed memory above which cached segments are garbage-collected
    /// (0: off). Only acts once a memory fraction is set.
    pub garbage_collection_threshold: f64,
    /// Grow segments through virtual memory instead of allocating new ones.
    pub expandable_segments: bool,
    /// `large_segment_size_mb` in bytes (20 MiB by default, 2.11+): the segment of a 1–10 MiB
    /// request, the large pool's expandable page, the floor of `max_split_size_mb`.
    pub large_segment_size: u64,
    /// `max_non_split_rounding_mb` in bytes: how much larger than an oversize request a
    /// cached oversize block that serves it may be (less than this).
    pub max_non_split_rounding_size: u64,
    /// `per_process_memory_fraction` (1.0: no limit), applied when an allocator is built.
    pub per_process_memory_fraction: f64,
    /// `throw_on_cudamalloc_oom`: with a memory fraction, a request past the limit fails at
    /// once, skipping the rest of the retry chain (counted in `num_oom_rejections`).
    pub throw_on_cudamalloc_oom: bool,
    /// `expandable_segments_reserve`: each expandable segment's address space.
    pub expandable_segments_reserve: Option<ReserveSpec>,
    /// `expandable_segments_reserve_by_class`: reserves per stream class, in the given order.
    /// PyTorch tags streams with classes at run time (an API, not a key), which recordings do
    /// not keep: gpumem keeps the table and uses the global reserve.
    pub expandable_segments_reserve_by_class: Vec<(String, ReserveSpec)>,
    /// `graph_capture_record_stream_reuse` (validated and kept; no effect: it lets blocks
    /// freed during a capture be reused in it, which replay follows from the recording's own
    /// completions, and the core does not model).
    pub graph_capture_record_stream_reuse: bool,
    /// Release the allocator lock around `cudaMalloc` (accepted for compatibility).
    pub release_lock_on_cudamalloc: bool,
    /// The pinned host allocator's keys (validated and kept).
    pub pinned: PinnedSettings,
    /// gpumem only: the file of a placement plan to follow (Note [Planned placement]).
    pub plan: Option<String>,
    /// gpumem only: record this many trace events, then plan from them and follow the plan
    /// (`plan_record:N`, at most [`MAX_PLAN_RECORD`]; `gpumem-torch` does the planning).
    pub plan_record: Option<usize>,
    /// gpumem only: the PyTorch release whose decisions (and keys) the allocator follows
    /// (2.15 by default).
    pub pytorch: PyTorchVersion,
    /// Values of the last parse that PyTorch logs and ignores (a malformed reserve), each
    /// with the reason.
    pub ignored: Vec<String>,
    /// The last string parsed, as given.
    pub last_settings: String,
}

/// Which keys a settings string may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// PyTorch's keys only (`PYTORCH_CUDA_ALLOC_CONF`, `_set_allocator_settings`).
    PyTorch,
    /// PyTorch's keys and gpumem's own (`GPUMEM_ALLOC_CONF`, gpumem's snapshots).
    Gpumem,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            large_segment_size: DEFAULT_LARGE_SEGMENT_SIZE,
            max_non_split_rounding_size: DEFAULT_LARGE_SEGMENT_SIZE,
            per_process_memory_fraction: 1.0,
            throw_on_cudamalloc_oom: false,
            expandable_segments_reserve: None,
            expandable_segments_reserve_by_class: Vec::new(),
            graph_capture_record_stream_reuse: false,
            release_lock_on_cudamalloc: false,
            pinned: PinnedSettings::default(),
            plan: None,
            plan_record: None,
            pytorch: PyTorchVersion::LATEST,
            ignored: Vec::new(),
            last_settings: String::new(),
        }
    }
}

/// The `allocator_settings` object of a PyTorch snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct AllocatorSettings {
    /// The last settings string parsed.
    pub PYTORCH_CUDA_ALLOC_CONF: String,
    /// `max_split_size` in bytes; -1 when unlimited.
    pub max_split_size: i64,
    /// The GC threshold.
    pub garbage_collection_threshold: f64,
    /// Whether expandable segments are on.
    pub expandable_segments: bool,
    /// Pinned-memory registration threads.
    pub pinned_num_register_threads: u64,
    /// Whether the lock is released around `cudaMalloc`.
    pub release_lock_on_cudamalloc: bool,
    /// Whether pinned memory uses `cudaHostRegister`.
    pub pinned_use_cuda_host_register: bool,
    /// Whether capture reuses blocks with recorded streams.
    pub graph_capture_record_stream_reuse: bool,
    /// Interval start in MiB ("1", "2", ... "32768") → divisions.
    pub roundup_power2_divisions: std::collections::BTreeMap<String, u64>,
}

/// Which environment variable a release's device allocator reads its settings from, of
/// `PYTORCH_CUDA_ALLOC_CONF` (`cuda`) and `PYTORCH_ALLOC_CONF` (`generic`), and what it
/// ignores: up to 2.9 only the CUDA variable reaches the device allocator (2.9 reads the
/// generic one for its device-generic keys, which the 2.9 device allocator does not consult);
/// from 2.10 the CUDA variable wins and the generic one is read only when it is unset.
/// Returns the settings string in force and a variable that is set but ignored, if any.
pub fn settings_from_env<'a>(
    version: PyTorchVersion,
    cuda: Option<&'a str>,
    generic: Option<&'a str>,
) -> (Option<&'a str>, Option<&'a str>) {
    let used = if version.minor() <= LAST_OWN_PARSER || cuda.is_some() {
        cuda
    } else {
        generic
    };
    let ignored = [cuda, generic]
        .into_iter()
        .flatten()
        .find(|s| Some(*s) != used);
    (used, ignored)
}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string on top of the defaults (the newest
    /// release's keys and rules).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first option that is unknown, malformed or out of range.
    pub fn parse(settings: &str) -> Result<Self, ConfigError> {
        Self::parse_as(settings, Syntax::PyTorch)
    }

    /// Parses a settings string in `syntax` on top of the defaults.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first option that is unknown (in that syntax), malformed
    /// or out of range.
    pub fn parse_as(settings: &str, syntax: Syntax) -> Result<Self, ConfigError> {
        let mut config = AllocatorConfig::default();
        config.apply_as(settings, syntax)?;
        Ok(config)
    }

    /// Parses a settings string in `syntax` with the keys and rules of release `pytorch`
    /// (a `pytorch:` key in the string, gpumem's syntax, overrides it).
    ///
    /// # Errors
    /// As [`AllocatorConfig::parse_as`], also naming a key the release does not have.
    pub fn parse_for(
        settings: &str,
        syntax: Syntax,
        pytorch: PyTorchVersion,
    ) -> Result<Self, ConfigError> {
        let mut config = AllocatorConfig {
            pytorch,
            ..AllocatorConfig::default()
        };
        config.apply_as(settings, syntax)?;
        Ok(config)
    }

    /// A recording's settings string applied as far as it goes: each option that is valid
    /// takes effect; each that is not (a key of a newer release, a typo) is skipped, its
    /// reason returned. Nothing is refused.
    pub fn apply_lenient(&mut self, settings: &str, syntax: Syntax) -> Vec<String> {
        let mut parser = Parser::new(settings, syntax, true);
        let mut next = self.clone();
        // A lenient parse records each problem and goes on; it cannot fail.
        let _ = parser.parse_into(&mut next);
        next.last_settings = settings.to_string();
        *self = next;
        parser.problems
    }

    /// Applies a settings string as `torch.cuda.memory._set_allocator_settings` does: the
    /// fragmentation knobs go back to their defaults first, other options keep their
    /// values unless the string sets them. On error nothing changes.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first option that is unknown, malformed or out of range.
    pub fn apply(&mut self, settings: &str) -> Result<(), ConfigError> {
        self.apply_as(settings, Syntax::PyTorch)
    }

    /// [`AllocatorConfig::apply`] in `syntax`.
    ///
    /// # Errors
    /// As [`AllocatorConfig::apply`].
    pub fn apply_as(&mut self, settings: &str, syntax: Syntax) -> Result<(), ConfigError> {
        let mut next = self.clone();
        Parser::new(settings, syntax, false)
            .parse_into(&mut next)
            .map_err(|reason| ConfigError {
                input: settings.to_string(),
                reason,
            })?;
        next.last_settings = settings.to_string();
        *self = next;
        Ok(())
    }

    /// The divisions that apply to a request of `size` bytes: the entry of the interval
    /// `[2^(20+i), 2^(21+i))`, with entry 0 covering everything smaller and entry 15
    /// everything larger.
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log2 = u64::from(size.max(1).ilog2());
        let index = log2.saturating_sub(20).min(ROUNDUP_INTERVALS as u64 - 1);
        self.roundup_power2_divisions[index as usize]
    }

    /// The address space a new expandable segment reserves on a device of `total` bytes:
    /// `expandable_segments_reserve` if set, else 9/8 of the device. (A class's reserve
    /// needs the stream's class, which PyTorch sets at run time and gpumem never sees.)
    pub fn expandable_reserve(&self, total: u64) -> u64 {
        self.expandable_segments_reserve
            .map_or_else(|| default_reserve(total), |spec| spec.bytes(total))
    }

    /// Whether a reserve key changes how much address space expandable segments reserve.
    pub fn reserve_set(&self) -> bool {
        self.expandable_segments_reserve.is_some()
            || !self.expandable_segments_reserve_by_class.is_empty()
    }

    /// The settings as PyTorch's snapshot `allocator_settings` reports them.
    pub fn settings(&self) -> AllocatorSettings {
        AllocatorSettings {
            PYTORCH_CUDA_ALLOC_CONF: self.last_settings.clone(),
            max_split_size: max_split_size_stat(self.max_split_size),
            garbage_collection_threshold: self.garbage_collection_threshold,
            expandable_segments: self.expandable_segments,
            pinned_num_register_threads: self.pinned.num_register_threads,
            release_lock_on_cudamalloc: self.release_lock_on_cudamalloc,
            pinned_use_cuda_host_register: self.pinned.use_cuda_host_register,
            graph_capture_record_stream_reuse: self.graph_capture_record_stream_reuse,
            roundup_power2_divisions: self
                .roundup_power2_divisions
                .iter()
                .enumerate()
                .map(|(i, &d)| ((1u64 << i).to_string(), d))
                .collect(),
        }
    }
}

/// `max_split_size` as `memory_stats()` reports it: the unlimited value reads as -1.
pub(crate) fn max_split_size_stat(max_split_size: u64) -> i64 {
    i64::try_from(max_split_size).unwrap_or(-1)
}

fn tokenize(settings: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    for c in settings.chars() {
        match c {
            ',' | ':' | '[' | ']' => {
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
                tokens.push(c.to_string());
            }
            c if c.is_whitespace() => {}
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        tokens.push(word);
    }
    tokens
}

/// The release that first reads each key added after 2.0 (found in the key names each
/// release's `libc10` and `libc10_cuda` hold). A key is refused for an older release.
const KEYS_SINCE: &[(&str, u32)] = &[
    ("expandable_segments", 1),
    ("release_lock_on_cudamalloc", 2),
    ("release_lock_on_hipmalloc", 2),
    ("pinned_use_cuda_host_register", 2),
    ("pinned_use_hip_host_register", 2),
    ("pinned_num_register_threads", 2),
    ("max_non_split_rounding_mb", 6),
    ("pinned_use_background_threads", 6),
    ("graph_capture_record_stream_reuse", 9),
    ("per_process_memory_fraction", 10),
    ("pinned_reserve_segment_size_mb", 10),
    ("large_segment_size_mb", 11),
    ("throw_on_cudamalloc_oom", 12),
    ("pinned_free_catch_all", 12),
    ("pinned_max_round_threshold_mb", 13),
    ("pinned_max_cached_size_mb", 13),
    ("expandable_segments_reserve", 15),
    ("expandable_segments_reserve_by_class", 15),
];

/// The keys read before all others, each in a pass of its own, in this order: gpumem's
/// `pytorch` (whose release's keys and rules apply to the rest), then, as PyTorch reads it
/// first, `large_segment_size_mb` (the floor of the split sizes).
const FIRST_KEYS: [&str; 2] = ["pytorch", "large_segment_size_mb"];

/// Up to this release the device allocator parsed its own settings (`CUDAAllocatorConfig`:
/// floors exclusive, 32-bit sizes, the `>` quirk); from the next one the device-generic
/// parser reads the shared keys.
const LAST_OWN_PARSER: u32 = 9;

struct Parser {
    tokens: Vec<String>,
    pos: usize,
    syntax: Syntax,
    /// Skip a bad option, noting why, instead of failing (a recording's string).
    lenient: bool,
    problems: Vec<String>,
}

impl Parser {
    fn new(settings: &str, syntax: Syntax, lenient: bool) -> Parser {
        Parser {
            tokens: tokenize(settings),
            pos: 0,
            syntax,
            lenient,
            problems: Vec::new(),
        }
    }

    fn next(&mut self) -> Option<&str> {
        let token = self.tokens.get(self.pos)?;
        self.pos += 1;
        Some(token)
    }

    fn expect(&mut self, what: &str, option: &str) -> Result<(), String> {
        match self.next() {
            Some(t) if t == what => Ok(()),
            Some(t) => Err(format!("expected `{what}` after `{option}`, found `{t}`")),
            None => Err(format!("expected `{what}` after `{option}`, found the end")),
        }
    }

    fn value(&mut self, option: &str) -> Result<String, String> {
        self.expect(":", option)?;
        match self.next() {
            Some(t) if !matches!(t, "," | ":" | "[" | "]") => Ok(t.to_string()),
            Some(t) => Err(format!("`{option}` needs a value, found `{t}`")),
            None => Err(format!("`{option}` needs a value")),
        }
    }

    /// Moves past the rest of the current option: to the next `,` outside brackets.
    fn skip_option(&mut self) {
        let mut depth = 0usize;
        while let Some(t) = self.tokens.get(self.pos) {
            match t.as_str() {
                "," if depth == 0 => return,
                "[" => depth += 1,
                "]" => depth = depth.saturating_sub(1),
                _ => {}
            }
            self.pos += 1;
        }
    }

    /// The options in order: each that `read` takes is read, the others are moved past (a
    /// pass for other keys); after each, a `,` or the end. A lenient parser notes an
    /// option's error and goes on after its `,`.
    fn each_option(
        &mut self,
        config: &mut AllocatorConfig,
        read: impl Fn(&str) -> bool,
    ) -> Result<(), String> {
        self.pos = 0;
        while let Some(option) = self.next().map(str::to_string) {
            let start = self.pos;
            let handled = if read(&option) {
                self.option(&option, config)
            } else {
                self.skip_option();
                Ok(())
            };
            let done = handled.and_then(|()| match self.next() {
                Some(t) if t != "," => Err(format!(
                    "expected `,` after the value of `{option}`, found `{t}`"
                )),
                _ => Ok(()),
            });
            if let Err(reason) = done {
                if !self.lenient {
                    return Err(reason);
                }
                self.problems.push(reason);
                // From the option's own start, so that brackets are counted whole.
                self.pos = start;
                self.skip_option();
                self.pos += 1;
            }
        }
        Ok(())
    }

    /// The [`FIRST_KEYS`], then, after the per-parse resets, every other key in order.
    fn parse_into(&mut self, config: &mut AllocatorConfig) -> Result<(), String> {
        for first in FIRST_KEYS {
            self.each_option(config, |option| option == first)?;
        }
        config.max_split_size = u64::MAX;
        config.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
        config.garbage_collection_threshold = 0.0;
        if config.pytorch.minor() >= 11 {
            config.max_non_split_rounding_size = config.large_segment_size;
        }
        config.ignored.clear();
        self.each_option(config, |option| !FIRST_KEYS.contains(&option))
    }

    fn option(&mut self, option: &str, config: &mut AllocatorConfig) -> Result<(), String> {
        let version = config.pytorch;
        if let Some(&(_, since)) = KEYS_SINCE.iter().find(|(k, _)| *k == option)
            && version.minor() < since
        {
            return Err(format!(
                "`{option}` is not a key of PyTorch {version}'s allocator (it came in 2.{since})"
            ));
        }
        match option {
            "max_split_size_mb" => {
                config.max_split_size = self.split_size(option, config)?;
            }
            "max_non_split_rounding_mb" => {
                config.max_non_split_rounding_size = self.split_size(option, config)?;
            }
            "large_segment_size_mb" => {
                let mb = self.unsigned(option)?;
                if mb <= LARGE_SEGMENT_FLOOR_MB {
                    return Err(format!(
                        "`large_segment_size_mb` must be more than {LARGE_SEGMENT_FLOOR_MB}, not {mb}"
                    ));
                }
                config.large_segment_size = mb.min(u64::MAX / MIB) * MIB;
            }
            "garbage_collection_threshold" => {
                let v = self.value(option)?;
                let t: f64 = v.parse().map_err(|_| {
                    format!("`garbage_collection_threshold` must be a number, not `{v}`")
                })?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(format!(
                        "`garbage_collection_threshold` must be strictly between 0 and 1, not {v}"
                    ));
                }
                config.garbage_collection_threshold = t;
            }
            "per_process_memory_fraction" => {
                let v = self.value(option)?;
                let f: f64 = v.parse().map_err(|_| {
                    format!("`per_process_memory_fraction` must be a number, not `{v}`")
                })?;
                if !(0.0..=1.0).contains(&f) {
                    return Err(format!(
                        "`per_process_memory_fraction` must be within [0, 1], not {v}"
                    ));
                }
                config.per_process_memory_fraction = f;
            }
            "roundup_power2_divisions" => {
                let own_parser = version.minor() <= LAST_OWN_PARSER;
                config.roundup_power2_divisions = self.divisions(own_parser)?;
            }
            "expandable_segments" => config.expandable_segments = self.boolean(option)?,
            "throw_on_cudamalloc_oom" => config.throw_on_cudamalloc_oom = self.boolean(option)?,
            "graph_capture_record_stream_reuse" => {
                config.graph_capture_record_stream_reuse = self.boolean(option)?;
            }
            "expandable_segments_reserve" => {
                let v = self.value(option)?;
                match ReserveSpec::parse(&v) {
                    Some(spec) => config.expandable_segments_reserve = Some(spec),
                    None => config.ignored.push(reserve_ignored(option, &v)),
                }
            }
            "expandable_segments_reserve_by_class" => {
                config.expandable_segments_reserve_by_class = self.reserve_classes(config)?;
            }
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                config.release_lock_on_cudamalloc = self.boolean(option)?;
            }
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                config.pinned.use_cuda_host_register = self.boolean(option)?;
            }
            "pinned_use_background_threads" => {
                config.pinned.use_background_threads = self.boolean(option)?;
            }
            "pinned_free_catch_all" => config.pinned.free_catch_all = self.boolean(option)?,
            "pinned_num_register_threads" => {
                let n = self.unsigned(option)?;
                if !n.is_power_of_two() || n > PINNED_MAX_REGISTER_THREADS {
                    return Err(format!(
                        "`pinned_num_register_threads` must be a power of two of at most {PINNED_MAX_REGISTER_THREADS}, not {n}"
                    ));
                }
                config.pinned.num_register_threads = n;
            }
            "pinned_reserve_segment_size_mb" => {
                let mb = self.unsigned(option)?;
                if mb == 0 {
                    return Err("`pinned_reserve_segment_size_mb` must be more than 0".into());
                }
                config.pinned.reserve_segment_size = mb.saturating_mul(MIB);
            }
            "pinned_max_round_threshold_mb" => {
                config.pinned.max_round_threshold = self.unsigned(option)?.saturating_mul(MIB);
            }
            "pinned_max_cached_size_mb" => {
                config.pinned.max_cached_size = self.unsigned(option)?.saturating_mul(MIB);
            }
            "backend" => {
                let v = self.value(option)?;
                match v.as_str() {
                    "native" => {}
                    "cudaMallocAsync" => {
                        return Err("`backend:cudaMallocAsync` is not this allocator: gpumem implements the native backend".into());
                    }
                    _ => {
                        return Err(format!(
                            "`backend` must be `native` or `cudaMallocAsync`, not `{v}`"
                        ));
                    }
                }
            }
            "plan" if self.syntax == Syntax::PyTorch => {
                return Err("`plan` is gpumem's own key: set it in GPUMEM_ALLOC_CONF (replay takes the file with --plan), not where PyTorch's syntax is read".into());
            }
            "plan" => {
                let v = self.value(option)?;
                if config.plan_record.is_some() {
                    return Err("`plan` and `plan_record` exclude each other: a job follows a plan file or plans itself".into());
                }
                config.plan = Some(v);
            }
            "plan_record" if self.syntax == Syntax::PyTorch => {
                return Err("`plan_record` is gpumem's own key: set it in GPUMEM_ALLOC_CONF, not where PyTorch's syntax is read".into());
            }
            "plan_record" => {
                let n = self.unsigned(option)?;
                if n == 0 || n > MAX_PLAN_RECORD as u64 {
                    return Err(format!(
                        "`plan_record` must be between 1 and {MAX_PLAN_RECORD} events, not {n}"
                    ));
                }
                if config.plan.is_some() {
                    return Err("`plan` and `plan_record` exclude each other: a job follows a plan file or plans itself".into());
                }
                config.plan_record = Some(n as usize);
            }
            "pytorch" if self.syntax == Syntax::PyTorch => {
                return Err("`pytorch` is gpumem's own key: set it in GPUMEM_ALLOC_CONF (the commands take --pytorch), not where PyTorch's syntax is read".into());
            }
            "pytorch" => {
                config.pytorch = self.value(option)?.parse()?;
            }
            other => return Err(format!("unrecognized option `{other}`")),
        }
        Ok(())
    }

    /// A non-negative decimal integer (PyTorch's `toSizeT`).
    fn unsigned(&mut self, option: &str) -> Result<u64, String> {
        let v = self.value(option)?;
        if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "`{option}` must be a non-negative integer, not `{v}`"
            ));
        }
        v.parse::<u64>().map_err(|_| {
            format!(
                "`{option}` is {v}, past the largest 64-bit size ({})",
                u64::MAX
            )
        })
    }

    /// `max_split_size_mb` or `max_non_split_rounding_mb`, in bytes, checked against the
    /// release's floor: more than 20 (a 32-bit integer) up to 2.9; at least 20 in 2.10; at
    /// least `large_segment_size_mb` from 2.11 (where it is 20 unless set).
    fn split_size(&mut self, option: &str, config: &AllocatorConfig) -> Result<u64, String> {
        let mb = if config.pytorch.minor() <= LAST_OWN_PARSER {
            let v = self.value(option)?;
            let mb: i32 = v.parse().map_err(|_| {
                format!("`{option}` must be an integer (MiB) that fits 32 bits, not `{v}`")
            })?;
            if i64::from(mb) <= MAX_SPLIT_SIZE_FLOOR_MB {
                return Err(format!(
                    "`{option}` must be greater than {MAX_SPLIT_SIZE_FLOOR_MB} in PyTorch {}, not {mb}",
                    config.pytorch
                ));
            }
            mb as u64
        } else {
            let mb = self.unsigned(option)?;
            let floor = config.large_segment_size / MIB;
            if mb < floor {
                return Err(format!(
                    "`{option}` must be at least {floor} (large_segment_size_mb), not {mb}"
                ));
            }
            mb
        };
        Ok(mb.min(u64::MAX / MIB) * MIB)
    }

    fn boolean(&mut self, option: &str) -> Result<bool, String> {
        match self.value(option)?.as_str() {
            "True" => Ok(true),
            "False" => Ok(false),
            v => Err(format!(
                "`{option}` must be `True` or `False` (case-sensitive), not `{v}`"
            )),
        }
    }

    /// `expandable_segments_reserve_by_class:[class:value,...]`: a malformed value is noted
    /// and its entry skipped, as PyTorch logs and skips it; a later entry of a class
    /// replaces an earlier one.
    fn reserve_classes(
        &mut self,
        config: &mut AllocatorConfig,
    ) -> Result<Vec<(String, ReserveSpec)>, String> {
        const OPTION: &str = "expandable_segments_reserve_by_class";
        self.expect(":", OPTION)?;
        self.expect("[", OPTION)?;
        let mut classes: Vec<(String, ReserveSpec)> = Vec::new();
        loop {
            let name = match self.next() {
                Some("]") => return Ok(classes),
                Some(t) if !matches!(t, "," | ":" | "[") => t.to_string(),
                Some(t) => return Err(format!("`{OPTION}` expects a class name, found `{t}`")),
                None => return Err(format!("`{OPTION}` list is not closed with `]`")),
            };
            let value = self.value(OPTION)?;
            match ReserveSpec::parse(&value) {
                Some(spec) => match classes.iter_mut().find(|(n, _)| *n == name) {
                    Some(entry) => entry.1 = spec,
                    None => classes.push((name, spec)),
                },
                None => config
                    .ignored
                    .push(reserve_ignored(&format!("{OPTION} class `{name}`"), &value)),
            }
            if self.tokens.get(self.pos).is_some_and(|t| t == ",") {
                self.pos += 1;
            }
        }
    }

    /// `roundup_power2_divisions:N` or `roundup_power2_divisions:[k:v,...,>:v]`. `>` fills
    /// the intervals after the previous key's; up to 2.9 (`own_parser`) it started at that
    /// key's own interval, overwriting its value (a quirk kept for those releases).
    fn divisions(&mut self, own_parser: bool) -> Result<[u64; ROUNDUP_INTERVALS], String> {
        const OPTION: &str = "roundup_power2_divisions";
        self.expect(":", OPTION)?;
        let mut table = [0u64; ROUNDUP_INTERVALS];
        let first = self.next().map(str::to_string);
        match first.as_deref() {
            Some("[") => {}
            Some(v) => {
                let n: u64 = v
                    .parse()
                    .map_err(|_| format!("`{OPTION}` must be a number or a list, not `{v}`"))?;
                if !n.is_power_of_two() {
                    return Err(format!("`{OPTION}` must be a power of two, not {n}"));
                }
                return Ok([n; ROUNDUP_INTERVALS]);
            }
            None => return Err(format!("`{OPTION}` needs a value")),
        }
        let mut first_key = true;
        let mut last_index = 0usize;
        loop {
            let key = self
                .next()
                .ok_or_else(|| format!("`{OPTION}` list is not closed with `]`"))?
                .to_string();
            if key == "]" {
                return Err(format!(
                    "`{OPTION}` list is empty: give `[size_mb:divisions,...,>:divisions]`"
                ));
            }
            self.expect(":", OPTION)?;
            let v = self
                .next()
                .ok_or_else(|| format!("`{OPTION}` entry `{key}` needs a value"))?
                .to_string();
            let value: u64 = v
                .parse()
                .map_err(|_| format!("`{OPTION}` value for `{key}` must be a number, not `{v}`"))?;
            if value != 0 && !value.is_power_of_two() {
                return Err(format!(
                    "`{OPTION}` value for `{key}` must be 0 or a power of two, not {value}"
                ));
            }
            if key == ">" {
                let from = if own_parser {
                    last_index
                } else {
                    last_index + 1
                };
                table[from.min(ROUNDUP_INTERVALS)..].fill(value);
            } else {
                let mb: u64 = key.parse().map_err(|_| {
                    format!("`{OPTION}` keys must be sizes in MiB or `>`, not `{key}`")
                })?;
                if !mb.is_power_of_two() {
                    return Err(format!(
                        "`{OPTION}` key must be a power of two (MiB), not {mb}"
                    ));
                }
                let index = (mb.ilog2() as usize).min(ROUNDUP_INTERVALS - 1);
                if first_key {
                    table[..=index].fill(value);
                    first_key = false;
                } else {
                    table[index] = value;
                }
                last_index = index;
            }
            match self.next() {
                Some(",") => {}
                Some("]") => return Ok(table),
                Some(t) => {
                    return Err(format!(
                        "expected `,` or `]` in `{OPTION}` list, found `{t}`"
                    ));
                }
                None => return Err(format!("`{OPTION}` list is not closed with `]`")),
            }
        }
    }
}

/// Why a reserve value is ignored, in PyTorch's terms.
fn reserve_ignored(what: &str, value: &str) -> String {
    format!(
        "{what}: `{value}` is not a positive, finite fraction (0.5) or size in GiB (40G); PyTorch ignores it and keeps the default reserve"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pytorch_key_is_gpumems_own_and_names_a_known_release() {
        let gpumem = |text: &str| AllocatorConfig::parse_as(text, Syntax::Gpumem);
        assert_eq!(gpumem("").expect("empty").pytorch, PyTorchVersion::LATEST);
        let old = gpumem("pytorch:2.11,max_split_size_mb:64").expect("valid");
        assert_eq!(old.pytorch.to_string(), "2.11");
        assert_eq!(old.max_split_size, 64 << 20);
        // Refused by name where only PyTorch's syntax is valid.
        let e = AllocatorConfig::parse("pytorch:2.11").expect_err("PyTorch's syntax");
        assert!(e.reason.contains("gpumem's own key"), "{e}");
        for bad in [
            "2.16", "3.0", "1.13", "2", "2.", ".5", "2.x", "02.015", "2.1.1",
        ] {
            let e = gpumem(&format!("pytorch:{bad}")).expect_err(bad);
            assert!(e.reason.contains("2.0 to 2.15"), "{bad}: {e}");
        }
        assert!(gpumem("pytorch:").is_err());
        // The old value stays on a bad string.
        let mut config = old.clone();
        assert!(config.apply_as("pytorch:9.9", Syntax::Gpumem).is_err());
        assert_eq!(config, old);
    }

    #[test]
    fn an_empty_division_list_says_so_and_a_repeated_option_takes_its_last_value() {
        let err = AllocatorConfig::parse("roundup_power2_divisions:[]").expect_err("empty");
        assert!(err.to_string().contains("list is empty"), "{err}");
        let c = AllocatorConfig::parse("max_split_size_mb:100,max_split_size_mb:200").expect("ok");
        assert_eq!(c.max_split_size, 200 * MIB);
    }

    #[test]
    fn rejected_settings_name_the_option() {
        refused(&[
            ("max_split_size_mb:19", "max_split_size_mb"),
            ("max_split_size_mb:abc", "max_split_size_mb"),
            ("max_split_size_mb:-1", "max_split_size_mb"),
            (
                "garbage_collection_threshold:1.0",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:0",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:nan",
                "garbage_collection_threshold",
            ),
            ("roundup_power2_divisions:3", "roundup_power2_divisions"),
            ("roundup_power2_divisions:0", "roundup_power2_divisions"),
            (
                "roundup_power2_divisions:[256:3]",
                "roundup_power2_divisions",
            ),
            (
                "roundup_power2_divisions:[300:2]",
                "roundup_power2_divisions",
            ),
            (
                "roundup_power2_divisions:[256:2",
                "roundup_power2_divisions",
            ),
            ("expandable_segments:true", "expandable_segments"),
            ("foo:1", "foo"),
            (
                "pinned_num_register_threads:256",
                "pinned_num_register_threads",
            ),
            (
                "pinned_num_register_threads:3",
                "pinned_num_register_threads",
            ),
            ("backend:cudaMallocAsync", "backend"),
            ("max_split_size_mb", "max_split_size_mb"),
            (
                "max_split_size_mb:100 expandable_segments:True",
                "max_split_size_mb",
            ),
        ]);
    }

    #[test]
    fn accepted_settings() {
        let c = AllocatorConfig::parse("max_split_size_mb:21").expect("valid");
        assert_eq!(c.max_split_size, 21 * MIB);
        let c = AllocatorConfig::parse(" max_split_size_mb : 256 , expandable_segments : True ")
            .expect("spaces are ignored");
        assert_eq!(c.max_split_size, 256 * MIB);
        assert!(c.expandable_segments);
        let c = AllocatorConfig::parse("garbage_collection_threshold:0.6,release_lock_on_cudamalloc:True,pinned_num_register_threads:8,backend:native,")
            .expect("valid");
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert!(c.release_lock_on_cudamalloc);
        assert_eq!(c.pinned.num_register_threads, 8);
        assert_eq!(
            AllocatorConfig::parse("").expect("empty"),
            AllocatorConfig::default()
        );
    }

    #[test]
    fn each_parse_resets_the_fragmentation_knobs_only() {
        let mut c =
            AllocatorConfig::parse("max_split_size_mb:100,garbage_collection_threshold:0.5")
                .expect("valid");
        c.apply("expandable_segments:True").expect("valid");
        assert_eq!(c.max_split_size, u64::MAX);
        assert_eq!(c.garbage_collection_threshold, 0.0);
        assert!(c.expandable_segments);
        c.apply("max_split_size_mb:64").expect("valid");
        assert!(c.expandable_segments, "other options keep their values");
        assert_eq!(c.last_settings, "max_split_size_mb:64");
        let before = c.clone();
        assert!(c.apply("max_split_size_mb:128,foo:1").is_err());
        assert_eq!(c, before, "a failed parse changes nothing");
    }

    #[test]
    fn division_lists_follow_pytorch_including_the_gt_quirk_up_to_2_9() {
        let list = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]";
        let old = AllocatorConfig::parse_for(list, Syntax::PyTorch, v(9)).expect("valid");
        let mut want = [8u64; 16];
        want[..=8].fill(1);
        want[9] = 2;
        assert_eq!(
            old.roundup_power2_divisions, want,
            "`>` overwrites 1024's entry"
        );
        let new = AllocatorConfig::parse(list).expect("valid");
        want[10] = 4;
        assert_eq!(
            new.roundup_power2_divisions, want,
            "2.10+: `>` starts after it"
        );
        let c = AllocatorConfig::parse("roundup_power2_divisions:[1:4,64:8]").expect("valid");
        let mut want = [0u64; 16];
        want[0] = 4;
        want[6] = 8;
        assert_eq!(c.roundup_power2_divisions, want);
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").expect("valid");
        assert_eq!(c.roundup_power2_divisions, [4; 16]);
        assert_eq!(c.divisions_for(1), 4);
    }

    #[test]
    fn settings_report_like_a_snapshot() {
        let c = AllocatorConfig::parse("max_split_size_mb:100").expect("valid");
        let s = c.settings();
        assert_eq!(s.max_split_size, 104_857_600);
        assert_eq!(s.roundup_power2_divisions.len(), 16);
        assert_eq!(s.roundup_power2_divisions.get("32768"), Some(&0));
        assert_eq!(AllocatorConfig::default().settings().max_split_size, -1);
    }
    /// Each text is refused, with a reason that holds its needle.
    fn refused(cases: &[(&str, &str)]) {
        for &(text, needle) in cases {
            let e = AllocatorConfig::parse(text).expect_err(text);
            assert!(e.reason.contains(needle), "{text}: {e}");
        }
    }

    fn v(minor: u32) -> PyTorchVersion {
        PyTorchVersion::new(2, minor).expect("known")
    }

    #[test]
    fn each_key_is_refused_before_the_release_that_added_it() {
        for &(key, since) in KEYS_SINCE {
            let value = match key {
                "max_non_split_rounding_mb" => "64",
                "pinned_num_register_threads" => "8",
                "large_segment_size_mb" => "12",
                "per_process_memory_fraction" => "0.5",
                "pinned_reserve_segment_size_mb"
                | "pinned_max_round_threshold_mb"
                | "pinned_max_cached_size_mb" => "64",
                "expandable_segments_reserve" => "0.5",
                "expandable_segments_reserve_by_class" => "[serve:0.25]",
                _ => "True",
            };
            let text = format!("{key}:{value}");
            AllocatorConfig::parse_for(&text, Syntax::PyTorch, v(since))
                .unwrap_or_else(|e| panic!("{text} in 2.{since}: {e}"));
            let e =
                AllocatorConfig::parse_for(&text, Syntax::PyTorch, v(since - 1)).expect_err(&text);
            assert!(
                e.reason
                    .contains(&format!("not a key of PyTorch 2.{}", since - 1))
                    && e.reason.contains(&format!("2.{since}")),
                "{e}"
            );
        }
        // A release named in the string itself (gpumem's syntax) decides too.
        let e = AllocatorConfig::parse_as("large_segment_size_mb:12,pytorch:2.10", Syntax::Gpumem)
            .expect_err("2.10 has no large_segment_size_mb");
        assert!(e.reason.contains("2.11"), "{e}");
        // Made-up keys are refused in every release.
        let e = AllocatorConfig::parse("expandable_segments_page_size:4194304")
            .expect_err("no such key");
        assert!(e.reason.contains("unrecognized option"), "{e}");
    }

    #[test]
    fn large_segment_size_is_read_first_and_sets_the_floors() {
        // max_split_size_mb:15 is valid only because large_segment_size_mb, later in the
        // string, lowered the floor to 12.
        let c =
            AllocatorConfig::parse("max_split_size_mb:15,large_segment_size_mb:12").expect("valid");
        assert_eq!(c.large_segment_size, 12 * MIB);
        assert_eq!(c.max_split_size, 15 * MIB);
        assert_eq!(
            c.max_non_split_rounding_size,
            12 * MIB,
            "follows the segment size"
        );
        let e = AllocatorConfig::parse("max_split_size_mb:15").expect_err("floor 20");
        assert!(e.reason.contains("at least 20"), "{e}");
        let e = AllocatorConfig::parse("large_segment_size_mb:40,max_non_split_rounding_mb:30")
            .expect_err("floor 40");
        assert!(e.reason.contains("at least 40"), "{e}");
        for bad in ["10", "0", "-12", "twelve", "12.5"] {
            let e = AllocatorConfig::parse(&format!("large_segment_size_mb:{bad}")).expect_err(bad);
            assert!(e.reason.contains("large_segment_size_mb"), "{bad}: {e}");
        }
        assert_eq!(
            AllocatorConfig::parse("large_segment_size_mb:11")
                .expect("valid")
                .large_segment_size,
            11 * MIB
        );
        // The segment size is kept across parses; the rounding slack and split size are not.
        let mut c = AllocatorConfig::parse("large_segment_size_mb:32,max_non_split_rounding_mb:64")
            .expect("valid");
        assert_eq!(c.max_non_split_rounding_size, 64 * MIB);
        c.apply("expandable_segments:True").expect("valid");
        assert_eq!(c.large_segment_size, 32 * MIB);
        assert_eq!(
            c.max_non_split_rounding_size,
            32 * MIB,
            "reset to the segment size"
        );
        // Before 2.11 the rounding slack survives a parse that does not set it.
        let mut c =
            AllocatorConfig::parse_for("max_non_split_rounding_mb:64", Syntax::PyTorch, v(10))
                .expect("valid");
        c.apply("expandable_segments:True").expect("valid");
        assert_eq!(c.max_non_split_rounding_size, 64 * MIB);
    }

    #[test]
    fn split_floors_per_release() {
        // Up to 2.9 the device allocator's own parser: more than 20, a 32-bit integer.
        for minor in [0, 4, 9] {
            for (text, ok) in [
                ("max_split_size_mb:20", false),
                ("max_split_size_mb:21", true),
                ("max_split_size_mb:99999999999", false),
            ] {
                let r = AllocatorConfig::parse_for(text, Syntax::PyTorch, v(minor));
                assert_eq!(r.is_ok(), ok, "2.{minor} {text}: {r:?}");
            }
        }
        // From 2.10: at least 20 (the segment size), any 64-bit size (clamped).
        for minor in [10, 11, 15] {
            let c = AllocatorConfig::parse_for("max_split_size_mb:20", Syntax::PyTorch, v(minor))
                .expect("valid");
            assert_eq!(c.max_split_size, 20 * MIB);
            let c = AllocatorConfig::parse_for(
                "max_split_size_mb:99999999999",
                Syntax::PyTorch,
                v(minor),
            )
            .expect("valid");
            assert_eq!(c.max_split_size, 99_999_999_999 * MIB);
        }
    }

    #[test]
    fn fraction_oom_throw_and_capture_keys() {
        let c = AllocatorConfig::parse(
            "per_process_memory_fraction:0.95,throw_on_cudamalloc_oom:True,graph_capture_record_stream_reuse:True",
        )
        .expect("valid");
        assert_eq!(c.per_process_memory_fraction, 0.95);
        assert!(c.throw_on_cudamalloc_oom && c.graph_capture_record_stream_reuse);
        assert!(c.settings().graph_capture_record_stream_reuse);
        refused(&[
            ("per_process_memory_fraction:1.5", "[0, 1]"),
            ("per_process_memory_fraction:-0.1", "[0, 1]"),
            ("per_process_memory_fraction:nan", "[0, 1]"),
            ("per_process_memory_fraction:half", "a number"),
            ("throw_on_cudamalloc_oom:1", "`True` or `False`"),
            ("throw_on_cudamalloc_oom:true", "`True` or `False`"),
            ("graph_capture_record_stream_reuse:yes", "`True` or `False`"),
        ]);
        assert_eq!(
            AllocatorConfig::parse("per_process_memory_fraction:0")
                .expect("valid")
                .per_process_memory_fraction,
            0.0
        );
    }

    #[test]
    fn reserve_values_are_kept_or_ignored_with_a_reason() {
        let c = AllocatorConfig::parse(
            "expandable_segments_reserve:0.5,expandable_segments_reserve_by_class:[serve:40G,train:0.25,serve:2g]",
        )
        .expect("valid");
        assert_eq!(
            c.expandable_segments_reserve,
            Some(ReserveSpec::Fraction(0.5))
        );
        assert_eq!(
            c.expandable_segments_reserve_by_class,
            vec![
                ("serve".to_string(), ReserveSpec::Gib(2.0)),
                ("train".to_string(), ReserveSpec::Fraction(0.25)),
            ]
        );
        assert!(c.reserve_set() && c.ignored.is_empty());
        let total = 80 * GIB;
        assert_eq!(c.expandable_reserve(total), 40 * GIB);
        assert_eq!(
            ReserveSpec::Gib(500.0).bytes(total),
            90 * GIB,
            "clamped to 9/8"
        );
        // Malformed values: kept out, the reason noted, the string still valid.
        let c = AllocatorConfig::parse(
            "expandable_segments_reserve:-1,expandable_segments_reserve_by_class:[a:inf,b:0.1]",
        )
        .expect("malformed reserves are not errors");
        assert_eq!(c.expandable_segments_reserve, None);
        assert_eq!(c.expandable_segments_reserve_by_class.len(), 1);
        assert_eq!(c.ignored.len(), 2, "{:?}", c.ignored);
        assert!(c.ignored[0].contains("`-1`"), "{:?}", c.ignored);
        assert_eq!(c.expandable_reserve(total), total + total / 8);
        refused(&[
            ("expandable_segments_reserve_by_class:serve", "`[`"),
            (
                "expandable_segments_reserve_by_class:[serve:0.5",
                "not closed",
            ),
            ("expandable_segments_reserve_by_class:[:0.5]", "class name"),
        ]);
    }

    #[test]
    fn pinned_keys_are_validated_and_kept() {
        let c = AllocatorConfig::parse(
            "pinned_reserve_segment_size_mb:512,pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:1024,pinned_free_catch_all:True,pinned_use_background_threads:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
        )
        .expect("valid");
        assert_eq!(
            c.pinned,
            PinnedSettings {
                use_cuda_host_register: true,
                num_register_threads: 16,
                use_background_threads: true,
                reserve_segment_size: 512 * MIB,
                max_round_threshold: 64 * MIB,
                max_cached_size: 1024 * MIB,
                free_catch_all: true,
            }
        );
        refused(&[
            ("pinned_reserve_segment_size_mb:0", "more than 0"),
            ("pinned_max_round_threshold_mb:-1", "non-negative integer"),
            ("pinned_max_cached_size_mb:1.5", "non-negative integer"),
            ("pinned_free_catch_all:on", "`True` or `False`"),
            // A non-negative integer, but no 64-bit size: named as such.
            (
                "max_split_size_mb:18446744073709551616",
                "past the largest 64-bit size (18446744073709551615)",
            ),
        ]);
    }

    #[test]
    fn a_lenient_parse_applies_what_it_can_and_says_what_it_skipped() {
        let mut c = AllocatorConfig::default();
        let problems = c.apply_lenient(
            "large_segment_size_mb:12,some_future_key:3,max_split_size_mb:15,expandable_segments:maybe,throw_on_cudamalloc_oom:True",
            Syntax::Gpumem,
        );
        assert_eq!(c.large_segment_size, 12 * MIB);
        assert_eq!(c.max_split_size, 15 * MIB);
        assert!(c.throw_on_cudamalloc_oom);
        assert!(!c.expandable_segments);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("some_future_key"), "{problems:?}");
        assert!(problems[1].contains("expandable_segments"), "{problems:?}");
        // A bad list is skipped whole: its entries are not read as options.
        let problems = c.apply_lenient(
            "roundup_power2_divisions:[256:3,512:2],garbage_collection_threshold:0.5",
            Syntax::Gpumem,
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(c.garbage_collection_threshold, 0.5);
    }

    #[test]
    fn the_environment_variable_in_force_per_release() {
        let (cuda, generic) = (
            Some("expandable_segments:True"),
            Some("max_split_size_mb:64"),
        );
        assert_eq!(settings_from_env(v(15), cuda, generic), (cuda, generic));
        assert_eq!(settings_from_env(v(15), None, generic), (generic, None));
        assert_eq!(settings_from_env(v(15), cuda, cuda), (cuda, None));
        // Up to 2.9 the device allocator reads only the CUDA variable.
        assert_eq!(settings_from_env(v(9), None, generic), (None, generic));
        assert_eq!(settings_from_env(v(4), cuda, None), (cuda, None));
    }
}
