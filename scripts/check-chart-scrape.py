#!/usr/bin/env python3
"""A real Prometheus scrapes a real agent over TLS with the chart's settings (issue 36).

Usage: check-chart-scrape.py GPUMEM_BINARY

The chart is rendered with the real Helm engine, with a web configuration Secret and a
ServiceMonitor whose tlsConfig and credentials come from Secrets: once with a bearer token
(`authorization`), once with a user and password (`basicAuth`). The agent runs as the rendered
DaemonSet runs it: its `--web-config-file` argument and the Secret's volume mount, the Secret's
keys as files in a directory standing for the mount. Each rendered endpoint becomes a scrape job
as prometheus-operator writes it (scheme; tls_config ca_file and server_name; authorization or
basic_auth from the Secrets' files), plus one job without credentials. Prometheus must report
the two jobs up and the third down with a 401, and the agent must refuse a request without
credentials. Loopback only; every wait bounded. Exits non-zero on any finding."""

import json
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "gpumem"
NAMESPACE = "gpu-monitoring"
WEB_SECRET = "gpumem-web"


def fail(message):
    print(f"check-chart-scrape: {message}", file=sys.stderr)
    sys.exit(1)


def render(values):
    """The chart's objects under `values` (checked against its schema), by kind."""
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name="gpumem", namespace=NAMESPACE)
    objects = {}
    for template, text in manifests.items():
        if template.endswith(".yaml"):
            for doc in yaml.safe_load_all(text):
                if doc:
                    objects.setdefault(doc["kind"], []).append(doc)
    return objects


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, seconds, probe):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.25)
    fail(f"{what}: not within {seconds} s")


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def certificates(dir):
    """A CA and a server certificate it signed for localhost and 127.0.0.1."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
            "-keyout", f"{dir}/ca.key", "-out", f"{dir}/ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
            "-keyout", f"{dir}/tls.key", "-out", f"{dir}/tls.csr")
    Path(f"{dir}/san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", f"{dir}/tls.csr", "-CA", f"{dir}/ca.crt", "-CAkey",
            f"{dir}/ca.key", "-CAcreateserial", "-days", "2", "-extfile", f"{dir}/san.ext",
            "-out", f"{dir}/tls.crt")


def main():
    if len(sys.argv) != 2:
        fail("usage: check-chart-scrape.py GPUMEM_BINARY")
    binary = Path(sys.argv[1]).resolve()
    work = Path(tempfile.mkdtemp(prefix="gpumem-chart-scrape-"))
    processes = []
    try:
        run(binary, work, processes)
    finally:
        for p in processes:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    print("check-chart-scrape: Prometheus scrapes the agent over TLS with the chart's settings "
          "(bearer token and basic authentication); without credentials it is refused")


def run(binary, work, processes):
    # The Secrets, one directory each, as their volumes would hold them.
    web = work / "secrets" / WEB_SECRET
    web.mkdir(parents=True)
    certificates(web)
    token = secrets.token_urlsafe(32)
    password = "correct horse battery staple"
    (web / "tokens").write_text(token + "\n")
    hash_line = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    (web / "web.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
        "basic_auth_users": {"prometheus": hash_line},
        "bearer_auth_tokens_file": "tokens",
    }))
    scrape_secret = work / "secrets" / "scrape-credentials"
    scrape_secret.mkdir()
    (scrape_secret / "token").write_text(token)
    (scrape_secret / "username").write_text("prometheus")
    (scrape_secret / "password").write_text(password)

    credentials = {
        "bearer": {"authorization": {"type": "Bearer",
                                     "credentials": {"name": "scrape-credentials", "key": "token"}}},
        "basic": {"basicAuth": {"username": {"name": "scrape-credentials", "key": "username"},
                                "password": {"name": "scrape-credentials", "key": "password"}}},
    }
    endpoints = {}
    daemonset = None
    for name, auth in credentials.items():
        objects = render({
            "webConfig": {"secretName": WEB_SECRET, "tls": True},
            "serviceMonitor": dict({"enabled": True,
                                    "tlsConfig": {"ca": {"secret": {"name": WEB_SECRET, "key": "ca.crt"}},
                                                  "serverName": "localhost"}}, **auth),
        })
        endpoints[name] = objects["ServiceMonitor"][0]["spec"]["endpoints"][0]
        daemonset = objects["DaemonSet"][0]
    pod = daemonset["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    args = agent["args"]
    config = args[args.index("--web-config-file") + 1]
    volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == WEB_SECRET)
    mount = next(m for m in agent["volumeMounts"] if m["name"] == volume["name"])
    if not config.startswith(mount["mountPath"] + "/"):
        fail(f"--web-config-file {config} is not in the Secret's mount {mount['mountPath']}")
    local_config = web / Path(config).relative_to(mount["mountPath"])

    port = free_port()
    log = open(work / "agent.log", "w")
    processes.append(subprocess.Popen(
        [str(binary), "serve", "--listen", f"127.0.0.1:{port}", "--web-config-file", str(local_config),
         "--push-socket", "", "--pod-resources-socket", "", "--kubelet-logs", ""],
        stderr=log, stdout=log))
    context = ssl.create_default_context(cafile=str(web / "ca.crt"))

    def get(headers):
        request = urllib.request.Request(f"https://localhost:{port}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=5) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.headers
        except OSError:
            return None

    wait_for("the agent answering over TLS", 20, lambda: get({}))
    status, headers = get({})
    challenges = headers.get_all("WWW-Authenticate") or []
    if status != 401 or not any(c.startswith("Bearer") for c in challenges):
        fail(f"without credentials: {status} {challenges}")
    if get({"Authorization": f"Bearer {token}"})[0] != 200 \
            or get({"Authorization": "Bearer " + "x" * 43})[0] != 401:
        fail("a bearer token is not told apart")

    # Each endpoint as prometheus-operator turns it into a scrape job.
    def secret_file(ref):
        return str(work / "secrets" / ref["name"] / ref["key"])

    jobs = []
    for name, endpoint in list(endpoints.items()) + [("none", dict(endpoints["bearer"], authorization=None))]:
        tls = endpoint["tlsConfig"]
        job = {
            "job_name": name,
            "scheme": endpoint.get("scheme", "http"),
            "metrics_path": endpoint["path"],
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "honor_labels": endpoint["honorLabels"],
            "tls_config": {"ca_file": secret_file(tls["ca"]["secret"]), "server_name": tls["serverName"]},
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
        }
        if endpoint.get("authorization"):
            auth = endpoint["authorization"]
            job["authorization"] = {"type": auth["type"], "credentials_file": secret_file(auth["credentials"])}
        if endpoint.get("basicAuth"):
            auth = endpoint["basicAuth"]
            job["basic_auth"] = {"username": Path(secret_file(auth["username"])).read_text(),
                                 "password_file": secret_file(auth["password"])}
        jobs.append(job)
    (work / "prometheus.yml").write_text(yaml.safe_dump({"scrape_configs": jobs}))
    promtool = subprocess.run(["promtool", "check", "config", str(work / "prometheus.yml")],
                              capture_output=True, text=True)
    if promtool.returncode != 0:
        fail(f"promtool check config: {promtool.stdout}{promtool.stderr}")
    web_port = free_port()
    plog = open(work / "prometheus.log", "w")
    processes.append(subprocess.Popen(
        ["prometheus", f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=plog, stderr=plog))

    def targets():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/api/v1/targets", timeout=5) as r:
                active = json.load(r)["data"]["activeTargets"]
        except OSError:
            return None
        health = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in active}
        settled = health.get("bearer", ("",))[0] == "up" and health.get("basic", ("",))[0] == "up" \
            and health.get("none", ("",))[0] == "down"
        return health if settled else None

    health = wait_for("Prometheus scraping the agent", 60, targets)
    if "401" not in health["none"][1]:
        fail(f"the scrape without credentials failed otherwise: {health['none']}")
    print(f"check-chart-scrape: targets {health}")


if __name__ == "__main__":
    main()
