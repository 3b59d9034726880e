//! Where archived recordings lie: the archive's address (`--recordings-url`), each
//! recording's key under it, and an object's address as the tools take it.
//!
//! # Layout
//! A recording and its sidecar are two objects under the archive's prefix:
//!
//! ```text
//! {prefix}/{cluster}/{namespace}/{pod}/{stamp}-{pid}.pickle.gz   the recording, gzipped
//! {prefix}/{cluster}/{namespace}/{pod}/{stamp}-{pid}.json        its sidecar (archive::sidecar)
//! ```
//!
//! `{stamp}` is the time the agent kept it, in UTC (`20261207T011203.123456Z`: keys sort by
//! time), `{pid}` the process's pid on its node. A process in no known pod is filed under
//! the namespace `_host` and its node's name as the pod (no Kubernetes name starts with `_`).
//! A prefix may hold one segment `{namespace}`, which stands for each recording's own
//! namespace: `s3://bucket/tenants/{namespace}/gpumem` puts each namespace's recordings
//! under its own prefix, so that a bucket policy can give each tenant its own (gpumem grants
//! nothing itself).
//!
//! # Invariants
//! - Every segment of a key is 1 to 253 bytes of ASCII letters, digits, `-`, `_` and `.`,
//!   and is neither `.` nor `..`: a key never climbs out of its prefix, nor carries a
//!   character a store would re-encode. A namespace or pod name that is not one (a label
//!   pushed by hand) files the recording under `_host`.
//! - Keys are made only from the archive's own prefix and validated names: the agent's view,
//!   which opens recordings by namespace, pod and name, reads nothing else in the bucket.

use object_store::path::Path;

/// The namespace of recordings of processes in no known pod (filed under their node).
pub const HOST: &str = "_host";
/// A prefix segment that stands for each recording's namespace.
pub const NAMESPACE_SEGMENT: &str = "{namespace}";
/// The extension of an archived recording.
pub const RECORDING: &str = "pickle.gz";
/// The extension of its sidecar.
pub const SIDECAR: &str = "json";

/// The schemes archives and recordings are read from: S3 (and S3-compatible stores, through
/// `AWS_ENDPOINT_URL`), Google Cloud Storage, Azure Blob Storage, and local files.
pub const SCHEMES: [&str; 4] = ["s3", "gs", "az", "file"];

/// Whether `segment` may be a key's segment (see the module's invariants).
pub fn valid_segment(segment: &str) -> bool {
    (1..=253).contains(&segment.len())
        && segment != "."
        && segment != ".."
        && segment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// An archive's address: its store (`s3://bucket`) and the prefix under it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchiveUrl {
    /// The store: the scheme and bucket (or, for `file`, the root).
    store: url::Url,
    /// The prefix's segments; one may be [`NAMESPACE_SEGMENT`].
    prefix: Vec<String>,
}

/// Splits `text` into its store's URL and its path's segments: the schemes of [`SCHEMES`].
fn split(text: &str) -> Result<(url::Url, Vec<String>), String> {
    // The URL parser would resolve them away: refused as written.
    let raw_path = text.split_once("://").map_or("", |(_, rest)| rest);
    let dotted = raw_path.split(['/', '?', '#']).skip(1).any(|segment| {
        let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
        decoded == "." || decoded == ".."
    });
    if dotted {
        return Err(format!("{text:?}: no '.' or '..' segments"));
    }
    let url = url::Url::parse(text).map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    if !SCHEMES.contains(&url.scheme()) {
        return Err(format!(
            "{text:?}: the scheme {:?} is not one of {}",
            url.scheme(),
            SCHEMES.map(|s| format!("{s}://")).join(", ")
        ));
    }
    if url.query().is_some()
        || url.fragment().is_some()
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return Err(format!(
            "{text:?}: an address takes no query, fragment or credentials (credentials come from the environment)"
        ));
    }
    let segments: Vec<String> = url
        .path_segments()
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|s| s.into_owned())
                .map_err(|_| format!("{text:?}: a path segment is not UTF-8"))
        })
        .collect::<Result<_, _>>()?;
    let mut store = url.clone();
    store.set_path("");
    if url.scheme() != "file" && url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{text:?} names no bucket"));
    }
    Ok((store, segments))
}

