#!/usr/bin/env python3
"""Renders the Helm chart with the real Helm engine (helm-python-sdk) under the default
values and with every optional feature on, lints it, and validates every rendered object
offline: Kubernetes objects with kubernetes-validate --strict, prometheus-operator objects
against the JSON schemas in helm/schemas. Exits non-zero on any finding."""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "gpumem"
SCHEMAS = ROOT / "helm" / "schemas"
OPERATOR_KINDS = {
    "ServiceMonitor": "servicemonitor.json",
    "PodMonitor": "podmonitor.json",
    "PrometheusRule": "prometheusrule.json",
    "Certificate": "certificate.json",
    "Issuer": "issuer.json",
}
ALL_ON = {
    "global": {"imageRegistry": "registry.example.com"},
    "nameOverride": "gpu-memory",
    "hostPID": True,
    "runtimeClassName": "nvidia",
    "priorityClassName": "system-node-critical",
    "priorityClassQuota": {"enabled": True, "pods": 500},
    "imagePullSecrets": [{"name": "registry"}],
    "image": {"repository": "registry.example.com/gpumem", "tag": "0.1.0",
              "digest": "sha256:" + "ab" * 32},
    "extraEnv": [{"name": "RUST_LOG", "value": "debug"}],
    "extraArgs": ["--interval", "10"],
    "podAnnotations": {"example.com/owner": "gpu-team"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "nvidia.com/gpu.product", "operator": "Exists"}]}]}}},
    "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "kube-prometheus-stack"},
                       "namespace": "monitoring",
                       "relabelings": [{"targetLabel": "cluster", "replacement": "gpu-a"}],
                       "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "go_.*",
                                              "action": "drop"}]},
    "prometheusRule": {
        "enabled": True, "additionalLabels": {"release": "kube-prometheus-stack"},
        "runbookBaseURL": "https://wiki.example.com/gpu/runbooks", "agentJob": ".*gpu-memory.*",
        "ruleLabels": {"team": "gpu-platform"},
        "alerts": {
            "GpumemOutOfMemory": {"severity": "page", "labels": {"team": "ml"},
                                  "thresholds": {"windowSeconds": 900}},
            "GpumemAllocRetriesRising": {"thresholds": {"perSecond": 0.05}},
            "GpumemFragmentationUnderPressure": {"for": "30m", "thresholds": {
                "ratio": 0.5, "minReservedBytes": 4294967296, "deviceUsedRatio": 0.9}},
            "GpumemDeviceMemoryFillPredicted": {"thresholds": {"horizonSeconds": 3600}},
            "GpumemMemoryOutsideAllocatorHigh": {"enabled": False},
        },
    },
    "dashboards": {"enabled": True, "namespace": "monitoring"},
    "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "livenessProbe": {"initialDelaySeconds": 10, "periodSeconds": 20, "timeoutSeconds": 3,
                      "failureThreshold": 5},
    "readinessProbe": {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2,
                       "successThreshold": 1},
    "gpuNodeLabel": {"key": "gpumem.io/gpu", "value": "true"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "dra": {"enabled": True, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi", "/opt/cdi"]},
    "webhook": {"enabled": True, "volume": "image", "replicas": 3,
                "namespaceSelector": {"matchLabels": {"gpumem.io/tenant": "true"}}},
    "podNetwork": {"enabled": True, "criSocket": "/var/run/crio/crio.sock", "expose": "hostPort",
                   "hostPort": 19417, "maxProcessesPerPod": 4},
}

failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL: {message}")


def check(values, label, chart_dir=CHART):
    with helm.Chart.load(str(chart_dir)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name="gpumem", namespace="gpu-monitoring")
    objects = []
    for template, text in manifests.items():
        if not template.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append((template, doc))
    kinds = sorted(doc["kind"] for _, doc in objects)
    print(f"{label}: {len(objects)} objects: {', '.join(kinds)}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (template, doc) in enumerate(objects):
            path = Path(tmp) / f"{i}-{doc['kind'].lower()}.yaml"
            path.write_text(yaml.safe_dump(doc))
            if doc["kind"] in OPERATOR_KINDS:
                cmd = ["check-jsonschema", "--schemafile", str(SCHEMAS / OPERATOR_KINDS[doc["kind"]]), str(path)]
            else:
                cmd = ["kubernetes-validate", "--strict", "--quiet", str(path)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                fail(f"{label}: {template} ({doc['kind']}): {result.stdout}{result.stderr}")
    return kinds


# Helm's lint severities: 1 information, 2 warning, 3 error. Clean means no warning or error.
lint = helm.lint(str(CHART))
for message in lint["messages"]:
    print(f"lint (severity {message['severity']}): {message['path']}: {message['error']}")
    if message["severity"] >= 2:
        fail(f"lint: {message['path']}: {message['error']}")
for error in lint["errors"]:
    fail(f"lint: {error}")
defaults = check({}, "default values")
if defaults != sorted(["DaemonSet", "Service", "ServiceAccount"]):
    fail(f"default values render {defaults}")
everything = check(ALL_ON, "every option on")
for kind in ["ServiceMonitor", "PrometheusRule", "ConfigMap", "ResourceQuota"]:
    if kind not in everything:
        fail(f"every option on: no {kind}")
pod_monitor = dict(ALL_ON, serviceMonitor={"enabled": False},
                   podMonitor={"enabled": True, "relabelings": [{"targetLabel": "cluster",
                                                                 "replacement": "gpu-a"}]})
if "PodMonitor" not in check(pod_monitor, "a PodMonitor instead"):
    fail("podMonitor on: no PodMonitor")
# Both monitors would scrape every agent twice: refused, saying why.
try:
    with helm.Chart.load(str(CHART)) as chart:
        chart.render(dict(ALL_ON, podMonitor={"enabled": True}), name="gpumem",
                     namespace="gpu-monitoring")
    fail("serviceMonitor and podMonitor both on rendered")
except Exception as error:
    if "scrape every agent twice" not in str(error):
        fail(f"both monitors: unclear refusal {error}")
    else:
        print("both monitors on: refused")


def rendered(values, kind):
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="gpumem", namespace="gpu-monitoring")
    return [doc for template, text in manifests.items() if template.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc and doc["kind"] == kind]


def daemonset(values):
    """The pod spec of the DaemonSet `values` render."""
    found = rendered(values, "DaemonSet")
    if not found:
        fail("no DaemonSet rendered")
        return {}
    return found[0]["spec"]["template"]["spec"]


ds = rendered(ALL_ON, "DaemonSet")[0]
container = ds["spec"]["template"]["spec"]["containers"][0]
if not container["image"].endswith("@sha256:" + "ab" * 32):
    fail(f"image digest not used: {container['image']}")
if {"name": "RUST_LOG", "value": "debug"} not in container["env"]:
    fail(f"extraEnv missing: {container['env']}")
if ds["metadata"]["name"] != "gpumem-gpu-memory":
    fail(f"nameOverride: {ds['metadata']['name']}")
if rendered(dict(fullnameOverride="agent"), "DaemonSet")[0]["metadata"]["name"] != "agent":
    fail("fullnameOverride not used")
monitor = rendered(ALL_ON, "ServiceMonitor")[0]
relabel = monitor["spec"]["endpoints"][0]["relabelings"]
if {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance"} not in relabel \
        or relabel[-1].get("targetLabel") != "cluster" or monitor["metadata"]["namespace"] != "monitoring":
    fail(f"ServiceMonitor relabelings or namespace: {monitor}")
default_pod = daemonset({})
if default_pod.get("priorityClassName") != "system-node-critical":
    fail(f"default priority class: {default_pod.get('priorityClassName')}")
ds_pod = ds["spec"]["template"]["spec"]
if {"name": "scratch", "emptyDir": {}} not in ds_pod["volumes"] \
        or {"name": "scratch", "mountPath": "/scratch"} not in container["volumeMounts"]:
    fail(f"extraVolumes/extraVolumeMounts: {ds_pod['volumes']} {container['volumeMounts']}")
if container["livenessProbe"] != {"httpGet": {"path": "/healthz", "port": "metrics"},
                                  **ALL_ON["livenessProbe"]} \
        or container["readinessProbe"] != {"httpGet": {"path": "/readyz", "port": "metrics"},
                                           **ALL_ON["readinessProbe"]}:
    fail(f"probes: {container['livenessProbe']} {container['readinessProbe']}")
if ds_pod.get("nodeSelector") != {"gpumem.io/gpu": "true", "kubernetes.io/os": "linux"}:
    fail(f"gpuNodeLabel and nodeSelector: {ds_pod.get('nodeSelector')}")
# By default, nodes of either setup (device plugin or DRA): any of gpuNodeAffinity's expressions.
GPU_EXPRESSIONS = yaml.safe_load((CHART / "values.yaml").read_text())["gpuNodeAffinity"]


def required_terms(pod):
    """The pod's required node-affinity terms."""
    affinity = pod.get("affinity", {}).get("nodeAffinity", {})
    return affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
        "nodeSelectorTerms")


keys = {e["key"] for e in GPU_EXPRESSIONS}
if "nodeSelector" in default_pod \
        or required_terms(default_pod) != [{"matchExpressions": [e]} for e in GPU_EXPRESSIONS] \
        or not {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present",
                "eks.amazonaws.com/instance-gpu-manufacturer"} <= keys:
    fail(f"default node selection: {default_pod.get('nodeSelector')} {default_pod.get('affinity')}")
# The user's required terms (ORed) are each ANDed with each expression: term × expression.
user_terms = [{"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In",
                                     "values": ["amd64"]}]},
              {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}]
