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
//!   volume (a reinvocation), and a pod whose names or paths the patch would take (an init
//!   container named [`INIT_CONTAINER`], a mount at [`MOUNT_PATH`]) get no patch.
//! - The patch adds the volume, the init container, mounts and variables, and sets only the
//!   value of a container's own `PYTHONPATH`, which it prefixes.
//! - The init container meets Pod Security "restricted" (not root, no privilege escalation,
//!   every capability dropped, the runtime's default seccomp profile, a read-only root) and
//!   has requests and limits, so namespaces under a ResourceQuota admit the pod.

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod};
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
/// The init container's name.
pub const INIT_CONTAINER: &str = "gpumem-inject";

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
    /// JSON Patch operations (RFC 6902), in order; empty for no patch.
    pub operations: Vec<Value>,
    /// Warnings for the user who created the pod.
    pub warnings: Vec<String>,
}

impl Injection {
    /// The mutation of `pod` (the admission request's object), or none.
    pub fn mutate(&self, pod: &Pod) -> Mutation {
        let mut m = Mutation::default();
        let meta = &pod.metadata;
        let opted_in = meta
            .labels
            .as_ref()
            .and_then(|l| l.get(OPT_IN_LABEL))
            .is_some_and(|v| v == "true");
        let Some(spec) = pod.spec.as_ref().filter(|_| opted_in) else {
            return m;
        };
        let volumes = spec.volumes.as_deref().unwrap_or_default();
        if volumes.iter().any(|v| v.name == VOLUME) {
            // Injected already (a reinvocation of the webhook): nothing to say.
            return m;
        }
        // Names and paths the patch would take: the API server would refuse the pod.
        let inits = spec.init_containers.as_deref().unwrap_or_default();
        let taken_mount = spec.containers.iter().find(|c| {
            c.volume_mounts
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|v| v.mount_path.trim_end_matches('/') == MOUNT_PATH)
        });
        let clash = if inits.iter().any(|c| c.name == INIT_CONTAINER) {
            Some(format!("an init container is named {INIT_CONTAINER}"))
        } else {
            taken_mount.map(|c| format!("container {:?} mounts something at {MOUNT_PATH}", c.name))
        };
        if let Some(clash) = clash {
            m.warnings
                .push(format!("gpumem: {clash}; the hook is not injected"));
            return m;
        }
        m.add_to_list("/spec/volumes", spec.volumes.is_some(), self.volume());
        if self.source == VolumeSource::InitContainer {
            m.add_to_list(
                "/spec/initContainers",
                spec.init_containers.is_some(),
                self.init_container(),
            );
        }
        let image_path = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(PYTHONPATH_ANNOTATION))
            .filter(|p| !p.is_empty());
        for (i, container) in spec.containers.iter().enumerate() {
            self.inject_into(&mut m, i, container, image_path.map(String::as_str));
        }
        m
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

    fn init_container(&self) -> Value {
        json!({
            "name": INIT_CONTAINER,
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

    fn inject_into(&self, m: &mut Mutation, i: usize, c: &Container, image_path: Option<&str>) {
        let base = format!("/spec/containers/{i}");
        let mut mount = json!({"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": true});
        if self.source == VolumeSource::Image {
            // The image's root is mounted; the hook is one directory of it.
            mount["subPath"] = json!(IMAGE_HOOK_DIR.trim_start_matches('/'));
        }
        m.add_to_list(
            &format!("{base}/volumeMounts"),
            c.volume_mounts.is_some(),
            mount,
        );
        let env = c.env.as_deref().unwrap_or_default();
        let mut has_env = c.env.is_some();
        let mut add = |m: &mut Mutation, var: Value| {
            m.add_to_list(&format!("{base}/env"), has_env, var);
            has_env = true;
        };
        // The last of a name given twice is the one the kubelet sets.
        match env.iter().rposition(|v| v.name == "PYTHONPATH") {
            Some(j) => match &env[j] {
                // An empty value arrives without `value` (the API server omits it).
                EnvVar { value, value_from: None, .. } => {
                    let value = match value.as_deref() {
                        None | Some("") => MOUNT_PATH.to_string(),
                        Some(own) => format!("{MOUNT_PATH}:{own}"),
                    };
                    // `add` sets the member whether or not it is there.
                    m.operations.push(json!({
                        "op": "add", "path": format!("{base}/env/{j}/value"), "value": value,
                    }));
                }
                _ => m.warnings.push(format!(
                    "container {:?} takes PYTHONPATH from a reference: gpumem's hook is not on it, so this container does not push",
                    c.name
                )),
            },
            None => {
                let value = match image_path {
                    Some(path) => format!("{MOUNT_PATH}:{path}"),
                    None => MOUNT_PATH.to_string(),
                };
                add(m, json!({"name": "PYTHONPATH", "value": value}));
            }
        }
        if !env.iter().any(|v| v.name == "GPUMEM_PUSH") {
            add(m, json!({"name": "GPUMEM_PUSH", "value": "1"}));
        }
        if !env.iter().any(|v| v.name == "GPUMEM_PUSH_URL") {
            // A URL naming the node's address (the agent's hostPort) gets it from the
            // downward API, defined before the URL so that the kubelet expands it.
            if self.push_url.contains(&format!("$({NODE_IP_VARIABLE})"))
                && !env.iter().any(|v| v.name == NODE_IP_VARIABLE)
            {
                add(
                    m,
                    json!({"name": NODE_IP_VARIABLE,
                           "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}),
                );
            }
            add(
                m,
                json!({"name": "GPUMEM_PUSH_URL", "value": self.push_url}),
            );
        }
        if c.env_from.as_ref().is_some_and(|from| !from.is_empty()) {
            m.warnings.push(format!(
                "container {:?} takes variables from envFrom: a PYTHONPATH, GPUMEM_PUSH or GPUMEM_PUSH_URL there is overridden by gpumem's (set them under env to keep them)",
                c.name
            ));
        }
    }
}

impl Mutation {
    /// Appends `value` to the list at `path`, creating the list where the pod has none.
    fn add_to_list(&mut self, path: &str, exists: bool, value: Value) {
        self.operations.push(if exists {
            json!({"op": "add", "path": format!("{path}/-"), "value": value})
        } else {
            json!({"op": "add", "path": path, "value": [value]})
        });
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

    /// The paths the mutation's operations touch, in order.
    fn paths(m: &Mutation) -> Vec<&str> {
        m.operations
            .iter()
            .map(|o| o["path"].as_str().unwrap_or(""))
            .collect()
    }

    fn pod(labels: Value, spec: Value) -> Pod {
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
        let m = injection(VolumeSource::InitContainer).mutate(&bare);
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
        assert!(m.operations.iter().all(|o| o["op"] == "add"));
        let full = pod(
            json!({OPT_IN_LABEL: "true"}),
            json!({"volumes": [], "initContainers": [], "containers": [
                {"name": "a", "volumeMounts": [], "env": [{"name": "GPUMEM_PUSH", "value": "0"}]}]}),
        );
        let m = injection(VolumeSource::Image).mutate(&full);
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
        let m = host_port.mutate(&pod(json!({OPT_IN_LABEL: "true"}), spec));
        let names: Vec<(&str, &str)> = m
            .operations
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
        let node_ip = m
            .operations
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
            let m = plain.mutate(&pod(labels, json!({"containers": [{"name": "a"}]})));
            assert_eq!(m, Mutation::default());
        }
        let no_spec: Pod =
            serde_json::from_value(json!({"metadata": {"labels": {OPT_IN_LABEL: "true"}}}))
                .expect("a pod");
        assert_eq!(plain.mutate(&no_spec), Mutation::default());
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
        let m = injection(VolumeSource::InitContainer).mutate(&p);
        let set = |path: &str| {
            m.operations
                .iter()
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

    /// A pod whose init container or mount the patch would duplicate is left alone, saying
    /// why; an injected pod is left alone silently.
    #[test]
    fn names_and_paths_the_patch_would_take_leave_the_pod_alone() {
        let plain = injection(VolumeSource::InitContainer);
        let clashes = [
            json!({"initContainers": [{"name": INIT_CONTAINER}], "containers": [{"name": "a"}]}),
            json!({"containers": [{"name": "a", "volumeMounts": [{"name": "x", "mountPath": "/gpumem/python/"}]}]}),
        ];
        for spec in clashes {
            let m = plain.mutate(&pod(json!({OPT_IN_LABEL: "true"}), spec));
            assert!(m.operations.is_empty());
            assert!(m.warnings[0].contains("not injected"), "{:?}", m.warnings);
        }
        let injected = pod(
            json!({OPT_IN_LABEL: "true"}),
            json!({"volumes": [{"name": VOLUME, "emptyDir": {}}], "containers": [{"name": "a"}]}),
        );
        assert_eq!(plain.mutate(&injected), Mutation::default());
    }
}
