//! The snapshot reader on a large recording with stacks, side by side with Python's
//! `pickle.load` of the same file (what PyTorch's own `_memory_viz.py` does first), each in a
//! child process whose wall time and peak resident memory are measured (`wait4`, through
//! Python's `os.wait4`).
//!
//! `cargo bench --bench reader` generates a snapshot of 100 000 entries with 480 frames each
//! (about 1 GB; `GPUMEM_READER_ENTRIES` and `GPUMEM_READER_FRAMES` change it) with
//! `scripts/gen-snapshot.py`, then times `gpumem replay`, `gpumem replay --check` and Python;
//! and the same snapshot with FX fields on every frame (`--fx`, torch.compile's
//! `augment_with_fx_traces`), whose `gpumem replay` row is given against the plain one's.
//! Under `cargo test` (benchmarks run once) it uses 2 000 entries of 20 frames and skips
//! Python. `GPUMEM_READER_SKIP_PYTHON=1` skips Python at any size (it needs about 11 GB per
//! GB of pickle).

use std::path::Path;
use std::process::{Command, Stdio};

/// Runs a child under Python's `os.wait4`, which reports the child's own peak resident
/// memory (so the crate needs no unsafe code for it), and prints wall seconds and bytes.
const WAIT4: &str = "import os, subprocess, sys, time
t = time.monotonic()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(p.pid, 0)
if status != 0:
    sys.exit(f'{sys.argv[1:]} failed: status {status}')
print(time.monotonic() - t, usage.ru_maxrss * 1024)";

/// Wall seconds and peak resident bytes of `argv`, run as a child.
fn measure(argv: &[&std::ffi::OsStr]) -> (f64, u64) {
    let out = Command::new("python3")
        .args(["-c", WAIT4])
        .args(argv)
        .stderr(Stdio::inherit())
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{argv:?} failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.split_whitespace();
    let seconds = fields.next().and_then(|s| s.parse().ok()).expect("seconds");
    let peak = fields
        .next()
        .and_then(|s| s.parse().ok())
        .expect("peak bytes");
    (seconds, peak)
}

fn number(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (entries, frames) = if bench {
        (
            number("GPUMEM_READER_ENTRIES", 100_000),
            number("GPUMEM_READER_FRAMES", 480),
        )
    } else {
        (2_000, 20)
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let gpumem = env!("CARGO_BIN_EXE_gpumem");
    let dir = std::env::temp_dir().join(format!("gpumem-reader-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let generate = |file: &Path, fx: bool| {
        let mut command = Command::new("python3");
        command
            .arg(root.join("scripts/gen-snapshot.py"))
            .args([
                "--entries",
                &entries.to_string(),
                "--frames",
                &frames.to_string(),
            ])
            .args(["--gpumem", gpumem]);
        if fx {
            command.arg("--fx");
        }
        let generated = command
            .arg(file)
            .status()
            .expect("python3 runs the generator");
        assert!(generated.success());
        std::fs::metadata(file).expect("generated").len()
    };
    let file = dir.join("snapshot.pickle");
    let size = generate(&file, false);
    println!(
        "reader: {} MB, {entries} entries, {frames} frames each",
        size / 1_000_000
    );
    let os = std::ffi::OsStr::new;
    let mut rows = vec![
        (
            "gpumem replay",
            measure(&[os(gpumem), os("replay"), file.as_os_str()]),
        ),
        (
            "gpumem replay --check",
            measure(&[os(gpumem), os("replay"), os("--check"), file.as_os_str()]),
        ),
    ];
    if bench && std::env::var_os("GPUMEM_READER_SKIP_PYTHON").is_none() {
        let load = "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))";
        rows.push((
            "python pickle.load",
            measure(&[os("python3"), os("-c"), os(load), file.as_os_str()]),
        ));
    }
    // Ratios against Python, where it ran.
    let anchor = (rows.len() == 3).then(|| rows[2].1);
    println!(
        "{:<24} {:>9} {:>11} {:>16} {:>16}",
        "reader", "seconds", "peak MiB", "time / python", "memory / python"
    );
    for (name, (seconds, peak)) in &rows {
        let ratio = |x: f64, of: f64| anchor.map_or("-".to_string(), |_| format!("{:.3}", x / of));
        let (t, m) = anchor.unwrap_or((1.0, 1));
        println!(
            "{name:<24} {seconds:>9.2} {:>11.0} {:>16} {:>16}",
            *peak as f64 / (1 << 20) as f64,
            ratio(*seconds, t),
            ratio(*peak as f64, m as f64)
        );
    }
    // FX frames: the same snapshot, every frame also naming its graph node.
    let fx_file = dir.join("snapshot-fx.pickle");
    let fx_size = generate(&fx_file, true);
    std::fs::remove_file(&file).expect("plain snapshot removed");
    let fx = measure(&[os(gpumem), os("replay"), fx_file.as_os_str()]);
    let (plain_seconds, plain_peak) = rows[0].1;
    println!(
        "{:<24} {:>9} {:>11} {:>16} {:>16}",
        "reader (FX frames)", "seconds", "peak MiB", "time / plain", "memory / plain"
    );
    println!(
        "{:<24} {:>9.2} {:>11.0} {:>16.3} {:>16.3}   ({} MB)",
        "gpumem replay",
        fx.0,
        fx.1 as f64 / (1 << 20) as f64,
        fx.0 / plain_seconds,
        fx.1 as f64 / plain_peak as f64,
        fx_size / 1_000_000
    );
    let _ = std::fs::remove_dir_all(&dir);
}
