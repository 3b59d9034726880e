//! The mutation gpumem's admission webhook (`gpumem webhook`) makes to an opted-in Pod, so
//! that its Python jobs push to the node's agent with no `gpumem_push` in their image.
//!
//! A pod opts in with the label [`OPT_IN_LABEL`]` = "true"` (a label, so the webhook
//! configuration's `objectSelector` spares the API server every other pod). It gets:
//! - the volume [`VOLUME`] holding the hook (the directory `scripts/python-inject` assembles,
//!   which the agent's image carries at [`IMAGE_HOOK_DIR`]): an `emptyDir` that an init
//!   container running the agent's image fills (`gpumem copy-hook`), or, where the cluster
//!   has image volumes, the agent's image itself, read-only;
//! - in every container of `spec.containers` (init containers and native sidecars are left
//!   as they are): that volume at [`MOUNT_PATH`], read-only; [`MOUNT_PATH`] first on
//!   `PYTHONPATH` (a `PYTHONPATH` the container's `env` sets follows it; one the image sets is
//!   shadowed, and the annotation [`PYTHONPATH_ANNOTATION`] supplies it instead; one from a
//!   reference is left, with a warning); `GPUMEM_PUSH=1` and `GPUMEM_PUSH_URL`, unless the
//!   container's `env` sets them (variables from `envFrom` are overridden, with a warning);
//!   before the URL, [`NODE_IP_VARIABLE`] from `status.hostIP` where the URL names it.
//!
//! # Invariants
//! - Anything but a Pod being created, a pod without the label, a pod that already has the
//!   volume (a reinvocation) get no patch; nor, with a warning, a pod of an OS other than
//!   Linux (`spec.os.name`), one with a mount at [`MOUNT_PATH`] (the API server would refuse
//!   the patched pod), one of more than [`MAX_CONTAINERS`] containers or whose patch would
//!   pass its budget (etcd could not store the patched pod).
//! - The patch adds the volume, the init container, mounts and variables, and sets only the
//!   value of a container's own `PYTHONPATH`, which it prefixes. The init container's name
//!   is one no container, init container or ephemeral container of the pod has.
//! - The init container meets Pod Security "restricted" (not root, no privilege escalation,
//!   every capability dropped, the runtime's default seccomp profile, a read-only root) and
//!   has requests and limits, so namespaces under a ResourceQuota admit the pod.
//!
//! # Budgets
//! - The pod is read from the review's JSON into a [`PodView`]: only the fields the mutation
//!   reads, lists folded into summaries as they are read (a container keeps its name, its own
//!   `PYTHONPATH` and a few flags, never its `env`), at most [`MAX_CONTAINERS`] containers
//!   kept: memory linear in the review and a small multiple of it.
//! - The patch is written once, as JSON text, an operation at a time (linear in the
//!   containers, at most a few hundred bytes each), and given up as soon as it passes its
//!   budget; at most [`MAX_WARNINGS`] warnings (and a count of the rest).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The label a pod opts in with (value `"true"`).
pub const OPT_IN_LABEL: &str = "gpumem.io/inject";
/// The annotation that supplies the `PYTHONPATH` an image sets, which the injected one
/// shadows.
pub const PYTHONPATH_ANNOTATION: &str = "gpumem.io/pythonpath";
/// The injected volume's name.
pub const VOLUME: &str = "gpumem-python";
/// Where the hook is mounted in every container.
pub const MOUNT_PATH: &str = "/gpumem/python";
/// The variable a push URL may name for the node's address (`$(GPUMEM_NODE_IP)`, the
/// agent's hostPort): the patch sets it from `status.hostIP`.
pub const NODE_IP_VARIABLE: &str = "GPUMEM_NODE_IP";
/// Where the agent's image holds the hook.
pub const IMAGE_HOOK_DIR: &str = "/usr/share/gpumem/python";
/// The init container's name, where no container of the pod has it; else the first of
/// `gpumem-inject-2` … `gpumem-inject-`[`MAX_NAME_SUFFIX`] none has.
pub const INIT_CONTAINER: &str = "gpumem-inject";
/// The last suffix tried for the init container's name.
pub const MAX_NAME_SUFFIX: usize = 64;
/// The most containers (`spec.containers`) a patched pod may have: each container's mount
/// alone is over 100 bytes of patch, so more could not be patched within etcd's 1.5 MiB.
pub const MAX_CONTAINERS: usize = (3 << 19) / 100;
/// The most warnings one mutation gives (one more says how many were left out).
pub const MAX_WARNINGS: usize = 8;

