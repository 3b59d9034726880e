//! The live page agrees with `/metrics`, value for value: every figure `GET /api/v1/node`
//! serves is read back from the exposition of the same still node (the simulated node held
//! at speed 0, a pushed job that ran out of memory), by its metric and labels.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpumem::agent::Agent;
use gpumem::demo::{SimNode, SimNodeConfig};
use gpumem::metrics::contract as c;

use crate::agent::{get, pid_77_in_a_pod};

type Labels = BTreeMap<String, String>;

/// The samples of an exposition in the 0.0.4 text format.
struct Scrape(Vec<(String, Labels, f64)>);

/// `name{a="x",b="y"} value`, with the format's escapes in label values.
fn sample(line: &str) -> (String, Labels, f64) {
    let (series, value) = line.rsplit_once(' ').expect("a value");
    let value: f64 = value.parse().expect("a number");
    let Some((name, rest)) = series.split_once('{') else {
        return (series.to_string(), Labels::new(), value);
    };
    let mut labels = Labels::new();
    let mut chars = rest.strip_suffix('}').expect("closed labels").chars();
    loop {
        let key: String = chars.by_ref().take_while(|&ch| ch != '=').collect();
        if key.is_empty() {
            break;
        }
        assert_eq!(chars.next(), Some('"'), "{line}");
        let mut text = String::new();
        while let Some(ch) = chars.next() {
            match ch {
                '"' => break,
                '\\' => match chars.next() {
                    Some('n') => text.push('\n'),
                    Some(other) => text.push(other),
                    None => panic!("{line}"),
                },
                other => text.push(other),
            }
        }
        labels.insert(key, text);
        if chars.next() != Some(',') {
            break;
        }
    }
    (name.to_string(), labels, value)
}

impl Scrape {
    fn of(text: &str) -> Scrape {
        Scrape(
            text.lines()
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(sample)
                .collect(),
        )
    }

