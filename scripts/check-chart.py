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
    "hostPID": True,
    "runtimeClassName": "nvidia",
    "priorityClassName": "system-node-critical",
    "imagePullSecrets": [{"name": "registry"}],
    "extraArgs": ["--interval", "10"],
    "podAnnotations": {"example.com/owner": "gpu-team"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "nvidia.com/gpu.product", "operator": "Exists"}]}]}}},
    "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "kube-prometheus-stack"}},
    "podMonitor": {"enabled": True, "additionalLabels": {"release": "kube-prometheus-stack"}},
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
for kind in ["ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"]:
    if kind not in everything:
        fail(f"every option on: no {kind}")


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