both = daemonset({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": user_terms}}}})
expected = [{**term, "matchExpressions": term.get("matchExpressions", []) + [e]}
            for term in user_terms for e in GPU_EXPRESSIONS]
if required_terms(both) != expected:
    fail(f"gpuNodeAffinity beside the user's node affinity: {required_terms(both)}")
# The node's CDI spec directories, read-only under /host, passed to the agent; none without
# DRA or without pod resources.
default_container = default_pod["containers"][0]
cdi_volumes = [v for v in default_pod["volumes"] if v["name"].startswith("cdi-")]
cdi_mounts = [m for m in default_container["volumeMounts"] if m["name"].startswith("cdi-")]
args = default_container["args"]
if [v["hostPath"]["path"] for v in cdi_volumes] != ["/etc/cdi", "/var/run/cdi"] \
        or [(m["mountPath"], m.get("readOnly")) for m in cdi_mounts] \
        != [("/host/etc/cdi", True), ("/host/var/run/cdi", True)] \
        or args[args.index("--cdi-spec-dirs") + 1] != "/host/etc/cdi,/host/var/run/cdi":
    fail(f"CDI directories: {cdi_volumes} {cdi_mounts} {args}")
for off in [{"dra": {"enabled": False, "cdiSpecDirs": ["/etc/cdi"]}},
            {"podResources": {"enabled": False, "hostPath": "/var/lib/kubelet/pod-resources"}}]:
    pod = daemonset(off)
    off_args = pod["containers"][0]["args"]
    if off_args[off_args.index("--cdi-spec-dirs") + 1] != "" \
            or any(v["name"].startswith("cdi-") for v in pod.get("volumes", [])):
        fail(f"CDI directories with {off}")
default_probes = default_pod["containers"][0]
if default_probes["livenessProbe"]["httpGet"]["path"] != "/healthz" \
        or default_probes["readinessProbe"]["httpGet"]["path"] != "/readyz":
    fail(f"default probes: {default_probes['livenessProbe']} {default_probes['readinessProbe']}")
# Without GPU Feature Discovery: a label of any value is a node-affinity term.
any_value = daemonset({"gpuNodeLabel": {"key": "cloud.google.com/gke-accelerator", "value": ""}})
terms = any_value["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
if "nodeSelector" in any_value or terms["nodeSelectorTerms"] != [{"matchExpressions": [
        {"key": "cloud.google.com/gke-accelerator", "operator": "Exists"}]}]:
    fail(f"gpuNodeLabel with any value: {any_value.get('nodeSelector')} {any_value['affinity']}")
if "nodeSelector" in daemonset({"gpuNodeLabel": {"key": "", "value": ""}}):
    fail("gpuNodeLabel key \"\" still selects nodes")
print("composition options: as configured")

# The admission webhook: off by default; on, its objects, its certificate (signed by the CA
# the configuration trusts, for the Service's name), a restricted pod, and a configuration
# that only opted-in pods of other namespaces reach.
hook = {"webhook": {"enabled": True}}
if rendered({}, "MutatingWebhookConfiguration"):
    fail("the webhook renders by default")
webhook_kinds = sorted(set(check(hook, "the webhook on")) - set(defaults))
if webhook_kinds != ["Deployment", "MutatingWebhookConfiguration", "Secret"]:
    fail(f"the webhook on adds {webhook_kinds}")
# One render: each makes a new certificate authority.
with helm.Chart.load(str(CHART)) as chart:
    hook_docs = [doc for template, text in chart.render(hook, name="gpumem",
                                                        namespace="gpu-monitoring").items()
                 if template.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
configuration = next(d for d in hook_docs if d["kind"] == "MutatingWebhookConfiguration")
configuration = configuration["webhooks"][0]
secret = next(d for d in hook_docs if d["kind"] == "Secret")["data"]
if configuration["sideEffects"] != "None" or configuration["admissionReviewVersions"] != ["v1"] \
        or configuration["failurePolicy"] != "Ignore" \
        or configuration["objectSelector"] != {"matchLabels": {"gpumem.io/inject": "true"}} \
        or configuration["namespaceSelector"]["matchExpressions"] != [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["gpu-monitoring"]}] \
        or configuration["clientConfig"]["caBundle"] != secret["ca.crt"]:
    fail(f"webhook configuration: {dict(configuration, clientConfig='…')}")
with tempfile.TemporaryDirectory() as tmp:
    import base64
    for key in ("ca.crt", "tls.crt"):
        (Path(tmp) / key).write_bytes(base64.b64decode(secret[key]))
    verified = subprocess.run(["openssl", "verify", "-CAfile", f"{tmp}/ca.crt", f"{tmp}/tls.crt"],
                              capture_output=True, text=True)
    names = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                            f"{tmp}/tls.crt"], capture_output=True, text=True).stdout
    if verified.returncode != 0 or "DNS:gpumem-webhook.gpu-monitoring.svc" not in names:
        fail(f"the webhook's certificate: {verified.stdout}{verified.stderr} {names}")
hook_pod = rendered(hook, "Deployment")[0]["spec"]["template"]["spec"]
hook_container = hook_pod["containers"][0]
args = hook_container["args"]
if hook_pod["securityContext"].get("runAsNonRoot") is not True \
        or hook_pod["securityContext"]["seccompProfile"] != {"type": "RuntimeDefault"} \
        or hook_container["securityContext"] != {"allowPrivilegeEscalation": False,
                                                 "readOnlyRootFilesystem": True,
                                                 "capabilities": {"drop": ["ALL"]}} \
        or args[args.index("--push-url") + 1] != "http://gpumem.gpu-monitoring.svc:9417/api/v1/push" \
        or args[args.index("--volume") + 1] != "init-container":
    fail(f"the webhook's pod: {hook_pod}")
on = rendered(ALL_ON, "MutatingWebhookConfiguration")[0]["webhooks"][0]["namespaceSelector"]
on_args = rendered(ALL_ON, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
if on.get("matchLabels") != {"gpumem.io/tenant": "true"} or len(on["matchExpressions"]) != 1 \
        or on_args[on_args.index("--volume") + 1] != "image":
    fail(f"webhook options: {on} {on_args}")
print("the webhook: as configured")

# The serving certificate from cert-manager: a Certificate for the Service's names (issued by
# a self-signed Issuer the chart makes, or the one named), its CA injected into the
# configuration by cert-manager's cainjector, and no Secret of the chart's. "auto" takes it
# only where cert-manager's API is installed: Helm's offline engine has none, so the chart's.
cert_manager = {"webhook": {"enabled": True, "certificate": {"source": "certManager", "issuerRef": {}}}}
kinds = sorted(set(check(cert_manager, "the webhook's certificate from cert-manager")) - set(defaults))
if kinds != ["Certificate", "Deployment", "Issuer", "MutatingWebhookConfiguration"]:
    fail(f"cert-manager's certificate adds {kinds}")
certificate = rendered(cert_manager, "Certificate")[0]
issuer = rendered(cert_manager, "Issuer")[0]
mwc = rendered(cert_manager, "MutatingWebhookConfiguration")[0]
volume = rendered(cert_manager, "Deployment")[0]["spec"]["template"]["spec"]["volumes"][0]
if certificate["spec"]["secretName"] != volume["secret"]["secretName"] \
        or certificate["spec"]["secretName"] == rendered(hook, "Deployment")[0]["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] \
        or certificate["spec"]["dnsNames"] != ["gpumem-webhook.gpu-monitoring.svc",
                                               "gpumem-webhook.gpu-monitoring.svc.cluster.local"] \
        or certificate["spec"]["issuerRef"] != {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                                "group": "cert-manager.io"} \
        or issuer["spec"] != {"selfSigned": {}} \
        or mwc["metadata"]["annotations"] != {"cert-manager.io/inject-ca-from": "gpu-monitoring/gpumem-webhook"} \
        or "caBundle" in mwc["webhooks"][0]["clientConfig"]:
    fail(f"cert-manager's certificate: {certificate} {issuer} {mwc['metadata']}")
named = {"webhook": {"enabled": True, "certificate": {
    "source": "certManager", "issuerRef": {"name": "platform-ca", "kind": "ClusterIssuer",
                                           "group": "cert-manager.io"}}}}
kinds = sorted(set(check(named, "cert-manager with a named issuer")) - set(defaults))
if "Issuer" in kinds or rendered(named, "Certificate")[0]["spec"]["issuerRef"]["name"] != "platform-ca":
    fail(f"a named issuer: {kinds}")
auto = {"webhook": {"enabled": True, "certificate": {"source": "auto", "issuerRef": {}}}}
if rendered(auto, "Certificate") or not rendered(auto, "Secret"):
    fail("auto without cert-manager's API does not make its own certificate")
print("the webhook's certificate from cert-manager: as configured")


def refused(values, message, what):
    """Rendering `values` must fail, saying `message`."""
    try:
        with helm.Chart.load(str(CHART)) as chart:
            chart.render(values, name="gpumem", namespace="gpu-monitoring")
        fail(f"{what}: rendered")
    except Exception as error:
        if message not in str(error):
            fail(f"{what}: unclear refusal {error}")
        else:
            print(f"{what}: refused")


# A label of any value beside the user's node affinity: both required.
beside = daemonset({"gpuNodeLabel": {"key": "example.com/gpu", "value": ""},
                    "affinity": ALL_ON["affinity"]})
if required_terms(beside) != [{"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "Exists"},
        {"key": "example.com/gpu", "operator": "Exists"}]}]:
    fail(f"gpuNodeLabel beside nodeAffinity: {beside.get('affinity')}")
refused({"dra": {"enabled": True, "cdiSpecDirs": ["/etc/cdi,/run/cdi"]}},
        "cdiSpecDirs", "a CDI directory with a comma")

# The rules: at default values exactly the repository's file (its {{ $labels }} untouched by
# Helm), and with every knob set, the knobs applied and the result still valid rules.
CANONICAL = yaml.safe_load((ROOT / "alerts" / "gpumem.rules.yml").read_text())
if rendered({"prometheusRule": {"enabled": True}}, "PrometheusRule")[0]["spec"]["groups"] \
        != CANONICAL["groups"]:
    fail("the chart's rules at default values differ from alerts/gpumem.rules.yml")
else:
    print("rules at default values: equal to alerts/gpumem.rules.yml")
tuned = rendered(ALL_ON, "PrometheusRule")[0]["spec"]["groups"]
alerts = {r["alert"]: r for g in tuned for r in g["rules"] if "alert" in r}
oom, frag = alerts["GpumemOutOfMemory"], alerts["GpumemFragmentationUnderPressure"]
checks = {
    "disabled alert left out": "GpumemMemoryOutsideAllocatorHigh" not in alerts,
    "every other alert kept": len(alerts) == sum(
        1 for g in CANONICAL["groups"] for r in g["rules"] if "alert" in r) - 1,
    "severity": oom["labels"] == {"severity": "page", "team": "ml"},
    "rule labels": frag["labels"] == {"severity": "warning", "team": "gpu-platform"},
    "for": frag["for"] == "30m",
    "thresholds": "< 900 # threshold: windowSeconds" in oom["expr"]
    and "> 0.5 # threshold: ratio" in frag["expr"]
    and "> 4294967296 # threshold: minReservedBytes" in frag["expr"]
    and "> 0.9 # threshold: deviceUsedRatio" in frag["expr"]
    and "3600 # threshold: horizonSeconds" in alerts["GpumemDeviceMemoryFillPredicted"]["expr"]
    and "> 0.05 # threshold: perSecond" in alerts["GpumemAllocRetriesRising"]["expr"],
    "runbook base": all(r["annotations"]["runbook_url"].startswith(
        "https://wiki.example.com/gpu/runbooks#gpumem") for r in alerts.values()),
    "job matcher": 'up{job=~".*gpu-memory.*"} == 0' == alerts["GpumemAgentDown"]["expr"],
    "templates untouched": "{{ $labels.job_key }}" in oom["annotations"]["summary"],
}
for what, ok in checks.items():
    if not ok:
        fail(f"tuned rules: {what}: {yaml.safe_dump(tuned)}")
with tempfile.NamedTemporaryFile("w", suffix=".yml") as rules_file:
    yaml.safe_dump({"groups": tuned}, rules_file)
    rules_file.flush()
    result = subprocess.run(["promtool", "check", "rules", rules_file.name],
                            capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"tuned rules: promtool: {result.stdout}{result.stderr}")
print("tuned rules: every knob applied, promtool check rules passes")
refused({"prometheusRule": {"enabled": True, "alerts": {"GpumemOOM": {"enabled": False}}}},
        "prometheusRule.alerts.GpumemOOM: no such alert", "an unknown alert")
refused({"prometheusRule": {"enabled": True, "alerts": {
    "GpumemOutOfMemory": {"thresholds": {"ratio": 0.5}}}}},
        "GpumemOutOfMemory.thresholds.ratio: the rule has no such threshold", "an unknown threshold")
refused({"prometheusRule": {"enabled": True, "alerts": {
    "GpumemOutOfMemory": {"enabled": False, "thresholds": {"ratio": 0.5}}}}},
        "GpumemOutOfMemory.thresholds.ratio: the rule has no such threshold",
        "an unknown threshold on a disabled alert")
def allowed(args):
    return [args[i + 1] for i, a in enumerate(args) if a == "--allow-host"]


# recordings.urlTemplate: the OOM alert links the rank with the job's newest OOM to its
# recording on its node's agent (promtool evaluates the annotation), the agent answers to the
# URL's host, and a template that is not such a URL is refused.
LINKED = {"prometheusRule": {"enabled": True}, "recordings": {
    "urlTemplate": "https://gpumem.example.com/nodes/{node}/recordings/pid/{pid}"}}
linked = rendered(LINKED, "PrometheusRule")[0]["spec"]["groups"]
linked_oom = next(r for g in linked for r in g["rules"] if r.get("alert") == "GpumemOutOfMemory")
if [r for g in linked for r in g["rules"] if r is not linked_oom] \
        != [r for g in CANONICAL["groups"] for r in g["rules"] if r.get("alert") != "GpumemOutOfMemory"]:
    fail("recordings.urlTemplate changed rules other than GpumemOutOfMemory")
rank = ('gpumem_allocator_last_oom_timestamp_seconds{{instance="{ip}:9400",node="{node}",'
        'job="gpumem",gpu="0",UUID="GPU-{node}",pid="{pid}",allocator="pytorch",'
        'pod_namespace="ml",pod_name="{pod}",run_id="run-1"}}')
unit = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
    "interval": "1m",
    "input_series": [
        # Two ranks of one job on two nodes; the second ran out of memory last.
        {"series": rank.format(ip="10.0.0.4", node="gpu-3", pid=77, pod="train-0"),
         "values": "300x20"},
        {"series": rank.format(ip="10.0.0.5", node="gpu-7", pid=4242, pod="train-1"),
         "values": "540x20"}],
    "alert_rule_test": [{"eval_time": "10m", "alertname": "GpumemOutOfMemory", "exp_alerts": [{
        "exp_labels": {"job": "gpumem", "allocator": "pytorch", "run_id": "run-1",
                       "pod_namespace": "ml", "namespace": "ml", "job_key": "run-1",
                       "severity": "warning"},
        "exp_annotations": {
            "summary": "CUDA out of memory in job run-1 (namespace ml)",
            "description": "An allocation of job run-1 failed after every recovery step of its "
                           "allocator. Compare reserved-but-unallocated memory with the "
                           "request to tell fragmentation from a full device.",
            "runbook_url": "https://github.com/gpumem/gpumem/blob/main/docs/runbooks.md"
                           "#gpumemoutofmemory",
            "recording_url": "https://gpumem.example.com/nodes/gpu-7/recordings/pid/4242"}}]}]}]}
