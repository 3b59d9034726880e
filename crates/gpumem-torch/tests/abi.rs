//! The C entry points on simulated GPUs (`--features sim`): allocation and free through the
//! same functions PyTorch calls, from several threads at once, bad input refused without a
//! crash, the in-process /metrics server, and the library loaded by Python's ctypes.

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpumem_torch::{
    gpumem_alloc, gpumem_empty_cache, gpumem_free, gpumem_record_stream, memory_stats,
    sim_set_capturing,
};

const MIB: usize = 1 << 20;

fn metrics(port: u16) -> Option<String> {
    get(port, "/metrics").map(|(_, body)| body)
}

/// A GET on loopback: the status code and the body.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    Some((
        head.split_whitespace().nth(1)?.parse().ok()?,
        body.to_string(),
    ))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One test: the allocators are process-wide, so the steps share one order.
#[test]
fn entry_points_on_simulated_gpus() {
    let port = free_port();
    // SAFETY of the test: set before any allocator exists, while no other thread runs.
    #[allow(unsafe_code)] // the environment, set once at the start
    unsafe {
        std::env::set_var("GPUMEM_ALLOC_CONF", "max_split_size_mb:64");
        std::env::set_var("GPUMEM_METRICS_LISTEN", format!("127.0.0.1:{port}"));
    }
    let stream = 7usize as *mut c_void;

    // Allocate and free.
    let p = gpumem_alloc(3 * MIB, 0, stream);
    assert!(!p.is_null());
    let stats = memory_stats(0).expect("device 0 open");
    assert_eq!(stats["allocated_bytes.all.current"], 3 * MIB as i64);
    assert_eq!(
        stats["max_split_size"],
        64 * MIB as i64,
        "GPUMEM_ALLOC_CONF applies"
    );
    gpumem_record_stream(p, 9usize as *mut c_void);
    gpumem_free(p, 3 * MIB, 0, stream);
    assert_eq!(
        memory_stats(0).expect("open")["allocated_bytes.all.current"],
        0
    );

    // Bad input: refused, reported, no crash, nothing changes.
    let before = memory_stats(0).expect("open");
    gpumem_free(0xdead_0000usize as *mut c_void, 512, 0, stream);
    gpumem_free(std::ptr::null_mut(), 0, 0, stream);
    assert!(gpumem_alloc(MIB, -1, stream).is_null(), "negative device");
    assert!(gpumem_alloc(MIB, 999, stream).is_null(), "no such device");
    assert!(gpumem_alloc(1 << 61, 0, stream).is_null(), "1 EiB or more");
    assert!(
        gpumem_alloc(200 << 30, 0, stream).is_null(),
        "more than the device"
    );
    let after = memory_stats(0).expect("open");
    assert_eq!(
        before["allocated_bytes.all.current"],
        after["allocated_bytes.all.current"]
    );

    // A stream being captured into a CUDA graph gets nothing (its memory would be handed
    // out again while the graph's replays write it); other streams and the default one are
    // served, and the stream again once the capture ends.
    let captured = 11usize as *mut c_void;
    sim_set_capturing(0, captured, true);
    let before = memory_stats(0).expect("open");
    assert!(
        gpumem_alloc(MIB, 0, captured).is_null(),
        "refused during capture"
    );
    assert_eq!(
        memory_stats(0).expect("open")["num_alloc_retries"],
        before["num_alloc_retries"],
        "refused before the allocator ran"
    );
    let other = gpumem_alloc(MIB, 0, stream);
    let default = gpumem_alloc(MIB, 0, std::ptr::null_mut());
    assert!(!other.is_null() && !default.is_null());
    sim_set_capturing(0, captured, false);
    let after_capture = gpumem_alloc(MIB, 0, captured);
    assert!(!after_capture.is_null());
    for (p, s) in [
        (other, stream),
        (default, std::ptr::null_mut()),
        (after_capture, captured),
    ] {
        gpumem_free(p, MIB, 0, s);
    }
    assert_eq!(
        memory_stats(0).expect("open")["allocated_bytes.all.current"],
        before["allocated_bytes.all.current"]
    );

    // Eight threads, two devices, each thread keeping a few live blocks.
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let device = (t % 2) as i32;
                let stream = (100 + t) as *mut c_void;
                let mut live: Vec<(usize, usize)> = Vec::new();
                for i in 0..2_000usize {
                    if live.len() < 16 && (i * 7 + t) % 3 != 0 {
                        let size = 512 + (i * 4099 + t * 997) % (24 * MIB);
                        let p = gpumem_alloc(size, device, stream);
                        assert!(!p.is_null(), "80 GiB is enough");
                        live.push((p as usize, size));
                    } else if let Some((p, size)) = live.pop() {
                        gpumem_free(p as *mut c_void, size, device, stream);
                    }
                }
                for (p, size) in live {
                    gpumem_free(p as *mut c_void, size, device, stream);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("no panic");
    }
    gpumem_empty_cache();
    for device in 0..2 {
        let s = memory_stats(device).expect("open");
        assert_eq!(s["allocated_bytes.all.current"], 0, "device {device}");
        assert_eq!(s["reserved_bytes.all.current"], 0, "device {device}");
        assert!(s["allocation.all.allocated"] > 1_000, "device {device}");
    }

    // The in-process metrics server.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        if let Some(text) = metrics(port).filter(|t| t.contains("gpumem_allocator_allocated_bytes"))
        {
            break text;
        }
        assert!(Instant::now() < deadline, "the /metrics server answers");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(text.contains(&format!("pid=\"{}\"", std::process::id())));
    assert!(text.contains(r#"config="max_split_size_mb:64""#));
    assert!(text.contains(r#"gpumem_source_up{source="allocator"} 1"#));
    // The out-of-memory error of the 200 GiB request above, explained in the metrics.
    let parts: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gpumem_oom_breakdown_bytes{") && l.contains(r#"gpu="0""#))
        .collect();
    assert_eq!(
        parts.len(),
        gpumem::allocator::breakdown::Breakdown::PARTS,
        "{parts:?}"
    );
    let total: f64 = parts
        .iter()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        total,
        (80u64 << 30) as f64,
        "the parts add up to the device: {parts:?}"
    );

    // The live page, and the segments of the job's own allocator, published on request.
    let (status, page) = get(port, "/").expect("the page");
    assert_eq!(status, 200);
    assert!(page.contains("assets/agent.js"), "{page}");
    let uuid = text
        .lines()
        .find(|l| l.starts_with("gpumem_allocator_reserved_bytes{"))
        .and_then(|l| l.split("UUID=\"").nth(1)?.split('"').next())
        .expect("a UUID")
        .to_string();
    let live = gpumem_alloc(5 * MIB, 0, stream);
    assert!(!live.is_null());
    let path = format!("/api/v1/segments?uuid={uuid}&pid={}", std::process::id());
    let deadline = Instant::now() + Duration::from_secs(10);
    let map = loop {
        match get(port, &path) {
            Some((200, body)) => break body,
            Some((202, _)) | None => {}
            Some(other) => panic!("{path}: {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the segments are published within 10 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let map: serde_json::Value = serde_json::from_str(&map).expect("json");
    let reserved = memory_stats(0).expect("open")["reserved_bytes.all.current"];
    assert_eq!(map["reserved"], reserved, "{map}");
    assert!(
        map["segments_total"].as_u64().is_some_and(|n| n >= 1),
        "{map}"
    );
    gpumem_free(live, 5 * MIB, 0, stream);
}

fn library() -> PathBuf {
    // The cdylib of this very build (features included) sits beside the test binary.
    let exe = std::env::current_exe().expect("test binary");
    exe.parent().expect("deps dir").join("libgpumem_torch.so")
}

#[test]
fn python_loads_the_library_and_calls_it_through_ctypes() {
    let lib = library();
    assert!(lib.is_file(), "{} built", lib.display());
    let script = r#"
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.gpumem_alloc.restype = ctypes.c_void_p
lib.gpumem_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.gpumem_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
p = lib.gpumem_alloc(1 << 20, 0, None)
assert p, "allocated"
lib.gpumem_free(p, 1 << 20, 0, None)
lib.gpumem_free(12345 * 512, 512, 0, None)   # unknown: reported, ignored
assert not lib.gpumem_alloc(1 << 62, 0, None)
lib.gpumem_empty_cache()
print("ok")
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&lib)
        .env_remove("GPUMEM_METRICS_LISTEN")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ignored"), "{stderr}");
}

#[test]
fn the_python_helper_swaps_the_allocator_before_cuda_starts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = r#"
import sys, types, os
calls = []
class Memory:
    class CUDAPluggableAllocator:
        def __init__(self, path, alloc, free):
            calls.append(("allocator", os.path.basename(path), alloc, free))
    @staticmethod
    def change_current_allocator(a):
        calls.append(("swap",))
class Cuda:
    initialised = False
    memory = Memory
    @classmethod
    def is_initialized(cls):
        return cls.initialised
torch = types.ModuleType("torch")
torch.cuda = Cuda
sys.modules["torch"] = torch
sys.path.insert(0, sys.argv[1])
import gpumem_torch
try:
    gpumem_torch.enable(library="/nonexistent/libgpumem_torch.so")
    raise SystemExit("a missing library must be refused")
except FileNotFoundError as e:
    assert "does not exist" in str(e)
gpumem_torch.enable(conf="expandable_segments:True", library=sys.argv[2])
assert calls == [("allocator", "libgpumem_torch.so", "gpumem_alloc", "gpumem_free"), ("swap",)], calls
assert os.environ["GPUMEM_ALLOC_CONF"] == "expandable_segments:True"
Cuda.initialised = True
try:
    gpumem_torch.enable(library=sys.argv[2])
    raise SystemExit("enable after CUDA init must be refused")
except RuntimeError as e:
    assert "already initialised" in str(e)
print("ok")
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(root.join("python/gpumem_torch/src"))
        .arg(library())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
