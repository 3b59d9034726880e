//! Alerts that reach the tenant (issue 36): two tenants' jobs push from the pod network (pods
//! attributed as in `pod_network.rs`: processes in PID namespaces and kubelet-named cgroups, a
//! stand-in container runtime, pods on loopback addresses), a real Prometheus evaluates the
//! shipped rules and a real Alertmanager (Debian's prometheus-alertmanager) routes them with
//! the shipped example configuration. Each alert carries its tenant's namespace, a job of four
//! ranks fires once, and its OOM inhibits its retries alert. Needs root, as CI runs.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::agent::{Reaper, free_port, http_get, spawn_prometheus_alerting};
use crate::common::temp_dir;
use crate::kubelet::StandIn;
use crate::pod_network::{
    Container, Runtime, as_root, cgroup_root, pod_network_agent, push_from, sandbox,
};

const UID_LLAMA: &str = "5d8e1c2a-3b4f-4a6d-9e7f-0a1b2c3d4e51";
const UID_RESNET: &str = "6e9f2d3b-4c5a-4b7e-8f90-1b2c3d4e5f62";

/// The shipped rules as the chart renders them with `for: 0s` on the retries alert (its
/// 10 minutes would outlast the test).
fn rules(dir: &Path) -> std::path::PathBuf {
    let file = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("alerts/gpumem.rules.yml"),
    )
    .expect("the rules");
    let at = file
        .find("- alert: GpumemAllocRetriesRising")
        .expect("the retries alert");
    let for_at = at + file[at..].find("for: 10m").expect("its for");
    let rules = format!(
        "{}for: 0s{}",
        &file[..for_at],
        &file[for_at + "for: 10m".len()..]
    );
    let path = dir.join("rules.yml");
    std::fs::write(&path, rules).expect("rules written");
    path
}

/// A real Alertmanager with the shipped example configuration.
fn spawn_alertmanager(dir: &Path) -> (Reaper, u16) {
    let port = free_port();
    let config =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples/alertmanager-gpumem.yml");
    let child = Command::new("prometheus-alertmanager")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.path={}",
            dir.join("alertmanager").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        // No gossip: a single instance.
        .arg("--cluster.listen-address=")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect(
            "prometheus-alertmanager is installed (scripts/test-all installs Debian's package)",
        );
    (Reaper(child), port)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A rank's push: its retries so far, an OOM where it had one.
fn push(pid: u32, start: u64, seq: u64, labels: serde_json::Value, oom: bool) -> serde_json::Value {
    let stats = serde_json::json!({
        "allocated_bytes.all.current": 1024, "reserved_bytes.all.current": 2048,
        "num_alloc_retries": seq * 3, "num_ooms": u64::from(oom),
    });
    let mut body = serde_json::json!({
        "pid": pid, "seq": seq, "start_time": start, "torch_version": "2.11.0",
        "labels": labels,
        "devices": [{"index": 0, "uuid": "GPU-5e0c", "stats": stats}]
    });
    if oom {
        body["last_oom_unix_seconds"] = unix_now().into();
    }
    body
}

/// Alertmanager's alerts named `name`.
fn alerts(am_port: u16, name: &str) -> Vec<serde_json::Value> {
    http_get(am_port, "/api/v2/alerts")
        .and_then(|body| serde_json::from_str::<serde_json::Value>(&body).ok())
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a["labels"]["alertname"] == name)
        .collect()
}

#[test]
fn alerts_reach_each_tenant_once_per_job_and_an_oom_inhibits_its_retries() {
    if !as_root() {
        return;
    }
    let dir = temp_dir("tenant-alerts");
    let socket = dir.join("cri.sock");
    let runtime = Runtime::default();
    *runtime.sandboxes.lock().expect("lock") = vec![
        sandbox(UID_LLAMA, "llama-0", "127.0.0.2", false),
        sandbox(UID_RESNET, "resnet-0", "127.0.0.3", false),
    ];
    // The stand-in names the pods' namespaces after them: team-llama-0, team-resnet-0.
    let _cri = StandIn::serve(&socket, runtime);
    let root = cgroup_root();
    let llama = Container::start(&root, UID_LLAMA, 3);
    let resnet = Container::start(&root, UID_RESNET, 0);
    let ranks = llama.processes(4);
    let single = resnet.processes(1);

    let agent_port = free_port();
    let _agent = pod_network_agent(agent_port, &dir.join("agent.log"), &socket, &[]);
    let (_alertmanager, am_port) = spawn_alertmanager(&dir);
    let rules = rules(&dir);
    let (_prometheus, _) = spawn_prometheus_alerting(&dir, agent_port, Some(&rules), Some(am_port));

    // The llama job (four ranks, run id llama-7f3) runs out of memory and retries; the resnet
    // job (torchrun's default run id) only retries.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seq = 0;
    let found = loop {
        assert!(
            Instant::now() < deadline,
            "no alerts as expected; agent log: {}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
        );
        seq += 1;
        for (rank, (inner, _, start)) in ranks.iter().enumerate() {
            let labels = serde_json::json!({"run_id": "llama-7f3", "rank": rank.to_string()});
            let (status, answer) = push_from(
                "127.0.0.2",
                agent_port,
                &push(*inner, *start, seq, labels, true),
            );
            assert_eq!(status, 202, "{answer}");
        }
        let (inner, _, start) = single[0];
        let labels = serde_json::json!({"run_id": "none"});
        let (status, answer) = push_from(
            "127.0.0.3",
            agent_port,
            &push(inner, start, seq, labels, false),
        );
        assert_eq!(status, 202, "{answer}");
        std::thread::sleep(Duration::from_secs(1));
        let ooms = alerts(am_port, "GpumemOutOfMemory");
        let retries = alerts(am_port, "GpumemAllocRetriesRising");
        let inhibited = retries.iter().any(|a| a["status"]["state"] == "suppressed");
        if !ooms.is_empty() && retries.len() == 2 && inhibited {
            break (ooms, retries);
        }
    };
    let (ooms, retries) = found;
    // One OOM alert for the job of four ranks, in its tenant's namespace, named by its run id.
    assert_eq!(ooms.len(), 1, "{ooms:#?}");
    let oom = &ooms[0]["labels"];
    assert_eq!(oom["namespace"], "team-llama-0", "{oom}");
    assert_eq!(oom["job_key"], "llama-7f3", "{oom}");
    assert!(
        oom.get("pid").is_none() && oom.get("rank").is_none(),
        "{oom}"
    );
    // Each tenant's retries alert carries its namespace; the OOM inhibits its own job's only.
    let of = |namespace: &str| {
        retries
            .iter()
            .find(|a| a["labels"]["namespace"] == namespace)
            .unwrap_or_else(|| panic!("no retries alert in {namespace}: {retries:#?}"))
    };
    let llama_retries = of("team-llama-0");
    assert_eq!(llama_retries["labels"]["job_key"], "llama-7f3");
    assert_eq!(
        llama_retries["status"]["state"], "suppressed",
        "{llama_retries}"
    );
    assert!(
        !llama_retries["status"]["inhibitedBy"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "{llama_retries}"
    );
    let resnet_retries = of("team-resnet-0");
    assert_eq!(resnet_retries["labels"]["job_key"], "resnet-0");
    assert_eq!(
        resnet_retries["status"]["state"], "active",
        "{resnet_retries}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