with tempfile.TemporaryDirectory() as work:
    (Path(work) / "rules.yml").write_text(yaml.safe_dump({"groups": linked}))
    (Path(work) / "test.yml").write_text(yaml.safe_dump(unit))
    result = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=work,
                            capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"the OOM alert's recording_url: promtool: {result.stdout}{result.stderr}")
for template, host in [(LINKED["recordings"]["urlTemplate"], "gpumem.example.com"),
                       ("http://{node}.gpu.example.com:9400/recordings/pid/{pid}",
                        "$(GPUMEM_NODE_NAME).gpu.example.com")]:
    pod = daemonset({"recordings": {"urlTemplate": template}})
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    if allowed(pod["containers"][0]["args"])[-1] != host \
            or env.get("GPUMEM_NODE_NAME", {}).get("valueFrom") \
            != {"fieldRef": {"fieldPath": "spec.nodeName"}}:
        fail(f"{template}: the agent's hosts {allowed(pod['containers'][0]['args'])}, env {env}")
for template in ["https://gpumem.example.com/recordings/{node}",  # no {pid}
                 "javascript:alert(1)//{pid}",
                 "https://gpumem.example.com/{{ $labels.x }}/{pid}",
                 "https://evil.example/\"/{pid}"]:
    refused({"recordings": {"urlTemplate": template}}, "urlTemplate",
            f"the URL template {template!r}")
