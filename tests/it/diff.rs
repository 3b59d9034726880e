//! `gpumem diff` (issue 61): two runs compared at their peaks. A synthetic pair whose second
//! run adds one allocation site (under another checkout directory), the shared recordings of
//! one codebase against each other, and one against its own what-if; the page in Chromium.

use std::process::Command;

use gpumem::device::StreamId;
use gpumem::recording::read_recording;
use gpumem::replay::{Session, Setup};
use serde_json::{Value, json};

use crate::common::succeeded;
use crate::support::traces::shared_traces;

const MIB: u64 = 1 << 20;

/// The site B adds: its file, line and function (markup in the name: the page escapes it).
const ADDED: (&str, u64, &str) = (
    "extra.py",
    7,
    "add</td><script>document.title='owned'</script>",
);
/// Its bytes: an odd size above 10 MiB, so that it has a segment of its own.
const ADDED_BYTES: u64 = 30 * MIB + 1;

/// A program's recording, its files under `root`: three iterations that each allocate an
/// 8 MiB and a 4 MiB activation at `train.py` and free them, then `kept` (file, line, bytes)
/// allocated in order and kept, each larger than what the cache holds, so that the peak is
/// after the last. Each allocation's stack is its own line, beneath a torch frame.
fn program(root: &str, kept: &[(&str, u64, &str, u64)]) -> Value {
    let mut sites: Vec<(String, u64, String)> = Vec::new();
    let bytes = crate::explain::recorded_json(8 << 30, 0, |a| {
        let s = StreamId::DEFAULT;
        for _ in 0..3 {
            let x = a.malloc(8 * MIB, s).expect("fits");
            let y = a.malloc(4 * MIB, s).expect("fits");
            sites.push(("train.py".into(), 20, "step".into()));
            sites.push(("train.py".into(), 21, "step".into()));
            a.free(y).expect("frees");
            a.free(x).expect("frees");
        }
        for &(file, line, name, size) in kept {
            a.malloc(size, s).expect("fits");
            sites.push((file.into(), line, name.into()));
        }
    });
    let mut doc: Value = serde_json::from_slice(&bytes).expect("json");
    let mut next = sites.into_iter();
    for entry in doc["device_traces"][0].as_array_mut().expect("a trace") {
        if entry["action"] == "alloc" {
            let (file, line, name) = next.next().expect("a site per allocation");
            entry["frames"] = json!([
                {"filename": "/env/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1750, "name": "_call_impl"},
                {"filename": format!("{root}/{file}"), "line": line, "name": name},
            ]);
        }
    }
    assert!(next.next().is_none(), "every site allocated");
    doc
}

/// `gpumem diff` with `args`, `--json`: its answer.
fn diff_json(args: &[&std::ffi::OsStr]) -> Value {
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .arg("diff")
            .args(args)
            .arg("--json"),
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

fn bytes(v: &Value) -> i128 {
    i128::from(v.as_i64().unwrap_or_else(|| panic!("a figure: {v}")))
}

/// The module's invariants on a diff's JSON: the sites add up to the live difference, and it
/// with the differences of the cached and pending parts to the reserved difference; each run's
/// sites' requested bytes are not checked here (the JSON lists the first 200 only).
fn assert_adds_up(d: &Value) {
    let sites: i128 = d["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .map(|s| bytes(&s["difference"]))
        .sum();
    let rest = d.get("rest").map_or(0, |r| bytes(&r["difference"]));
    assert_eq!(sites + rest, bytes(&d["live_difference"]), "sites add up");
    let part = |run: &str, p: &str| bytes(&d[run]["breakdown"][p]);
    let live = |run: &str| part(run, "requested") + part(run, "rounding");
    assert_eq!(live("b") - live("a"), bytes(&d["live_difference"]));
    let beside: i128 = [
        "fragmented",
        "other_streams",
        "other_pools",
        "pending_stream_frees",
    ]
    .iter()
    .map(|p| part("b", p) - part("a", p))
    .sum();
    assert_eq!(
        bytes(&d["live_difference"]) + beside,
        bytes(&d["reserved_difference"]),
        "the parts add up to the reserved difference"
    );
    assert_eq!(
        bytes(&d["b"]["peak_reserved"]["bytes"]) - bytes(&d["a"]["peak_reserved"]["bytes"]),
        bytes(&d["reserved_difference"])
    );
}

/// The share of the sites' absolute differences the first ten carry, from the listing.
fn top_ten_share(d: &Value) -> f64 {
    let diffs: Vec<f64> = d["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .map(|s| bytes(&s["difference"]).abs() as f64)
        .collect();
    let rest = d
        .get("rest")
        .map_or(0.0, |r| bytes(&r["difference"]).abs() as f64);
    diffs.iter().take(10).sum::<f64>() / (diffs.iter().sum::<f64>() + rest)
}

#[test]
fn an_added_allocation_site_comes_first_with_its_exact_bytes() {
    let dir = crate::common::temp_dir("diff-synthetic");
    let kept = [
        ("model.py", 40, "__init__", 24 * MIB),
        ("model.py", 41, "__init__", 40 * MIB),
        ("optim.py", 12, "zero_state", 64 * MIB),
    ];
    let mut with_added = kept.to_vec();
    with_added.insert(1, (ADDED.0, ADDED.1, ADDED.2, ADDED_BYTES));
    let a = dir.join("a.json");
    let b = dir.join("b <run2>.json");
    std::fs::write(&a, program("/workspace/run1", &kept).to_string()).expect("write");
    std::fs::write(&b, program("/workspace/run2", &with_added).to_string()).expect("write");

    let page = dir.join("diff.html");
    let d = diff_json(&[
        a.as_os_str(),
        b.as_os_str(),
        "--html".as_ref(),
        page.as_os_str(),
    ]);
    assert_adds_up(&d);
    let first = &d["sites"][0];
    assert_eq!(
        first["site"],
        format!("/workspace/run2/{}:{} in {}", ADDED.0, ADDED.1, ADDED.2),
        "{d:#}"
    );
    // Its exact bytes: what it asked for, and its block (large blocks round up to 512 bytes).
    let block = ADDED_BYTES.div_ceil(512) * 512;
    assert_eq!(first["b"]["requested"], ADDED_BYTES);
    assert_eq!(first["b"]["bytes"], block);
    assert_eq!(first["b"]["blocks"], 1);
    assert_eq!(first["a"]["bytes"], 0);
    assert_eq!(first["difference"], block);
    assert_eq!(d["live_difference"], block, "nothing else differs");
    // Its own segment: sizes above 10 MiB round up to 2 MiB.
    assert_eq!(
        d["reserved_difference"],
        ADDED_BYTES.div_ceil(2 * MIB) * 2 * MIB
    );
    for s in d["sites"].as_array().expect("sites").iter().skip(1) {
        assert_eq!(s["difference"], 0, "{s}");
        let site = s["site"].as_str().expect("a site");
        assert!(
            site.starts_with("/workspace/run1/"),
            "matched under A's name: {site}"
        );
    }
    assert_eq!(d["top_share"], 1.0);
    // The program's files matched across the checkouts; the added one has no match.
    let matched: Vec<(&str, &str)> = d["files_matched"]
        .as_array()
        .expect("matches")
        .iter()
        .map(|m| (m["a"].as_str().expect("a"), m["b"].as_str().expect("b")))
        .collect();
    assert_eq!(
        matched,
        [
            ("/workspace/run1/model.py", "/workspace/run2/model.py"),
            ("/workspace/run1/optim.py", "/workspace/run2/optim.py"),
        ],
        "files of sites live at the peaks (train.py's activations are freed by then)"
    );
    // Both peaks, after each run's last allocation; their iterations side by side.
    for (run, events) in [("a", &a), ("b", &b)] {
        let rec = read_recording(events).expect("reads");
        let last_alloc = rec.device_traces[0]
            .iter()
            .rposition(|e| e.action == gpumem::allocator::TraceAction::Alloc)
            .expect("allocations");
        assert_eq!(d[run]["peak_reserved"]["event"], json!(last_alloc), "{run}");
        let its = &d[run]["iterations"];
        assert!(
            its["count"].as_u64().is_some_and(|n| n >= 2),
            "{run}: {its}"
        );
        for it in its["listed"].as_array().expect("listed") {
            assert_eq!(
                it["kept"], 0,
                "each iteration frees what it allocates: {it}"
            );
            assert!(
                it["peak_allocated"].as_u64().is_some_and(|p| p >= 12 * MIB),
                "{it}"
            );
        }
    }

    // The text names it first, with its figure.
    let text = succeeded(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .arg("diff")
            .arg(&a)
            .arg(&b),
    );
    let text = String::from_utf8_lossy(&text.stdout);
    let line = text
        .lines()
        .skip_while(|l| !l.starts_with("Live tensors by site"))
        .nth(2)
        .expect("a site line");
    assert!(
        line.contains("extra.py:7") && line.contains("+30.00 MiB"),
        "{text}"
    );

    // The page shows every figure of the JSON, escaped.
    let browser = crate::browser::Browser::start();
    crate::explain::check_page(&browser, &page, &d, "diff-synthetic.png", &|path| {
        path.contains(".frames.")
            || (path.contains(".divergence.") && !path.ends_with(".divergence.index"))
    });
    assert_ne!(browser.eval("return document.title;"), "owned");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_diff_needs_a_second_run_and_refuses_a_bad_configuration() {
    let dir = crate::common::temp_dir("diff-refusals");
    let a = dir.join("a.json");
    std::fs::write(&a, program("/w", &[("m.py", 1, "f", 24 * MIB)]).to_string()).expect("write");
    for (args, says) in [
        (vec![], "name B's recording, or a --config"),
        (vec!["--config", "bogus_key:1"], "bogus_key"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .arg("diff")
            .arg(&a)
            .args(&args)
            .output()
            .expect("runs");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 61's pair: one codebase's 2.7B model's forward pass with the cache emptied, against
/// its smaller model's full training step. The peaks are the replay's own, and ten sites carry
/// nine tenths of the change; the same recording against its own what-if, too.
#[test]
fn two_real_runs_and_a_what_if_are_told_apart_by_ten_sites() {
    let Some(traces) = shared_traces("two_real_runs_and_a_what_if_are_told_apart_by_ten_sites")
    else {
        return;
    };
    let forward = traces.join("cs336_lm2p7b_forward_emptycache.pickle");
    let step = traces.join("cs336_lm_fullstep_ctx128.pickle");
    let d = diff_json(&[forward.as_os_str(), step.as_os_str()]);
    assert_adds_up(&d);
    for (run, file) in [("a", &forward), ("b", &step)] {
        let rec = std::sync::Arc::new(read_recording(file).expect("reads"));
        let report = Session::new(rec, Setup::default())
            .expect("a session")
            .check()
            .expect("replays");
        assert!(report.divergence.is_none());
        assert_eq!(
            d[run]["peak_reserved"]["bytes"], report.peak_reserved,
            "{run}"
        );
        assert_eq!(
            d[run]["peak_allocated"]["bytes"], report.peak_allocated,
            "{run}"
        );
    }
    let share = top_ten_share(&d);
    assert!(share >= 0.9, "ten sites carry {share:.3} of the change");
    assert!((d["top_share"].as_f64().expect("a share") - share).abs() < 1e-9);
    let sites: Vec<&str> = d["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .take(10)
        .map(|s| s["site"].as_str().expect("a site"))
        .collect();
    // The optimizer's state is B's alone, and torch.compile's generated code is named by the
    // program's line that ran it.
    assert!(
        sites.iter().any(|s| s.contains("optimizers.py:")),
        "{sites:#?}"
    );
    assert!(
        d["sites"]
            .as_array()
            .expect("sites")
            .iter()
            .all(|s| !s["site"]
                .as_str()
                .expect("a site")
                .contains("torchinductor_")),
        "{sites:#?}"
    );

    let what_if = diff_json(&[
        step.as_os_str(),
        "--config".as_ref(),
        "roundup_power2_divisions:4".as_ref(),
    ]);
    assert_adds_up(&what_if);
    assert_eq!(what_if["a"]["what_if"], false);
    assert_eq!(what_if["b"]["what_if"], true);
    assert_eq!(what_if["b"]["config"], "roundup_power2_divisions:4");
    // The same program: what its tensors ask for is the same, their rounding is not.
    assert_eq!(
        what_if["a"]["breakdown"]["requested"],
        what_if["b"]["breakdown"]["requested"]
    );
    assert!(bytes(&what_if["live_difference"]) > 0, "{what_if:#}");
    let share = top_ten_share(&what_if);
    assert!(
        share >= 0.9,
        "ten sites carry {share:.3} of the what-if's change"
    );
}
