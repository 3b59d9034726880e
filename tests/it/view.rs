//! `gpumem view` in a real browser: the page of a recording made by the tests (a
//! fragmentation OOM whose frames are hostile markup), its segment map checked against the
//! replayed allocator at two events (the slider moved between them), the explanation at the
//! OOM, a what-if configuration beside the recorded one, the Host check; and a generated
//! 1 GB snapshot, whose first page and slider steps are timed in the log.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpumem::allocator::{BlockState, TraceAction};
use gpumem::device::StreamId;
use gpumem::explain::At;
use gpumem::recording::read_recording;
use gpumem::replay::Setup;

use crate::agent::{Reaper, free_port, http_get, wait_for};
use crate::browser::Browser;
use crate::common::{explain, session};

const MIB: u64 = 1 << 20;

/// Starts `gpumem view FILE` on a free loopback port; waits (bounded) until it answers.
pub(crate) fn spawn_view(file: &Path, log: &Path) -> (Reaper, u16) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .arg("view")
        .arg(file)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("gpumem view starts");
    let view = Reaper(child);
    wait_for(Duration::from_secs(120), || {
        http_get(port, "/api/v1/recording")
    })
    .unwrap_or_else(|| {
        panic!(
            "the view answers: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    (view, port)
}

/// A raw GET of `path` with the given `Host` (and `Origin`, where given): the status code and
/// the body.
fn get_with(port: u16, path: &str, host: &str, origin: Option<&str>) -> Option<(u16, String)> {
    raw_get(port, path, host, origin).map(|(status, _, body)| (status, body))
}

/// A raw GET of `path` with the given `Host` (and `Origin`, where given): the status code,
/// the head and the body.
pub(crate) fn raw_get(
    port: u16,
    path: &str,
    host: &str,
    origin: Option<&str>,
) -> Option<(u16, String, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    let origin = origin.map_or(String::new(), |o| format!("Origin: {o}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {host}\r\n{origin}\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    Some((
        head.split_whitespace().nth(1)?.parse().ok()?,
        head.to_string(),
        body.to_string(),
    ))
}

fn status_with_host(port: u16, host: &str) -> Option<u16> {
    get_with(port, "/api/v1/recording", host, None).map(|(status, _)| status)
}

/// Waits until the recorded map shows `event`; its number of segment rows.
fn rows_at(browser: &Browser, event: usize) -> u64 {
    let found = wait_for(Duration::from_secs(30), || {
        let v = browser.eval(&format!(
            "const svg = document.querySelector('#map-recorded svg'); \
             return svg && svg.dataset.event === '{event}' ? \
                 svg.querySelectorAll('g.segment').length : null;"
        ));
        v.as_u64()
    });
    found.unwrap_or_else(|| panic!("the map never showed event {event}"))
}

#[test]
fn the_view_draws_the_replayed_segments_and_moves_with_the_slider() {
    let s = StreamId::DEFAULT;
    let json = crate::explain::recorded_json(900 * MIB, 0, |a| {
        // A few small blocks first, so the map has a small-pool segment too.
        let _small: Vec<_> = (0..5).map(|_| a.malloc(4096, s).expect("fits")).collect();
        crate::explain::fragment(a);
    });
    let mut doc: serde_json::Value = serde_json::from_slice(&json).expect("json");
    let hostile = "</title><script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\">";
    for entry in doc["device_traces"][0].as_array_mut().expect("a trace") {
        entry["frames"] =
            serde_json::json!([{"filename": "/job/train.py", "line": 3, "name": hostile}]);
    }
    let dir = crate::common::temp_dir("view");
    let file = dir.join("frag.json");
    std::fs::write(&file, serde_json::to_vec(&doc).expect("json")).expect("write");
    let rec = read_recording(&file).expect("reads back");
    let events = &rec.device_traces[0];
    let oom = events
        .iter()
        .position(|e| e.action == TraceAction::Oom)
        .expect("an OOM");
    let total = rec.simulated_device.expect("recorded").total_bytes;
    let setup = Setup {
        capacity: Some(total),
        ..Setup::default()
    };
    let session = session(&rec, setup).expect("a session");
    let segments_at = |event: usize| {
        let (mut alloc, divergence) = session.state_after(event).expect("replays");
        assert!(divergence.is_none());
        alloc.snapshot().segments.len() as u64
    };
    // After the 800 MiB block's free: one whole free segment; at the OOM, split ones.
    let early = events
        .iter()
        .position(|e| e.action == TraceAction::FreeCompleted && e.size == 800 * MIB)
        .expect("the 800 MiB block's free");
    // The states of the replayed blocks just after `event`, in address order, as the page
    // names them.
    let states_at = |event: usize| {
        let (mut alloc, _) = session.state_after(event).expect("replays");
        let mut replayed = alloc.snapshot().segments;
        replayed.sort_by_key(|s| s.address);
        let states: Vec<&str> = replayed
            .iter()
            .flat_map(|s| {
                let split = s.blocks.len() > 1;
                s.blocks.iter().map(move |b| match b.state {
                    BlockState::ActiveAllocated => "allocated",
                    BlockState::ActivePendingFree => "pending_free",
                    BlockState::Inactive if split => "inactive_split",
                    BlockState::Inactive => "free",
                })
            })
            .collect();
        serde_json::json!(states)
    };

    let (_view, port) = spawn_view(&file, &dir.join("view.log"));
    assert_eq!(status_with_host(port, "evil.example:80"), Some(421));
    assert_eq!(
        status_with_host(port, &format!("localhost:{port}")),
        Some(200)
    );
    // Another site's page cannot make it replay.
    let (status, _) = get_with(
        port,
        "/api/v1/timeline.svg?device=0&config=expandable_segments:True",
        "127.0.0.1",
        Some("http://evil.example"),
    )
    .expect("answers");
    assert_eq!(status, 403);
    // Bad requests are refused with their reason, and the view goes on.
    let long = "x".repeat(600);
    for (path, says) in [
        (
            "/api/v1/segments?device=0&event=99999".to_string(),
            "outside device 0's trace",
        ),
        (
            "/api/v1/segments?device=7&event=0".to_string(),
            "neither a trace nor segments",
        ),
        ("/api/v1/segments?device=0".to_string(), "event"),
        ("/api/v1/segments?device=0&event=-1".to_string(), "event"),
        (
            "/api/v1/segments?device=0&event=1&config=bogus:1".to_string(),
            "bogus",
        ),
        (
            format!("/api/v1/timeline.svg?device=0&config={long}"),
            "at most 512 bytes",
        ),
        (
            "/api/v1/explain?device=0&event=184467440737095516160".to_string(),
            "event",
        ),
        (
            "/api/v1/diff?device=0".to_string(),
            "needs a what-if configuration",
        ),
        ("/api/v1/diff?device=0&config=bogus:1".to_string(), "bogus"),
    ] {
        let (status, body) = get_with(port, &path, "127.0.0.1", None).expect("answers");
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
    }

    let browser = Browser::start();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    // The page opens at the first OOM, and explains it (fetched after the map).
    assert_eq!(rows_at(&browser, oom), segments_at(oom));
    wait_for(Duration::from_secs(60), || {
        (browser.eval("return document.getElementById('explain').hidden;") == false).then_some(())
    })
    .expect("the explanation is shown");
    let shown = browser.eval(
        "return {sentence: document.getElementById('sentence').textContent, \
                 hidden: document.getElementById('explain').hidden, \
                 candidates: document.querySelectorAll('#candidates tr').length, \
                 split: document.querySelectorAll('#map-recorded rect[data-state=inactive_split]').length, \
                 frames: document.getElementById('top').textContent, \
                 cause: document.getElementById('cause').textContent, \
                 alive: document.querySelectorAll('script:not([src]),img,iframe').length, \
                 title: document.title};",
    );
    let e = explain(&rec, At::Event(oom), Setup::default()).expect("explains");
    assert_eq!(shown["sentence"], e.sentence.as_str(), "{shown}");
    // Issue 38: the cause, in the view as in `explain`.
    assert_eq!(shown["cause"], e.cause_sentence.as_str(), "{shown}");
    assert!(
        e.cause_sentence.starts_with("Fragmentation"),
        "{}",
        e.cause_sentence
    );
    assert_eq!(shown["hidden"], false, "{shown}");
    assert_eq!(
        shown["candidates"],
        e.candidates.len() as u64 + 1,
        "{shown}"
    );
    assert!(shown["split"].as_u64().is_some_and(|n| n >= 20), "{shown}");
    // The hostile frame is text, and nothing it holds came alive.
    assert!(
        shown["frames"]
            .as_str()
            .is_some_and(|t| t.contains(hostile)),
        "{shown}"
    );
    assert_eq!(shown["alive"], 0, "{shown}");
    assert_ne!(shown["title"], "owned");
    browser.screenshot("view-oom.png");
    browser.eval("document.querySelector('.maps').scrollIntoView(); return true;");
    browser.screenshot("view-segments.png");

    // The slider, moved back to just after the first free: the map follows.
    browser.eval(&format!(
        "const s = document.getElementById('slider'); s.value = '{early}'; \
         s.dispatchEvent(new Event('input')); return true;"
    ));
    assert_eq!(rows_at(&browser, early), segments_at(early));
    let states = browser.eval(
        "return Array.from(document.querySelectorAll('#map-recorded rect')).map(r => r.dataset.state);",
    );
    assert_eq!(states, states_at(early), "block by block");
    assert!(
        states
            .as_array()
            .is_some_and(|s| s.iter().any(|b| b == "free")),
        "the 800 MiB segment, whole and free: {states}"
    );
    assert_eq!(
        browser.eval("return document.getElementById('explain').hidden;"),
        true
    );

    // Forward again, past the frees that split the segment: the map is the replayed state
    // at that event, block by block (a cursor that stopped early would show another).
    let later = events
        .iter()
        .rposition(|e| e.action == TraceAction::FreeCompleted)
        .expect("frees");
    browser.eval(&format!(
        "const s = document.getElementById('slider'); s.value = '{later}'; \
         s.dispatchEvent(new Event('input')); return true;"
    ));
    assert_eq!(rows_at(&browser, later), segments_at(later));
    let drawn = browser.eval(
        "return Array.from(document.querySelectorAll('#map-recorded rect')).map(r => r.dataset.state);",
    );
    let expected = states_at(later);
    assert!(
        expected.as_array().is_some_and(|e| e.len() > 20),
        "{expected}"
    );
    assert_eq!(drawn, expected, "block by block");

    // A what-if configuration beside the recorded one.
    browser.eval(
        "document.getElementById('whatif').value = 'expandable_segments:True'; \
         document.getElementById('apply').click(); return true;",
    );
    let compared = wait_for(Duration::from_secs(30), || {
        let v = browser.eval(
            "const col = document.getElementById('whatif-column'); \
             const legend = document.querySelectorAll('#timeline .legend').length; \
             return !col.hidden && legend === 2 && document.querySelector('#map-whatif svg') ? legend : null;",
        );
        v.as_u64()
    });
    assert_eq!(compared, Some(2));
    // The recording against the what-if at their peaks, as `gpumem diff --config` says.
    let what_if = gpumem::replay::WhatIf::default().under(Some(
        gpumem::AllocatorConfig::parse("expandable_segments:True").expect("parses"),
    ));
    let expected = gpumem::diff::diff(
        &gpumem::diff::RunSpec {
            name: "recorded".into(),
            session: &session,
            mode: gpumem::replay::Mode::CHECK,
        },
        &gpumem::diff::RunSpec {
            name: "what-if".into(),
            session: &session,
            mode: gpumem::replay::Mode::WhatIf(what_if),
        },
    )
    .expect("compares");
    let shown = wait_for(Duration::from_secs(30), || {
        let v = browser.eval(
            "const d = document.getElementById('diff'); \
             return d.hidden ? null : {sentence: document.getElementById('diff-sentence').textContent, \
               rows: document.querySelectorAll('#diff-breakdown tr').length};",
        );
        (!v.is_null()).then_some(v)
    })
    .expect("the comparison is shown");
    assert_eq!(shown["sentence"], expected.sentence);
    assert_eq!(
        shown["rows"], 8,
        "a heading, six parts and the reserved memory"
    );
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    assert_eq!(
        browser.eval("return document.getElementById('error').textContent;"),
        ""
    );
    browser.eval("document.querySelector('.maps').scrollIntoView(); return true;");
    browser.screenshot("view-what-if.png");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A generated 1 GB snapshot (100 000 events, 480 frames each): how long the view takes to
/// answer after reading, and each slider step, written to the test's log (timings are not
/// asserted: these machines are noisy). Steps go forward (replaying on) and back (starting
/// again), and each map must show the event asked for.
#[test]
fn a_large_recording_opens_and_steps_quickly() {
    let dir = crate::common::temp_dir("view-large");
    let file = dir.join("large.pickle");
    let size = crate::replay::generate_snapshot(100_000, 480, &[], &file);
    let log = dir.join("view.log");
    let started = Instant::now();
    let (_view, port) = spawn_view(&file, &log);
    let answered = started.elapsed();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let browser = Browser::start();
    let opened = Instant::now();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    let events = read_events(port);
    let first = wait_for(Duration::from_secs(60), || {
        browser
            .eval("return document.querySelector('#map-recorded svg') ? 1 : null;")
            .as_u64()
    });
    assert!(first.is_some(), "the first map is drawn");
    let first_page = opened.elapsed();
    let forward = (1..=10).map(|step| events * step / 11);
    let back = (1..=10).rev().map(|step| events * step / 13);
    for event in forward.chain(back) {
        browser.eval(&format!(
            "const s = document.getElementById('slider'); s.value = '{event}'; \
             s.dispatchEvent(new Event('input')); return true;"
        ));
        let _ = rows_at(&browser, event);
    }
    let timings = browser.eval("return window.gpumemTimings;");
    let steps: Vec<f64> = timings
        .as_array()
        .expect("timings")
        .iter()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    let mean = steps.iter().sum::<f64>() / steps.len().max(1) as f64;
    let worst = steps.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "view of a {:.0} MB snapshot ({events} events): answering {:.1} s after start ({}), first page drawn {:.0} ms after opening; {} map steps: mean {mean:.0} ms, worst {worst:.0} ms",
        size as f64 / 1e6,
        answered.as_secs_f64(),
        said.trim(),
        first_page.as_secs_f64() * 1000.0,
        steps.len()
    );
    assert_eq!(steps.len(), 21, "the first map and each step's");
    assert!(browser.console_errors().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The first device's event count, from the view's API.
fn read_events(port: u16) -> usize {
    let body = http_get(port, "/api/v1/recording").expect("recording");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v["devices"][0]["events"].as_u64().expect("events") as usize
}

/// Starts `gpumem demo` on a free loopback port with `extra` arguments; waits until ready.
pub(crate) fn spawn_demo(extra: &[&str], log: &Path) -> (Reaper, u16) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .arg("demo")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("gpumem demo starts");
    let demo = Reaper(child);
    wait_for(Duration::from_secs(60), || http_get(port, "/readyz")).unwrap_or_else(|| {
        panic!(
            "the demo is ready: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    (demo, port)
}

/// A sample's value in an exposition: the series of `metric` whose labels include every one
/// of `labels`, summed.
fn metric_sum(exposition: &str, metric: &str, labels: &[(&str, &str)]) -> f64 {
    exposition
        .lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn the_agents_live_page_lines_up_with_its_metrics() {
    let dir = crate::common::temp_dir("live");
    // Held still, so the page and /metrics can be read at the same state.
    let (_demo, port) = spawn_demo(
        &["--speed", "0", "--interval", "0.1"],
        &dir.join("demo.log"),
    );
    let browser = Browser::start();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    let read_page = || {
        browser.eval(
            "return {drawn: window.gpumemDrawn, \
              gpus: Array.from(document.querySelectorAll('section.gpu')).map(s => ({ \
                gpu: s.dataset.gpu, uuid: s.dataset.uuid, \
                parts: s.querySelectorAll('rect.part').length, \
                figures: Object.fromEntries(Array.from(s.querySelectorAll('[data-field]')).map(e => [e.dataset.field, Number(e.dataset.value)]))})), \
              processes: Array.from(document.querySelectorAll('#processes tr[data-pid]')).map(r => ({ \
                pid: r.dataset.pid, uuid: r.dataset.uuid, \
                reserved: Number(r.querySelector('[data-field=reserved]').dataset.value), \
                allocated: Number(r.querySelector('[data-field=allocated]').dataset.value), \
                retries: Number(r.querySelector('[data-field=retries]').dataset.value)}))};",
        )
    };
    // Two draws that agree, with /metrics read between them: the same state.
    let (page, exposition) = wait_for(Duration::from_secs(60), || {
        let before = read_page();
        if before["drawn"].as_u64()? < 2 {
            return None;
        }
        let exposition = http_get(port, "/metrics")?;
        let drawn = before["drawn"].as_u64()?;
        wait_for(Duration::from_secs(10), || {
            (browser.eval("return window.gpumemDrawn;").as_u64()? > drawn).then_some(())
        })?;
        let after = read_page();
        (before["gpus"] == after["gpus"] && before["processes"] == after["processes"])
            .then_some((after, exposition))
    })
    .expect("the page settles");
    let gpus = page["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 2, "the demo's two GPUs: {page}");
    let mut pids = 0;
    for g in gpus {
        let uuid = g["uuid"].as_str().expect("uuid");
        let f = &g["figures"];
        let device = |metric: &str| metric_sum(&exposition, metric, &[("UUID", uuid)]);
        assert_eq!(f["total"], device("gpumem_device_total_bytes"), "{uuid}");
        assert_eq!(f["used"], device("gpumem_device_used_bytes"), "{uuid}");
        assert_eq!(f["free"], device("gpumem_device_free_bytes"), "{uuid}");
        assert_eq!(
            f["driver_reserved"],
            device("gpumem_device_reserved_bytes"),
            "{uuid}"
        );
        // The parts meet nvidia-smi's total.
        let parts: f64 = f
            .as_object()
            .expect("figures")
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "total" | "used"))
            .map(|(_, v)| v.as_f64().unwrap_or(0.0))
            .sum();
        assert_eq!(parts, f["total"].as_f64().expect("total"), "{uuid}: {f}");
        assert!(g["parts"].as_u64().is_some_and(|n| n >= 5), "{g}");
        for p in page["processes"].as_array().expect("rows") {
            if p["uuid"] != uuid {
                continue;
            }
            pids += 1;
            let pid = p["pid"].as_str().expect("pid");
            let of =
                |metric: &str| metric_sum(&exposition, metric, &[("UUID", uuid), ("pid", pid)]);
            assert_eq!(
                p["reserved"],
                of("gpumem_allocator_reserved_bytes"),
                "{pid}"
            );
            assert_eq!(
                p["allocated"],
                of("gpumem_allocator_allocated_bytes"),
                "{pid}"
            );
            assert_eq!(
                p["retries"],
                of("gpumem_allocator_alloc_retries_total"),
                "{pid}"
            );
            assert_eq!(
                f[&format!("process.{pid}.allocated")],
                p["allocated"],
                "the line-up and the table agree"
            );
            let used = of("gpumem_process_used_bytes");
            assert_eq!(
                f[&format!("process.{pid}.outside")].as_f64(),
                Some((used - of("gpumem_allocator_reserved_bytes")).max(0.0)),
                "{pid}"
            );
        }
    }
    assert_eq!(pids, 6, "three processes a GPU: {page}");
    // The assignments' table: a row per series, each naming its pod.
    let assigned = browser.eval(
        "return {shown: !document.getElementById('assignments').hidden, \
           pods: Array.from(document.querySelectorAll('#assigned tr[data-pod]')).map(r => r.dataset.pod)};",
    );
    let series: Vec<&str> = exposition
        .lines()
        .filter(|l| l.starts_with("gpumem_gpu_assigned_info{"))
        .collect();
    let pods = assigned["pods"].as_array().expect("rows");
    assert!(
        assigned["shown"] == true && !series.is_empty(),
        "{assigned}"
    );
    assert_eq!(pods.len(), series.len(), "{assigned} {series:?}");
    for pod in pods {
        let (namespace, name) = pod
            .as_str()
            .and_then(|p| p.split_once('/'))
            .expect("ns/pod");
        let labels = format!(r#"pod_namespace="{namespace}",pod_name="{name}""#);
        assert!(
            series.iter().any(|l| l.contains(&labels)),
            "{pod}: {series:?}"
        );
    }
    // GPU 1 is in MIG mode: a bar per GPU instance under it, each with its process, and
    // the instances /metrics names.
    let migs = browser.eval(
        "return Array.from(document.querySelectorAll('section.gpu[data-gpu=\"1\"] div.mig')).map(m => ({ \
           uuid: m.dataset.migUuid, parts: m.querySelectorAll('rect.part').length, \
           allocated: m.querySelectorAll('rect.part.allocated').length}));",
    );
    let migs = migs.as_array().expect("MIG instances");
    assert_eq!(migs.len(), 3, "three instances under GPU 1: {migs:?}");
    for m in migs {
        let uuid = m["uuid"].as_str().expect("a MIG device's UUID");
        assert!(
            metric_sum(&exposition, "gpumem_mig_total_bytes", &[("mig_uuid", uuid)]) > 0.0,
            "{uuid} not in /metrics"
        );
        assert_eq!(m["allocated"], 1, "its process's allocated part: {m}");
    }
    // At 1 280 px, with an OOM's cell drawn, the page does not scroll sideways.
    let widths = wait_for(Duration::from_secs(30), || {
        let w = browser.eval(
            "const oom = document.querySelector('#processes tr.oom .last-oom'); \
             return oom ? [window.innerWidth, document.documentElement.scrollWidth] : null;",
        );
        let w = w.as_array()?;
        Some((w[0].as_u64()?, w[1].as_u64()?))
    })
    .expect("an OOM row is drawn");
    assert_eq!(widths.0, 1280, "the window's width");
    assert!(widths.1 <= widths.0, "scrolls sideways: {widths:?}");
    // The segments of an allocator the demo holds, drawn on request.
    browser.eval("document.querySelector('#processes button.segments').click(); return true;");
    let rows = wait_for(Duration::from_secs(30), || {
        browser
            .eval("const s = document.querySelectorAll('#map svg g.segment'); return s.length || null;")
            .as_u64()
    })
    .expect("the live map is drawn");
    let first = &page["processes"][0];
    let (uuid, pid) = (
        first["uuid"].as_str().expect("uuid"),
        first["pid"].as_str().expect("pid"),
    );
    let api = http_get(port, &format!("/api/v1/segments?uuid={uuid}&pid={pid}")).expect("the map");
    let map: serde_json::Value = serde_json::from_str(&api).expect("json");
    assert_eq!(map["segments_total"], rows, "{api}");
    assert_eq!(
        map["reserved"].as_f64(),
        Some(metric_sum(
            &exposition,
            "gpumem_allocator_reserved_bytes",
            &[("UUID", uuid), ("pid", pid)]
        )),
        "the map holds the reserved memory"
    );
    assert!(
        http_get(port, &format!("/api/v1/segments?uuid={uuid}&pid=1")).is_none(),
        "not held"
    );
    // A process on the demo's MIG GPU (the last rows): its map is asked for by its MIG
    // device's UUID, and drawn.
    let node: serde_json::Value =
        serde_json::from_str(&http_get(port, "/api/v1/node").expect("the node")).expect("json");
    let on_mig = node["processes"]
        .as_array()
        .and_then(|rows| rows.last())
        .expect("rows");
    let mig_uuid = on_mig["mig_uuid"].as_str().expect("mig_uuid");
    assert!(mig_uuid.starts_with("MIG-"), "{on_mig}");
    let drawn = browser
        .eval("return window.gpumemDrawn;")
        .as_u64()
        .unwrap_or(0);
    browser.eval(
        "const b = document.querySelectorAll('#processes button.segments'); b[b.length - 1].click(); return true;",
    );
    let mig_map = wait_for(Duration::from_secs(30), || {
        browser
            .eval(&format!(
                "return window.gpumemDrawn > {} && document.getElementById('map-title').textContent.includes('{mig_uuid}') \
                 ? document.querySelectorAll('#map svg g.segment').length : null;",
                drawn + 1
            ))
            .as_u64()
    });
    assert!(
        mig_map.is_some_and(|n| n > 0),
        "the MIG process's map: {:?}",
        browser.eval("return document.getElementById('error').textContent;")
    );
    // A job whose vLLM pool sleeps pushes (from loopback): its reserved-but-not-resident
    // bytes are said beside its GPU's bar.
    let gpu0 = node["gpus"][0]["uuid"].as_str().expect("a GPU").to_string();
    let me = std::process::id();
    let push = serde_json::json!({"pid": me, "seq": 1, "devices": [{"index": 0, "uuid": gpu0,
        "stats": {"reserved_bytes.all.current": 40u64 << 30, "reserved_bytes.large_pool.current": 40u64 << 30},
        "unmapped_bytes": 30u64 << 30}]})
    .to_string();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connects");
    std::io::Write::write_all(
        &mut stream,
        format!(
            "POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{push}",
            push.len()
        )
        .as_bytes(),
    )
    .expect("sends");
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut stream, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 2"), "{answer}");
    let beside = wait_for(Duration::from_secs(30), || {
        let found = browser.eval(&format!(
            "const p = document.querySelector('section.gpu p.beside[data-pid=\"{me}\"]'); \
             return p ? [Number(p.dataset.notResident), p.textContent] : null;"
        ));
        found.as_array().cloned()
    })
    .expect("the sleeping pool is said beside the bar");
    assert_eq!(beside[0].as_f64(), Some((30u64 << 30) as f64), "{beside:?}");
    assert!(
        beside[1]
            .as_str()
            .is_some_and(|t| t.contains("30.00 GiB reserved, not resident")),
        "{beside:?}"
    );
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    browser.screenshot("agent-live.png");

    // Turned off, the page and its API are gone; /metrics stays.
    let (_off, off_port) = spawn_demo(&["--ui", "off"], &dir.join("off.log"));
    let index = http_get(off_port, "/").expect("the links page");
    assert!(!index.contains("agent.js"), "{index}");
    assert!(http_get(off_port, "/api/v1/node").is_none(), "no API");
    assert!(http_get(off_port, "/assets/agent.js").is_none());
    assert!(http_get(off_port, "/metrics").is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The explanation the view's page in `browser` shows, once it shows one (30 s at most):
/// its sentence, slider event, breakdown rows, map blocks, error text and address; a panic
/// naming the page's address, error and console otherwise.
pub(crate) fn shown_explanation(browser: &crate::browser::Browser) -> serde_json::Value {
    crate::agent::wait_for(Duration::from_secs(30), || {
        let shown = browser.eval(
            "const e = document.getElementById('explain'); \
             return e && !e.hidden ? {sentence: document.getElementById('sentence').textContent, \
               event: document.getElementById('slider').value, \
               parts: document.querySelectorAll('#breakdown tr').length, \
               blocks: document.querySelectorAll('#map-recorded rect').length, \
               shown_error: document.getElementById('error').textContent, \
               url: window.location.href} : null;",
        );
        (!shown.is_null()).then_some(shown)
    })
    .unwrap_or_else(|| {
        panic!(
            "the view shows no explanation: {} (console: {:?})",
            browser.eval(
                "return [window.location.href, document.getElementById('error').textContent];"
            ),
            browser.console_errors()
        )
    })
}
