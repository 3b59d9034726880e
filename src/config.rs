//! Allocator configuration in the `PYTORCH_CUDA_ALLOC_CONF` syntax.
//!
//! `option:value,option:value,...`, with PyTorch's lexer (`,` `:` `[` `]` are tokens, spaces
//! vanish) and PyTorch's validation, so users can paste what their jobs run with. Values are
//! stored in the units the allocator uses (bytes, not MiB).
//!
//! # Invariants
//! - Parsing is all or nothing: a string with an error leaves the configuration unchanged.
//! - Every successful parse first resets `max_split_size`, `roundup_power2_divisions` and
//!   `garbage_collection_threshold` to their defaults, as PyTorch does; the other options keep
//!   the values an earlier parse gave them.
//! - `max_split_size` is `u64::MAX` (unlimited) or more than 20 MiB; every division is 0 or a
//!   power of two; the GC threshold is 0 (off) or strictly between 0 and 1.
//! - An option given twice takes its last value, as in PyTorch (whose parser overwrites).
//! - [`Syntax::Gpumem`] is PyTorch's syntax plus gpumem's own keys (`plan:PATH`,
//!   `pytorch:MAJOR.MINOR`: the release whose decisions the allocator follows), read from
//!   `GPUMEM_ALLOC_CONF` and gpumem's own snapshots; where only PyTorch's syntax is valid
//!   ([`Syntax::PyTorch`]: `PYTORCH_CUDA_ALLOC_CONF`, `_set_allocator_settings`, the command
//!   line's `--config`) gpumem's keys are refused by name. The plan's path is kept
//!   as given (it cannot hold `,` `:` `[` `]` or spaces, the syntax's separators); reading
//!   the file is the caller's business, the configuration stays pure.

use serde::Serialize;

/// Bytes in a MiB: option names say "mb" but mean MiB.
const MIB: u64 = 1 << 20;

/// Number of size intervals of `roundup_power2_divisions` (1 MiB, 2 MiB, ... 32 GiB and up).
pub const ROUNDUP_INTERVALS: usize = 16;

/// The smallest `max_split_size_mb` accepted is one more than this.
pub const MAX_SPLIT_SIZE_FLOOR_MB: i64 = 20;

