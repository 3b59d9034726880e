#!/usr/bin/env python3
"""Checks `gpumem webhook` as the API server uses it: real AdmissionReview v1 requests over
HTTPS (a certificate made here with openssl), on loopback only. An opted-in pod's patch,
applied, must give a Pod that kubernetes-validate --strict accepts and that meets the Pod
Security "restricted" rules (written out below from their source); a pod without the label,
one already injected and any other object get no patch; a pod with a container named as the
init container would be gets one under another name; a Windows pod and one past etcd's 1.5 MiB
get none, with a warning; malformed and oversized reviews get an error answer and the webhook
goes on serving; the webhook's peak memory after reviews up to 3 MiB stays under the chart's
limit. Exits non-zero on any finding.

  scripts/check-webhook.py [GPUMEM_BINARY]      # default target/release/gpumem"""

import base64
import copy
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonpatch
import yaml

ROOT = Path(__file__).resolve().parent.parent
BINARY = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target" / "release" / "gpumem"
IMAGE = "registry.example.com/gpumem:0.1.0"
PUSH_URL = "http://gpumem.gpumem.svc:9417/api/v1/push"
findings = []


def check(condition, what):
    print(("ok   " if condition else "FAIL ") + what)
    if not condition:
        findings.append(what)


# --- Pod Security "restricted", as https://kubernetes.io/docs/concepts/security/pod-security-standards/
# states it (baseline's controls included), for the fields a pod spec can set.
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod, volume_types=RESTRICTED_VOLUMES):
    spec, out = pod["spec"], []
    psc = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key} is set")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= volume_types:
            out.append(f"volume {v['name']} is of type {sorted(kinds)}")
    containers = spec.get("containers", []) + spec.get("initContainers", []) + \
        spec.get("ephemeralContainers", [])
    for c in containers:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if set(caps.get("add", [])) - BASELINE_CAPS:
            out.append(f"{name}: adds capabilities beyond baseline")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runs as uid 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccomp profile {seccomp!r}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount {sc['procMount']}")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                out.append(f"{name}: hostPort {p['hostPort']}")
    return out


def tenant_pod(name, labels=None, annotations=None, env=None):
    """A pod that itself meets "restricted", as a tenant under it must write one."""
    container = {
        "name": "train", "image": "registry.example.com/team/train:1",
        "command": ["python", "train.py"],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    if env is not None:
        container["env"] = env
    meta = {"name": name, "namespace": "team-a"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container, dict(container, name="sidecar", env=[])]}}


def review(obj, uid, kind="Pod", resource="pods", operation="CREATE"):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": "", "version": "v1", "kind": kind},
        "resource": {"group": "", "version": "v1", "resource": resource},
        "requestKind": {"group": "", "version": "v1", "kind": kind},
        "requestResource": {"group": "", "version": "v1", "resource": resource},
        "namespace": "team-a", "operation": operation,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj, "oldObject": None, "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


