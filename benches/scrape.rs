//! The agent under load: a scrape at 8 GPUs × 64 processes, each with allocator series.
//!
//! Prints the median and p99 latency of a scrape (encoding all families, and through the
//! HTTP router, as text and as Prometheus asks: OpenMetrics, gzipped), the CPU of gzip at the
//! level the agent uses and at the default one on this scrape and on the worst valid pushes'
//! (the pushed-series budget filled with every label and text at its bound), the resident
//! memory of the process holding what an agent holds (the
//! published counters and a node view, not the allocators), and the allocator's same-size
//! hot path side by side with and without a scraper thread reading its counters.
//!
//! `cargo bench --bench scrape`; without `--bench` (as `cargo test` runs it) a short smoke run.

use std::hint::black_box;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flate2::Compression;
use flate2::write::GzEncoder;
use gpumem::agent::Agent;
use gpumem::device::{SimConfig, SimDevice, simulated_uuid};
use gpumem::ingest::IngestConfig;
use gpumem::ingest::store::Peer;
use gpumem::metrics::{Format, Metrics, ReportReader};
use gpumem::server::{AppState, app};
use gpumem::sources::{AllocatorKind, AllocatorSource, AllocatorSources, Cache};
use gpumem::telemetry::{GpuSample, NodeSample, ProcessSample, SourceReport};
use gpumem::{AllocatorConfig, CachingAllocator, StreamId};
use http_body_util::BodyExt;
use tower::ServiceExt;

const GPUS: u32 = 8;
const PROCESSES: u32 = 64;
const MIB: u64 = 1 << 20;
/// What Debian's Prometheus (2.42) asks for.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// A `/proc/self/status` figure in KiB (`VmRSS`: resident now; `VmHWM`: the peak).
fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// 512 allocator sources. They share the counters of one allocator that did some work: an
/// agent holds only the published counters, and sharing keeps the allocators' own memory out
/// of the measurement while every series is still encoded.
fn sources() -> Vec<Arc<AllocatorSource>> {
    let mut alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(80 << 30)),
        AllocatorConfig::default(),
    );
    let a = alloc.malloc(30 * MIB, StreamId::DEFAULT).expect("fits");
    let _b = alloc.malloc(4096, StreamId::DEFAULT).expect("fits");
    alloc.free(a).expect("live");
    let stats = Arc::clone(alloc.stats());
    let largest = alloc.largest_free_block();
    let mut out = Vec::new();
    for gpu in 0..GPUS {
        for p in 0..PROCESSES {
            out.push(Arc::new(AllocatorSource {
                gpu,
                uuid: simulated_uuid(gpu),
                pid: 100_000 + gpu * 1000 + p,
                allocator: AllocatorKind::Pytorch,
                version: "2.5.1".into(),
                config: "expandable_segments:True".into(),
                stats: Arc::clone(&stats),
                cache: Mutex::new(Some(Cache {
                    largest_free_block: largest,
                    segments_by_size: Vec::new(),
                    read_at: Instant::now(),
                })),
                labels: Vec::new(),
                last_oom_unix_seconds: None,
                last_oom: Default::default(),
                segments: Default::default(),
                xla: None,
                unmapped: 0,
                memory_limit: None,
            }));
        }
    }
    out
}

fn node() -> Arc<SourceReport> {
    let gpus = (0..GPUS)
        .map(|gpu| GpuSample {
            index: gpu,
            uuid: simulated_uuid(gpu),
            minor: Some(gpu),
            model: "NVIDIA H200".into(),
            total: 141 << 30,
            used: 100 << 30,
            free: 40 << 30,
            reserved: Some(1 << 30),
            processes: (0..PROCESSES)
                .map(|p| ProcessSample {
                    container: None,
                    pid: 100_000 + gpu * 1000 + p,
                    name: "python3".into(),
                    used: Some(u64::from(p + 1) << 28),
                })
                .collect(),
            mig: Vec::new(),
        })
        .collect();
    Arc::new(SourceReport {
        source: "nvml",
        up: true,
        sample: Some(NodeSample {
            driver_version: "560.35.03".into(),
            simulated: false,
            gpus,
        }),
        error: None,
        duration_seconds: 0.004,
    })
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// ns per same-size malloc+free pair, best of `rounds`.
fn hot_path(iterations: u64, rounds: u32, scraper: Option<&Metrics>) -> f64 {
    let mut alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(80 << 30)),
        AllocatorConfig::default(),
    );
    let stop = AtomicBool::new(false);
    let mut best = f64::MAX;
    std::thread::scope(|scope| {
        if let Some(metrics) = scraper {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    black_box(metrics.encode(Format::Text));
                }
            });
        }
        for _ in 0..rounds {
            let started = Instant::now();
            for _ in 0..iterations {
                let p = alloc
                    .malloc(black_box(12 * MIB), StreamId::DEFAULT)
                    .expect("fits");
                alloc.free(p).expect("live");
            }
            best = best.min(started.elapsed().as_nanos() as f64 / iterations as f64);
        }
        stop.store(true, Ordering::Relaxed);
    });
    best
}

