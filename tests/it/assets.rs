//! What operators deploy, tested like code: dashboards and alert rules use only the metric
//! contract, alert rules pass promtool's checks and unit tests, and the dashboards' queries
//! are run against a real Prometheus (in `agent.rs`, which starts one).

use std::path::{Path, PathBuf};
use std::process::Command;

use gpumem::metrics::contract::CONTRACT;

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The metric names an expression mentions: identifiers that contain `gpumem_`.
fn metric_names(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.contains("gpumem_"))
        .map(str::to_string)
        .collect()
}

fn contract_names() -> Vec<&'static str> {
    CONTRACT.iter().map(|d| d.name).collect()
}

pub fn dashboards() -> Vec<(PathBuf, serde_json::Value)> {
    let mut out: Vec<_> = std::fs::read_dir(root().join("dashboards"))
        .expect("dashboards/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("readable");
            let json = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", p.display()));
            (p, json)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The panels of a dashboard that query (rows only group them).
fn query_panels(d: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .filter(|p| p["type"] != "row")
}

/// (dashboard, panel title, expression) for every panel target.
pub fn dashboard_expressions() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (path, d) in dashboards() {
        let file = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        for panel in query_panels(&d) {
            let title = panel["title"].as_str().unwrap_or_default().to_string();
            for t in panel["targets"].as_array().expect("targets") {
                let expr = t["expr"].as_str().expect("expr").to_string();
                out.push((file.clone(), title.clone(), expr));
            }
        }
    }
    out
}

/// (dashboard, panel title, query with every variable "All") of the panel targets whose
/// expression names `metric`.
pub fn dashboard_queries_of(metric: &str) -> Vec<(String, String, String)> {
    dashboard_expressions()
        .into_iter()
        .filter(|(_, _, expr)| expr.contains(metric))
        .map(|(file, title, expr)| (file, title, substitute(&expr)))
        .collect()
}

/// (dashboard, annotation name, expression) for every annotation query.
pub fn annotation_expressions() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (path, d) in dashboards() {
        let file = path.display().to_string();
        for a in d["annotations"]["list"].as_array().expect("annotations") {
            let name = a["name"].as_str().unwrap_or_default().to_string();
            out.push((file.clone(), name, a["expr"].as_str().expect("expr").into()));
        }
    }
    out
}

/// An expression with the template variables replaced as "All" and a short rate interval.
pub fn substitute(expr: &str) -> String {
    ["$cluster", "$node", "$gpu", "$namespace", "$pod"]
        .iter()
        .fold(expr.to_string(), |e, var| e.replace(var, ".*"))
        .replace("$__rate_interval", "1m")
}

/// What a query's values measure, from its metrics' suffixes and its functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Measure {
    Bytes,
    /// 0..1: a `_ratio` metric, or bytes divided by bytes.
    Ratio,
    /// `rate()` of a counter (but of seconds: a [`Measure::Ratio`], the share of time).
    PerSecond,
    /// A count: `increase()` of a counter, or a gauge of things (segments, up).
    Count,
    /// An info metric: its labels are the data.
    Labels,
}

fn measure(expr: &str) -> Measure {
    if expr.contains("rate(") {
        let of_seconds = metric_names(expr)
            .iter()
            .all(|n| n.ends_with("_seconds_total"));
        return if of_seconds {
            Measure::Ratio
        } else {
            Measure::PerSecond
        };
    }
    if expr.contains("increase(") {
        return Measure::Count;
    }
    let names = metric_names(expr);
    let kind = |n: &String| {
        // A recording rule's metric is its middle part; a `_by_<label>` qualifier follows
        // the unit (`gpumem_allocator_segment_free_bytes_by_size`).
        let base = n.split(':').nth(1).unwrap_or(n);
        let base = base.rsplit_once("_by_").map_or(base, |(unit, _)| unit);
        if base.ends_with("_bytes") {
            Measure::Bytes
        } else if base.ends_with("_ratio") {
            Measure::Ratio
        } else if base.ends_with("_info") {
            Measure::Labels
        } else {
            Measure::Count
        }
    };
    let first = names.first().map_or(Measure::Count, kind);
    assert!(
        names.iter().all(|n| kind(n) == first),
        "{expr}: metrics of different measures"
    );
    if first == Measure::Bytes && expr.contains(") / ") {
        Measure::Ratio
    } else {
        first
    }
}

