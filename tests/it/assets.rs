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

/// (dashboard, panel title, expression) for every panel target.
pub fn dashboard_expressions() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (path, d) in dashboards() {
        let file = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        for panel in d["panels"].as_array().expect("panels") {
            let title = panel["title"].as_str().unwrap_or_default().to_string();
            for t in panel["targets"].as_array().expect("targets") {
                let expr = t["expr"].as_str().expect("expr").to_string();
                out.push((file.clone(), title.clone(), expr));
            }
        }
    }
    out
}

/// An expression with the template variables replaced as "All" and a short rate interval.
pub fn substitute(expr: &str) -> String {
    expr.replace("$cluster", ".*")
        .replace("$node", ".*")
        .replace("$gpu", ".*")
        .replace("$__rate_interval", "1m")
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
        for v in ["cluster", "node", "gpu"] {
            let v = var(v).unwrap_or_else(|| panic!("{name}: variable {v}"));
            let query = v["definition"].as_str().expect("definition");
            for m in metric_names(query) {
                assert!(
                    contract.contains(&m.as_str()),
                    "{name}: {m} is not in the contract"
                );
            }
        }
        for panel in d["panels"].as_array().expect("panels") {
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
    assert_eq!(alerts, 10);
    for m in metric_names(&text) {
        assert!(
            contract.contains(&m.as_str()) || recorded.contains(&m),
            "{m} is neither in the contract nor a recording rule"
        );
    }
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