/// The exposition of an agent whose pushed-series budget is filled with the worst valid
/// pushes: each process with 16 devices and eight labels of 64 bytes, its texts 128 bytes.
fn worst_pushed_exposition() -> String {
    fn alive(_: u32) -> Option<u64> {
        Some(1)
    }
    let ingest = IngestConfig {
        start_time: alive,
        ..IngestConfig::default()
    };
    let agent = Agent::node(
        AllocatorSources::new(Vec::new()),
        Vec::new(),
        ingest,
        Default::default(),
    )
    .expect("registers");
    let store = agent.ingest().expect("ingests");
    let labels: serde_json::Map<String, serde_json::Value> = (0..8)
        .map(|i| {
            (
                format!("label_{i}_{}", "k".repeat(8)),
                "v".repeat(44).into(),
            )
        })
        .collect();
    let stats: serde_json::Map<String, serde_json::Value> = ["allocated", "reserved", "active"]
        .iter()
        .flat_map(|stat| {
            ["all", "small_pool", "large_pool"].map(|pool| {
                (
                    format!("{stat}_bytes.{pool}.current"),
                    serde_json::json!(123_456_789),
                )
            })
        })
        .collect();
    for pid in 1..2_000 {
        let devices: Vec<serde_json::Value> = (0..16)
            .map(|i| serde_json::json!({"index": i, "uuid": format!("GPU-{i:04}-{}", "u".repeat(100)), "stats": stats}))
            .collect();
        let body = serde_json::json!({"pid": pid, "seq": 1, "labels": labels,
            "torch_version": "t".repeat(128), "alloc_conf": "a".repeat(128), "devices": devices});
        let peer = Peer {
            pid,
            start_time: Some(1),
            uid: None,
        };
        if store
            .push_from(body.to_string().as_bytes(), Some(peer))
            .is_err()
        {
            break;
        }
    }
    agent.state.metrics.encode(Format::Text)
}

/// Median time and size of gzip over `body` at `level`.
fn gzip_cost(body: &[u8], level: Compression, runs: usize) -> (Duration, usize) {
    let mut size = 0;
    let times = (0..runs)
        .map(|_| {
            let started = Instant::now();
            let mut encoder = GzEncoder::new(Vec::new(), level);
            encoder.write_all(body).expect("compresses");
            size = encoder.finish().expect("compresses").len();
            started.elapsed()
        })
        .collect();
    (percentiles(times).0, size)
}

fn print_gzip(what: &str, body: &str, runs: usize) {
    let (fast, fast_size) = gzip_cost(body.as_bytes(), Compression::fast(), runs);
    let (default, default_size) = gzip_cost(body.as_bytes(), Compression::default(), runs);
    println!(
        "  gzip of {what} ({:.1} MB): fastest level (the agent's) {fast:?} to {:.2} MB; default level {default:?} to {:.2} MB",
        body.len() as f64 / 1e6,
        fast_size as f64 / 1e6,
        default_size as f64 / 1e6
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (scrapes, iterations, rounds) = if full {
        (300, 2_000_000, 7)
    } else {
        (3, 1_000, 1)
    };

    let rss_start = status_kib("VmRSS:");
    let sources = sources();
    let report = node();
    let reader: ReportReader = Box::new(move || Arc::clone(&report));
    let metrics = Arc::new(
        Metrics::new(
            AllocatorSources::new(sources),
            vec![reader],
            None,
            Default::default(),
        )
        .expect("registers"),
    );
    let body = metrics.encode(Format::Text);
    let series = body.lines().filter(|l| !l.starts_with('#')).count();

    let encode: Vec<Duration> = (0..scrapes)
        .map(|_| {
            let started = Instant::now();
            black_box(metrics.encode(Format::Text));
            started.elapsed()
        })
        .collect();
    let rss_encode = status_kib("VmHWM:");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let router = app(AppState::new(Arc::clone(&metrics), None));
    let scrape_times = |accept: &'static str, encoding: &'static str| {
        runtime.block_on(async {
            let mut out = Vec::new();
            let mut size = 0;
            for _ in 0..scrapes {
                let started = Instant::now();
                let request = axum::http::Request::get("/metrics")
                    .header("accept", accept)
                    .header("accept-encoding", encoding)
                    .body(axum::body::Body::empty())
                    .expect("request");
                let response = router.clone().oneshot(request).await.expect("responds");
                size = black_box(response.into_body().collect().await.expect("body"))
                    .to_bytes()
                    .len();
                out.push(started.elapsed());
            }
            (out, size)
        })
    };
    let (http, _) = scrape_times("text/plain", "identity");
    let (asked, asked_size) = scrape_times(PROMETHEUS_ACCEPT, "gzip");
    let (rss, peak) = (status_kib("VmRSS:"), status_kib("VmHWM:"));
    let (encode_p50, encode_p99) = percentiles(encode);
    let (http_p50, http_p99) = percentiles(http);
    let (asked_p50, asked_p99) = percentiles(asked);
    println!(
        "scrape of {GPUS} GPUs x {PROCESSES} processes: {series} series, {} KiB of text",
        body.len() / 1024
    );
    println!("  encode:         p50 {encode_p50:?}  p99 {encode_p99:?}");
    println!("  HTTP /metrics:  p50 {http_p50:?}  p99 {http_p99:?}");
    println!(
        "  HTTP /metrics as Prometheus asks (OpenMetrics, gzip): p50 {asked_p50:?}  p99 {asked_p99:?}, {} KiB sent",
        asked_size / 1024
    );
    print_gzip("this scrape", &body, scrapes.min(30));
    let worst = worst_pushed_exposition();
    print_gzip("the worst valid pushes' scrape", &worst, scrapes.min(30));
    println!(
        "  resident memory: {:.1} MiB after the scrapes, peak {:.1} MiB (process start {:.1} MiB; peak after encoding only {:.1} MiB)",
        rss as f64 / 1024.0,
        peak as f64 / 1024.0,
        rss_start as f64 / 1024.0,
        rss_encode as f64 / 1024.0
    );

    let alone = hot_path(iterations, rounds, None);
    let scraped = hot_path(iterations, rounds, Some(&metrics));
    println!(
        "allocator same-size hot path: {alone:.1} ns/pair alone, {scraped:.1} ns/pair while a thread scrapes without pause ({:+.1} %)",
        (scraped / alone - 1.0) * 100.0
    );
}
