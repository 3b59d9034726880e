//! The node's CDI specs (Container Device Interface): what each fully qualified CDI device
//! (`vendor/class=name`) adds to a container, as far as it names a GPU: its device nodes
//! (`/dev/nvidia3`, `/dev/nvidia-caps/nvidia-cap21`) and its environment
//! (`NVIDIA_VISIBLE_DEVICES=…`). A DRA driver writes one spec per prepared claim (NVIDIA's
//! under `/var/run/cdi`), and the kubelet's pod-resources API names a claim's devices by
//! these qualified names, so the specs say which GPU or MIG device a claim's device is.
//!
//! Specs are JSON or YAML (`.json`, `.yaml`, `.yml`; YAML with the `kubelet` feature), read
//! from the directories given in increasing priority (CDI's defaults: `/etc/cdi`, then
//! `/var/run/cdi`, whose devices win). Only a device's own `containerEdits` count: a spec's
//! common edits (`/dev/nvidiactl`, libraries) name no one device.
//!
//! # Budgets
//! - At most [`MAX_SPEC_FILES`] spec files per directory, [`MAX_SPEC_BYTES`] per file and
//!   [`MAX_TOTAL_BYTES`] parsed per reading; a file beyond any is skipped with its reason, the
//!   others still read. Only regular files are opened (a FIFO never blocks the reader).
//! - A file is parsed again only when its length or modification time changes: a node's
//!   specs are read once, not on every refresh.
//! - Of each device, only what names a GPU is kept (`NVIDIA_VISIBLE_DEVICES` entries, device
//!   nodes under `/dev/nvidia`), so what stays in memory is a few bytes a device.
//!
//! # Invariants
//! - Reading never fails as a whole: an absent directory holds no spec, an unreadable or
//!   malformed file is skipped (its reason kept for the log), and the rest stand.
//! - Where two specs name one device, the one in the later directory wins, and within a
//!   directory the file whose name sorts last (CDI leaves this undefined; gpumem is
//!   deterministic).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Deserialize;

/// The most spec files read from one directory.
pub const MAX_SPEC_FILES: usize = 4096;
/// The largest spec file read (NVIDIA's per-claim specs are a few kilobytes).
pub const MAX_SPEC_BYTES: u64 = 1 << 20;
/// The most bytes of changed spec files parsed in one reading.
pub const MAX_TOTAL_BYTES: u64 = 64 << 20;
/// The directories CDI reads by default, in increasing priority.
pub const DEFAULT_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// What a CDI device adds to a container, as far as it names a device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Edits {
    /// `NAME=value` entries.
    #[serde(default)]
    pub env: Vec<String>,
    /// Device nodes (their host path, where given, is the one that names the host's device).
    #[serde(default)]
    pub device_nodes: Vec<DeviceNode>,
}

/// A device node of a CDI device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Its path in the container.
    pub path: String,
    /// Its path on the host, where it differs.
    #[serde(default)]
    pub host_path: Option<String>,
}

impl DeviceNode {
    /// The node's path on the host.
    pub fn host_path(&self) -> &str {
        self.host_path.as_deref().unwrap_or(&self.path)
    }
}

/// A spec file, as far as it is read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    /// Required: a file without it is not a CDI spec.
    #[serde(rename = "cdiVersion")]
    _cdi_version: String,
    kind: String,
    #[serde(default)]
    devices: Vec<SpecDevice>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecDevice {
    name: String,
    #[serde(default)]
    container_edits: Edits,
}

/// One file's devices, kept while its length and modification time stay.
struct Parsed {
    stamp: (u64, Option<SystemTime>),
    /// (qualified name, edits), or why the file was skipped.
    devices: Result<Vec<(String, Edits)>, String>,
}

/// The specs of some directories, read again as they change.
#[derive(Default)]
pub struct CdiSpecs {
    dirs: Vec<PathBuf>,
    files: HashMap<PathBuf, Parsed>,
}

impl CdiSpecs {
    /// The specs in `dirs` (increasing priority), not read yet.
    pub fn new(dirs: Vec<PathBuf>) -> CdiSpecs {
        CdiSpecs {
            dirs,
            files: HashMap::new(),
        }
    }

