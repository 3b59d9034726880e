#!/usr/bin/env python3
"""Measures what one AdmissionReview costs `gpumem webhook`: for opted-in pods of 10, 100,
1 000, 3 000 and 10 000 small containers, and the most whose review fits in 1.5 MiB (etcd's
default request limit), a fresh webhook answers the review once; printed are the review's
size, the answer's time, the patch's operations (0: none; past about 3 100 such containers
the patched pod would pass 1.5 MiB, and the webhook admits it unchanged) and the process's
resident memory before and at its peak (VmHWM, read from /proc after the answer). Linux only;
the standard library and openssl. Runs any gpumem binary, so that releases compare.

  scripts/measure-webhook.py [GPUMEM_BINARY] [CONTAINERS...]   # default target/release/gpumem"""

import http.client
import json
import base64
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINARY = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target" / "release" / "gpumem"
COUNTS = [int(n) for n in sys.argv[2:]] or [10, 100, 1000, 3000, 10000, 0]
LARGEST = (3 << 19)  # 1.5 MiB: the largest review the webhook patches


def review(containers):
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "big", "namespace": "team-a",
                        "labels": {"gpumem.io/inject": "true"}},
           "spec": {"containers": [{"name": f"c{i}", "image": "i"} for i in range(containers)]}}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                   "resource": {"group": "", "version": "v1", "resource": "pods"},
                                   "namespace": "team-a", "operation": "CREATE",
                                   "userInfo": {"username": "alice"}, "object": pod}},
                      separators=(",", ":")).encode()


def largest_count():
    """The most containers whose review is at most LARGEST bytes (sizes grow with the count)."""
    low, high = 1, 1
    while len(review(high)) <= LARGEST:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(review(middle)) <= LARGEST else (low, middle)
    return low


def peak_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def measure(tmp, containers):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [str(BINARY), "webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert", f"{tmp}/tls.crt",
         "--tls-key", f"{tmp}/tls.key", "--image", "registry.example.com/gpumem:0.1.0",
         "--push-url", "http://gpumem.gpumem.svc:9417/api/v1/push"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    context = ssl.create_default_context(cafile=f"{tmp}/tls.crt")
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                c = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit("the webhook did not start")
                time.sleep(0.05)
        idle = peak_kib(process.pid)
        body = review(containers)
        c = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=3600)
        start = time.monotonic()
        c.request("POST", "/mutate", body, {"Content-Type": "application/json"})
        answer = c.getresponse()
        data = answer.read()
        seconds = time.monotonic() - start
        response = json.loads(data).get("response", {}) if answer.status == 200 else {}
        operations = len(json.loads(base64.b64decode(response["patch"]))) \
            if "patch" in response else 0
        return len(body), seconds, operations, idle, peak_kib(process.pid), answer.status
    finally:
        process.terminate()
        process.wait(10)


def main():
    with tempfile.TemporaryDirectory(prefix="gpumem-measure-") as tmp:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=m",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", f"{tmp}/tls.key",
                        "-out", f"{tmp}/tls.crt"], check=True, capture_output=True)
        print("| containers | review | time | operations | idle RSS | peak RSS |")
        print("|---:|---:|---:|---:|---:|---:|")
        for containers in COUNTS:
            containers = containers or largest_count()
            size, seconds, operations, idle, peak, status = measure(tmp, containers)
            note = "" if status == 200 else f" (HTTP {status})"
            print(f"| {containers} | {size / 1024:.1f} KiB | {seconds:.3f} s | {operations} | "
                  f"{idle / 1024:.1f} MiB | {peak / 1024:.1f} MiB{note} |", flush=True)


main()