/// How the hook reaches the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum VolumeSource {
    /// An `emptyDir` filled by an init container (works everywhere).
    InitContainer,
    /// The agent's image mounted as an image volume (Kubernetes 1.35+ by default; the
    /// runtime must support it).
    Image,
}

/// What the webhook injects.
#[derive(Clone, Debug)]
pub struct Injection {
    /// The agent's image (the init container's, or the image volume's).
    pub image: String,
    /// Its pull policy.
    pub pull_policy: String,
    /// The push URL the jobs get.
    pub push_url: String,
    /// How the hook reaches the pod.
    pub source: VolumeSource,
}

/// A pod's patch and what the webhook warns about.
#[derive(Debug, Default, PartialEq)]
pub struct Mutation {
    /// The JSON Patch (RFC 6902) as JSON text, an array of operations; empty for no patch.
    pub patch: Vec<u8>,
    /// How many operations it holds.
    pub operations: usize,
    /// Warnings for the user who created the pod (at most [`MAX_WARNINGS`] + 1).
    pub warnings: Vec<String>,
    /// Warnings past [`MAX_WARNINGS`], counted.
    left_out: usize,
}

/// What the mutation reads of a pod, parsed straight from the review's JSON: every other
/// field is skipped, lists are folded into summaries as they are read, and past
/// [`MAX_CONTAINERS`] containers are only counted, so that its memory is a small multiple of
/// the few strings it keeps, whatever the pod's shape.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PodView {
    metadata: MetaView,
    spec: Option<SpecView>,
}

/// A pod's opt-in label alone (the rest of the pod skipped, read in constant memory).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PodLabel {
    metadata: MetaView,
}

impl PodLabel {
    /// Whether the pod opts in.
    pub fn opted_in(&self) -> bool {
        self.metadata.opted_in()
    }
}