print("recordings.urlTemplate: the OOM alert links the newest OOM's recording (promtool), "
      "the agent answers to its host")
# A fullnameOverride the default job matcher does not match would silence AgentDown.
refused({"fullnameOverride": "gpu-agent", "serviceMonitor": {"enabled": True},
         "prometheusRule": {"enabled": True}},
        "does not match the agents' scrape job \"gpu-agent\"", "a job matcher its monitor misses")
if not rendered({"fullnameOverride": "gpu-agent", "podMonitor": {"enabled": True},
                 "prometheusRule": {"enabled": True, "agentJob": "gpu-monitoring/gpu-agent"}},
                "PrometheusRule"):
    fail("a PodMonitor's job matcher: no PrometheusRule")

# The PodMonitor of docs/gpumem-torch.md for jobs that serve gpumem_torch's metrics is a valid object.
example = ROOT / "docs" / "examples" / "podmonitor-gpumem-torch.yaml"
result = subprocess.run(["check-jsonschema", "--schemafile", str(SCHEMAS / "podmonitor.json"),
                         str(example)], capture_output=True, text=True)
if result.returncode != 0:
    fail(f"{example.name}: {result.stdout}{result.stderr}")
else:
    print(f"{example.name}: valid")

# The Kyverno policy offered instead of the webhook is a valid ClusterPolicy, and adds what the
# webhook adds (the same volume, init container and variables).
example = ROOT / "docs" / "examples" / "kyverno-inject.yaml"
result = subprocess.run(["check-jsonschema", "--schemafile", str(SCHEMAS / "kyverno-clusterpolicy.json"),
                         str(example)], capture_output=True, text=True)
