//! A process's identity beyond its pid: its start time, from `/proc/<pid>/stat`, so that a
//! new process reusing a dead one's pid is told apart from it; its pid inside its own pid
//! namespace (a container's), from `NSpid` in `/proc/<pid>/status`.
//!
//! # Invariants
//! - Parsing is total: the command name (field 2) may hold spaces and parentheses, so the
//!   fields are counted from the last `)`; anything else yields `None`.
//! - Reading is bounded ([`MAX_STAT_FILE`]); a vanished process is `None`, not an error,
//!   and so is one that has exited and waits to be reaped (a zombie: its pid and start time
//!   are still there, the process is not).

use std::io::Read;

/// The most of a `/proc/<pid>/stat` file that is read (real ones are under 400 bytes).
pub const MAX_STAT_FILE: u64 = 4096;

/// At most `limit` bytes of `/proc/<pid>/<file>`; `None` when the process is gone (or the
/// file is not text).
pub fn read_proc(pid: u32, file: &str, limit: u64) -> Option<String> {
    let file = std::fs::File::open(format!("/proc/{pid}/{file}")).ok()?;
    let mut text = String::new();
    file.take(limit).read_to_string(&mut text).ok()?;
    Some(text)
}

/// The start time of `pid` in clock ticks since boot; `None` when it does not exist or has
/// exited (a zombie).
pub fn start_time(pid: u32) -> Option<u64> {
    parse_start_time(&read_proc(pid, "stat", MAX_STAT_FILE)?)
}

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line, unless field 3 (the state) says the
/// process has exited (`Z` zombie, `X` dead).
pub fn parse_start_time(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // After the name come field 3 (state) onwards: starttime is the 20th of those.
    let mut fields = rest.split_ascii_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// The most of a `/proc/<pid>/status` file that is read (real ones are under 2 KiB).
pub const MAX_STATUS_FILE: u64 = 16 * 1024;

/// The pid `pid` has in its innermost pid namespace (a container's own pid); `None` when it
/// does not exist.
pub fn namespace_pid(pid: u32) -> Option<u32> {
    parse_namespace_pid(&read_proc(pid, "status", MAX_STATUS_FILE)?)
}

/// The last pid of the `NSpid:` line of a `/proc/<pid>/status` text (the line lists the
/// pid in each namespace from the reader's outwards-in: the last is the innermost).
pub fn parse_namespace_pid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_ascii_whitespace().last()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_whatever_the_name() {
        let tail = "S 1 1 1 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 12345678 300";
        for name in ["python3", "pt_main thread", "a) b (c", ")"] {
            let line = format!("4242 ({name}) {tail}\n");
            assert_eq!(parse_start_time(&line), Some(987_654), "{name:?}");
        }
        let zombie = format!("4242 (python3) Z{}", &tail[1..]);
        for bad in [
            "",
            "4242 (x)",
            "4242 (x) S 1 2",
            "no parenthesis 1 2 3",
            &zombie,
        ] {
            assert_eq!(parse_start_time(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_innermost_namespace_pid_is_the_last() {
        let status = "Name:\tpython\nTgid:\t1918\nPid:\t1918\nNSpid:\t1918\t42\t2\nNSsid:\t1\n";
        assert_eq!(parse_namespace_pid(status), Some(2));
        assert_eq!(parse_namespace_pid("NSpid:\t77\n"), Some(77));
        for bad in ["", "Pid:\t5\n", "NSpid:\n", "NSpid:\tx\n"] {
            assert_eq!(parse_namespace_pid(bad), None, "{bad:?}");
        }
        let me = std::process::id();
        assert!(namespace_pid(me).is_some());
    }

    #[test]
    fn this_process_has_a_start_time() {
        let me = std::process::id();
        let first = start_time(me).expect("readable");
        assert_eq!(start_time(me), Some(first), "stable");
        assert_eq!(start_time(u32::MAX), None);
    }
}