/// The Grafana units that show `measure` right.
fn units_for(measure: Measure) -> &'static [&'static str] {
    match measure {
        Measure::Bytes => &["bytes"],
        Measure::Ratio => &["percentunit"],
        Measure::PerSecond => &["ops", "reqps", "cps"],
        Measure::Count => &["short", "none", ""],
        Measure::Labels => &["none", ""],
    }
}

/// The unit a panel shows target `refid`'s values in: a field override (by query, or by the
/// name a table gives its value column), else the panel's default.
fn unit_of(panel: &serde_json::Value, refid: &str, targets: usize) -> String {
    let config = &panel["fieldConfig"];
    let value_column = if targets == 1 {
        "Value".to_string()
    } else {
        format!("Value #{refid}")
    };
    let shown = panel["transformations"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|t| t["options"]["renameByName"][&value_column].as_str())
        .unwrap_or(&value_column)
        .to_string();
    let overridden = config["overrides"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|o| {
            let (id, option) = (&o["matcher"]["id"], &o["matcher"]["options"]);
            (id == "byFrameRefID" && option == refid) || (id == "byName" && *option == *shown)
        });
    overridden
        .and_then(|o| {
            o["properties"]
                .as_array()?
                .iter()
                .find(|p| p["id"] == "unit")
        })
        .and_then(|p| p["value"].as_str())
        .or_else(|| config["defaults"]["unit"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn the_unit_check_tells_measures_apart() {
    let cases = [
        ("sum(gpumem_device_used_bytes)", Measure::Bytes),
        (
            "sum(gpumem_device_used_bytes) / sum(gpumem_device_total_bytes)",
            Measure::Ratio,
        ),
        ("max(gpumem_allocator_fragmentation_ratio)", Measure::Ratio),
        (
            "sum(rate(gpumem_allocator_alloc_retries_total[1m]))",
            Measure::PerSecond,
        ),
        (
            "sum(rate(gpumem_host_pinned_alloc_seconds_total[1m]))",
            Measure::Ratio,
        ),
        (
            "sum(increase(gpumem_allocator_ooms_total[1h]))",
            Measure::Count,
        ),
        ("gpumem_source_up", Measure::Count),
        ("max by (config) (gpumem_allocator_info)", Measure::Labels),
        ("gpu:gpumem_device_used_bytes:sum", Measure::Bytes),
        (
            "gpumem_allocator_segment_free_bytes_by_size",
            Measure::Bytes,
        ),
        ("gpumem_allocator_segments_by_size", Measure::Count),
    ];
    for (expr, expected) in cases {
        assert_eq!(measure(expr), expected, "{expr}");
    }
    // A ratio on a bytes axis (the defect this check exists for) is caught.
    let panel = serde_json::json!({
        "fieldConfig": {"defaults": {"unit": "bytes"}, "overrides": []},
        "targets": [{"refId": "A", "expr": "gpumem_allocator_inactive_split_ratio"}]
    });
    let unit = unit_of(&panel, "A", 1);
    assert!(!units_for(measure("gpumem_allocator_inactive_split_ratio")).contains(&unit.as_str()));
    // An override names a table column's unit.
    let table = serde_json::json!({
        "fieldConfig": {"defaults": {}, "overrides": [{"matcher": {"id": "byName", "options": "free"},
            "properties": [{"id": "unit", "value": "bytes"}]}]},
        "transformations": [{"id": "organize", "options": {"renameByName": {"Value #B": "free"}}}]
    });
    assert_eq!(unit_of(&table, "B", 2), "bytes");
    assert_eq!(unit_of(&table, "A", 2), "");
}

#[test]
fn every_panel_shows_its_query_in_the_right_unit() {
    for (path, d) in dashboards() {
        for panel in query_panels(&d) {
            let title = panel["title"].as_str().unwrap_or_default();
            let targets = panel["targets"].as_array().expect("targets");
            for t in targets {
                let refid = t["refId"].as_str().expect("refId");
                let expr = t["expr"].as_str().expect("expr");
                let unit = unit_of(panel, refid, targets.len());
                let allowed = units_for(measure(expr));
                assert!(
                    allowed.contains(&unit.as_str()),
                    "{}: {title} ({refid}): unit {unit:?}, but {expr} is {:?} (wants one of {allowed:?})",
                    path.display(),
                    measure(expr)
                );
            }
        }
    }
}

#[test]
fn the_dashboards_are_what_their_generator_writes() {
    let out = Command::new("python3")
        .arg(root().join("scripts/dashboards.py"))
        .arg("--check")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn dashboards_are_well_formed_and_use_only_the_contract() {
    let contract = contract_names();
    let all = dashboards();
    assert_eq!(all.len(), 2, "overview and allocator internals");
    for (path, d) in &all {
        let name = path.display();
        let vars = d["templating"]["list"].as_array().expect("variables");
        let var = |n: &str| vars.iter().find(|v| v["name"] == n);
        assert_eq!(
            var("datasource").map(|v| v["type"].clone()),
            Some("datasource".into()),
            "{name}"
        );
        for v in ["cluster", "node", "gpu", "namespace", "pod"] {
            let v = var(v).unwrap_or_else(|| panic!("{name}: variable {v}"));
            let query = v["definition"].as_str().expect("definition");
            for m in metric_names(query) {
                assert!(
                    contract.contains(&m.as_str()),
                    "{name}: {m} is not in the contract"
                );
            }
        }
        // Each links to the other, keeping the time range and variables.
        assert!(
            d["links"]
                .as_array()
                .is_some_and(|l| l.iter().any(|l| l["tags"][0] == "gpumem")),
            "{name}: links to the other dashboards"
        );
        for panel in query_panels(d) {
            let title = panel["title"].as_str().expect("title");
            let description = panel["description"].as_str().unwrap_or_default();
            assert!(
                description.len() > 40,
                "{name}: panel {title:?} says what to conclude"
            );
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "{name}: {title}"
            );
            for t in panel["targets"].as_array().expect("targets") {
                assert_eq!(t["datasource"]["uid"], "${datasource}", "{name}: {title}");
            }
        }
    }
    for (file, title, expr) in dashboard_expressions() {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "{file}: {title}: {expr}");
        for m in names {
            assert!(
                contract.contains(&m.as_str()),
                "{file}: {title}: {m} is not in the contract"
            );
        }
    }
}

#[test]
fn alert_rules_pass_promtool_and_use_only_the_contract() {
    let rules = root().join("alerts/gpumem.rules.yml");
    for args in [vec!["check", "rules"], vec!["test", "rules"]] {
        let file = if args[0] == "check" {
            rules.clone()
        } else {
            root().join("alerts/gpumem.rules.test.yml")
        };
        let out = Command::new("promtool")
            .args(&args)
            .arg(&file)
            .output()
            .expect(
                "promtool is installed (scripts/test-all installs Debian's prometheus package)",
            );
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = std::fs::read_to_string(&rules).expect("rules");
    let recorded: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(str::to_string)
        .collect();
    assert!(
        recorded.iter().all(|r| r.split(':').count() == 3),
        "level:metric:operations"
    );
    let contract = contract_names();
    let alerts = text.matches("- alert: ").count();
    assert_eq!(alerts, 14);
    for m in metric_names(&text) {
        assert!(
            contract.contains(&m.as_str()) || recorded.contains(&m),
            "{m} is neither in the contract nor a recording rule"
        );
    }
    // The alerts about jobs route them one way: the same tenant labels and job key in each
    // (written out six times, so checked here to stay alike).
    let tails: Vec<&str> = text
        .split(", \"job_part\", \"/\"")
        .skip(1)
        .map(|t| t.split_once("\"(.+)\")").map_or(t, |(tail, _)| tail))
        .collect();
    assert_eq!(tails.len(), 6, "the per-job alerts");
    assert!(
        tails.iter().all(|t| t == &tails[0]),
        "the per-job alerts' routing differs: {tails:#?}"
    );
    let heads = text.matches("max without (pid, gpu, UUID, GPU_I_ID, GPU_I_PROFILE, mig_uuid, instance, node, pod, pod_uid, container_id, pod_name, container_name, rank, local_rank, job_part) (").count();
    assert_eq!(
        heads, 6,
        "each per-job alert aggregates the same per-rank labels away"
    );
    // Every alert links its runbook section, and the section exists.
    let runbooks = std::fs::read_to_string(root().join("docs/runbooks.md")).expect("runbooks");
    for line in text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            runbooks.contains(&format!("\n## {line}\n")),
            "runbook for {line}"
        );
        let anchor = format!("runbooks.md#{}", line.to_lowercase());
        assert!(text.contains(&anchor), "runbook_url of {line}");
    }
    // Every alert is tested firing and not firing.
    let tests =
        std::fs::read_to_string(root().join("alerts/gpumem.rules.test.yml")).expect("tests");
    for line in text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        let cases = tests.matches(&format!("alertname: {line}\n")).count();
        assert!(cases >= 2, "{line} has {cases} test cases");
    }
}