if result.returncode != 0:
    fail(f"{example.name}: {result.stdout}{result.stderr}")
else:
    rules = yaml.safe_load(example.read_text())["spec"]["rules"]
    pod_patch = rules[0]["mutate"]["patchStrategicMerge"]["spec"]
    container_patch = rules[1]["mutate"]["foreach"][0]["patchStrategicMerge"]["spec"]["containers"][0]
    init = pod_patch["initContainers"][0]
    if pod_patch["volumes"][0]["name"] != "gpumem-python" or init["name"] != "gpumem-inject" \
            or init["command"][1:] != ["copy-hook", "/usr/share/gpumem/python", "/gpumem/python"] \
            or [e["name"] for e in container_patch["env"]] != ["PYTHONPATH", "GPUMEM_PUSH", "GPUMEM_PUSH_URL"]:
        fail(f"{example.name} adds other than the webhook: {pod_patch} {container_patch}")
    else:
        print(f"{example.name}: valid")

# As a dependency of an umbrella chart, with global values: schema-valid and every object
# valid.
with tempfile.TemporaryDirectory() as umbrella:
    umbrella = Path(umbrella)
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "gpumem", "version": version,
                          "repository": f"file://{CHART}", "condition": "gpumem.enabled"}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "registry.example.com", "clusterName": "gpu-a"},
        "gpumem": {"enabled": True, "serviceMonitor": {"enabled": True},
                   "prometheusRule": {"enabled": True}}}))
    shutil.copytree(CHART, umbrella / "charts" / "gpumem")
    kinds = check({}, "as an umbrella chart's dependency", umbrella)
    if "DaemonSet" not in kinds or "PrometheusRule" not in kinds:
        fail(f"umbrella chart renders {kinds}")


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