    /// The series of `name` whose labels include `with`.
    fn series<'a>(
        &'a self,
        name: &'a str,
        with: &'a [(&str, &str)],
    ) -> impl Iterator<Item = &'a (String, Labels, f64)> + 'a {
        self.0.iter().filter(move |(n, labels, _)| {
            n == name
                && with
                    .iter()
                    .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.series(name, with).map(|(_, _, v)| v).sum()
    }

    /// The one value of `name` with `with` (compute instances of one GPU instance report
    /// the same figures: all must agree), if any.
    fn one(&self, name: &str, with: &[(&str, &str)]) -> Option<f64> {
        let values: BTreeSet<u64> = self
            .series(name, with)
            .map(|(_, _, v)| v.to_bits())
            .collect();
        assert!(values.len() <= 1, "{name} {with:?}: {values:?}");
        values.first().map(|&bits| f64::from_bits(bits))
    }

    fn label(&self, name: &str, with: &[(&str, &str)], label: &str) -> Option<String> {
        self.series(name, with)
            .next()
            .and_then(|(_, l, _)| l.get(label).cloned())
    }
}

/// The simulated node held still (its own OOM job off: the test pushes one), and its agent.
fn still_agent() -> (SimNode, Agent) {
    let node = SimNode::start(SimNodeConfig {
        speed: 0.0,
        tick: Duration::from_millis(10),
        oom_job: false,
        ..SimNodeConfig::default()
    })
    .expect("starts");
    let agent = Agent::simulated(&node, pid_77_in_a_pod()).expect("registers");
    (node, agent)
}

/// A push of pid 77 that ran out of memory on GPU `uuid`, its snapshot sent.
fn pushed_oom(uuid: &str) -> Vec<u8> {
    serde_json::json!({"pid": 77, "seq": 1, "reason": "oom", "alloc_conf": "expandable_segments:False",
        "devices": [{"index": 0, "uuid": uuid,
            "stats": {"allocated_bytes.all.current": 3u64 << 30, "allocated_bytes.large_pool.current": 3u64 << 30,
                      "reserved_bytes.all.current": 5u64 << 30, "reserved_bytes.large_pool.current": 5u64 << 30,
                      "num_ooms": 1, "num_alloc_retries": 4},
            "largest_free_block": 1 << 29, "unmapped_bytes": 2u64 << 30,
            "segments_by_size": [{"size": 1 << 30, "segments": 5, "free_bytes": 2u64 << 30}],
            "oom": {"size": 1 << 30, "stream": 0, "device_total": 80u64 << 30, "device_free": 0,
                    "pools": [{"pool": "large", "stream": 0, "allocated": 3u64 << 30, "requested": 3u64 << 30,
                               "pending_free": 0, "free": 2u64 << 30, "largest_free": 1 << 29,
                               "segments_with_free": 3}]}}]})
    .to_string()
    .into_bytes()
}

fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_agrees_with_the_metrics_value_for_value() {
    let (node, agent) = still_agent();
    let router = agent.router();
    // The simulated processes reach their still picture on their own thread, in rounds of
    // bounded time: a loaded machine takes a while.
    for _ in 0..600 {
        if node.is_still() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        node.is_still(),
        "the node reaches its still picture in a minute"
    );
    let (_, _, first) = get(router.clone(), "/metrics").await;
    let gpu0 = Scrape::of(&first)
        .label(c::DEVICE_TOTAL.name, &[("gpu", "0")], "UUID")
        .expect("GPU 0");
    let store = agent.ingest().expect("ingests");
    let peer = gpumem::ingest::Peer {
        pid: 77,
        start_time: Some(1),
        uid: None,
    };
    store
        .push_from(&pushed_oom(&gpu0), Some(peer))
        .expect("accepted");
    // A JAX job on GPU 1: XLA's figures.
    let gpu1 = Scrape::of(&first)
        .label(c::DEVICE_TOTAL.name, &[("gpu", "1")], "UUID")
        .expect("GPU 1");
    let xla = serde_json::json!({"pid": 88, "seq": 1, "jax_version": "0.10.2",
        "devices": [{"index": 0, "uuid": gpu1, "allocator": "xla",
                     "stats": {"bytes_in_use": 1u64 << 30, "pool_bytes": 2u64 << 30,
                               "largest_free_block_bytes": 1u64 << 29}}]});
    store
        .push_from(xla.to_string().as_bytes(), None)
        .expect("accepted");
    // A page between two identical scrapes saw what they saw.
    let (metrics, page) = {
        let mut last = None;
        let mut moved = Vec::new();
        for _ in 0..20 {
            let (_, _, before) = get(router.clone(), "/metrics").await;
            let (status, _, page) = get(router.clone(), "/api/v1/node").await;
            assert_eq!(status, 200, "{page}");
            let (_, _, after) = get(router.clone(), "/metrics").await;
            let still = |text: &str| {
                text.lines()
                    .filter(|l| !l.contains("duration_seconds") && !l.contains("age_seconds"))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            if still(&before) == still(&after) {
                last = Some((after, page));
                break;
            }
            let (before, after) = (still(&before), still(&after));
            let before: BTreeSet<&str> = before.lines().collect();
            moved = after
                .lines()
                .filter(|l| !before.contains(l))
                .map(str::to_string)
                .collect();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last.unwrap_or_else(|| panic!("the node holds still; still moving: {moved:?}"))
    };
    let m = Scrape::of(&metrics);
    let page: serde_json::Value = serde_json::from_str(&page).expect("JSON");
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    let s = |v: &serde_json::Value, k: &str| v[k].as_str().unwrap_or_default().to_string();

    // Each process row: its allocator's series, by (UUID, pid).
    let rows = page["processes"].as_array().expect("processes");
    let keys: BTreeSet<(String, String)> = m
        .series(c::RESERVED_BYTES.name, &[])
        .map(|(_, l, _)| (l["UUID"].clone(), l["pid"].clone()))
        .collect();
    let row_keys: BTreeSet<(String, String)> =
        rows.iter().map(|r| (s(r, "uuid"), s(r, "pid"))).collect();
    assert_eq!(row_keys, keys, "a row per allocator");
    assert!(
        keys.contains(&(gpu0.clone(), "77".into())),
        "the pushed job has a row"
    );
    for r in rows {
        let (uuid, pid) = (s(r, "uuid"), s(r, "pid"));
        let at = [("UUID", uuid.as_str()), ("pid", pid.as_str())];
        let reserved = m.sum(c::RESERVED_BYTES.name, &at);
        let allocated = m.sum(c::ALLOCATED_BYTES.name, &at);
        assert_eq!(f(r, "reserved"), reserved, "{pid}");
        assert_eq!(f(r, "allocated"), allocated, "{pid}");
        // What an allocator has no figure for (XLA's: fragmentation, retries) is absent on
        // both.
        match (
            r["fragmentation"].as_f64(),
            m.one(c::FRAGMENTATION_RATIO.name, &at),
        ) {
            (Some(shown), Some(exported)) => assert!(approx(shown, exported), "{pid}: {r}"),
            (shown, exported) => assert_eq!(shown, exported, "{pid}: {r}"),
        }
        assert_eq!(
            r["largest_free_block"].as_f64(),
            m.one(c::LARGEST_FREE_BLOCK.name, &at)
        );
        assert_eq!(
            r["retries"].as_f64(),
            m.one(c::ALLOC_RETRIES.name, &at),
            "{pid}"
        );
        assert_eq!(r["ooms"].as_f64(), m.one(c::OOMS.name, &at), "{pid}");
        // (serde_json's default parser may miss a float's last bit.)
        let last_oom = m.one(c::LAST_OOM_TIMESTAMP.name, &at);
        match (r["last_oom"].as_f64(), last_oom) {
            (Some(shown), Some(exported)) => assert!(approx(shown, exported), "{pid}"),
            (shown, exported) => assert_eq!(shown, exported, "{pid}"),
        }
        let breakdown: BTreeMap<String, f64> = m
            .series(c::OOM_BREAKDOWN.name, &at)
            .map(|(_, l, v)| (l["kind"].clone(), *v))
            .collect();
        let shown: BTreeMap<String, f64> =
            serde_json::from_value(r["oom_breakdown"].clone()).expect("a breakdown");
        assert_eq!(shown, breakdown, "{pid}");
        for (field, label) in [
            ("config", "config"),
            ("allocator", "allocator"),
            ("gpu", "gpu"),
        ] {
            let info = m.label(c::ALLOCATOR_INFO.name, &at, label);
            assert_eq!(Some(s(r, field)), info, "{pid} {field}");
        }
        for name in ["pod_namespace", "pod_name", "container_name", "mig_uuid"] {
            let labelled = m
                .label(c::RESERVED_BYTES.name, &at, name)
                .unwrap_or_default();
            assert_eq!(s(r, name), labelled, "{pid} {name}");
        }
    }
    let jax = rows
        .iter()
        .find(|r| s(r, "pid") == "88")
        .expect("the JAX job's row");
    assert_eq!(s(jax, "allocator"), "xla");
    assert_eq!(
        (f(jax, "reserved"), f(jax, "allocated")),
        (2.0 * (1u64 << 30) as f64, (1u64 << 30) as f64)
    );
    assert!(
        jax["fragmentation"].is_null() && jax["retries"].is_null(),
        "{jax}"
    );
    let pushed = rows.iter().find(|r| s(r, "pid") == "77").expect("pushed");
    assert!(
        f(pushed, "ooms") == 1.0 && pushed["last_oom"].is_f64(),
        "{pushed}"
    );
    // Its sleeping pool: exported, and on the row.
    let unmapped = [("pid", "77")];
    assert_eq!(
        m.one(c::UNMAPPED_BYTES.name, &unmapped),
        Some(f64::from(2u32 << 30))
    );
    assert_eq!(f(pushed, "unmapped"), f64::from(2u32 << 30), "{pushed}");
    assert!(
        !pushed["oom_breakdown"]
            .as_object()
            .expect("parts")
            .is_empty()
    );
    let why = pushed["oom_why"].as_str().unwrap_or_default();
    assert!(!why.is_empty(), "the OOM's sentence: {pushed}");

    // Each GPU: NVML's figures, its instances', and its line-up's parts.
    let gpus = page["gpus"].as_array().expect("gpus");
    let devices: BTreeSet<String> = m
        .series(c::DEVICE_TOTAL.name, &[])
        .map(|(_, l, _)| l["UUID"].clone())
        .collect();
    assert_eq!(
        gpus.iter().map(|g| s(g, "uuid")).collect::<BTreeSet<_>>(),
        devices
    );
    let mut migs = 0;
    for g in gpus {
        let uuid = s(g, "uuid");
        let at = [("UUID", uuid.as_str())];
        for (field, def) in [
            ("total", &c::DEVICE_TOTAL),
            ("used", &c::DEVICE_USED),
            ("free", &c::DEVICE_FREE),
        ] {
            assert_eq!(Some(f(g, field)), m.one(def.name, &at), "{uuid} {field}");
        }
        let reserved = m.one(c::DEVICE_RESERVED.name, &at).unwrap_or(0.0);
        assert_eq!(f(g, "driver_reserved"), reserved);
        assert_eq!(
            Some(s(g, "model")),
            m.label(c::DEVICE_INFO.name, &at, "model")
        );
        for mig in g["migs"].as_array().expect("migs") {
            migs += 1;
            let instance = s(mig, "instance");
            let at = [("UUID", uuid.as_str()), ("GPU_I_ID", instance.as_str())];
            for (field, def) in [
                ("total", &c::MIG_TOTAL),
                ("used", &c::MIG_USED),
                ("free", &c::MIG_FREE),
            ] {
                assert_eq!(
                    Some(f(mig, field)),
                    m.one(def.name, &at),
                    "{instance} {field}"
                );
            }
            assert_eq!(
                Some(s(mig, "profile")),
                m.label(c::MIG_TOTAL.name, &at, "GPU_I_PROFILE")
            );
            // Its processes: NVML's on its MIG devices, by GPU instance.
            let on: BTreeMap<String, f64> = m
                .series(c::PROCESS_USED.name, &at)
                .map(|(_, l, v)| (l["pid"].clone(), *v))
                .collect();
            let parts: BTreeSet<String> = mig["processes"]
                .as_array()
                .expect("parts")
                .iter()
                .map(|p| s(p, "pid"))
                .collect();
            let mut others = 0.0;
            let mut with_allocator = BTreeSet::new();
            for (pid, used) in &on {
                let allocator = [("UUID", uuid.as_str()), ("pid", pid.as_str())];
                if m.series(c::RESERVED_BYTES.name, &allocator)
                    .next()
                    .is_none()
                {
                    others += used;
                } else {
                    with_allocator.insert(pid.clone());
                }
            }
            assert_eq!(
                parts, with_allocator,
                "{instance}: a part per allocator on it"
            );
            assert!(!parts.is_empty(), "{instance} runs a process of the demo");
            assert!(approx(f(mig, "other_processes"), others), "{instance}");
            let charged: f64 = on.values().sum();
            let unattributed = (f(mig, "used") - charged).max(0.0);
            assert!(approx(f(mig, "unattributed"), unattributed), "{instance}");
        }
        // The parts: an allocator's allocated and reserved, and what NVML charges its pid
        // beyond them; processes without an allocator; what NVML charges to no process.
        let mut charged = 0.0;
        let mut others = 0.0;
        let used_of: BTreeMap<String, f64> = m
            .series(c::PROCESS_USED.name, &at)
            .map(|(_, l, v)| (l["pid"].clone(), *v))
            .collect();
        for (pid, used) in &used_of {
            charged += used;
            let allocator = [("UUID", uuid.as_str()), ("pid", pid.as_str())];
            if m.series(c::RESERVED_BYTES.name, &allocator)
                .next()
                .is_none()
            {
                others += used;
            }
        }
        assert!(approx(f(g, "other_processes"), others), "{uuid}");
        let mut uncharged = 0.0;
        let parts = g["processes"].as_array().expect("parts");
        let allocators: BTreeSet<String> = m
            .series(c::RESERVED_BYTES.name, &at)
            .map(|(_, l, _)| l["pid"].clone())
            .collect();
        let part_pids: BTreeSet<String> = parts.iter().map(|p| s(p, "pid")).collect();
        assert_eq!(
            part_pids, allocators,
            "{uuid}: a part per allocator, charged or not"
        );
        for part in parts {
            let pid = s(part, "pid");
            let allocator = [("UUID", uuid.as_str()), ("pid", pid.as_str())];
            // What the allocator holds on the device: reserved but for what a sleeping pool
            // unmapped, which is drawn beside the line-up.
            let reserved = m.sum(c::RESERVED_BYTES.name, &allocator);
            let unmapped = m.sum(c::UNMAPPED_BYTES.name, &allocator);
            let resident = (reserved - unmapped).max(0.0);
            let allocated = m.sum(c::ALLOCATED_BYTES.name, &allocator);
            assert_eq!(f(part, "allocated"), allocated.min(resident), "{pid}");
            assert_eq!(f(part, "not_resident"), unmapped, "{pid}");
            assert_eq!(
                f(part, "reserved_unallocated"),
                (resident - allocated).max(0.0)
            );
            let outside = match used_of.get(&pid) {
                Some(used) => (used - resident).max(0.0),
                None => {
                    uncharged += resident;
                    0.0
                }
            };
            assert_eq!(f(part, "outside"), outside, "{pid}");
            // Named by its pod, else as NVML names the process, else by its pid.
            let pod = m.label(c::RESERVED_BYTES.name, &allocator, "pod_name");
            let namespace = m.label(c::RESERVED_BYTES.name, &allocator, "pod_namespace");
            let process = m.label(c::PROCESS_USED.name, &allocator, "process");
            let name = match (pod, process) {
                (Some(pod), _) if !pod.is_empty() => {
                    format!("{}/{pod}", namespace.unwrap_or_default())
                }
                (_, Some(process)) => process,
                _ => format!("pid {pid}"),
            };
            assert_eq!(s(part, "name"), name, "{pid}");
        }
        let left = (f(g, "used") - charged).max(0.0);
        assert!(
            approx(f(g, "unattributed"), (left - uncharged).max(0.0)),
            "{uuid}"
        );
    }
    assert!(migs >= 3, "the demo's GPU in MIG mode shows its instances");

    // The assignments: one row per series, as labelled.
    let labelled = |l: &Labels, k: &str| l.get(k).cloned().unwrap_or_default();
    let series: BTreeSet<[String; 6]> = m
        .series(c::GPU_ASSIGNED.name, &[])
        .map(|(_, l, _)| {
            let claim = match labelled(l, "claim_name") {
                name if name.is_empty() => name,
                name => format!("{}/{name}", labelled(l, "claim_namespace")),
            };
            [
                labelled(l, "UUID"),
                labelled(l, "mig_uuid"),
                labelled(l, "pod_namespace"),
                labelled(l, "pod_name"),
                labelled(l, "container_name"),
                claim,
            ]
        })
        .collect();
    let rows: Vec<[String; 6]> = page["assigned"]
        .as_array()
        .expect("assigned")
        .iter()
        .map(|r| {
            [
                "uuid",
                "mig_uuid",
                "pod_namespace",
                "pod_name",
                "container_name",
                "claim",
            ]
            .map(|k| s(r, k))
        })
        .collect();
    assert!(!series.is_empty(), "the demo assigns its GPUs");
    assert_eq!(rows.len(), series.len(), "{rows:?}");
    assert_eq!(rows.into_iter().collect::<BTreeSet<_>>(), series);
}

/// NVML's view of one GPU whose only process is pid 77, charged `used` bytes.
fn one_process(used: u64) -> std::sync::Arc<gpumem::telemetry::SourceReport> {
    use gpumem::telemetry::{GpuSample, NodeSample, ProcessSample, SourceReport};
    std::sync::Arc::new(SourceReport {
        source: "nvml",
        up: true,
        sample: Some(NodeSample {
            driver_version: "580.95.05".into(),
            simulated: false,
            gpus: vec![GpuSample {
                index: 0,
                uuid: "GPU-a".into(),
                minor: Some(0),
                model: "H100".into(),
                total: 80 << 30,
                used: used + (2 << 30),
                free: (78 << 30) - used,
                reserved: Some(0),
                processes: vec![ProcessSample {
                    pid: 77,
                    name: "python3".into(),
                    used: Some(used),
                    container: None,
                }],
                mig: Vec::new(),
            }],
        }),
        error: None,
        duration_seconds: 0.001,
    })
}

/// An RL job's vLLM pool asleep (40 GiB reserved, 30 GiB of it unmapped, NVML charging the
/// process 12 GiB), then awake (42 GiB charged): the split is exported, no figure is negative
/// anywhere, the page draws what is resident in the line-up and the rest beside it, and awake
/// the figures are as they would be without a pool that sleeps.
#[tokio::test]
async fn a_sleeping_pool_is_reserved_but_not_resident() {
    use std::sync::{Arc, Mutex, PoisonError};
    let nvml = Arc::new(Mutex::new(one_process(12 << 30)));
    let reader = {
        let nvml = Arc::clone(&nvml);
        Box::new(move || Arc::clone(&nvml.lock().unwrap_or_else(PoisonError::into_inner)))
    };
    let ingest = gpumem::ingest::IngestConfig {
        min_interval: Duration::ZERO,
        ..pid_77_in_a_pod()
    };
    let agent = Agent::node(Default::default(), vec![reader], ingest, Default::default())
        .expect("registers");
    let store = agent.ingest().expect("ingests");
    let push = |seq: u64, unmapped: Option<u64>| {
        let mut device = serde_json::json!({"index": 0, "uuid": "GPU-a",
            "stats": {"allocated_bytes.all.current": 35u64 << 30, "allocated_bytes.large_pool.current": 35u64 << 30,
                      "reserved_bytes.all.current": 40u64 << 30, "reserved_bytes.large_pool.current": 40u64 << 30}});
        if let Some(bytes) = unmapped {
            device["unmapped_bytes"] = bytes.into();
        }
        serde_json::json!({"pid": 77, "seq": seq, "devices": [device]})
            .to_string()
            .into_bytes()
    };
    let peer = || gpumem::ingest::Peer {
        pid: 77,
        start_time: Some(1),
        uid: None,
    };
    let gib = |n: u64| (n << 30) as f64;
    for (seq, unmapped, used, [allocated, unallocated, outside, not_resident]) in [
        // Asleep: 10 GiB resident, all of it allocated in PyTorch's count; 2 GiB outside.
        (1, Some(30u64 << 30), 12u64 << 30, [10, 0, 2, 30]),
        // Awake: as without a sleeping pool.
        (2, None, 42 << 30, [35, 5, 2, 0]),
    ] {
        *nvml.lock().unwrap_or_else(PoisonError::into_inner) = one_process(used);
        store
            .push_from(&push(seq, unmapped), Some(peer()))
            .expect("accepted");
        let router = agent.router();
        let (_, _, metrics) = get(router.clone(), "/metrics").await;
        let m = Scrape::of(&metrics);
        let negative: Vec<&(String, Labels, f64)> =
            m.0.iter().filter(|(_, _, v)| *v < 0.0).collect();
        assert!(negative.is_empty(), "{negative:?}");
        assert_eq!(
            m.one(c::UNMAPPED_BYTES.name, &[("pid", "77")]),
            Some(unmapped.unwrap_or(0) as f64)
        );
        let (status, _, page) = get(router, "/api/v1/node").await;
        assert_eq!(status, 200, "{page}");
        let page: serde_json::Value = serde_json::from_str(&page).expect("JSON");
        let gpu = &page["gpus"][0];
        let part = &gpu["processes"][0];
        let figures = [
            "allocated",
            "reserved_unallocated",
            "outside",
            "not_resident",
        ]
        .map(|k| part[k].as_f64().unwrap_or(f64::NAN));
        assert_eq!(
            figures,
            [allocated, unallocated, outside, not_resident].map(gib),
            "{part}"
        );
        // The line-up meets nvidia-smi's total; what is not resident is not in it.
        let lineup: f64 = figures[..3].iter().sum::<f64>()
            + ["other_processes", "unattributed", "driver_reserved", "free"]
                .iter()
                .map(|k| gpu[*k].as_f64().unwrap_or(f64::NAN))
                .sum::<f64>();
        assert_eq!(lineup, gib(80), "{gpu}");
    }
}
