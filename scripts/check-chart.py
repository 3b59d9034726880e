#!/usr/bin/env python3
"""Renders the Helm chart with the real Helm engine (helm-python-sdk) under the default
values and with every optional feature on, lints it, and validates every rendered object
offline: Kubernetes objects with kubernetes-validate --strict, prometheus-operator objects
against the JSON schemas in helm/schemas. Exits non-zero on any finding."""

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
    "prometheusRule": {"enabled": True, "additionalLabels": {"release": "kube-prometheus-stack"}},
    "dashboards": {"enabled": True, "namespace": "monitoring"},
}

failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL: {message}")


def check(values, label):
    with helm.Chart.load(str(CHART)) as chart:
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
default_pod = rendered({}, "DaemonSet")[0]["spec"]["template"]["spec"]
if default_pod.get("priorityClassName") != "system-node-critical":
    fail(f"default priority class: {default_pod.get('priorityClassName')}")
print("composition options: as configured")


def daemonset(values):
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="gpumem", namespace="gpu-monitoring")
    for template, text in manifests.items():
        if not template.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "DaemonSet":
                return doc["spec"]["template"]["spec"]
    fail("no DaemonSet rendered")
    return {}


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


# By default the agent shares the push socket's host directory with jobs, asks the kubelet,
# and sees host pids; each can be turned off, and then nothing of it is mounted.
pod = daemonset({})
container = pod["containers"][0]
mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
hosts = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", [])}
expected = {"push": "/run/gpumem", "pod-resources": "/var/lib/kubelet/pod-resources",
            "logs": "/var/log"}
if mounts != expected or hosts != expected:
    fail(f"default mounts {mounts}, host paths {hosts}")
if flag(container["args"], "--push-socket") != "/run/gpumem/push.sock":
    fail(f"default push socket: {container['args']}")
if flag(container["args"], "--pod-resources-socket") != "/var/lib/kubelet/pod-resources/kubelet.sock":
    fail(f"default kubelet socket: {container['args']}")
if flag(container["args"], "--kubelet-logs") != "/var/log":
    fail(f"default kubelet logs: {container['args']}")
if pod.get("hostPID") is not True:
    fail("hostPID is not on by default")
pod = daemonset({"push": {"enabled": False, "hostPath": "/run/gpumem"},
                 "podResources": {"enabled": False, "hostPath": "/var/lib/kubelet/pod-resources"},
                 "kubeletLogs": {"enabled": False, "hostPath": "/var/log"}})
container = pod["containers"][0]
if "volumes" in pod or "volumeMounts" in container:
    fail(f"push, podResources and kubeletLogs off still mount: {pod.get('volumes')}")
for name in ["--push-socket", "--pod-resources-socket", "--kubelet-logs"]:
    if flag(container["args"], name) != "":
        fail(f"{name} is not turned off: {container['args']}")
print("host directories and sockets: as configured")
try:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema({"service": {"port": "not a port"}})
    fail("values.schema.json accepted a string port")
except Exception as error:  # the schema must refuse it
    print(f"schema refuses a bad value: {type(error).__name__}")
sys.exit(1 if failures else 0)