# By default the agent shares the push socket's host directory with jobs, asks the kubelet,
# and sees host pids; each can be turned off, and then nothing of it is mounted.
pod = daemonset({})
container = pod["containers"][0]
mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
hosts = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
expected = {"push": "/run/gpumem", "pod-resources": "/var/lib/kubelet/pod-resources",
            "pod-logs": "/var/log/pods", "container-logs": "/var/log/containers"}
cdi = {"cdi-0": "/etc/cdi", "cdi-1": "/var/run/cdi"}
cdi_mounts = {name: "/host" + path for name, path in cdi.items()}
if mounts != dict(expected, recordings="/var/lib/gpumem/recordings", **cdi_mounts) \
        or hosts != dict(expected, **cdi):
    fail(f"default mounts {mounts}, host paths {hosts}")
# Recordings: on an emptyDir with a size limit of their own, never a host path, with their caps.
recordings = [v for v in pod["volumes"] if v["name"] == "recordings"]
if recordings != [{"name": "recordings", "emptyDir": {"sizeLimit": "1152Mi"}}] \
        or flag(container["args"], "--recordings-dir") != "/var/lib/gpumem/recordings" \
        or flag(container["args"], "--recordings-max-bytes-each") != "16777216" \
        or flag(container["args"], "--recordings-max-memory-bytes") != "67108864":
    fail(f"the recordings' volume and caps: {recordings} {container['args']}")
if flag(container["args"], "--push-socket") != "/run/gpumem/push.sock":
    fail(f"default push socket: {container['args']}")
if flag(container["args"], "--pod-resources-socket") != "/var/lib/kubelet/pod-resources/kubelet.sock":
    fail(f"default kubelet socket: {container['args']}")
if flag(container["args"], "--kubelet-logs") != "/var/log":
    fail(f"default kubelet logs: {container['args']}")
if pod.get("hostPID") is not True:
    fail("hostPID is not on by default")

# The agent answers to its Service's names (DNS rebinding is refused otherwise), and to more
# where asked.
service = rendered({}, "Service")[0]["metadata"]["name"]
names = allowed(container["args"])
expected = [service, f"{service}.gpu-monitoring.svc", f"{service}.gpu-monitoring.svc.cluster.local"]
if names != expected:
    fail(f"the agent's allowed hosts {names}, not its Service's {expected}")
extra = allowed(daemonset({"allowedHosts": ["gpumem.example.org"]})["containers"][0]["args"])
if extra[-1] != "gpumem.example.org" or extra[:-1] != names:
    fail(f"allowedHosts not passed on: {extra}")
refused({"allowedHosts": ["evil.example/x"]}, "allowedHosts", "a host name with a slash")
pod = daemonset({"push": {"enabled": False, "hostPath": "/run/gpumem"},
                 "podResources": {"enabled": False, "hostPath": "/var/lib/kubelet/pod-resources"},
                 "kubeletLogs": {"enabled": False, "hostPath": "/var/log"},
                 "recordings": {"enabled": False, "volume": {"emptyDir": {}}, "maxBytesEach": 1024,
                                "maxBytes": 1024, "maxCount": 1, "maxMemoryBytes": 1048576}})
container = pod["containers"][0]
if "volumes" in pod or "volumeMounts" in container or "--recordings-dir" in container["args"]:
    fail(f"push, podResources, kubeletLogs and recordings off still mount: {pod.get('volumes')}")
for name in ["--push-socket", "--pod-resources-socket", "--kubelet-logs"]:
    if flag(container["args"], name) != "":
        fail(f"{name} is not turned off: {container['args']}")
print("host directories and sockets: as configured")

# Pushes from the pod network: off by default (the runtime's socket is root on the node: never
# mounted then); on, the runtime's directory read-only, the agent told its socket and the
# node's address, a pod reaching its own node's agent through the Service or a hostPort, and
# the webhook's jobs pointed at whichever it is.
if "internalTrafficPolicy" in rendered({}, "Service")[0]["spec"]:
    fail(f"the Service's traffic policy without pod-network pushes: {rendered({}, 'Service')[0]['spec']}")
default_agent = daemonset({})["containers"][0]
if flag(default_agent["args"], "--cri-socket") is not None or "hostPort" in default_agent["ports"][0] \
        or any(e["name"] == "GPUMEM_NODE_IP" for e in default_agent["env"]):
    fail(f"podNetwork off by default: {default_agent}")
pod_network = {"podNetwork": {"enabled": True, "criSocket": "/run/containerd/containerd.sock",
                              "expose": "service", "hostPort": 9417, "maxProcessesPerPod": 16},
               "webhook": {"enabled": True}}
check(pod_network, "pod-network pushes through the Service")
if rendered(pod_network, "Service")[0]["spec"].get("internalTrafficPolicy") != "Local":
    fail(f"the Service's traffic policy with pod-network pushes: {rendered(pod_network, 'Service')[0]['spec']}")