    /// The devices the directories name now, each by its qualified name, and the files
    /// skipped (path and reason). Files unchanged since the last call are not read again.
    pub fn devices(&mut self) -> (HashMap<String, Edits>, Vec<(PathBuf, String)>) {
        let mut seen: Vec<PathBuf> = Vec::new();
        let mut skipped = Vec::new();
        for dir in &self.dirs {
            let mut paths: Vec<PathBuf> = match std::fs::read_dir(dir) {
                Ok(entries) => entries
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| spec_format(p).is_some())
                    .collect(),
                Err(_) => continue,
            };
            paths.sort();
            if paths.len() > MAX_SPEC_FILES {
                skipped.push((
                    dir.clone(),
                    format!(
                        "{} spec files, past the {MAX_SPEC_FILES} read: the rest are skipped",
                        paths.len()
                    ),
                ));
                paths.truncate(MAX_SPEC_FILES);
            }
            seen.extend(paths);
        }
        let present: HashSet<&PathBuf> = seen.iter().collect();
        self.files.retain(|path, _| present.contains(path));
        let mut devices = HashMap::new();
        let mut budget = MAX_TOTAL_BYTES;
        for path in seen {
            let meta = std::fs::metadata(&path);
            let stamp = meta
                .as_ref()
                .map(|m| (m.len(), m.modified().ok()))
                .unwrap_or((0, None));
            let fresh = self.files.get(&path).is_some_and(|p| p.stamp == stamp);
            if !fresh {
                let read = match meta {
                    Ok(m) if !m.is_file() => Some(Err("not a regular file".to_string())),
                    // Read again at the next reading, within its budget.
                    Ok(m) if m.len() > budget => None,
                    Ok(m) => {
                        budget -= m.len().min(MAX_SPEC_BYTES);
                        Some(read_spec(&path))
                    }
                    Err(e) => Some(Err(e.to_string())),
                };
                let Some(devices) = read else {
                    self.files.remove(&path);
                    let why = format!("past the {MAX_TOTAL_BYTES} bytes parsed in one reading");
                    skipped.push((path, why));
                    continue;
                };
                self.files.insert(path.clone(), Parsed { stamp, devices });
            }
            match &self.files[&path].devices {
                Ok(list) => devices.extend(list.iter().cloned()),
                Err(reason) => skipped.push((path, reason.clone())),
            }
        }
        (devices, skipped)
    }
}

#[derive(Clone, Copy)]
enum Format {
    Json,
    Yaml,
}

fn spec_format(path: &Path) -> Option<Format> {
    match path.extension()?.to_str()? {
        "json" => Some(Format::Json),
        "yaml" | "yml" => Some(Format::Yaml),
        _ => None,
    }
}

/// One spec file's devices by qualified name, or why it is skipped.
fn read_spec(path: &Path) -> Result<Vec<(String, Edits)>, String> {
    let format = spec_format(path).ok_or("not a .json, .yaml or .yml file")?;
    let text = crate::bounded_file::read(path, MAX_SPEC_BYTES).map_err(|e| e.to_string())?;
    let spec = parse_spec(&text, format)?;
    Ok(spec
        .devices
        .into_iter()
        .map(|d| {
            (
                format!("{}={}", spec.kind, d.name),
                naming(d.container_edits),
            )
        })
        .collect())
}