impl std::str::FromStr for ArchiveUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<ArchiveUrl, String> {
        let (store, prefix) = split(text)?;
        let templated = prefix.iter().filter(|s| *s == NAMESPACE_SEGMENT).count();
        if templated > 1 {
            return Err(format!("{text:?}: at most one {NAMESPACE_SEGMENT} segment"));
        }
        if let Some(bad) = prefix
            .iter()
            .find(|s| *s != NAMESPACE_SEGMENT && !valid_segment(s))
        {
            return Err(format!(
                "{text:?}: the prefix segment {bad:?} is not letters, digits, '-', '_' and '.'"
            ));
        }
        Ok(ArchiveUrl { store, prefix })
    }
}

/// A store's URL as the start of its objects' addresses (`s3://bucket`, `file://`).
fn store_text(store: &url::Url) -> &str {
    if store.scheme() == "file" {
        "file://"
    } else {
        store.as_str().trim_end_matches('/')
    }
}

impl std::fmt::Display for ArchiveUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", store_text(&self.store))?;
        for segment in &self.prefix {
            write!(f, "/{segment}")?;
        }
        Ok(())
    }
}

impl ArchiveUrl {
    /// The store's URL (scheme and bucket).
    pub fn store(&self) -> &url::Url {
        &self.store
    }

    /// Whether the prefix holds a [`NAMESPACE_SEGMENT`].
    pub fn per_namespace(&self) -> bool {
        self.prefix.iter().any(|s| s == NAMESPACE_SEGMENT)
    }

    /// The prefix of `namespace`'s recordings (the one prefix where it is not per namespace).
    pub fn prefix(&self, namespace: &str) -> Path {
        Path::from_iter(self.prefix.iter().map(|s| {
            if s == NAMESPACE_SEGMENT {
                namespace
            } else {
                s.as_str()
            }
        }))
    }

    /// The prefix common to every namespace's: the segments before a [`NAMESPACE_SEGMENT`].
    pub fn common_prefix(&self) -> Path {
        Path::from_iter(
            self.prefix
                .iter()
                .take_while(|s| *s != NAMESPACE_SEGMENT)
                .map(String::as_str),
        )
    }

    /// The address of the object at `path` in this archive's store.
    pub fn object_url(&self, path: &Path) -> String {
        format!("{}/{path}", store_text(&self.store))
    }
}

/// One recording's place under its archive's prefix.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordingKey {
    /// The cluster's name, as its agents are told.
    pub cluster: String,
    /// The pod's namespace ([`HOST`] for a process in no known pod).
    pub namespace: String,
    /// The pod's name (the node's, under [`HOST`]).
    pub pod: String,
    /// `{stamp}-{pid}`.
    pub name: String,
}

impl RecordingKey {
    /// The key of a recording kept at `time` (Unix seconds) from process `pid` of `pod` in
    /// `namespace` (or, where either is not a valid segment, of node `node`), in `cluster`;
    /// `None` where the cluster or node name is not a valid segment.
    pub fn new(
        cluster: &str,
        namespace: &str,
        pod: &str,
        node: &str,
        time: f64,
        pid: u32,
    ) -> Option<RecordingKey> {
        let (namespace, pod) = if valid_segment(namespace) && valid_segment(pod) {
            (namespace, pod)
        } else {
            (HOST, node)
        };
        if !(valid_segment(cluster) && valid_segment(pod)) {
            return None;
        }
        let micros = (time * 1e6) as i64;
        let stamp = chrono::DateTime::from_timestamp_micros(micros)?
            .format("%Y%m%dT%H%M%S%.6fZ")
            .to_string();
        Some(RecordingKey {
            cluster: cluster.to_string(),
            namespace: namespace.to_string(),
            pod: pod.to_string(),
            name: format!("{stamp}-{pid}"),
        })
    }