/// Upper bound of `pinned_num_register_threads`.
const PINNED_MAX_REGISTER_THREADS: u64 = 128;

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
    /// Release the allocator lock around `cudaMalloc` (accepted for compatibility).
    pub release_lock_on_cudamalloc: bool,
    /// Pinned host memory through `cudaHostRegister` (accepted for compatibility).
    pub pinned_use_cuda_host_register: bool,
    /// Threads for registering pinned memory (accepted for compatibility).
    pub pinned_num_register_threads: u64,
    /// gpumem only: the file of a placement plan to follow (Note [Planned placement]).
    pub plan: Option<String>,
    /// gpumem only: the PyTorch release whose decisions the allocator follows (read when an
    /// allocator is built; 2.15 by default).
    pub pytorch: PyTorchVersion,
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
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            plan: None,
            pytorch: PyTorchVersion::LATEST,
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
    /// Interval start in MiB ("1", "2", ... "32768") → divisions.
    pub roundup_power2_divisions: std::collections::BTreeMap<String, u64>,
}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string on top of the defaults.
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

    /// Applies a settings string as `torch.cuda.memory._set_allocator_settings` does: the
    /// three fragmentation knobs go back to their defaults first, other options keep their
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
        next.max_split_size = u64::MAX;
        next.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
        next.garbage_collection_threshold = 0.0;
        Parser {
            tokens: tokenize(settings),
            pos: 0,
            syntax,
        }
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

    /// The settings as PyTorch's snapshot `allocator_settings` reports them.
    pub fn settings(&self) -> AllocatorSettings {
        AllocatorSettings {
            PYTORCH_CUDA_ALLOC_CONF: self.last_settings.clone(),
            max_split_size: max_split_size_stat(self.max_split_size),
            garbage_collection_threshold: self.garbage_collection_threshold,
            expandable_segments: self.expandable_segments,
            pinned_num_register_threads: self.pinned_num_register_threads,
            release_lock_on_cudamalloc: self.release_lock_on_cudamalloc,
            pinned_use_cuda_host_register: self.pinned_use_cuda_host_register,
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

struct Parser {
    tokens: Vec<String>,
    pos: usize,
    syntax: Syntax,
}

impl Parser {
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

    fn parse_into(&mut self, config: &mut AllocatorConfig) -> Result<(), String> {
        while let Some(option) = self.next().map(str::to_string) {
            match option.as_str() {
                "max_split_size_mb" => {
                    let v = self.value(&option)?;
                    let mb: i32 = v.parse().map_err(|_| {
                        format!("`max_split_size_mb` must be an integer (MiB), not `{v}`")
                    })?;
                    if i64::from(mb) <= MAX_SPLIT_SIZE_FLOOR_MB {
                        return Err(format!(
                            "`max_split_size_mb` must be greater than {MAX_SPLIT_SIZE_FLOOR_MB}, not {mb}"
                        ));
                    }
                    config.max_split_size = (mb as u64).saturating_mul(MIB);
                }
                "garbage_collection_threshold" => {
                    let v = self.value(&option)?;
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
                "roundup_power2_divisions" => {
                    config.roundup_power2_divisions = self.divisions()?;
                }
                "expandable_segments" => config.expandable_segments = self.boolean(&option)?,
                "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                    config.release_lock_on_cudamalloc = self.boolean(&option)?;
                }
                "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                    config.pinned_use_cuda_host_register = self.boolean(&option)?;
                }
                "pinned_num_register_threads" => {
                    let v = self.value(&option)?;
                    let n: u64 = v.parse().map_err(|_| {
                        format!("`pinned_num_register_threads` must be an integer, not `{v}`")
                    })?;
                    if !n.is_power_of_two() || n > PINNED_MAX_REGISTER_THREADS {
                        return Err(format!(
                            "`pinned_num_register_threads` must be a power of two of at most {PINNED_MAX_REGISTER_THREADS}, not {n}"
                        ));
                    }
                    config.pinned_num_register_threads = n;
                }
                "backend" => {
                    let v = self.value(&option)?;
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
                    let v = self.value(&option)?;
                    config.plan = Some(v);
                }
                "pytorch" if self.syntax == Syntax::PyTorch => {
                    return Err("`pytorch` is gpumem's own key: set it in GPUMEM_ALLOC_CONF (the commands take --pytorch), not where PyTorch's syntax is read".into());
                }
                "pytorch" => {
                    config.pytorch = self.value(&option)?.parse()?;
                }
                other => return Err(format!("unrecognized option `{other}`")),
            }
            if let Some(t) = self.next()
                && t != ","
            {
                return Err(format!(
                    "expected `,` after the value of `{option}`, found `{t}`"
                ));
            }
        }
        Ok(())
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

    /// `roundup_power2_divisions:N` or `roundup_power2_divisions:[k:v,...,>:v]`.
    fn divisions(&mut self) -> Result<[u64; ROUNDUP_INTERVALS], String> {
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
                // Quirk kept from PyTorch: `>` starts at the previous key's own interval.
                table[last_index..].fill(value);
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
        for (input, needle) in [
            ("max_split_size_mb:20", "max_split_size_mb"),
            ("max_split_size_mb:abc", "max_split_size_mb"),
            ("max_split_size_mb:99999999999", "max_split_size_mb"),
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
        ] {
            let err = AllocatorConfig::parse(input).expect_err(input);
            assert!(err.reason.contains(needle), "{input}: {err}");
        }
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
        assert_eq!(c.pinned_num_register_threads, 8);
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
    fn division_lists_follow_pytorch_including_the_gt_quirk() {
        let c = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
            .expect("valid");
        let mut want = [8u64; 16];
        want[..=8].fill(1);
        want[9] = 2;
        assert_eq!(c.roundup_power2_divisions, want);
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
}
