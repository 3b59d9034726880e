#!/usr/bin/env python3
"""Writes what a gpumem binary answers on every recording of a folder, one file per answer,
so that two builds can be compared with `diff -r` (a refactoring must leave them
byte-identical; an intended change shows as the files it changes).

    scripts/golden-outputs.py BINARY OUT_DIR [TRACES_DIR]

Per recording (TRACES_DIR, by default ../shared/traces, its *.pickle): `replay --check`
(text and JSON), `replay --config expandable_segments:True --json`, and per device `explain`
(text, JSON and the HTML page, and without `--device`), `plan --json`; then `gpumem view` on loopback and
its API: the overview, each device's timeline (recorded and the what-if), segment maps at
the first, middle, last, OOM and peak events, and the explanations at the OOM and the peak.
Each file holds the exit status, stderr and stdout (or the HTTP status and body).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

WHAT_IF = "expandable_segments:True"


def run(binary, args, out):
    p = subprocess.run([binary, *args], capture_output=True, timeout=600)
    out.write_bytes(
        b"exit %d\n--- stderr\n" % p.returncode + p.stderr + b"--- stdout\n" + p.stdout
    )
    return p


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Host": f"127.0.0.1:{port}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def view(binary, trace, out):
    port = free_port()
    server = subprocess.Popen(
        [binary, "view", str(trace), "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)

        def save(name, path):
            status, body = get(port, path)
            (out / f"view-{name}").write_bytes(b"status %d\n" % status + body)
            return status, body

        status, body = save("overview.json", "/api/v1/recording")
        if status != 200:
            return
        for d in json.loads(body)["devices"]:
            dev = d["device"]
            save(f"d{dev}-timeline.svg", f"/api/v1/timeline.svg?device={dev}")
            q = urllib.parse.quote(WHAT_IF)
            save(f"d{dev}-timeline-whatif.svg", f"/api/v1/timeline.svg?device={dev}&config={q}")
            n = d["events"]
            moments = {"first": 0, "middle": n // 2, "last": max(n - 1, 0)}
            if d["ooms"]:
                moments["oom"] = d["ooms"][0]
            if d["peak"] is not None:
                moments["peak"] = d["peak"]
            for name, event in moments.items():
                save(f"d{dev}-segments-{name}.json", f"/api/v1/segments?device={dev}&event={event}")
            if "peak" in moments:
                save(
                    f"d{dev}-segments-peak-whatif.json",
                    f"/api/v1/segments?device={dev}&event={moments['peak']}&config={q}",
                )
            for name in ("oom", "peak"):
                if name in moments:
                    save(f"d{dev}-explain-{name}.json", f"/api/v1/explain?device={dev}&event={moments[name]}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def main():
    binary = os.path.abspath(sys.argv[1])
    out_root = pathlib.Path(sys.argv[2])
    traces = pathlib.Path(sys.argv[3] if len(sys.argv) > 3 else "../shared/traces")
    only = os.environ.get("GOLDEN_ONLY")
    for trace in sorted(traces.glob("*.pickle")):
        if only and only not in trace.name:
            continue
        out = out_root / trace.stem
        out.mkdir(parents=True, exist_ok=True)
        start = time.time()
        run(binary, ["replay", "--check", str(trace)], out / "replay-check.txt")
        p = run(binary, ["replay", "--check", "--json", str(trace)], out / "replay-check.json")
        run(binary, ["replay", "--config", WHAT_IF, "--json", str(trace)], out / "replay-whatif.json")
        run(binary, ["explain", str(trace)], out / "explain.txt")
        run(binary, ["explain", "--json", str(trace)], out / "explain.json")
        try:
            devices = [d["device"] for d in json.loads(p.stdout)]
        except ValueError:
            devices = []
        for dev in devices:
            run(binary, ["explain", "--device", str(dev), str(trace)], out / f"explain-d{dev}.txt")
            run(binary, ["explain", "--json", "--device", str(dev), str(trace)], out / f"explain-d{dev}.json")
            run(binary, ["plan", "--json", "--device", str(dev), str(trace)], out / f"plan-d{dev}.json")
            page = (out / f"explain-d{dev}.html").resolve()
            run(binary, ["explain", "--device", str(dev), "--html", str(page), str(trace)], out / f"explain-d{dev}.html.log")
        view(binary, trace, out)
        print(f"{trace.name}: {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