    /// The key a recording's or sidecar's path names under `prefix` (`None` for another
    /// object), and whether it is the sidecar.
    pub fn of(prefix: &Path, path: &Path) -> Option<(RecordingKey, bool)> {
        let parts: Vec<_> = path.prefix_match(prefix)?.collect();
        let [cluster, namespace, pod, file] = parts.as_slice() else {
            return None;
        };
        let file = file.as_ref();
        let (name, sidecar) = match file.strip_suffix(&format!(".{SIDECAR}")) {
            Some(name) => (name, true),
            None => (file.strip_suffix(&format!(".{RECORDING}"))?, false),
        };
        RecordingKey::named(cluster.as_ref(), namespace.as_ref(), pod.as_ref(), name)
            .map(|key| (key, sidecar))
    }

    /// The key of recording `name` of `pod` in `namespace` in `cluster`, where each is a
    /// valid segment.
    pub fn named(cluster: &str, namespace: &str, pod: &str, name: &str) -> Option<RecordingKey> {
        [cluster, namespace, pod, name]
            .iter()
            .all(|s| valid_segment(s))
            .then(|| RecordingKey {
                cluster: cluster.to_string(),
                namespace: namespace.to_string(),
                pod: pod.to_string(),
                name: name.to_string(),
            })
    }

    /// The directory of `pod`'s recordings under `prefix`.
    pub fn pod_dir(prefix: &Path, cluster: &str, namespace: &str, pod: &str) -> Path {
        Path::from_iter(
            prefix
                .parts()
                .map(|p| p.as_ref().to_string())
                .chain([cluster, namespace, pod].map(str::to_string)),
        )
    }

    fn file(&self, prefix: &Path, extension: &str) -> Path {
        prefix
            .clone()
            .join(self.cluster.as_str())
            .join(self.namespace.as_str())
            .join(self.pod.as_str())
            .join(format!("{}.{extension}", self.name))
    }

    /// The recording's path under `prefix`.
    pub fn recording(&self, prefix: &Path) -> Path {
        self.file(prefix, RECORDING)
    }

    /// Its sidecar's path under `prefix`.
    pub fn sidecar(&self, prefix: &Path) -> Path {
        self.file(prefix, SIDECAR)
    }
}

/// Whether `name` is a recording's name in the layout (`{stamp}-{pid}`).
fn is_recording_name(name: &str) -> bool {
    let Some((stamp, pid)) = name.rsplit_once('-') else {
        return false;
    };
    !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
        && chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%dT%H%M%S%.6fZ").is_ok()
}