impl MetaView {
    fn opted_in(&self) -> bool {
        self.labels.as_deref() == Some("true")
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MetaView {
    /// The opt-in label's value.
    #[serde(deserialize_with = "opt_in_label")]
    labels: Option<String>,
    /// The `PYTHONPATH` annotation's value.
    #[serde(deserialize_with = "pythonpath_annotation")]
    annotations: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct SpecView {
    #[serde(deserialize_with = "volumes")]
    volumes: Option<Volumes>,
    #[serde(deserialize_with = "names")]
    init_containers: Option<Names>,
    #[serde(deserialize_with = "containers")]
    containers: Option<Containers>,
    #[serde(deserialize_with = "names")]
    ephemeral_containers: Option<Names>,
    os: Option<Os>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Os {
    name: Option<String>,
}

/// `spec.volumes`: whether the hook's volume is there (a reinvocation).
#[derive(Debug, Default)]
struct Volumes {
    ours: bool,
}

/// The names a list of containers holds that the init container's could be.
#[derive(Debug, Default)]
struct Names {
    ours: Vec<String>,
}

/// `spec.containers`: the first [`MAX_CONTAINERS`], and how many more.
#[derive(Debug, Default)]
struct Containers {
    kept: Vec<ContainerView>,
    more: usize,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct ContainerView {
    name: String,
    #[serde(deserialize_with = "env")]
    env: Option<Env>,
    #[serde(deserialize_with = "env_from")]
    env_from: Option<bool>,
    #[serde(deserialize_with = "mounts")]
    volume_mounts: Option<Mounts>,
}

/// A container's `env`, summarised: its length, its last `PYTHONPATH` (the one the kubelet
/// sets) and which of the variables the patch sets it has.
#[derive(Debug, Default)]
struct Env {
    len: usize,
    pythonpath: Option<(usize, OwnPath)>,
    push: bool,
    push_url: bool,
    node_ip: bool,
}

#[derive(Debug)]
enum OwnPath {
    /// A value (the API server omits an empty one).
    Value(Option<String>),
    /// `valueFrom`.
    Reference,
}

/// A container's `volumeMounts`: whether one is at [`MOUNT_PATH`].
#[derive(Debug, Default)]
struct Mounts {
    at_mount_path: bool,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct Named {
    name: String,
}

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct EnvVar {
    name: String,
    value: Option<String>,
    value_from: Option<IgnoredAny>,
}

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct Mount {
    mount_path: String,
}

/// Folds a JSON array's elements (each read as `T`, then dropped) into `S`; `null` is none.
struct Fold<T, S, F> {
    state: S,
    fold: F,
    element: PhantomData<T>,
}

fn fold<'de, D, T, S, F>(d: D, state: S, fold: F) -> Result<Option<S>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
    F: FnMut(&mut S, T),
{
    d.deserialize_any(Fold {
        state,
        fold,
        element: PhantomData,
    })
}

impl<'de, T: Deserialize<'de>, S, F: FnMut(&mut S, T)> Visitor<'de> for Fold<T, S, F> {
    type Value = Option<S>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Self::Value, A::Error> {
        while let Some(element) = seq.next_element::<T>()? {
            (self.fold)(&mut self.state, element);
        }
        Ok(Some(self.state))
    }
}

/// The value of one key of a map of strings (labels, annotations); the others are skipped.
struct OneKey(&'static str);

impl<'de> Visitor<'de> for OneKey {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of strings")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key::<String>()? {
            if key == self.0 {
                found = map.next_value::<Option<String>>()?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

fn opt_in_label<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(OneKey(OPT_IN_LABEL))
}

fn pythonpath_annotation<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(OneKey(PYTHONPATH_ANNOTATION))
}

fn volumes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Volumes>, D::Error> {
    fold(d, Volumes::default(), |s, v: Named| {
        s.ours |= v.name == VOLUME
    })
}

fn names<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Names>, D::Error> {
    fold(d, Names::default(), |s, c: Named| {
        if c.name.starts_with(INIT_CONTAINER) {
            s.ours.push(c.name);
        }
    })
}

fn containers<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Containers>, D::Error> {
    fold(d, Containers::default(), |s, c: ContainerView| {
        if s.kept.len() < MAX_CONTAINERS {
            s.kept.push(c);
        } else {
            s.more += 1;
        }
    })
}

fn env<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Env>, D::Error> {
    fold(d, Env::default(), |s, v: EnvVar| {
        match v.name.as_str() {
            "PYTHONPATH" => {
                let own = match v.value_from {
                    None => OwnPath::Value(v.value),
                    Some(_) => OwnPath::Reference,
                };
                s.pythonpath = Some((s.len, own));
            }
            "GPUMEM_PUSH" => s.push = true,
            "GPUMEM_PUSH_URL" => s.push_url = true,
            NODE_IP_VARIABLE => s.node_ip = true,
            _ => {}
        }
        s.len += 1;
    })
}

fn env_from<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    fold(d, false, |s, _: IgnoredAny| *s = true)
}

fn mounts<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Mounts>, D::Error> {
    fold(d, Mounts::default(), |s, m: Mount| {
        s.at_mount_path |= m.mount_path.trim_end_matches('/') == MOUNT_PATH;
    })
}

impl Injection {
    /// The mutation of `pod` (the admission request's object), or none; a patch longer than
    /// `budget` bytes is none, with a warning.
    pub fn mutate(&self, pod: &PodView, budget: usize) -> Mutation {
        let mut m = Mutation::default();
        let meta = &pod.metadata;
        let Some(spec) = pod.spec.as_ref().filter(|_| meta.opted_in()) else {
            return m;
        };
        if spec.volumes.as_ref().is_some_and(|v| v.ours) {
            // Injected already (a reinvocation of the webhook): nothing to say.
            return m;
        }
        let no_containers = Containers::default();
        let containers = spec.containers.as_ref().unwrap_or(&no_containers);
        // The hook is a Python path on Linux: another OS's pod is not the hook's.
        if let Some(os) = spec.os.as_ref().and_then(|os| os.name.as_deref())
            && os != "linux"
        {
            return m.refused(format!("the pod's OS is {os:?}, not linux"));
        }
        if containers.more > 0 {
            return m.refused(format!(
                "the pod has {} containers; past {MAX_CONTAINERS} its patch could not be stored",
                containers.kept.len() + containers.more
            ));
        }
        // A path the patch would take: the API server would refuse the pod.
        let taken_mount = containers
            .kept
            .iter()
            .find(|c| c.volume_mounts.as_ref().is_some_and(|v| v.at_mount_path));
        if let Some(c) = taken_mount {
            return m.refused(format!(
                "container {:?} mounts something at {MOUNT_PATH}",
                c.name
            ));
        }
        let mut writer = Writer::default();
        writer.add_to_list("/spec/volumes", spec.volumes.is_some(), self.volume());
        if self.source == VolumeSource::InitContainer {
            let Some(name) = free_name(spec) else {
                return m.refused(format!(
                    "the pod's containers take every name from {INIT_CONTAINER} to {INIT_CONTAINER}-{MAX_NAME_SUFFIX}"
                ));
            };
            writer.add_to_list(
                "/spec/initContainers",
                spec.init_containers.is_some(),
                self.init_container(&name),
            );
        }
        let image_path = meta.annotations.as_deref().filter(|p| !p.is_empty());
        for (i, container) in containers.kept.iter().enumerate() {
            self.inject_into(&mut writer, &mut m, i, container, image_path);
            if writer.patch.len() > budget {
                return Mutation::default().refused(format!(
                    "the patch would pass {budget} bytes, the pod's share of etcd's 1.5 MiB request limit"
                ));
            }
        }
        writer.patch.push(b']');
        m.patch = writer.patch;
        m.operations = writer.operations;
        m.finish()
    }

    fn volume(&self) -> Value {
        match self.source {
            VolumeSource::InitContainer => json!({
                "name": VOLUME,
                "emptyDir": {"sizeLimit": "16Mi"},
            }),
            VolumeSource::Image => json!({
                "name": VOLUME,
                "image": {"reference": self.image, "pullPolicy": self.pull_policy},
            }),
        }
    }

    fn init_container(&self, name: &str) -> Value {
        json!({
            "name": name,
            "image": self.image,
            "imagePullPolicy": self.pull_policy,
            "command": ["/usr/bin/gpumem", "copy-hook", IMAGE_HOOK_DIR, MOUNT_PATH],
            "resources": {
                "requests": {"cpu": "10m", "memory": "16Mi"},
                "limits": {"cpu": "100m", "memory": "32Mi"},
            },
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "allowPrivilegeEscalation": false,
                "readOnlyRootFilesystem": true,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT_PATH}],
        })
    }

    fn inject_into(
        &self,
        w: &mut Writer,
        m: &mut Mutation,
        i: usize,
        c: &ContainerView,
        image_path: Option<&str>,
    ) {
        let base = format!("/spec/containers/{i}");
        let mut mount = json!({"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": true});
        if self.source == VolumeSource::Image {
            // The image's root is mounted; the hook is one directory of it.
            mount["subPath"] = json!(IMAGE_HOOK_DIR.trim_start_matches('/'));
        }
        w.add_to_list(
            &format!("{base}/volumeMounts"),
            c.volume_mounts.is_some(),
            mount,
        );
        let no_env = Env::default();
        let env = c.env.as_ref().unwrap_or(&no_env);
        let env_path = format!("{base}/env");
        let mut has_env = c.env.is_some();
        let mut add = |w: &mut Writer, var: Value| {
            w.add_to_list(&env_path, has_env, var);
            has_env = true;
        };
        match &env.pythonpath {
            Some((j, OwnPath::Value(value))) => {
                let value = match value.as_deref() {
                    None | Some("") => MOUNT_PATH.to_string(),
                    Some(own) => format!("{MOUNT_PATH}:{own}"),
                };
                // `add` sets the member whether or not it is there.
                w.add(&format!("{base}/env/{j}/value"), &json!(value));
            }
            Some((_, OwnPath::Reference)) => m.warn(format!(
                "container {:?} takes PYTHONPATH from a reference: gpumem's hook is not on it, so this container does not push",
                c.name
            )),
            None => {
                let value = match image_path {
                    Some(path) => format!("{MOUNT_PATH}:{path}"),
                    None => MOUNT_PATH.to_string(),
                };
                add(w, json!({"name": "PYTHONPATH", "value": value}));
            }
        }
        if !env.push {
            add(w, json!({"name": "GPUMEM_PUSH", "value": "1"}));
        }
        if !env.push_url {
            // A URL naming the node's address (the agent's hostPort) gets it from the
            // downward API, defined before the URL so that the kubelet expands it.
            if self.push_url.contains(&format!("$({NODE_IP_VARIABLE})")) && !env.node_ip {
                add(
                    w,
                    json!({"name": NODE_IP_VARIABLE,
                           "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}),
                );
            }
            add(
                w,
                json!({"name": "GPUMEM_PUSH_URL", "value": self.push_url}),
            );
        }
        if c.env_from == Some(true) {
            m.warn(format!(
                "container {:?} takes variables from envFrom: a PYTHONPATH, GPUMEM_PUSH or GPUMEM_PUSH_URL there is overridden by gpumem's (set them under env to keep them)",
                c.name
            ));
        }
    }
}

/// The init container's name: the first candidate no container, init container or
/// ephemeral container of the pod has (names are unique across the three).
fn free_name(spec: &SpecView) -> Option<String> {
    let taken: Vec<&str> = [&spec.init_containers, &spec.ephemeral_containers]
        .into_iter()
        .flatten()
        .flat_map(|names| names.ours.iter().map(String::as_str))
        .chain(
            spec.containers
                .iter()
                .flat_map(|c| c.kept.iter().map(|c| c.name.as_str())),
        )
        .filter(|name| name.starts_with(INIT_CONTAINER))
        .collect();
    std::iter::once(INIT_CONTAINER.to_string())
        .chain((2..=MAX_NAME_SUFFIX).map(|n| format!("{INIT_CONTAINER}-{n}")))
        .find(|name| !taken.contains(&name.as_str()))
}

/// The patch's JSON text, written an operation at a time (no operation is kept as a value).
#[derive(Default)]
struct Writer {
    patch: Vec<u8>,
    operations: usize,
}

#[derive(Serialize)]
struct Add<'a> {
    op: &'static str,
    path: &'a str,
    value: &'a Value,
}

impl Writer {
    fn add(&mut self, path: &str, value: &Value) {
        self.patch
            .push(if self.operations == 0 { b'[' } else { b',' });
        let op = Add {
            op: "add",
            path,
            value,
        };
        // Into a Vec, a Value with string keys: this cannot fail.
        let _ = serde_json::to_writer(&mut self.patch, &op);
        self.operations += 1;
    }

    /// Appends `value` to the list at `path`, creating the list where the pod has none.
    fn add_to_list(&mut self, path: &str, exists: bool, value: Value) {
        if exists {
            self.add(&format!("{path}/-"), &value);
        } else {
            self.add(path, &Value::Array(vec![value]));
        }
    }
}

impl Mutation {
    fn warn(&mut self, warning: String) {
        if self.warnings.len() < MAX_WARNINGS {
            self.warnings.push(format!("gpumem: {warning}"));
        } else {
            self.left_out += 1;
        }
    }

    /// No patch, saying why.
    fn refused(mut self, why: String) -> Mutation {
        self.warn(format!("{why}; the hook is not injected"));
        self.patch.clear();
        self.operations = 0;
        self.finish()
    }

    fn finish(mut self) -> Mutation {
        if self.left_out > 0 {
            self.warnings
                .push(format!("gpumem: {} more warnings left out", self.left_out));
            self.left_out = 0;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn injection(source: VolumeSource) -> Injection {
        Injection {
            image: "example.com/gpumem:1".into(),
            pull_policy: "IfNotPresent".into(),
            push_url: "http://gpumem:9417/api/v1/push".into(),
            source,
        }
    }

    /// A budget no test pod's patch comes near.
    const BUDGET: usize = 1 << 20;

    /// The patch's operations, which must be a JSON array of `count` of them.
    fn ops(m: &Mutation) -> Vec<Value> {
        if m.patch.is_empty() {
            assert_eq!(m.operations, 0);
            return Vec::new();
        }
        let ops: Vec<Value> = serde_json::from_slice(&m.patch).expect("a JSON array");
        assert_eq!(ops.len(), m.operations);
        ops
    }

    /// The paths the mutation's operations touch, in order.
    fn paths(m: &Mutation) -> Vec<String> {
        ops(m)
            .iter()
            .map(|o| o["path"].as_str().unwrap_or("").to_string())
            .collect()
    }

    fn pod(labels: Value, spec: Value) -> PodView {
        serde_json::from_value(json!({"metadata": {"name": "p", "labels": labels}, "spec": spec}))
            .expect("a pod")
    }

    /// A pod with no volumes, init containers, mounts or variables gets each list created,
    /// not appended to; a pod with some gets appended to.
    #[test]
    fn lists_are_created_where_the_pod_has_none() {
        let bare = pod(
            json!({OPT_IN_LABEL: "true"}),
            json!({"containers": [{"name": "a"}]}),
        );
        let m = injection(VolumeSource::InitContainer).mutate(&bare, BUDGET);
        assert_eq!(
            paths(&m),
            [
                "/spec/volumes",
                "/spec/initContainers",
                "/spec/containers/0/volumeMounts",
                "/spec/containers/0/env",
                "/spec/containers/0/env/-",
                "/spec/containers/0/env/-",
            ]
        );
        assert!(ops(&m).iter().all(|o| o["op"] == "add"));
        let full = pod(
            json!({OPT_IN_LABEL: "true"}),
            json!({"volumes": [], "initContainers": [], "containers": [
                {"name": "a", "volumeMounts": [], "env": [{"name": "GPUMEM_PUSH", "value": "0"}]}]}),
        );
        let m = injection(VolumeSource::Image).mutate(&full, BUDGET);
        // The container's own GPUMEM_PUSH stands; the image volume needs no init container.
        assert_eq!(
            paths(&m),
            [
                "/spec/volumes/-",
                "/spec/containers/0/volumeMounts/-",
                "/spec/containers/0/env/-",
                "/spec/containers/0/env/-"
            ]
        );
    }

    /// A push URL naming the node's address (the agent's hostPort) gets the variable from the
    /// downward API, before the URL; a container setting it keeps its own.
    #[test]
    fn a_url_naming_the_node_address_gets_it_from_the_downward_api() {
        let host_port = Injection {
            push_url: format!("http://$({NODE_IP_VARIABLE}):9417/api/v1/push"),
            ..injection(VolumeSource::Image)
        };
        let spec = json!({"containers": [{"name": "a", "env": []},
            {"name": "b", "env": [{"name": NODE_IP_VARIABLE, "value": "10.0.0.1"}]}]});
        let m = host_port.mutate(&pod(json!({OPT_IN_LABEL: "true"}), spec), BUDGET);
        let ops = ops(&m);
        let names: Vec<(&str, &str)> = ops
            .iter()
            .filter(|o| o["path"].as_str().is_some_and(|p| p.ends_with("/env/-")))
            .map(|o| {
                (
                    o["path"].as_str().unwrap_or(""),
                    o["value"]["name"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                ("/spec/containers/0/env/-", "PYTHONPATH"),
                ("/spec/containers/0/env/-", "GPUMEM_PUSH"),
                ("/spec/containers/0/env/-", NODE_IP_VARIABLE),
                ("/spec/containers/0/env/-", "GPUMEM_PUSH_URL"),
                ("/spec/containers/1/env/-", "PYTHONPATH"),
                ("/spec/containers/1/env/-", "GPUMEM_PUSH"),
                ("/spec/containers/1/env/-", "GPUMEM_PUSH_URL"),
            ]
        );
        let node_ip = ops
            .iter()
            .find(|o| o["value"]["name"] == NODE_IP_VARIABLE)
            .expect("set");
        assert_eq!(
            node_ip["value"]["valueFrom"]["fieldRef"]["fieldPath"],
            "status.hostIP"
        );
    }

    /// Only the label's value "true" opts in; a pod without a spec gets nothing.
    #[test]
    fn only_an_opted_in_pod_with_a_spec_is_mutated() {
        let plain = injection(VolumeSource::InitContainer);
        for labels in [
            json!({}),
            json!({OPT_IN_LABEL: "True"}),
            json!({OPT_IN_LABEL: "1"}),
        ] {
            let m = plain.mutate(&pod(labels, json!({"containers": [{"name": "a"}]})), BUDGET);
            assert_eq!(m, Mutation::default());
        }
        let no_spec: PodView =
            serde_json::from_value(json!({"metadata": {"labels": {OPT_IN_LABEL: "true"}}}))
                .expect("a pod");
        assert_eq!(plain.mutate(&no_spec, BUDGET), Mutation::default());
    }

    /// A `PYTHONPATH` without a value (the API server omits an empty one) gets the hook's
    /// directory alone; of a name given twice the last is the kubelet's and is the one set;
    /// `envFrom` is warned about.
    #[test]
    fn the_containers_own_pythonpath_is_the_last_and_may_have_no_value() {
        let p = pod(
            json!({OPT_IN_LABEL: "true"}),
            json!({"containers": [
                {"name": "a", "env": [{"name": "PYTHONPATH"}]},
                {"name": "b", "env": [{"name": "PYTHONPATH", "value": "/x"},
                                      {"name": "PYTHONPATH", "value": "/y"}],
                 "envFrom": [{"configMapRef": {"name": "settings"}}]},
            ]}),
        );
        let m = injection(VolumeSource::InitContainer).mutate(&p, BUDGET);
        let ops = ops(&m);
        let set = |path: &str| {
            ops.iter()
                .find(|o| o["path"] == path)
                .map(|o| (o["op"].clone(), o["value"].clone()))
        };
        assert_eq!(
            set("/spec/containers/0/env/0/value"),
            Some((json!("add"), json!(MOUNT_PATH)))
        );
        assert_eq!(
            set("/spec/containers/1/env/1/value"),
            Some((json!("add"), json!(format!("{MOUNT_PATH}:/y"))))
        );
        assert_eq!(set("/spec/containers/1/env/0/value"), None);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].contains("envFrom"), "{:?}", m.warnings);
    }

    /// A pod with a mount where the hook goes is left alone, saying why; an injected pod is
    /// left alone silently.
    #[test]
    fn a_path_the_patch_would_take_leaves_the_pod_alone() {
        let plain = injection(VolumeSource::InitContainer);
        let spec = json!({"containers": [{"name": "a", "volumeMounts": [{"name": "x", "mountPath": "/gpumem/python/"}]}]});
        let m = plain.mutate(&pod(json!({OPT_IN_LABEL: "true"}), spec), BUDGET);
        assert!(m.patch.is_empty());
        assert!(m.warnings[0].contains("not injected"), "{:?}", m.warnings);
        let injected = pod(
            json!({OPT_IN_LABEL: "true"}),
            json!({"volumes": [{"name": VOLUME, "emptyDir": {}}], "containers": [{"name": "a"}]}),
        );
        assert_eq!(plain.mutate(&injected, BUDGET), Mutation::default());
    }

    /// The init container's name: the first candidate that no container, init container or
    /// ephemeral container has (names are unique across the three); none left, no patch.
    #[test]
    fn the_init_container_takes_a_name_no_container_has() {
        let plain = injection(VolumeSource::InitContainer);
        let init_name = |spec: Value| {
            let m = plain.mutate(&pod(json!({OPT_IN_LABEL: "true"}), spec), BUDGET);
            ops(&m)
                .iter()
                .find(|o| {
                    o["path"]
                        .as_str()
                        .is_some_and(|p| p.starts_with("/spec/initContainers"))
                })
                .map(|o| {
                    let value = &o["value"];
                    let c = if value.is_array() { &value[0] } else { value };
                    c["name"].as_str().unwrap_or("").to_string()
                })
        };
        assert_eq!(
            init_name(json!({"containers": [{"name": "a"}]})).as_deref(),
            Some(INIT_CONTAINER)
        );
        let spec = json!({
            "containers": [{"name": INIT_CONTAINER}, {"name": "gpumem-inject-3"}],
            "initContainers": [{"name": "gpumem-inject-2"}],
            "ephemeralContainers": [{"name": "gpumem-inject-4"}],
        });
        assert_eq!(init_name(spec).as_deref(), Some("gpumem-inject-5"));
        let mut all: Vec<Value> = vec![json!({"name": INIT_CONTAINER})];
        all.extend((2..=MAX_NAME_SUFFIX).map(|n| json!({"name": format!("{INIT_CONTAINER}-{n}")})));
        let m = plain.mutate(
            &pod(
                json!({OPT_IN_LABEL: "true"}),
                json!({"containers": [{"name": "a"}], "initContainers": all}),
            ),
            BUDGET,
        );
        assert!(m.patch.is_empty());
        assert!(m.warnings[0].contains("every name"), "{:?}", m.warnings);
    }

    /// A Windows pod (or any OS but Linux) gets no patch, with a warning; a Linux one does.
    #[test]
    fn only_a_linux_pod_is_patched() {
        let plain = injection(VolumeSource::InitContainer);
        for (os, patched) in [("windows", false), ("plan9", false), ("linux", true)] {
            let spec = json!({"os": {"name": os}, "containers": [{"name": "a"}]});
            let m = plain.mutate(&pod(json!({OPT_IN_LABEL: "true"}), spec), BUDGET);
            assert_eq!(!m.patch.is_empty(), patched, "{os}");
            assert_eq!(m.warnings.is_empty(), patched, "{os}: {:?}", m.warnings);
        }
    }

    /// The patch is linear in the containers: the same operations for each, and no more
    /// bytes per container for 2 000 than for 20 beyond the index's digits; past its budget,
    /// or past MAX_CONTAINERS containers, there is none.
    #[test]
    fn the_patch_is_linear_in_the_containers_and_bounded() {
        let plain = injection(VolumeSource::InitContainer);
        let of = |n: usize| {
            let containers: Vec<Value> = (0..n).map(|i| json!({"name": format!("c{i}")})).collect();
            plain.mutate(
                &pod(
                    json!({OPT_IN_LABEL: "true"}),
                    json!({"containers": containers}),
                ),
                usize::MAX,
            )
        };
        let (small, large) = (of(20), of(2000));
        assert_eq!(small.operations, 2 + 4 * 20);
        assert_eq!(large.operations, 2 + 4 * 2000);
        let per_container = |m: &Mutation, n: usize| m.patch.len() as f64 / n as f64;
        // 4 paths per container, each up to 3 more digits of index.
        assert!(per_container(&large, 2000) <= per_container(&small, 20) + 12.0);
        // Each container's mount alone is over 100 bytes: MAX_CONTAINERS is honest.
        let one = of(1);
        let mount = ops(&one)[2].to_string();
        assert!(mount.len() > 100, "{mount}");
        let m = plain.mutate(
            &pod(json!({OPT_IN_LABEL: "true"}), json!({"containers": (0..2000).map(|i| json!({"name": format!("c{i}")})).collect::<Vec<_>>()})),
            large.patch.len() / 2,
        );
        assert!(
            m.patch.is_empty() && m.warnings[0].contains("etcd"),
            "{:?}",
            m.warnings
        );
        let many = of(MAX_CONTAINERS + 1);
        assert!(many.patch.is_empty(), "{} operations", many.operations);
        assert!(
            many.warnings[0].contains("containers"),
            "{:?}",
            many.warnings
        );
    }

    /// Warnings are bounded: one per container up to MAX_WARNINGS, then a count.
    #[test]
    fn warnings_are_bounded() {
        let containers: Vec<Value> = (0..50)
            .map(|i| json!({"name": format!("c{i}"), "envFrom": [{"configMapRef": {"name": "s"}}]}))
            .collect();
        let m = injection(VolumeSource::Image).mutate(
            &pod(
                json!({OPT_IN_LABEL: "true"}),
                json!({"containers": containers}),
            ),
            BUDGET,
        );
        assert_eq!(m.warnings.len(), MAX_WARNINGS + 1);
        assert!(
            m.warnings[MAX_WARNINGS].contains("42 more"),
            "{:?}",
            m.warnings
        );
        assert_eq!(m.operations, 1 + 4 * 50);
    }
}