/// Of a device's edits, what can name a GPU: `NVIDIA_VISIBLE_DEVICES` entries and device nodes
/// under `/dev/nvidia` (`/dev/nvidia3`, `/dev/nvidia-caps/…`).
fn naming(mut edits: Edits) -> Edits {
    edits
        .env
        .retain(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES="));
    edits
        .device_nodes
        .retain(|n| n.host_path().starts_with("/dev/nvidia"));
    edits
}

fn parse_spec(text: &str, format: Format) -> Result<Spec, String> {
    let spec: Spec = match format {
        Format::Json => serde_json::from_str(text).map_err(|e| e.to_string())?,
        #[cfg(feature = "kubelet")]
        Format::Yaml => serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?,
        #[cfg(not(feature = "kubelet"))]
        Format::Yaml => return Err("YAML specs need the kubelet feature".into()),
    };
    // `vendor/class`, as CDI qualifies it.
    let valid = spec
        .kind
        .split_once('/')
        .is_some_and(|(vendor, class)| !vendor.is_empty() && !class.is_empty());
    if !valid {
        return Err(format!("kind {:?} is not vendor/class", spec.kind));
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("writes");
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpumem-cdi-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[test]
    fn json_and_yaml_specs_name_their_devices_and_later_directories_win() {
        let (etc, run) = (temp("etc"), temp("run"));
        write(
            &etc,
            "nvidia.json",
            r#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[
                {"name":"0","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia0"}]}},
                {"name":"1","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia1"}]}}],
              "containerEdits":{"deviceNodes":[{"path":"/dev/nvidiactl"}]}}"#,
        );
        write(
            &run,
            "override.yaml",
            "cdiVersion: 0.6.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"1\"\n  containerEdits:\n    env: [NVIDIA_VISIBLE_DEVICES=GPU-1]\n    deviceNodes:\n    - path: /dev/nvidia7\n      hostPath: /dev/nvidia1\n",
        );
        write(&run, "notes.txt", "not a spec");
        write(&run, "broken.json", "{\"cdiVersion\":");
        write(
            &run,
            "nokind.json",
            r#"{"cdiVersion":"0.5.0","kind":"gpu"}"#,
        );
        let mut specs = CdiSpecs::new(vec![etc.clone(), run.clone(), temp("absent").join("x")]);
        let (devices, skipped) = specs.devices();
        assert_eq!(devices.len(), 2, "{devices:?}");
        let zero = &devices["nvidia.com/gpu=0"];
        assert_eq!(zero.device_nodes[0].host_path(), "/dev/nvidia0");
        // The spec's common edits belong to no device.
        assert!(zero.device_nodes.iter().all(|n| n.path != "/dev/nvidiactl"));
        let one = &devices["nvidia.com/gpu=1"];
        assert_eq!(one.env, ["NVIDIA_VISIBLE_DEVICES=GPU-1"]);
        assert_eq!(one.device_nodes[0].host_path(), "/dev/nvidia1");
        let reasons: Vec<String> = skipped
            .iter()
            .map(|(p, r)| format!("{}: {r}", p.display()))
            .collect();
        assert_eq!(skipped.len(), 2, "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("broken.json")));
        assert!(reasons.iter().any(|r| r.contains("not vendor/class")));

        // A removed file's devices go; an unchanged one is kept.
        std::fs::remove_file(run.join("override.yaml")).expect("removes");
        let (devices, _) = specs.devices();
        assert_eq!(
            devices["nvidia.com/gpu=1"].device_nodes[0].path,
            "/dev/nvidia1"
        );
        for dir in [etc, run] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Aliases that would expand a small file into billions of entries are refused by the
    /// parser (its repetition limit), not expanded.
    #[cfg(feature = "kubelet")]
    #[test]
    fn an_alias_bomb_is_skipped() {
        let dir = temp("bomb");
        let mut text = String::from(
            "cdiVersion: 0.5.0\nkind: a.com/b\nx0: &x0 [a, a, a, a, a, a, a, a, a, a]\n",
        );
        for i in 1..12 {
            let prev = i - 1;
            text.push_str(&format!(
                "x{i}: &x{i} [*x{prev}, *x{prev}, *x{prev}, *x{prev}, *x{prev}, *x{prev}, *x{prev}, *x{prev}, *x{prev}, *x{prev}]\n"
            ));
        }
        text.push_str("devices: [{name: d, containerEdits: {env: *x11}}]\n");
        write(&dir, "bomb.yaml", &text);
        let started = std::time::Instant::now();
        let (devices, skipped) = CdiSpecs::new(vec![dir.clone()]).devices();
        assert!(devices.is_empty() && skipped.len() == 1, "{skipped:?}");
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_oversized_spec_or_a_fifo_is_skipped_and_the_rest_read() {
        let dir = temp("big");
        let big = format!(
            r#"{{"cdiVersion":"0.5.0","kind":"a.com/b","devices":[],"pad":"{}"}}"#,
            "x".repeat(MAX_SPEC_BYTES as usize)
        );
        write(&dir, "big.json", &big);
        write(
            &dir,
            "small.json",
            r#"{"cdiVersion":"0.5.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{}}]}"#,
        );
        // A FIFO named like a spec would block whoever opens it: not opened.
        let fifo = dir.join("fifo.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let (devices, skipped) = CdiSpecs::new(vec![dir.clone()]).devices();
        assert!(devices.contains_key("a.com/b=d"));
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(
            skipped
                .iter()
                .any(|(p, why)| p.ends_with("big.json") && why.contains("larger than"))
        );
        assert!(
            skipped
                .iter()
                .any(|(p, why)| p == &fifo && why == "not a regular file")
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