pod = daemonset(pod_network)
agent = pod["containers"][0]
cri = [v for v in pod["volumes"] if v["name"] == "cri"]
node_ip = [e for e in agent["env"] if e["name"] == "GPUMEM_NODE_IP"]
if cri != [{"name": "cri", "hostPath": {"path": "/run/containerd", "type": "Directory"}}] \
        or {"name": "cri", "mountPath": "/run/cri", "readOnly": True} not in agent["volumeMounts"] \
        or flag(agent["args"], "--cri-socket") != "/run/cri/containerd.sock" \
        or flag(agent["args"], "--node-ip") != "$(GPUMEM_NODE_IP)" \
        or flag(agent["args"], "--max-pod-processes") != "16" \
        or node_ip != [{"name": "GPUMEM_NODE_IP",
                        "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}] \
        or "hostPort" in agent["ports"][0]:
    fail(f"podNetwork through the Service: {pod['volumes']} {agent}")
hook_args = rendered(pod_network, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
if flag(hook_args, "--push-url") != "http://gpumem.gpu-monitoring.svc:9417/api/v1/push":
    fail(f"the webhook's push URL through the Service: {hook_args}")
pod = daemonset(ALL_ON)
agent = pod["containers"][0]
hook_args = rendered(ALL_ON, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
if agent["ports"][0].get("hostPort") != 19417 \
        or {"name": "cri", "hostPath": {"path": "/var/run/crio", "type": "Directory"}} not in pod["volumes"] \
        or flag(agent["args"], "--cri-socket") != "/run/cri/crio.sock" \
        or flag(hook_args, "--push-url") != "http://$(GPUMEM_NODE_IP):19417/api/v1/push":
    fail(f"podNetwork through a hostPort: {agent['ports']} {pod['volumes']} {hook_args}")
refused({"podNetwork": dict(pod_network["podNetwork"], expose="nodePort")}, "expose",
        "an unknown podNetwork.expose")
print("pod-network pushes: as configured")

# TLS and credentials: the agent reads its web configuration from the Secret named, the probes
# and the monitor speak HTTPS with the tlsConfig and basicAuth given, and with pod-network
# pushes the jobs push over plain HTTP on a port of their own, which the webhook points them
# at; the NetworkPolicy admits scrapes from the listed peers and pushes from any pod.
secured = {
    "webConfig": {"secretName": "gpumem-web", "tls": True, "clientCertificates": False, "pushPort": 9418},
    "podNetwork": dict(pod_network["podNetwork"]),
    "webhook": {"enabled": True},
    "networkPolicy": {"enabled": True, "scrapers": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
    "serviceMonitor": {"enabled": True,
                       "tlsConfig": {"ca": {"secret": {"name": "gpumem-web", "key": "ca.crt"}},
                                     "serverName": "gpumem.gpu-monitoring.svc"},
                       "basicAuth": {"username": {"name": "scrape-credentials", "key": "username"},
                                     "password": {"name": "scrape-credentials", "key": "password"}}},
}
kinds = check(secured, "TLS, credentials and a NetworkPolicy")
if "NetworkPolicy" not in kinds or rendered({}, "NetworkPolicy"):
    fail(f"the NetworkPolicy: rendered {kinds} (and by default: {len(rendered({}, 'NetworkPolicy'))})")
pod = daemonset(secured)
agent = pod["containers"][0]
ports = {p["name"]: p for p in agent["ports"]}
endpoint = rendered(secured, "ServiceMonitor")[0]["spec"]["endpoints"][0]
service_ports = {p["name"]: p["port"] for p in rendered(secured, "Service")[0]["spec"]["ports"]}
hook_args = rendered(secured, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
policy = rendered(secured, "NetworkPolicy")[0]["spec"]["ingress"]
if flag(agent["args"], "--web-config-file") != "/etc/gpumem/web/web.yml" \
        or flag(agent["args"], "--push-listen") != "0.0.0.0:9418" \
        or {"name": "web-config", "secret": {"secretName": "gpumem-web"}} not in pod["volumes"] \
        or {"name": "web-config", "mountPath": "/etc/gpumem/web", "readOnly": True} not in agent["volumeMounts"] \
        or agent["livenessProbe"]["httpGet"].get("scheme") != "HTTPS" \
        or agent["readinessProbe"]["httpGet"].get("scheme") != "HTTPS" \
        or ports["push"]["containerPort"] != 9418 or service_ports.get("push") != 9418:
    fail(f"the agent with TLS: {agent} {service_ports}")
if endpoint.get("scheme") != "https" or endpoint.get("tlsConfig") != secured["serviceMonitor"]["tlsConfig"] \
        or endpoint.get("basicAuth") != secured["serviceMonitor"]["basicAuth"]:
    fail(f"the ServiceMonitor with TLS: {endpoint}")
if flag(hook_args, "--push-url") != "http://gpumem.gpu-monitoring.svc:9418/api/v1/push":
    fail(f"the webhook's push URL with TLS: {hook_args}")
if policy != [{"ports": [{"port": "metrics", "protocol": "TCP"}], "from": secured["networkPolicy"]["scrapers"]},
              {"ports": [{"port": "push", "protocol": "TCP"}], "from": [{"namespaceSelector": {}}]}]:
    fail(f"the NetworkPolicy's rules: {policy}")
plain = daemonset({})["containers"][0]
if plain["livenessProbe"]["httpGet"].get("scheme") or flag(plain["args"], "--web-config-file"):
    fail(f"TLS or a web configuration by default: {plain}")
# Client certificates required: the kubelet has none, so the probes see the port answer.
certified = daemonset(dict(secured, webConfig=dict(secured["webConfig"], clientCertificates=True)))
probes = [certified["containers"][0][p] for p in ("livenessProbe", "readinessProbe")]
if any(p.get("tcpSocket") != {"port": "metrics"} or "httpGet" in p for p in probes):
    fail(f"probes with client certificates: {probes}")
# A bearer token from a Secret instead of a user: the endpoint's authorization, valid to the
# operator's schema; both at once refused (Prometheus sends one Authorization header).
token = {"type": "Bearer", "credentials": {"name": "scrape-credentials", "key": "token"}}
bearer = dict(secured, serviceMonitor=dict(
    {k: v for k, v in secured["serviceMonitor"].items() if k != "basicAuth"}, authorization=token))
check(bearer, "TLS and a bearer token")
endpoint = rendered(bearer, "ServiceMonitor")[0]["spec"]["endpoints"][0]
if endpoint.get("authorization") != token or "basicAuth" in endpoint:
    fail(f"the ServiceMonitor with a bearer token: {endpoint}")
refused(dict(secured, serviceMonitor=dict(secured["serviceMonitor"], authorization=token)),
        "not both", "basicAuth and authorization both")
refused(dict(secured, serviceMonitor={"enabled": False},
             podMonitor={"enabled": True, "basicAuth": secured["serviceMonitor"]["basicAuth"],
                         "authorization": token}),
        "not both", "basicAuth and authorization both on the PodMonitor")
refused({"webConfig": {"secretName": "", "tls": True, "clientCertificates": False, "pushPort": 9418}},
        "secretName", "TLS without a web configuration")
refused({"networkPolicy": {"enabled": True, "scrapers": []}}, "scrapers", "a NetworkPolicy admitting everyone")
refused(dict(secured, webConfig=dict(secured["webConfig"], pushPort=9417)), "pushPort equals service.port",
        "a push port on the scrape port")
refused({"webhook": {"enabled": True, "certificate": {"source": "certManager", "issuerRef": {"kind": "Issuer"}}}},
        "issuerRef", "an issuer without a name")
print("TLS, credentials and the NetworkPolicy: as configured")
# recordings.urlTemplate naming the archive: {namespace} and {pod} become the rank's labels.
ARCHIVE_LINK = "https://gpumem.example.com/recordings/archive/{namespace}/{pod}"
archive_linked = rendered({"prometheusRule": {"enabled": True},
                           "recordings": {"urlTemplate": ARCHIVE_LINK}}, "PrometheusRule")
archive_oom = next(r for g in archive_linked[0]["spec"]["groups"] for r in g["rules"]
                   if r.get("alert") == "GpumemOutOfMemory")
archive_unit = yaml.safe_load(yaml.safe_dump(unit))
archive_unit["tests"][0]["alert_rule_test"][0]["exp_alerts"][0]["exp_annotations"][
    "recording_url"] = "https://gpumem.example.com/recordings/archive/ml/train-1"
with tempfile.TemporaryDirectory() as work:
    (Path(work) / "rules.yml").write_text(yaml.safe_dump({"groups": archive_linked[0]["spec"]["groups"]}))
    (Path(work) / "test.yml").write_text(yaml.safe_dump(archive_unit))
    result = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=work,
                            capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"the archive's recording_url: promtool: {result.stdout}{result.stderr}")

# recordings.archive: the agent archives with workload identity (the ServiceAccount's
# annotation, no key in the pod) or a Secret's keys, its node's name from the downward API,
# and time to finish after SIGTERM; every object validated.
IRSA = {"recordings": {"archive": {"url": "s3://gpu-ooms/gpumem/{namespace}", "cluster": "prod-eu",
                                   "uploadGraceSeconds": 30, "secretName": "", "env": {}}},
        "serviceAccount": {"annotations": {
            "eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/gpumem-recordings"}}}
SECRET = {"recordings": {"archive": {"url": "s3://gpu-ooms/gpumem", "cluster": "lab",
                                     "uploadGraceSeconds": 20, "secretName": "gpumem-s3",
                                     "env": {"AWS_ENDPOINT_URL": "https://minio.example.com",
                                             "AWS_REGION": "eu-west-1"}}}}
AZURE = {"recordings": {"archive": {"url": "az://recordings/gpumem", "cluster": "aks-1",
                                    "uploadGraceSeconds": 20, "secretName": "",
                                    "env": {"AZURE_STORAGE_ACCOUNT_NAME": "gpuooms"}}},
         "podLabels": {"azure.workload.identity/use": "true"},
         "serviceAccount": {"annotations": {
             "azure.workload.identity/client-id": "00000000-0000-0000-0000-000000000000"}}}
for values, label in [(IRSA, "workload identity (EKS)"), (SECRET, "a Secret's keys"),
                      (AZURE, "workload identity (AKS)")]:
    check(values, f"recordings archived with {label}")
    pod = daemonset(values)
    agent = pod["containers"][0]
    archive = values["recordings"]["archive"]
    env = {e["name"]: e for e in agent.get("env", [])}
    wanted = {"--recordings-url": archive["url"], "--cluster": archive["cluster"],
              "--node-name": "$(GPUMEM_NODE_NAME)",
              "--recordings-upload-grace": str(archive["uploadGraceSeconds"])}
    if {k: flag(agent["args"], k) for k in wanted} != wanted \
            or env.get("GPUMEM_NODE_NAME", {}).get("valueFrom") \
            != {"fieldRef": {"fieldPath": "spec.nodeName"}} \
            or pod.get("terminationGracePeriodSeconds") != archive["uploadGraceSeconds"] + 15 \
            or any(env.get(k, {}).get("value") != v for k, v in archive["env"].items()):
        fail(f"archived with {label}: {agent['args']} {env} {pod.get('terminationGracePeriodSeconds')}")
    secret_refs = [s["secretRef"]["name"] for s in agent.get("envFrom", [])]
    if secret_refs != ([archive["secretName"]] if archive["secretName"] else []):
        fail(f"archived with {label}: envFrom {agent.get('envFrom')}")
    account = rendered(values, "ServiceAccount")[0]
    if account["metadata"].get("annotations") != values.get("serviceAccount", {}).get("annotations"):
        fail(f"archived with {label}: the ServiceAccount's annotations {account['metadata']}")
if "--recordings-url" in daemonset({})["containers"][0]["args"] \
        or "terminationGracePeriodSeconds" in daemonset({}):
    fail("archiving is on by default")
if "--recordings-url" in daemonset({"recordings": dict(IRSA["recordings"], enabled=False)})[
        "containers"][0]["args"]:
    fail("recordings off still archive")
for bad, what in [({"url": "http://bucket/x"}, "url"), ({"url": "s3://Bucket"}, "url"),
                  ({"url": "s3://bk/a/../x"}, "url"), ({"url": "s3://bk/./x"}, "url"), ({"cluster": "a/b"}, "cluster"),
                  ({"env": {"PATH": "/tmp"}}, "'PATH' does not match"), ({"uploadGraceSeconds": -1}, "uploadGraceSeconds")]:
    values = {"recordings": {"archive": dict(SECRET["recordings"]["archive"], **bad)}}
    refused(values, what, f"recordings.archive {bad}")
print("recordings.archive: workload identity or a Secret, the node's name, the grace; "
      "bad settings refused")
try:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema({"service": {"port": "not a port"}})
    fail("values.schema.json accepted a string port")
except Exception as error:  # the schema must refuse it
    print(f"schema refuses a bad value: {type(error).__name__}")
sys.exit(1 if failures else 0)
