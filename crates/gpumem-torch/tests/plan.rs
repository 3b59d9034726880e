//! A job loads a placement plan through `GPUMEM_ALLOC_CONF=plan:PATH` (its own process: the
//! allocators are process-wide): the requests it expects land at their planned offsets, one
//! it does not expect is a miss served by the caching allocator, and the in-process /metrics
//! counts both.

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use gpumem_torch::{gpumem_alloc, gpumem_free, memory_stats};

const MIB: usize = 1 << 20;

fn metrics(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text.split_once("\r\n\r\n")?.1.to_string())
}

#[test]
fn a_job_follows_the_plan_its_configuration_names() {
    let dir = std::env::temp_dir().join(format!("gpumem-plan-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("plan.json");
    let stream = 7u64;
    let plan = serde_json::json!({
        "format": "gpumem-plan",
        "version": 1,
        "regions": [{"stream": stream, "bytes": 8 * MIB}],
        "entries": [
            {"size": 4 * MIB, "stream": stream, "offset": 2 * MIB},
            {"size": 2 * MIB, "stream": stream, "offset": 0},
            {"size": 2 * MIB, "stream": stream, "offset": 6 * MIB},
        ],
    });
    std::fs::write(&path, plan.to_string()).expect("write the plan");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    // SAFETY of the test: set before any allocator exists, while no other thread runs.
    #[allow(unsafe_code)] // the environment, set once at the start
    unsafe {
        std::env::set_var("GPUMEM_ALLOC_CONF", format!("plan:{}", path.display()));
        std::env::set_var("GPUMEM_METRICS_LISTEN", format!("127.0.0.1:{port}"));
    }
    let s = stream as usize as *mut c_void;
    let a = gpumem_alloc(4 * MIB, 0, s) as usize;
    let b = gpumem_alloc(2 * MIB - 100, 0, s) as usize;
    let c = gpumem_alloc(2 * MIB, 0, s) as usize;
    assert!(a != 0 && b != 0 && c != 0);
    // One region: the offsets the plan gives, relative to each other.
    assert_eq!(a - b, 2 * MIB, "entry 0 at 2 MiB, entry 1 at 0");
    assert_eq!(c - b, 6 * MIB, "entry 2 at 6 MiB");
    let stats = memory_stats(0).expect("device 0 open");
    assert_eq!(
        stats["reserved_bytes.all.current"],
        8 * MIB as i64,
        "the region alone"
    );
    // Not in the plan: a miss, served outside the region.
    let d = gpumem_alloc(3 * MIB, 0, s) as usize;
    assert!(d != 0 && !(b..b + 8 * MIB).contains(&d));
    for (p, size) in [(a, 4 * MIB), (b, 2 * MIB), (c, 2 * MIB), (d, 3 * MIB)] {
        gpumem_free(p as *mut c_void, size, 0, s);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        if let Some(t) =
            metrics(port).filter(|t| t.contains("gpumem_allocator_plan_requests_total"))
        {
            break t;
        }
        assert!(Instant::now() < deadline, "no plan counters on /metrics");
        std::thread::sleep(Duration::from_millis(100));
    };
    let count = |outcome: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("gpumem_allocator_plan_requests_total{")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!(count("hit"), Some(3.0), "{text}");
    assert_eq!(count("miss"), Some(1.0), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("gpumem_allocator_info{")
            && l.contains(&format!("config=\"plan:{}\"", path.display()))),
        "gpumem_allocator_info shows the plan in its config: {text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