/// The Alertmanager example passes amtool, and every alert it names is one the rules define
/// (a renamed alert would silently fall out of its routing and inhibition).
#[test]
fn the_alertmanager_example_passes_amtool_and_names_real_alerts() {
    let example = root().join("docs/examples/alertmanager-gpumem.yml");
    let out = Command::new("amtool")
        .arg("check-config")
        .arg(&example)
        .output()
        .expect("amtool is installed (scripts/test-all installs Debian's prometheus-alertmanager)");
    assert!(
        out.status.success(),
        "amtool check-config: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let rules = std::fs::read_to_string(root().join("alerts/gpumem.rules.yml")).expect("rules");
    let defined: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    let text = std::fs::read_to_string(&example).expect("example");
    let mut named = 0;
    for word in text.split(|c: char| !c.is_ascii_alphanumeric()) {
        // `Gpumem` alone opens an alternation, checked below.
        if word.starts_with("Gpumem") && word != "Gpumem" {
            named += 1;
            assert!(defined.contains(&word), "{word} is no alert of the rules");
        }
    }
    // The alternations name alerts by their tails: each must complete to a real alert.
    for alternation in text.split("Gpumem(").skip(1) {
        let inner = alternation.split(')').next().unwrap_or_default();
        for tail in inner.split('|') {
            named += 1;
            let pattern = format!("Gpumem{tail}");
            let pattern = pattern.trim_end_matches(".*");
            assert!(
                defined.iter().any(|d| d.starts_with(pattern)),
                "{pattern} names no alert of the rules"
            );
        }
    }
    // The agent-down rule names five, the OOM rule two.
    assert!(named >= 7, "the example names {named} alerts");
}

#[test]
fn the_chart_carries_exact_copies_of_the_dashboards_and_rules() {
    let chart = root().join("helm/gpumem/files");
    let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert_eq!(
        read(chart.join("gpumem.rules.yml")),
        read(root().join("alerts/gpumem.rules.yml")),
        "helm/gpumem/files/gpumem.rules.yml differs from alerts/: copy it again"
    );
    let names = |dir: PathBuf| {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let canonical = names(root().join("dashboards"));
    assert_eq!(names(chart.join("dashboards")), canonical);
    for name in canonical {
        assert_eq!(
            read(chart.join("dashboards").join(&name)),
            read(root().join("dashboards").join(&name)),
            "helm/gpumem/files/dashboards/{name} differs from dashboards/: copy it again"
        );
    }
}