class Webhook:
    def __init__(self, tmp, *extra):
        self.port = free_port()
        self.base = f"https://127.0.0.1:{self.port}"
        self.log = open(Path(tmp) / f"webhook-{self.port}.log", "w+")
        self.process = subprocess.Popen(
            [str(BINARY), "webhook", "--listen", f"127.0.0.1:{self.port}",
             "--tls-cert", str(Path(tmp) / "tls.crt"), "--tls-key", str(Path(tmp) / "tls.key"),
             "--image", IMAGE, "--push-url", PUSH_URL, *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.context = ssl.create_default_context(cafile=str(Path(tmp) / "both.crt"))
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.get("/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                sys.exit(f"the webhook did not start:\n{self.log.read()}")
            time.sleep(0.1)

    def get(self, path):
        with urllib.request.urlopen(self.base + path, context=self.context, timeout=5) as r:
            return r.status, r.read()

    def post(self, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.base + "/mutate", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def post_declaring(self, length):
        """POSTs headers declaring a body of `length` bytes and sends one: the answer's status.
        A refusal that comes before the body (Content-Length past the limit) is read without
        racing a client still sending the body into a closed connection."""
        connection = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context,
                                                 timeout=10)
        try:
            connection.putrequest("POST", "/mutate")
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(length))
            connection.endheaders(b"{")
            return connection.getresponse().status
        finally:
            connection.close()

    def close(self):
        self.process.terminate()
        self.process.wait(10)


def make_cert(directory, name, cn):
    """A self-signed certificate for loopback and the Service's name: name.crt, name.key."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", f"/CN={cn}",
                    "-addext", "subjectAltName=DNS:gpumem-webhook.gpumem.svc,IP:127.0.0.1",
                    "-keyout", f"{directory}/{name}.key", "-out", f"{directory}/{name}.crt"],
                   check=True, capture_output=True)


def served_cert(port, cafile):
    """The certificate the webhook presents now (DER)."""
    context = ssl.create_default_context(cafile=cafile)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patched(hook, pod, uid):
    status, answer = hook.post(review(pod, uid))
    check(status == 200, f"{uid}: answered 200 ({status})")
    response = answer["response"] if isinstance(answer, dict) else {}
    check(answer.get("apiVersion") == "admission.k8s.io/v1" and answer.get("kind") == "AdmissionReview",
          f"{uid}: the answer is an AdmissionReview v1")
    check(response.get("uid") == uid, f"{uid}: response.uid is the request's")
    check(response.get("allowed") is True, f"{uid}: allowed")
    if "patch" not in response:
        return None, response
    check(response.get("patchType") == "JSONPatch", f"{uid}: patchType JSONPatch")
    operations = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(copy.deepcopy(pod), operations), response


def validate(pod, tmp, name):
    path = Path(tmp) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(pod))
    result = subprocess.run(["kubernetes-validate", "--strict", "-k", "1.33.0", str(path)],
                            capture_output=True, text=True)
    check(result.returncode == 0, f"{name}: the patched pod validates against the Pod schema"
          + ("" if result.returncode == 0 else f"\n{result.stdout}{result.stderr}"))


def chart_memory_limit():
    """The webhook's memory limit in the chart's values (bytes)."""
    values = yaml.safe_load((ROOT / "helm" / "gpumem" / "values.yaml").read_text())
    limit = values["webhook"]["resources"]["limits"]["memory"]
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(limit[:-2]) * units[limit[-2:]] if limit[-2:] in units else int(limit)


def peak_memory(pid):
    """The process's peak resident memory so far (VmHWM, bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def all_names(pod):
    spec = pod["spec"]
    return [c["name"] for key in ("containers", "initContainers", "ephemeralContainers")
            for c in spec.get(key, [])]


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def main():
    with tempfile.TemporaryDirectory(prefix="gpumem-webhook-") as tmp:
        make_cert(tmp, "tls", "gpumem-webhook.gpumem.svc")
        make_cert(tmp, "renewed", "gpumem-webhook renewed")
        both = Path(tmp) / "both.crt"
        both.write_text((Path(tmp) / "tls.crt").read_text() + (Path(tmp) / "renewed.crt").read_text())
        # The init container's work: the hook's directory copied into the pod's volume.
        assembled, volume = Path(tmp) / "assembled", Path(tmp) / "volume"
        subprocess.run([str(ROOT / "scripts" / "python-inject"), str(assembled)], check=True)
        copied = subprocess.run([str(BINARY), "copy-hook", str(assembled), str(volume)],
                                capture_output=True, text=True)
        same = subprocess.run(["diff", "-r", str(assembled), str(volume)],
                              capture_output=True, text=True)
        check(copied.returncode == 0 and same.returncode == 0,
              f"copy-hook copies the hook file for file {copied.stderr}{same.stdout}")
        missing = subprocess.run([str(BINARY), "copy-hook", str(Path(tmp) / "nowhere"),
                                  str(Path(tmp) / "v2")], capture_output=True, text=True)
        check(missing.returncode != 0 and "nowhere" in missing.stderr,
              "copy-hook from a missing directory fails, naming it")
        hook = Webhook(tmp)
        try:
            opted = tenant_pod("opted", labels={"gpumem.io/inject": "true"},
                               annotations={"gpumem.io/pythonpath": "/app/lib"},
                               env=[{"name": "PYTHONPATH", "value": "/workspace"}])
            check(restricted_violations(opted) == [], "the tenant's own pod meets restricted")
            pod, response = patched(hook, opted, "uid-opted")
            check(pod is not None, "an opted-in pod gets a patch")
            if pod:
                validate(pod, tmp, "opted")
                check(restricted_violations(pod) == [],
                      f"the patched pod meets restricted: {restricted_violations(pod)}")
                init = pod["spec"].get("initContainers", [])
                check([c["name"] for c in init] == ["gpumem-inject"], "one init container")
                check(init and init[0]["image"] == IMAGE and init[0]["command"][:2] ==
                      ["/usr/bin/gpumem", "copy-hook"], "it copies the hook from the agent's image")
                check(init and all(k in init[0]["resources"].get(kind, {}) for kind in
                                   ("requests", "limits") for k in ("cpu", "memory")),
                      "it has cpu and memory requests and limits (ResourceQuota admits it)")
                train, sidecar = pod["spec"]["containers"]
                check(env_of(train)["PYTHONPATH"] == "/gpumem/python:/workspace",
                      "the container's own PYTHONPATH follows the hook")
                check(env_of(sidecar)["PYTHONPATH"] == "/gpumem/python:/app/lib",
                      "the annotation supplies the image's PYTHONPATH")
                for c in (train, sidecar):
                    e = env_of(c)
                    check(e.get("GPUMEM_PUSH") == "1" and e.get("GPUMEM_PUSH_URL") == PUSH_URL,
                          f"{c['name']}: GPUMEM_PUSH=1 and the agent's URL")
                    check({"name": "gpumem-python", "mountPath": "/gpumem/python",
                           "readOnly": True} in c["volumeMounts"],
                          f"{c['name']}: the hook mounted read-only")
                again, _ = patched(hook, pod, "uid-again")
                check(again is None, "an injected pod is not injected twice")
            empty = tenant_pod("empty", labels={"gpumem.io/inject": "true"},
                               env=[{"name": "PYTHONPATH"}])
            pod, _ = patched(hook, empty, "uid-empty")
            check(pod is not None and env_of(pod["spec"]["containers"][0])["PYTHONPATH"] ==
                  "/gpumem/python", "a PYTHONPATH without a value gets the hook's directory")
            referenced = tenant_pod("ref", labels={"gpumem.io/inject": "true"}, env=[
                {"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}])
            pod, response = patched(hook, referenced, "uid-ref")
            check(any("PYTHONPATH" in w for w in response.get("warnings", [])),
                  "a PYTHONPATH from a reference is left alone, with a warning")
            if pod:
                validate(pod, tmp, "referenced")
            for name, labels in (("plain", None), ("other-value", {"gpumem.io/inject": "false"})):
                pod, response = patched(hook, tenant_pod(name, labels=labels), f"uid-{name}")
                check(pod is None, f"a pod without the opt-in ({name}) gets no patch")
            service = {"apiVersion": "v1", "kind": "Service", "metadata": {
                "name": "s", "labels": {"gpumem.io/inject": "true"}}, "spec": {}}
            status, answer = hook.post(review(service, "uid-svc", "Service", "services"))
            check(status == 200 and "patch" not in answer.get("response", {}),
                  "any other object gets no patch")
            for what, body in (("not JSON", b"{not json"), ("not a review", {"kind": "Pod"}),
                               ("no request", {"apiVersion": "admission.k8s.io/v1",
                                               "kind": "AdmissionReview"})):
                status, answer = hook.post(body)
                check(status == 400 and isinstance(answer, str) and answer.strip(),
                      f"{what}: 400 with the reason ({status}: {str(answer)[:80]!r})")
            # Names are unique across containers, init and ephemeral containers: the init
            # container takes one none of them has.
            clash = tenant_pod("clash", labels={"gpumem.io/inject": "true"})
            clash["spec"]["containers"].append(dict(clash["spec"]["containers"][0],
                                                    name="gpumem-inject"))
            clash["spec"]["initContainers"] = [dict(clash["spec"]["containers"][0],
                                                    name="gpumem-inject-2")]
            pod, _ = patched(hook, clash, "uid-clash")
            check(pod is not None, "a pod with a container named gpumem-inject gets a patch")
            if pod:
                names = all_names(pod)
                check(len(names) == len(set(names)),
                      f"the patched pod's container names are unique: {names}")
                validate(pod, tmp, "clash")
            windows = tenant_pod("windows", labels={"gpumem.io/inject": "true"})
            windows["spec"]["os"] = {"name": "windows"}
            pod, response = patched(hook, windows, "uid-windows")
            check(pod is None and any("windows" in w for w in response.get("warnings", [])),
                  "a Windows pod gets no patch, with a warning")
            # Past etcd's default request limit (1.5 MiB) the API server could not store the
            # pod: admitted unchanged, with a warning.
            huge = tenant_pod("huge", labels={"gpumem.io/inject": "true"})
            huge["spec"]["containers"][0]["command"] = ["python", "x" * (2 << 20)]
            largest = len(json.dumps(review(huge, "uid-huge")))
            pod, response = patched(hook, huge, "uid-huge")
            check(pod is None and any("etcd" in w for w in response.get("warnings", [])),
                  "a 2 MiB pod is admitted unchanged, with a warning")
            # The cost: the largest reviews of many small containers and of fewer large
            # ones, patched or not, keep the webhook under the chart's memory limit.
            limit = chart_memory_limit()
            many = tenant_pod("many", labels={"gpumem.io/inject": "true"})
            many["spec"]["containers"] = [{"name": f"c{i}", "image": "i"} for i in range(43000)]
            size = len(json.dumps(review(many, "uid-many")))
            pod, response = patched(hook, many, "uid-many")
            check(size < 3 << 19 and pod is None and response.get("warnings"),
                  f"{size / (1 << 20):.2f} MiB of 43 000 containers: no patch (it could not be stored), a warning")
            fat = tenant_pod("fat", labels={"gpumem.io/inject": "true"})
            fat["spec"]["containers"] = [dict(fat["spec"]["containers"][0], name=f"c{i}",
                                              command=["python", "y" * 600]) for i in range(1000)]
            pod, _ = patched(hook, fat, "uid-fat")
            check(pod is not None and len(pod["spec"]["containers"][999]["env"]) == 3,
                  "a pod of 1 000 containers, 0.8 MiB, is patched")
            peak = peak_memory(hook.process.pid)
            check(0 < peak < limit, f"the webhook's peak memory ({peak >> 20} MiB) after reviews "
                  f"of up to {largest / (1 << 20):.1f} MiB stays under the chart's limit ({limit >> 20} MiB)")
            status = hook.post_declaring((4 << 20) + 2)
            check(status == 413, f"a review past 3 MiB gets 413 before its body is read ({status})")
            check(hook.get("/healthz")[0] == 200 and hook.process.poll() is None,
                  "the webhook still serves")
            # A renewal in place (as cert-manager's Secret volume does): the new pair serves;
            # then a key that does not load leaves the renewed pair serving.
            first = served_cert(hook.port, str(both))
            for suffix in ("crt", "key"):
                (Path(tmp) / f"tls.{suffix}").write_bytes((Path(tmp) / f"renewed.{suffix}").read_bytes())
            renewed = ssl.PEM_cert_to_DER_cert((Path(tmp) / "renewed.crt").read_text())
            deadline = time.monotonic() + 10
            while served_cert(hook.port, str(both)) != renewed and time.monotonic() < deadline:
                time.sleep(0.2)
            check(first != renewed and served_cert(hook.port, str(both)) == renewed,
                  "a certificate renewed in place is served within seconds")
            (Path(tmp) / "tls.key").write_text("not a key\n")
            time.sleep(1.5)
            check(served_cert(hook.port, str(both)) == renewed and hook.get("/healthz")[0] == 200,
                  "a key that does not load leaves the renewed pair serving")
        finally:
            hook.close()
        for suffix in ("crt", "key"):
            (Path(tmp) / f"tls.{suffix}").write_bytes((Path(tmp) / f"renewed.{suffix}").read_bytes())
        image_hook = Webhook(tmp, "--volume", "image")
        try:
            pod, _ = patched(image_hook, tenant_pod("img", labels={"gpumem.io/inject": "true"}),
                             "uid-img")
            check(pod is not None, "image volume: a patch")
            if pod:
                validate(pod, tmp, "image")
                volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "gpumem-python")
                check(volume.get("image", {}).get("reference") == IMAGE,
                      "the agent's image is the volume")
                check("initContainers" not in pod["spec"], "no init container")
                mounts = pod["spec"]["containers"][0]["volumeMounts"]
                check(mounts[-1].get("subPath") == "usr/share/gpumem/python",
                      "the hook's directory of the image is mounted")
                # Whether "restricted" admits the image volume type is the cluster's
                # pod-security-admission release's call; everything else must pass.
                check(restricted_violations(pod, RESTRICTED_VOLUMES | {"image"}) == [],
                      "image volume: restricted but for the volume type")
        finally:
            image_hook.close()
    if findings:
        print(f"\ncheck-webhook: {len(findings)} finding(s)", file=sys.stderr)
        sys.exit(1)
    print("\ncheck-webhook: every check passed")


main()