/// An object's address as the tools take a recording (`gpumem view s3://bucket/key`): its
/// store and path. A sidecar's address (`{stamp}-{pid}.json` in the layout) stands for the
/// recording beside it; any other `.json` object is a snapshot in JSON.
/// `None` where `text` is not an address of one of [`SCHEMES`] (a local path).
///
/// # Errors
/// An address of one of the schemes that names no object.
pub fn object_address(text: &str) -> Option<Result<(url::Url, Path), String>> {
    let scheme = text.split_once("://")?.0;
    if !SCHEMES.contains(&scheme) {
        return None;
    }
    Some(split(text).and_then(|(store, segments)| {
        let Some(last) = segments.last() else {
            return Err(format!("{text:?} names a bucket, not a recording"));
        };
        let mut segments = segments.clone();
        if let Some(name) = last.strip_suffix(&format!(".{SIDECAR}"))
            && is_recording_name(name)
        {
            let recording = format!("{name}.{RECORDING}");
            *segments.last_mut().unwrap_or(&mut String::new()) = recording;
        }
        Ok((store, Path::from_iter(segments.iter().map(String::as_str))))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_laid_out_by_cluster_namespace_pod_and_time() {
        let url: ArchiveUrl = "s3://bucket/gpumem/{namespace}/oom"
            .parse()
            .expect("parses");
        assert!(url.per_namespace());
        assert_eq!(url.to_string(), "s3://bucket/gpumem/{namespace}/oom");
        let prefix = url.prefix("team-a");
        assert_eq!(prefix.as_ref(), "gpumem/team-a/oom");
        assert_eq!(url.common_prefix().as_ref(), "gpumem");
        // 2026-12-07T01:12:03.25Z
        let key = RecordingKey::new(
            "prod",
            "team-a",
            "trainer-0",
            "node-1",
            1_796_605_923.25,
            42,
        )
        .expect("valid");
        let path = key.recording(&prefix);
        assert_eq!(
            path.as_ref(),
            "gpumem/team-a/oom/prod/team-a/trainer-0/20261207T011203.250000Z-42.pickle.gz"
        );
        assert_eq!(
            url.object_url(&path),
            format!("s3://bucket/{path}"),
            "the address the tools open"
        );
        assert_eq!(RecordingKey::of(&prefix, &path), Some((key.clone(), false)));
        assert_eq!(
            RecordingKey::of(&prefix, &key.sidecar(&prefix)),
            Some((key, true))
        );
        assert_eq!(RecordingKey::of(&prefix, &Path::from("gpumem/x")), None);
    }

    #[test]
    fn a_process_in_no_valid_pod_is_filed_under_its_node() {
        for (namespace, pod) in [("", ""), ("ns", "../../etc"), ("a/b", "p"), ("..", "p")] {
            let key = RecordingKey::new("c", namespace, pod, "node-7", 0.0, 1).expect("valid");
            assert_eq!((key.namespace.as_str(), key.pod.as_str()), (HOST, "node-7"));
        }
        assert_eq!(
            RecordingKey::new("bad/cluster", "ns", "p", "n", 0.0, 1),
            None
        );
        assert_eq!(RecordingKey::new("c", "", "", "", 0.0, 1), None, "no node");
    }

    #[test]
    fn addresses_are_checked() {
        for bad in [
            "http://bucket/x",
            "s3://",
            "s3://bucket/a/{namespace}/{namespace}",
            "s3://bucket/a%2Fb",
            "s3://bucket/..",
            "s3://user:secret@bucket/x",
            "s3://:secret@bucket/x",
            "s3://bucket/x?versionId=1",
            "not a url",
        ] {
            assert!(bad.parse::<ArchiveUrl>().is_err(), "{bad}");
        }
        let plain: ArchiveUrl = "gs://b".parse().expect("a bucket alone");
        assert_eq!(plain.prefix("ns").as_ref(), "");
        assert!(!plain.per_namespace());
        assert_eq!(object_address("/tmp/x.pickle"), None, "a local path");
        assert_eq!(object_address("http://x/y"), None, "not a store's scheme");
        let sidecar = "s3://b/p/c/ns/pod/20261207T011203.250000Z-42.json";
        let (store, path) = object_address(sidecar).expect("an address").expect("valid");
        assert_eq!(
            (store.as_str(), path.as_ref()),
            ("s3://b", "p/c/ns/pod/20261207T011203.250000Z-42.pickle.gz"),
            "a sidecar stands for its recording"
        );
        assert!(object_address("s3://b").expect("an address").is_err());
        let (_, snapshot) = object_address("gs://b/runs/snap.json")
            .expect("an address")
            .expect("valid");
        assert_eq!(
            snapshot.as_ref(),
            "runs/snap.json",
            "a JSON snapshot stays itself"
        );
        // Local archives: addresses the tools open again.
        let local: ArchiveUrl = "file:///var/lib/archive".parse().expect("parses");
        assert_eq!(local.to_string(), "file:///var/lib/archive");
        let path = local.prefix("ns").join("c");
        let address = local.object_url(&path);
        assert_eq!(address, "file:///var/lib/archive/c");
        let (store, again) = object_address(&address)
            .expect("an address")
            .expect("valid");
        assert_eq!((store.scheme(), again), ("file", path));
        assert!(
            object_address("s3://b/a/../x")
                .expect("an address")
                .is_err()
        );
    }
}
