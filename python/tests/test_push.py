"""gpumem_push as a job uses it: child Python processes with the stand-in torch push to a
recording stand-in for the agent, which applies the agent's rules to every payload."""

import json
import os
import socket
import textwrap
import time
import unittest

from support import Agent, Child, Recorder, check_oom, child_env, tempdir

MIB = 1 << 20
UUID0 = "GPU-6a1f0e2c-0000-4000-8000-000000000000"

# The end of most children: what the pusher says about itself, as JSON on the last line.
REPORT = """
import json as _json, sys as _sys
_gp = _sys.modules.get("gpumem_push")
_torch = _sys.modules.get("torch")
print(_json.dumps({
    "loaded": _gp is not None,
    "stats": _gp.stats() if _gp else None,
    "settings": _gp.settings() if _gp else None,
    "violations": _torch._fake.violations if _torch else None,
    "snapshot_calls": _torch._fake.snapshot_calls if _torch else None,
    "observers": len(_torch._C._oom_observers) if _torch else None,
    "initialized": _torch.cuda.is_initialized() if _torch else None,
}))
"""

# Waits (bounded) until the pusher has sent `n` pushes; no import of gpumem_push.
WAIT_SENT = """
import sys as _s, time as _t
def wait_sent(n, timeout=10):
    deadline = _t.monotonic() + timeout
    while _t.monotonic() < deadline:
        gp = _s.modules.get("gpumem_push")
        if gp is not None and gp.stats()["sent"] >= n:
            return True
        _t.sleep(0.02)
    return False
"""


class PushTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempdir(self)
        self.agent = Agent()
        self.addCleanup(self.agent.close)

    def env(self, **extra):
        base = {"GPUMEM_PUSH": "1", "GPUMEM_PUSH_URL": self.agent.url,
                "GPUMEM_PUSH_INTERVAL": "0.5"}
        base.update(extra)
        return child_env(self.tmp, **{k: v for k, v in base.items() if v is not None})

    def spawn(self, body, **env):
        """A child job running `body` between WAIT_SENT and REPORT."""
        return Child(WAIT_SENT + textwrap.dedent(body) + REPORT, self.env(**env), self.tmp)

    def run_child(self, body, timeout=20, **env):
        return self.spawn(body, **env).finish(timeout)

    def assertNoRefusals(self, recorder=None):
        refused = (recorder or self.agent.recorder).refused()
        self.assertEqual(refused, [], "the agent would have refused these pushes")

    def assertOrdered(self, payloads):
        seqs = [p["seq"] for p in payloads]
        self.assertEqual(seqs, sorted(set(seqs)), "sequence numbers must strictly increase")


class SettingsVariables(PushTest):
    def test_both_variables_are_sent_where_they_differ(self):
        # The agent decides which one the job's release reads (2.10+: the CUDA one first;
        # up to 2.9 the device allocator reads only the CUDA one).
        for env, want in [
            ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
              "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
             {"alloc_conf": "expandable_segments:True",
              "alloc_conf_generic": "max_split_size_mb:64"}),
            ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
             {"alloc_conf_generic": "max_split_size_mb:64"}),
            # Set but empty is set, and wins from 2.10.
            ({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
             {"alloc_conf": "", "alloc_conf_generic": "max_split_size_mb:64"}),
            ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64",
              "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
             {"alloc_conf": "max_split_size_mb:64"}),
        ]:
            self.agent.recorder.pushes.clear()
            child = self.run_child(
                """
                import torch
                torch._fake.allocate(0, 3 << 20)
                wait_sent(1)
                """,
                **env)
            self.assertEqual(child.rc, 0, child.stderr)
            pushes = self.agent.recorder.accepted()
            self.assertNoRefusals()
            self.assertTrue(pushes, env)
            for p in pushes:
                got = {k: p[k] for k in ("alloc_conf", "alloc_conf_generic") if k in p}
                self.assertEqual(got, want, env)


class PinnedHostMemory(PushTest):
    PIN = """
        import torch
        torch._fake.allocate(0, 3 << 20)
        torch._fake.pin(3 << 20)      # a 4 MiB block
        torch._fake.pin(1 << 20)      # a 1 MiB block
        torch._fake.unpin_all()
        torch._fake.pin(1 << 20)      # the cached 1 MiB block again
        wait_sent(1)
        """
    WANT = {"allocated_bytes.current": 5 * MIB, "active_bytes.current": MIB,
            "allocations.current": 2, "active_requests.current": 1, "num_host_alloc": 2,
            "num_host_free": 0, "host_alloc_time.total": 500}

    def host_of_last_push(self, **env):
        child = self.run_child(self.PIN, **env)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertEqual(child.result["violations"], [])
        self.assertNoRefusals()
        return [p.get("host") for p in self.agent.recorder.accepted()][-1]

    def test_host_memory_stats_are_pushed_under_their_2_10_names(self):
        self.assertEqual(self.host_of_last_push(), self.WANT)

    def test_older_key_names_are_renamed(self):
        # 2.7 to 2.9 called the pool's blocks segment/reserved_bytes and those in use
        # allocation/allocated_bytes: the same figures arrive under 2.10's names.
        self.assertEqual(self.host_of_last_push(FAKE_TORCH_HOST_KEYS="old"), self.WANT)

    def test_a_torn_read_leaves_out_the_figure_not_the_push(self):
        want = dict(self.WANT)
        del want["active_bytes.current"]
        self.assertEqual(self.host_of_last_push(FAKE_TORCH_HOST_TORN="1"), want)

    def test_no_host_object_without_host_memory_stats_or_pinned_memory(self):
        self.assertIsNone(self.host_of_last_push(FAKE_TORCH_HOST_KEYS="none"))
        self.agent.recorder.pushes.clear()
        child = self.run_child(
            """
            import torch
            torch._fake.allocate(0, 3 << 20)
            wait_sent(1)
            """)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertTrue(all("host" not in p for p in self.agent.recorder.accepted()))


class Activation(PushTest):
    def test_gpumem_push_1_pushes_a_job_that_never_imports_it(self):
        # torch takes a second to import, during which the hook's thread must not touch it.
        child = self.run_child(
            """
            import torch
            torch._fake.allocate(0, 3 << 20)
            wait_sent(3)
            """,
            FAKE_TORCH_IMPORT_DELAY="1.0",
            PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        self.assertEqual(child.rc, 0, child.stderr)
        r = child.result
        self.assertTrue(r["loaded"], "the .pth hook did not load gpumem_push")
        self.assertEqual(r["violations"], [], "torch was used while `import torch` ran")
        self.assertGreaterEqual(r["stats"]["sent"], 3)
        self.assertEqual(r["stats"]["errors"], 0, r["stats"])
        self.assertTrue(r["settings"]["oom_observer"])
        self.assertEqual(child.stderr, "")
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertOrdered(pushes)
        periodic = [p for p in pushes if "reason" not in p]
        self.assertGreaterEqual(len(periodic), 3)
        self.assertEqual(pushes[-1].get("reason"), "exit", "the last push is the exit push")
        for p in pushes:
            self.assertEqual(p["pid"], child.pid)
            self.assertEqual(p["torch_version"], "2.5.1+fake")
            self.assertEqual(p["alloc_conf"], "expandable_segments:True")
            self.assertEqual(p["labels"], {})
            self.assertEqual([d["index"] for d in p["devices"]], [0])
            device = p["devices"][0]
            self.assertEqual(device["uuid"], UUID0)
            self.assertEqual(device["stats"]["reserved_bytes.all.current"], 4 * MIB)
            self.assertEqual(device["stats"]["allocated_bytes.all.current"], 3 * MIB)
            self.assertEqual(device["stats"]["max_split_size"], -1)
            if "reason" in p:
                self.assertNotIn("largest_free_block", device, "only with a snapshot")
            elif "largest_free_block" in device:  # a periodic snapshot's: 4 MiB, 1 MiB free
                self.assertEqual(device["largest_free_block"], MIB)
                self.assertEqual(device["segments_by_size"],
                                 [{"size": 4 * MIB, "segments": 1, "free_bytes": MIB}])
        self.assertEqual(set(r["snapshot_calls"]), {False}, "never with the history")
        self.assertGreaterEqual(r["stats"]["snapshots"]["periodic"], 2)
        self.assertGreaterEqual(sum("largest_free_block" in p["devices"][0] for p in periodic),
                                len(periodic) - 1, "figures with the periodic pushes")
        times = [e["t"] for e in self.agent.recorder.pushes if "reason" not in e["payload"]]
        self.assertTrue(all(b - a >= 0.5 for a, b in zip(times, times[1:])), times)

    def test_the_hook_never_imports_torch_nor_initialises_cuda(self):
        child = self.run_child(
            """
            import sys, threading, time
            time.sleep(1.5)
            before = {"torch": "torch" in sys.modules,
                      "threads": [t.name for t in threading.enumerate()]}
            import torch
            time.sleep(1.5)  # torch imported, CUDA never initialised
            print(before)
            """)
        self.assertEqual(child.rc, 0, child.stderr)
        before = eval(child.stdout.splitlines()[0])
        self.assertFalse(before["torch"], "the pusher imported torch")
        self.assertIn("gpumem-push", before["threads"])
        r = child.result
        self.assertFalse(r["initialized"], "the pusher initialised CUDA")
        self.assertEqual(r["observers"], 0, "the observer was attached before CUDA started")
        self.assertEqual(r["violations"], [])
        self.assertEqual(self.agent.recorder.pushes, [], "nothing to push without CUDA")
        self.assertEqual(r["stats"], {
            "sent": 0, "dropped": 0, "errors": 0, "last_error": None, "observer_seconds": None,
            "snapshots": {"periodic": 0, "oom": 0, "seconds": 0.0, "last_seconds": None,
                          "off": None},
            "history": {"sent": 0, "saved": 0, "dropped": 0, "skipped": 0, "seconds": None,
                        "last_error": None, "state": None}})

    def test_without_gpumem_push_the_hook_loads_nothing(self):
        for value in (None, "0", ""):
            child = Child("import sys, threading; print([sys.modules.get('gpumem_push'), "
                          "[t.name for t in threading.enumerate()]])",
                          self.env(GPUMEM_PUSH=value), self.tmp).finish()
            self.assertEqual(child.rc, 0, child.stderr)
            self.assertEqual(child.stdout.strip(), "[None, ['MainThread']]", value)
            self.assertEqual(child.stderr, "")

    def test_start_twice_is_one_pusher_and_stop_ends_it(self):
        child = self.run_child(
            """
            import threading, time, torch, gpumem_push
            first = gpumem_push.start(labels={"job": "explicit", "team": "nlp"}, interval=0.6)
            second = gpumem_push.start()
            torch._fake.allocate(0, 1 << 20)
            wait_sent(2)
            gpumem_push.stop()
            sent = gpumem_push.stats()["sent"]
            time.sleep(1.0)
            print([first is second, first.name,
                   sum(t.name == "gpumem-push" for t in threading.enumerate()),
                   gpumem_push.stats()["sent"] - sent])
            """,
            GPUMEM_PUSH_LABELS="job=env,zone=a")
        self.assertEqual(child.rc, 0, child.stderr)
        same, name, threads, after_stop = eval(child.stdout.splitlines()[0])
        self.assertTrue(same, "a second start() must return the running thread")
        self.assertEqual((name, threads, after_stop), ("gpumem-push", 0, 0))
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertGreaterEqual(len(pushes), 2)
        self.assertOrdered(pushes)
        for p in pushes:
            self.assertEqual(p["labels"], {"job": "explicit", "zone": "a", "team": "nlp"})
            self.assertNotIn("reason", p, "no exit push after stop()")
        self.assertEqual(child.result["settings"]["interval"], 0.6)


class Labels(PushTest):
    def test_labels_from_the_environment_and_torchrun(self):
        child = self.run_child(
            "import torch; torch._fake.allocate(0, 1 << 20); wait_sent(1)",
            GPUMEM_PUSH_LABELS="job=llama, team=nlp,", RANK="3", LOCAL_RANK="1",
            WORLD_SIZE="8", TORCHELASTIC_RUN_ID="run-42")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertEqual(child.stderr, "")
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertTrue(pushes)
        want = {"job": "llama", "team": "nlp", "rank": "3", "local_rank": "1",
                "world_size": "8", "run_id": "run-42"}
        for p in pushes:
            self.assertEqual(p["labels"], want)

    def test_bad_labels_are_dropped_with_one_warning_each(self):
        long_name, long_value = "n" * 65, "v" * 129
        bad = ["9bad=x", "__meta=y", "noequals",
               "a-b=c", "ctl=a\x01b", f"{long_name}=v", f"long={long_value}", "é=e",
               # Not visible (issue 34, case 14), and a name given twice.
               "rlo=a\u202eb", "zw=a\u200bb", "nbsp=a\u00a0b", "tag=\U000e0041", "job=again"]
        # Names the agent sets itself are sent: it exports them as exported_<name>.
        good = ["job=ok", "instance=i", "namespace=ns", "gpu=1", "pod_uid=z", "_x=1"]
        child = self.run_child(
            """
            import torch, gpumem_push
            gpumem_push.start()  # the same labels again: no second warning
            torch._fake.allocate(0, 1 << 20)
            wait_sent(2)
            """,
            GPUMEM_PUSH_LABELS=",".join(good[:3] + bad + good[3:]))
        self.assertEqual(child.rc, 0, child.stderr)
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertGreaterEqual(len(pushes), 2, "a bad label must not cost the pushes")
        for p in pushes:
            self.assertEqual(p["labels"], dict(g.split("=") for g in good))
        warnings = child.stderr.splitlines()
        self.assertEqual(len(warnings), len(bad), child.stderr)
        for item in bad:
            name = item.split("=")[0]
            shown = repr(name)
            self.assertEqual(sum(shown in w for w in warnings), 1, f"{name}: {child.stderr}")
        self.assertTrue(all(w.startswith("gpumem_push: ") for w in warnings))

    def test_at_most_eight_labels_plus_the_rank_labels(self):
        labels = [f"l{i}={i}" for i in range(10)]
        child = self.run_child(
            "import torch; torch._fake.allocate(0, 1 << 20); wait_sent(1)",
            GPUMEM_PUSH_LABELS=",".join(labels), RANK="0", WORLD_SIZE="2")
        self.assertEqual(child.rc, 0, child.stderr)
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertTrue(pushes)
        want = {f"l{i}": str(i) for i in range(8)}
        want.update(rank="0", world_size="2")
        self.assertEqual(pushes[0]["labels"], want)
        warnings = child.stderr.splitlines()
        self.assertEqual(len(warnings), 2, child.stderr)
        self.assertIn("'l8'", warnings[0])
        self.assertIn("'l9'", warnings[1])

    def test_labels_past_512_bytes_and_clashing_exports_are_dropped(self):
        # Eight labels of 64 bytes with the rank labels on top: the last ones do not fit.
        labels = [f"l{i}={'v' * 62}" for i in range(8)] + ["job=a", "exported_job=b",
                                                          "exported_team=c"]
        child = self.run_child(
            "import torch; torch._fake.allocate(0, 1 << 20); wait_sent(1)",
            GPUMEM_PUSH_LABELS=",".join(labels), RANK="3")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        pushes = self.agent.recorder.accepted()
        self.assertTrue(pushes)
        sent = pushes[0]["labels"]
        self.assertEqual(sent.get("rank"), "3", "the rank labels come first")
        self.assertLessEqual(sum(len(n) + len(v) for n, v in sent.items()), 512)
        self.assertNotIn("exported_job", sent, "it would clash with job")
        self.assertIn("past the 512 bytes", child.stderr)
        self.assertIn("clashes with 'job'", child.stderr)


class Delivery(PushTest):
    def test_an_agent_started_after_the_job_and_restarted_is_reached(self):
        # Until the socket exists, pushes go to the loopback default, held here so that no
        # agent on this machine answers (bound, not listening: connections are refused).
        default = socket.socket()
        try:
            default.bind(("127.0.0.1", 9417))
        except OSError:
            default.close()
            self.skipTest("127.0.0.1:9417 is in use (an agent on this machine?)")
        self.addCleanup(default.close)
        path = os.path.join(self.tmp, "agent", "push.sock")
        child = self.spawn(
            """
            import time, torch
            torch._fake.allocate(0, 1 << 20)
            time.sleep(5.5)
            """,
            GPUMEM_PUSH_URL=None, GPUMEM_PUSH_SOCKET=path)
        time.sleep(1.5)
        first = Agent(path=path)
        started = time.monotonic()
        reached = first.recorder.wait_for(lambda p: len(p) >= 2, 3)
        first_at = first.recorder.pushes[0]["t"] if first.recorder.pushes else None
        first.close()  # the agent restarts: its socket goes away, then comes back
        time.sleep(1.0)
        second = Agent(path=path)
        self.addCleanup(second.close)
        restarted = time.monotonic()
        reached_again = second.recorder.wait_for(lambda p: len(p) >= 1, 3)
        second_at = second.recorder.pushes[0]["t"] if second.recorder.pushes else None
        child.finish(20)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertTrue(reached, "the agent started after the job got no pushes")
        self.assertLess(first_at - started, 1.2, "reached within one interval")
        self.assertTrue(reached_again, "the restarted agent got no pushes")
        self.assertLess(second_at - restarted, 1.2)
        for recorder in (first.recorder, second.recorder):
            self.assertNoRefusals(recorder)
            for e in recorder.pushes:
                self.assertEqual(e["transport"], "unix")
                self.assertEqual(e["peer_pid"], child.pid)
        stats = child.result["stats"]
        self.assertGreaterEqual(stats["dropped"], 2, "pushes before the agent are dropped")
        self.assertGreaterEqual(stats["sent"], 3)
        self.assertEqual(stats["errors"], 0)

    def test_only_devices_the_job_used_are_pushed_and_they_stay(self):
        child = self.run_child(
            """
            import torch
            torch._fake.allocate(2, 5 << 20)
            wait_sent(2)
            torch._fake.free_all(2)
            torch._fake.reset_peak(2)
            wait_sent(4)
            """,
            FAKE_TORCH_DEVICES="4")
        self.assertEqual(child.rc, 0, child.stderr)
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertGreaterEqual(len(pushes), 4)
        for p in pushes:
            self.assertEqual([d["index"] for d in p["devices"]], [2], p["devices"])
            self.assertTrue(p["devices"][0]["uuid"].endswith("000000000002"))
        stats = [p["devices"][0]["stats"] for p in pushes]
        self.assertEqual(stats[0]["reserved_bytes.all.current"], 6 * MIB)
        released = [s for s in stats if s["reserved_bytes.all.current"] == 0
                    and s["reserved_bytes.all.peak"] == 0]
        self.assertTrue(released, "a device once pushed is pushed after it is released")
        self.assertEqual(child.result["settings"]["devices"], [2])

    def test_an_agent_that_is_down_or_refuses_costs_the_job_nothing(self):
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        self.addCleanup(closed.close)
        refusing = Agent(Recorder(status=503))
        self.addCleanup(refusing.close)
        code = """
            import time, torch
            torch._fake.allocate(0, 1 << 20)
            time.sleep(1.6)
            """
        down = self.spawn(code, GPUMEM_PUSH_URL=f"http://127.0.0.1:{closed.getsockname()[1]}")
        refused = self.spawn(code, GPUMEM_PUSH_URL=refusing.url)
        stale = self.spawn(code, GPUMEM_PUSH_URL="unix:" + os.path.join(self.tmp, "x.sock"))
        for child in (down, refused, stale):
            child.finish(20)
            self.assertEqual(child.rc, 0, child.stderr)
            self.assertLess(child.elapsed, 6, "exit must not wait on an absent agent")
            stats = child.result["stats"]
            self.assertEqual((stats["sent"], stats["errors"]), (0, 0), stats)
            self.assertGreaterEqual(stats["dropped"], 2, stats)
        self.assertIn("Connection refused", down.result["stats"]["last_error"])
        self.assertIn("HTTP 503", refused.result["stats"]["last_error"])
        self.assertIn("x.sock", stale.result["stats"]["last_error"])
        self.assertGreaterEqual(len(refusing.recorder.pushes), 3, "periodic and exit pushes")

    def test_failures_reading_pytorch_never_reach_training(self):
        child = self.run_child(
            """
            import time, torch
            torch._fake.allocate(0, 1 << 20)
            time.sleep(1.2)
            try:
                torch._fake.oom(0, 1 << 40)
            except torch.cuda.OutOfMemoryError:
                pass
            time.sleep(0.3)
            """,
            FAKE_TORCH_BROKEN="memory_stats,memory_snapshot")
        self.assertEqual(child.rc, 0, child.stderr)
        stats = child.result["stats"]
        self.assertGreaterEqual(stats["errors"], 2, stats)
        self.assertIn("broken on purpose", stats["last_error"])
        self.assertEqual(self.agent.recorder.pushes, [])


class OutOfMemory(PushTest):
    OOM = textwrap.dedent("""
        import sys, time, torch
        torch._fake.allocate(0, 3 << 20)   # a 4 MiB segment, 1 MiB of it free
        torch._fake.allocate(0, 5 << 20)   # a 6 MiB segment, 1 MiB of it free
        deadline = time.monotonic() + 10
        while not torch._C._oom_observers and time.monotonic() < deadline:
            time.sleep(0.02)
        print("attached", len(torch._C._oom_observers))
        """)

    def assertSnapshot(self, device):
        self.assertEqual(device["largest_free_block"], MIB)
        self.assertEqual(device["segments_by_size"], [
            {"size": 4 * MIB, "segments": 1, "free_bytes": MIB},
            {"size": 8 * MIB, "segments": 1, "free_bytes": MIB}])

    def test_an_oom_that_kills_the_job_is_pushed_then_its_exit(self):
        # The default interval (5 s): the out-of-memory push does not wait for it.
        child = self.run_child(self.OOM + "torch._fake.oom(0, 1 << 40)\n",
                               GPUMEM_PUSH_INTERVAL=None)
        self.assertEqual(child.rc, 1, child.stderr)
        self.assertIn("attached 1", child.stdout)
        self.assertIn("OutOfMemoryError", child.stderr)
        pushes = self.agent.recorder.accepted()
        self.assertNoRefusals()
        self.assertOrdered(pushes)
        reasons = [p.get("reason") for p in pushes if "reason" in p]
        self.assertEqual(reasons, ["oom", "exit"])
        oom = next(p for p in pushes if p.get("reason") == "oom")
        self.assertEqual(oom["pid"], child.pid)
        self.assertEqual([d["index"] for d in oom["devices"]], [0])
        self.assertEqual(oom["devices"][0]["stats"]["num_ooms"], 1)
        self.assertSnapshot(oom["devices"][0])
        # What the agent explains the error with: the observer's figures and the pools'.
        total = 80 << 30
        self.assertEqual(oom["devices"][0]["oom"], {
            "size": 1 << 40, "stream": 0, "device_total": total,
            "device_free": total - 10 * MIB,
            "pools": [{"pool": "large", "stream": 0, "allocated": 8 * MIB,
                       "requested": 8 * MIB, "pending_free": 0, "free": 2 * MIB,
                       "largest_free": MIB, "segments_with_free": 2}]})
        exit_push = pushes[-1]
        self.assertEqual(exit_push["reason"], "exit")
        self.assertNotIn("largest_free_block", exit_push["devices"][0])
        self.assertNotIn("oom", exit_push["devices"][0])
        self.assertEqual(exit_push["devices"][0]["stats"]["num_ooms"], 1)

    def test_the_oom_snapshot_leaves_the_history_out(self):
        # With the history recorded, a snapshot with it would copy every entry: the summary
        # asks for none (PyTorch 2.11+'s include_traces=False).
        child = self.run_child(self.OOM + textwrap.dedent("""
            torch.cuda.memory._record_memory_history(max_entries=1000)
            try:
                torch._fake.oom(0, 1 << 40)
            except torch.cuda.OutOfMemoryError:
                pass
            wait_sent(1)
            """), GPUMEM_PUSH_INTERVAL=None)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertSnapshot(next(p for p in self.agent.recorder.accepted()
                                 if p.get("reason") == "oom")["devices"][0])
        calls = child.result["snapshot_calls"]
        self.assertTrue(calls, "the OOM push took a snapshot")
        self.assertEqual(set(calls), {False}, calls)

    def test_ooms_in_a_row_are_pushed_at_most_once_a_second(self):
        child = self.run_child(self.OOM + textwrap.dedent("""
            for _ in range(3):
                try:
                    torch._fake.oom(0, 1 << 40)
                except torch.cuda.OutOfMemoryError:
                    pass
            time.sleep(1.6)
            """))
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        entries = [e for e in self.agent.recorder.pushes if "reason" in e["payload"]]
        reasons = [e["payload"]["reason"] for e in entries]
        self.assertEqual(reasons, ["oom", "oom", "exit"])
        first, second = entries[0], entries[1]
        self.assertGreaterEqual(second["t"] - first["t"], 0.95)
        self.assertEqual(second["payload"]["devices"][0]["stats"]["num_ooms"], 3)
        self.assertSnapshot(first["payload"]["devices"][0])
        self.assertSnapshot(second["payload"]["devices"][0])
        self.assertOrdered(self.agent.recorder.accepted())
        self.assertEqual(child.result["stats"]["errors"], 0)

    def test_a_pytorch_without_the_observer_still_pushes(self):
        child = self.run_child(
            """
            import torch
            torch._fake.allocate(0, 1 << 20)
            wait_sent(1)
            try:
                torch._fake.oom(0, 1 << 40)
            except torch.cuda.OutOfMemoryError:
                pass
            """,
            FAKE_TORCH_NO_OBSERVER="1")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertFalse(child.result["settings"]["oom_observer"])
        self.assertEqual(child.result["stats"]["errors"], 0)
        self.assertNoRefusals()
        reasons = [p.get("reason") for p in self.agent.recorder.accepted()]
        self.assertEqual(reasons[0], None)
        self.assertEqual(reasons[-1], "exit")
        self.assertNotIn("oom", reasons)


class LiveSnapshots(PushTest):
    """Periodic snapshots without the history: figures before any OOM, at a bounded cost."""

    # A 4 MiB segment with 1 MiB free, then pushes; the child reports the fake's snapshot
    # spans too.
    JOB = textwrap.dedent("""
        import json, time, torch
        torch._fake.allocate(0, 3 << 20)
        """)
    SPANS = "print(json.dumps(torch._fake.snapshot_spans))\n"

    def periodic(self):
        return [p for p in self.agent.recorder.accepted() if "reason" not in p]

    def assertLive(self, device):
        self.assertEqual(device["largest_free_block"], MIB)
        self.assertEqual(device["segments_by_size"],
                         [{"size": 4 * MIB, "segments": 1, "free_bytes": MIB}])

    def test_every_periodic_push_has_figures_and_no_snapshot_copies_the_history(self):
        child = self.run_child(self.JOB + textwrap.dedent("""
            torch.cuda.memory._record_memory_history(max_entries=1000)
            wait_sent(3)
            """))
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        periodic = self.periodic()
        self.assertGreaterEqual(len(periodic), 3)
        live = [p for p in periodic if "largest_free_block" in p["devices"][0]]
        # Each push can carry one (a snapshot takes microseconds here); a preempted one may
        # space the next.
        self.assertGreaterEqual(len(live), len(periodic) - 1)
        for p in live:
            self.assertLive(p["devices"][0])
        calls = child.result["snapshot_calls"]
        self.assertGreaterEqual(len(calls), 3)
        self.assertEqual(set(calls), {False}, calls)
        snapshots = child.result["stats"]["snapshots"]
        self.assertIsNone(snapshots["off"], snapshots)
        self.assertEqual(snapshots["periodic"], len(calls))

    def test_an_older_pytorch_without_history_gets_figures_too(self):
        child = self.run_child(self.JOB + "wait_sent(3)\n", FAKE_TORCH_SNAPSHOT="old")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        live = [p for p in self.periodic() if "largest_free_block" in p["devices"][0]]
        self.assertGreaterEqual(len(live), 2)
        for p in live:
            self.assertLive(p["devices"][0])
        self.assertIsNone(child.result["stats"]["snapshots"]["off"])
        self.assertGreaterEqual(child.result["stats"]["snapshots"]["periodic"], 3)

    def test_an_older_pytorch_recording_history_takes_no_periodic_snapshot(self):
        # The job records its own history: the first snapshot that shows it is the last.
        child = self.run_child(self.JOB + textwrap.dedent("""
            torch.cuda.memory._record_memory_history(max_entries=1000)
            torch._fake.allocate(0, 1 << 20)  # one entry at least
            import gpumem_push
            wait_sent(2)
            before = gpumem_push.stats()["snapshots"]["periodic"]
            wait_sent(5)
            print("periodic", before, gpumem_push.stats()["snapshots"]["periodic"])
            """), FAKE_TORCH_SNAPSHOT="old")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        _, before, after = next(line for line in child.stdout.splitlines()
                                if line.startswith("periodic")).split()
        self.assertEqual(before, after, "no periodic snapshot once the history shows")
        self.assertLessEqual(int(after), 2)
        self.assertIn("the job records", child.result["stats"]["snapshots"]["off"])
        self.assertNotIn("largest_free_block", self.periodic()[-1]["devices"][0])
        # GPUMEM_PUSH_HISTORY records it: none at all.
        self.agent.recorder.pushes.clear()
        child = self.run_child(self.JOB + "wait_sent(3)\n", FAKE_TORCH_SNAPSHOT="old",
                               GPUMEM_PUSH_HISTORY="500")
        self.assertEqual(child.rc, 0, child.stderr)
        snapshots = child.result["stats"]["snapshots"]
        self.assertEqual(snapshots["periodic"], 0, snapshots)
        self.assertIn("GPUMEM_PUSH_HISTORY", snapshots["off"])
        for p in self.periodic():
            self.assertNotIn("largest_free_block", p["devices"][0])

    def test_a_slow_snapshot_is_taken_less_often(self):
        # Each snapshot takes 10 ms: at most 0.5 % of the time means one per 2 s or less,
        # while the pushes go on every 0.5 s.
        child = self.run_child(self.JOB + "wait_sent(9, 15)\n" + self.SPANS,
                               FAKE_TORCH_SNAPSHOT_SECONDS="0.01")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        spans = json.loads(child.stdout.splitlines()[-2])
        self.assertGreaterEqual(len(spans), 2, spans)
        for (start, end), (following, _) in zip(spans, spans[1:]):
            self.assertGreaterEqual(following - start, (end - start) / 0.005,
                                    f"a snapshot of {end - start:.4f} s, the next after "
                                    f"{following - start:.3f} s")
        periodic = self.periodic()
        with_figures = [p for p in periodic if "largest_free_block" in p["devices"][0]]
        self.assertEqual(len(with_figures), len(spans))
        self.assertGreater(len(periodic), 2 * len(with_figures), "the pushes did not wait")
        self.assertEqual(child.result["stats"]["snapshots"]["periodic"], len(spans))


class SharedGpuLimits(PushTest):
    """HAMi's limit variables, read from the job's own environment and pushed per device."""

    def test_the_devices_own_limit_wins_and_values_parse_as_hami_writes_them(self):
        from gpumem_push import sharing
        env = {"CUDA_DEVICE_MEMORY_LIMIT": "8g", "CUDA_DEVICE_MEMORY_LIMIT_1": "3000m"}
        self.assertEqual(sharing.memory_limit(env, 0),
                         {"bytes": 8 << 30, "variable": "CUDA_DEVICE_MEMORY_LIMIT"})
        self.assertEqual(sharing.memory_limit(env, 1),
                         {"bytes": 3000 << 20, "variable": "CUDA_DEVICE_MEMORY_LIMIT_1"})
        self.assertIsNone(sharing.memory_limit({}, 0))
        for value, expected in [("1073741824", 1 << 30), ("512K", 512 << 10), (" 2G ", 2 << 30),
                                ("", None), ("0", None), ("-1g", None), ("1.5g", None),
                                ("1t", None), ("9" * 19 + "g", None)]:
            self.assertEqual(sharing.parse(value), expected, value)
        # A device's own variable that does not parse is not replaced by the other one.
        self.assertIsNone(sharing.memory_limit({"CUDA_DEVICE_MEMORY_LIMIT_0": "lots",
                                                "CUDA_DEVICE_MEMORY_LIMIT": "1g"}, 0))

    def test_a_job_under_hami_pushes_its_limit(self):
        child = self.run_child(textwrap.dedent("""
            import torch
            torch._fake.allocate(0, 1 << 30)
            wait_sent(2)
            """), CUDA_DEVICE_MEMORY_LIMIT_0="40960m")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        pushed = [p["devices"][0].get("memory_limit") for p in self.agent.recorder.accepted()]
        self.assertTrue(pushed)
        self.assertEqual(set(map(json.dumps, pushed)), {json.dumps(
            {"bytes": 40960 << 20, "variable": "CUDA_DEVICE_MEMORY_LIMIT_0"})})


class SleepingPools(PushTest):
    """A vLLM-style pool asleep: its unmapped bytes go with the pushes, within the reserved,
    until it wakes; what a job reports itself goes too."""

    # A stand-in for vLLM's CuMemAllocator (only what the hook reads and wraps): 20 GiB of
    # weights and 10 GiB of KV cache on device 0, in 40 GiB reserved.
    JOB = textwrap.dedent("""
        import json, sys, types, torch
        torch._fake.allocate(0, 40 << 30)
        for name in ("vllm", "vllm.device_allocator"):
            sys.modules[name] = types.ModuleType(name)
        cumem = types.ModuleType("vllm.device_allocator.cumem")
        class Data:
            def __init__(self, size, tag):
                self.handle, self.tag = (0, size, 0, 0), tag
        class CuMemAllocator:
            def __init__(self):
                self.pointer_to_data = {1: Data(20 << 30, "weights"), 2: Data(10 << 30, "kv_cache")}
                self.calls = []
            def sleep(self, offload_tags=None):
                self.calls.append(("sleep", offload_tags))
            def wake_up(self, tags=None):
                self.calls.append(("wake_up", tags))
        cumem.CuMemAllocator = CuMemAllocator
        sys.modules["vllm.device_allocator.cumem"] = cumem
        allocator = CuMemAllocator()
        """)

    def unmapped(self):
        """Each accepted push's device 0 unmapped bytes (None where absent), in order."""
        return [p["devices"][0].get("unmapped_bytes") for p in self.agent.recorder.accepted()]

    def test_a_sleeping_vllm_pool_is_pushed_unmapped_until_it_wakes(self):
        child = self.run_child(self.JOB + textwrap.dedent("""
            wait_sent(2)  # the hook has seen vLLM's module and wrapped it
            allocator.sleep(offload_tags=("weights",))
            sent = __import__("gpumem_push").stats()["sent"]
            wait_sent(sent + 2)
            allocator.wake_up(tags=["weights"])
            sent = __import__("gpumem_push").stats()["sent"]
            wait_sent(sent + 2)
            allocator.wake_up()
            sent = __import__("gpumem_push").stats()["sent"]
            wait_sent(sent + 2)
            print(json.dumps(allocator.calls))
            """))
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        # vLLM's own calls went through, as made.
        self.assertIn('[["sleep", ["weights"]], ["wake_up", ["weights"]], ["wake_up", null]]',
                      child.stdout)
        seen = self.unmapped()
        gib = 1 << 30
        # Awake, asleep (both allocations), the weights mapped again (the KV cache still
        # unmapped), awake: in that order, each at least once.
        order = [v for i, v in enumerate(seen) if i == 0 or seen[i - 1] != v]
        self.assertEqual(order, [None, 30 * gib, 10 * gib, None], seen)

    def test_a_job_reports_its_own_unmapped_memory_within_the_reserved(self):
        child = self.run_child(self.JOB + textwrap.dedent("""
            import gpumem_push
            gpumem_push.report_unmapped(0, 50 << 30)  # more than reserved: pushed as all of it
            sent = gpumem_push.stats()["sent"]
            wait_sent(sent + 2)
            gpumem_push.report_unmapped(0, 0)
            sent = gpumem_push.stats()["sent"]
            wait_sent(sent + 2)
            """))
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        seen = self.unmapped()
        order = [v for i, v in enumerate(seen) if i == 0 or seen[i - 1] != v]
        self.assertEqual(order[-2:], [40 << 30, None], seen)


class Interval(PushTest):
    def test_bad_intervals_warn_once_and_push_every_5_s(self):
        code = "import gpumem_push; gpumem_push.start(); print(gpumem_push.settings()['interval'])"
        cases = {"0.1": 5.0, "0": 5.0, "-1": 5.0, "0.49": 5.0, "nan": 5.0, "inf": 5.0,
                 "abc": 5.0, "": 5.0, "0.5": 0.5, "2.5": 2.5, " 7 ": 7.0}
        children = {value: Child(code, self.env(GPUMEM_PUSH_INTERVAL=value), self.tmp)
                    for value in cases}
        for value, want in cases.items():
            child = children[value].finish(20)
            self.assertEqual(child.rc, 0, child.stderr)
            self.assertEqual(float(child.stdout.strip()), want, value)
            warnings = child.stderr.splitlines()
            if want == 5.0 and value:
                self.assertEqual(len(warnings), 1, f"{value!r}: {child.stderr}")
                self.assertIn("GPUMEM_PUSH_INTERVAL", warnings[0])
                self.assertIn(repr(value.strip()), warnings[0])
            else:
                self.assertEqual(warnings, [], value)

    def test_pushes_keep_the_interval(self):
        child = self.run_child(
            "import time, torch; torch._fake.allocate(0, 1 << 20); time.sleep(3.2)",
            GPUMEM_PUSH_INTERVAL="0.8")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        times = [e["t"] for e in self.agent.recorder.pushes if "reason" not in e["payload"]]
        self.assertTrue(3 <= len(times) <= 5, times)
        gaps = [b - a for a, b in zip(times, times[1:])]
        self.assertTrue(all(0.7 <= g <= 1.1 for g in gaps), gaps)


class AllocationHistory(PushTest):
    """GPUMEM_PUSH_HISTORY: PyTorch's history turned on as CUDA initialises, and the snapshot
    uploaded at an out-of-memory error (issue 37)."""

    # Waits (bounded) until the hook has queued the history's start with torch.cuda._lazy_call,
    # allocates (which initialises CUDA), waits for the observer, then runs out of memory.
    JOB = textwrap.dedent("""
        import sys, time, torch
        deadline = time.monotonic() + 10
        while not torch._fake.queued and time.monotonic() < deadline:
            time.sleep(0.02)
        print("queued", len(torch._fake.queued))
        torch._fake.allocate(0, 3 << 20)
        deadline = time.monotonic() + 10
        while not torch._C._oom_observers and time.monotonic() < deadline:
            time.sleep(0.02)
        """)
    # The job, then one out-of-memory error it catches.
    JOB_OOM = JOB + textwrap.dedent("""
        try:
            torch._fake.oom(0, 1 << 40)
        except torch.cuda.OutOfMemoryError:
            pass
        """)

    def test_history_starts_with_cuda_and_an_oom_uploads_the_snapshot(self):
        import gzip
        import pickle
        child = self.run_child(self.JOB + textwrap.dedent("""
            # A second OOM past the observer's one-second gap, within the recordings'
            # interval: pushed, not recorded.
            for pause in (1.2, 0):
                try:
                    torch._fake.oom(0, 1 << 40)
                except torch.cuda.OutOfMemoryError:
                    pass
                time.sleep(pause)
            """), GPUMEM_PUSH_HISTORY="500")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertIn("queued 1", child.stdout)
        result = child.result
        self.assertEqual(result["violations"], [], "history never starts CUDA itself")
        history = result["stats"]["history"]
        self.assertEqual((history["state"], history["sent"], history["skipped"]), ("on", 1, 1),
                         history)
        self.assertGreater(result["stats"]["observer_seconds"], 0)
        recordings = self.agent.recorder.recordings
        self.assertEqual(len(recordings), 1, recordings)
        upload = recordings[0]
        self.assertEqual(upload["content_type"], "application/gzip")
        self.assertTrue(upload["path"].startswith(f"/api/v1/recordings?pid={child.pid}&start_time="),
                        upload["path"])
        snapshot = pickle.loads(gzip.decompress(upload["body"]))
        actions = [e["action"] for e in snapshot["device_traces"][0]]
        # From CUDA's first allocation (the history started as CUDA initialised) to the OOM.
        self.assertEqual(actions[:2], ["segment_alloc", "alloc"], actions)
        self.assertEqual(actions[-1], "oom", actions)
        self.assertEqual(len(snapshot["segments"]), 1)
        # The OOM push went first: the agent knows the process when its recording comes.
        self.assertEqual([p.get("reason") for p in self.agent.recorder.accepted()
                          if p.get("reason")][:1], ["oom"])

    def test_off_unless_asked_under_another_allocator_or_without_cuda(self):
        for env, state in [({}, None),
                           ({"GPUMEM_PUSH_HISTORY": "on",
                             "FAKE_TORCH_BACKEND": "cudaMallocAsync"},
                            "off: the cudaMallocAsync allocator keeps no history")]:
            self.agent.recorder.recordings.clear()
            child = self.run_child(self.JOB_OOM, **env)
            self.assertEqual(child.rc, 0, child.stderr)
            self.assertEqual(child.result["stats"]["history"]["state"], state, env)
            self.assertEqual(self.agent.recorder.recordings, [], env)
            self.assertEqual(child.result["violations"], [], env)
        # A job that never initialises CUDA never records (nor starts CUDA).
        child = self.run_child("import torch\ntime_ = __import__('time'); time_.sleep(0.5)\n",
                               GPUMEM_PUSH_HISTORY="on")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertFalse(child.result["initialized"])
        self.assertEqual(child.result["violations"], [])
        self.assertIsNone(child.result["stats"]["history"]["state"])

    def test_a_recording_the_agent_does_not_take_is_written_to_the_directory(self):
        # The agent refuses the recording; then it refuses everything, the OOM push too, and
        # the hook does not even try to upload.
        for refused, says in [("recording_status", "503"), ("status", "did not take")]:
            setattr(self.agent.recorder, refused, 503)
            directory = os.path.join(self.tmp, refused)
            child = self.run_child(self.JOB_OOM, GPUMEM_PUSH_HISTORY="200",
                                   GPUMEM_PUSH_HISTORY_DIR=directory)
            self.assertEqual(child.rc, 0, child.stderr)
            history = child.result["stats"]["history"]
            self.assertEqual((history["sent"], history["saved"]), (0, 1), history)
            self.assertIn(says, history["last_error"])
            saved = os.listdir(directory)
            self.assertEqual(len(saved), 1, saved)
            self.assertTrue(saved[0].startswith(f"gpumem-{child.pid}-"), saved)
        self.assertEqual(len(self.agent.recorder.recordings), 1, "only the first was tried")

    def test_an_agent_busy_with_other_recordings_is_asked_again(self):
        # All ranks of a job may fail at once; the agent receives two recordings at a time.
        self.agent.recorder.recordings_busy = 2
        child = self.run_child(self.JOB_OOM, GPUMEM_PUSH_HISTORY="200")
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertEqual(child.result["stats"]["history"]["sent"], 1, child.result["stats"])
        self.assertEqual([r["status"] for r in self.agent.recorder.recordings], [429, 429, 201])

    def test_settings_are_bounded(self):
        from gpumem_push.history import MAX_ENTRIES, Settings, recordings_url
        warnings = []
        for value, entries in [("", 0), ("0", 0), ("off", 0), ("on", 20_000), ("5000", 5000),
                               ("10", 100), ("1000000", MAX_ENTRIES), ("lots", 0)]:
            os.environ["GPUMEM_PUSH_HISTORY"] = value
            try:
                self.assertEqual(Settings.from_environment(warnings.append).entries, entries,
                                 value)
            finally:
                del os.environ["GPUMEM_PUSH_HISTORY"]
        self.assertEqual(len(warnings), 3, warnings)
        self.assertEqual(recordings_url("http://10.0.0.1:9418/api/v1/push"),
                         "http://10.0.0.1:9418/api/v1/recordings")
        self.assertEqual(recordings_url("unix:/run/gpumem/push.sock"),
                         "unix:/run/gpumem/push.sock")


class OomFigures(unittest.TestCase):
    """The figures of an out-of-memory push, in this process (gpumem_push imported as
    installed; no pusher started)."""

    def test_pools_past_the_agents_bound_are_added_into_another_streams_entry(self):
        from gpumem_push import limits, readings  # noqa: F401 (as installed)
        pools = {("large", s, False): {"allocated": s * MIB, "requested": s * MIB,
                                       "pending_free": 0, "free": MIB, "largest_free": MIB,
                                       "segments_with_free": 1}
                 for s in range(1, 101)}
        pools[("small", 50, False)] = {"allocated": 0, "requested": 0, "pending_free": MIB,
                                       "free": 0, "largest_free": 0, "segments_with_free": 0}
        out = readings.oom_pools(pools, stream=50)
        self.assertEqual(len(out), limits.MAX_OOM_POOLS)
        # The request's stream first, both its pools, then the others by reserved bytes.
        self.assertEqual([(p["pool"], p["stream"]) for p in out[:3]],
                         [("large", 50), ("small", 50), ("large", 100)])
        for key in ("allocated", "requested", "pending_free", "free", "segments_with_free"):
            self.assertEqual(sum(p[key] for p in out), sum(f[key] for f in pools.values()), key)
        self.assertNotEqual(out[-1]["stream"], 50)
        oom = {"size": MIB, "stream": 50, "device_total": 1 << 40, "device_free": 0,
               "pools": out}
        self.assertIsNone(check_oom(oom))

    def test_past_the_bound_private_and_default_figures_stay_apart(self):
        from gpumem_push import limits, readings  # noqa: F401 (as installed)
        def figures(free):
            return {"allocated": MIB, "requested": MIB, "pending_free": 0, "free": free,
                    "largest_free": free, "segments_with_free": 1}
        # 100 other streams' default pools, larger than the 5 private pools behind them.
        pools = {("large", s, False): figures(64 * MIB) for s in range(1, 101)}
        pools.update({("large", s, True): figures(MIB) for s in range(1, 6)})
        out = readings.oom_pools(pools, stream=7)
        self.assertEqual(len(out), limits.MAX_OOM_POOLS)
        self.assertIsNone(check_oom({"size": MIB, "stream": 7, "device_total": 1 << 40,
                                     "device_free": 0, "pools": out}))
        for private in (False, True):
            sent = [p for p in out if p.get("private", False) == private]
            had = [f for k, f in pools.items() if k[2] == private]
            self.assertTrue(sent, private)
            for key in ("allocated", "free", "segments_with_free"):
                self.assertEqual(sum(p[key] for p in sent), sum(f[key] for f in had),
                                 (private, key))
        # The request's own stream's entry, first, holds its own figures only.
        self.assertEqual((out[0]["stream"], out[0].get("private")), (7, None))
        self.assertEqual(out[0]["free"], 64 * MIB)

    def test_private_pools_are_sent_apart_from_the_default_pools(self):
        from gpumem_push import limits, readings  # noqa: F401 (as installed)
        import types
        def segment(pool_id, free):
            return {"device": 0, "total_size": 20 * MIB, "segment_type": "large", "stream": 0,
                    "segment_pool_id": pool_id,
                    "blocks": [{"size": 20 * MIB - free, "state": "active_allocated",
                                "requested_size": 4 * MIB},
                               {"size": free, "state": "inactive", "requested_size": 0}]}
        # A graph's pool and the default pool on the same stream: two entries, the graph's
        # marked private, the default one first.
        snapshot = [segment((7, 0), 12 * MIB), segment((0, 0), 2 * MIB)]
        torch = types.SimpleNamespace(
            cuda=types.SimpleNamespace(memory_snapshot=lambda: snapshot))
        oom = readings.snapshot_summary(torch, (0, 8 * MIB, 1 << 30, 0, 0))[0]["oom"]
        self.assertIsNone(check_oom(oom))
        self.assertEqual([(p["free"], p.get("private")) for p in oom["pools"]],
                         [(2 * MIB, None), (12 * MIB, True)])

    def test_a_periodic_summary_finds_what_an_oom_summary_does(self):
        from gpumem_push import readings  # as installed
        def segment(device, total, free, stream=0, active=True):
            blocks = [{"size": total - sum(free), "state": "active_allocated",
                       "requested_size": 1}]
            blocks += [{"size": f, "state": "inactive"} for f in free]
            blocks.append({"size": 0, "state": "active_pending_free"})
            out = {"device": device, "total_size": total, "segment_type": "large",
                   "stream": stream, "blocks": blocks}
            if active:  # as PyTorch gives it: what is not free
                out["active_size"] = total - sum(free)
            return out
        # With and without active_size; a segment whose free bytes could hold a larger
        # block than found so far is looked into (the 3 MiB after the 2 MiB), one that
        # cannot is not, and one whose figures do not add up is looked into as well.
        snapshot = [segment(0, 20 * MIB, [2 * MIB]), segment(0, 20 * MIB, [MIB, 3 * MIB]),
                    segment(0, 2 * MIB, [], active=False), segment(0, 20 * MIB, [MIB, MIB]),
                    segment(1, 64 * MIB, [40 * MIB], stream=5), segment(0, 20 * MIB, [0])]
        lying = segment(1, 64 * MIB, [MIB])
        lying["active_size"] = 65 * MIB  # more than the segment: its blocks are read
        snapshot.append(lying)
        periodic = readings.summarize(snapshot)
        oom = readings.summarize(snapshot, (0, MIB, 1 << 40, 0, 0))
        for device in (0, 1):
            self.assertEqual(periodic[device]["largest"], oom[device]["largest"])
            self.assertEqual(periodic[device]["classes"], oom[device]["classes"])
            self.assertEqual(periodic[device]["pools"], {}, "no pools without a request")
        self.assertEqual(periodic[0]["largest"], 3 * MIB)
        self.assertEqual(periodic[0]["classes"], {2 * MIB: [1, 0], 32 * MIB: [4, 8 * MIB]})
        self.assertEqual(periodic[1], {"largest": 40 * MIB,
                                       "classes": {64 * MIB: [2, 41 * MIB]}, "pools": {}})
        self.assertEqual(oom[0]["pools"][("large", 0, False)]["segments_with_free"], 3)

    def test_figures_that_cannot_add_up_are_not_sent(self):
        from gpumem_push import limits, readings  # noqa: F401 (as installed)
        import types
        segment = {"device": 0, "total_size": 4 * MIB, "segment_type": "large", "stream": 0,
                   "blocks": [{"size": 4 * MIB, "state": "active_allocated",
                               "requested_size": 3 * MIB}]}
        torch = types.SimpleNamespace(
            cuda=types.SimpleNamespace(memory_snapshot=lambda: [segment]))
        ok = readings.snapshot_summary(torch, (0, MIB, 8 * MIB, 0, 0))
        self.assertEqual(ok[0]["oom"]["pools"][0]["requested"], 3 * MIB)
        self.assertIsNone(check_oom(ok[0]["oom"]))
        # A device smaller than what is reserved on it (a stand-in's zeros): no figures.
        bad = readings.snapshot_summary(torch, (0, MIB, 0, 0, 0))
        self.assertNotIn("oom", bad[0])

    def test_the_snapshot_is_asked_without_history_where_pytorch_can(self):
        from gpumem_push import limits, readings  # noqa: F401 (as installed)
        import types
        asked = []

        def new(mempool_id=None, include_traces=True):  # PyTorch 2.11+
            asked.append(include_traces)
            return []

        def old(mempool_id=None):  # before 2.11
            asked.append("old")
            return []

        def wrapped(*args, **kwargs):  # a wrapper: its signature names nothing
            asked.append(kwargs)
            return []

        for snapshot in (new, old, wrapped):
            torch = types.SimpleNamespace(cuda=types.SimpleNamespace(memory_snapshot=snapshot))
            self.assertEqual(readings.snapshot_summary(torch), {})
        self.assertEqual(asked, [False, "old", {}])
        # A builtin without a readable signature is called as it is.
        self.assertFalse(readings.takes_include_traces(min))

    def test_observer_arguments_that_are_not_figures_give_no_request(self):
        from gpumem_push import limits, readings  # noqa: F401 (as installed)
        self.assertIsNone(readings.oom_request(None, (0, "x", 1, 2)))
        self.assertIsNone(readings.oom_request(None, (0, 1, 2)))
        self.assertIsNone(readings.oom_request(None, (0, -1, 2, 3)))
        self.assertEqual(readings.oom_request(None, (1, 2, 3, 4)), (1, 2, 3, 4, 0))


class DeviceIdentity(unittest.TestCase):
    """The UUID a push names a device by: NVML's spelling, so it joins NVML's series."""

    def test_a_mig_instance_keeps_its_mig_identity(self):
        from gpumem_push.pusher import device_uuid
        body = "5c1f2a3b-0000-4000-8000-00000000000a"
        other = "7d2e3f4a-0000-4000-8000-00000000000b"
        # A whole GPU: torch leaves out the prefix, NVML spells it GPU-.
        self.assertEqual(device_uuid(body, {}), "GPU-" + body)
        # A MIG instance handed to the container by its MIG UUID (the device plugin's
        # NVIDIA_VISIBLE_DEVICES, or the job's own CUDA_VISIBLE_DEVICES), in any case.
        for environ in ({"NVIDIA_VISIBLE_DEVICES": f"MIG-{body}"},
                        {"CUDA_VISIBLE_DEVICES": f"MIG-{other}, MIG-{body.upper()}"},
                        {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": f"MIG-{body}"}):
            self.assertEqual(device_uuid(body, environ), "MIG-" + body, environ)
        # Another instance listed: this device is not it.
        self.assertEqual(device_uuid(body, {"NVIDIA_VISIBLE_DEVICES": f"MIG-{other}"}),
                         "GPU-" + body)
        # A prefix torch already gives stands.
        self.assertEqual(device_uuid("MIG-" + body, {}), "MIG-" + body)
        self.assertEqual(device_uuid("GPU-" + body, {"CUDA_VISIBLE_DEVICES": f"MIG-{body}"}),
                         "GPU-" + body)


class PusherOutcomes(unittest.TestCase):
    """A Pusher of its own, in this process: each push says what became of it."""

    @staticmethod
    def torch():
        import types
        stats = {"reserved_bytes.all.current": 2 * MIB, "allocated_bytes.all.current": MIB}
        props = types.SimpleNamespace(uuid="6a1f0e2c-0000-4000-8000-000000000000")
        cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 1,
                                     memory_stats=lambda index: dict(stats),
                                     get_device_properties=lambda index: props)
        return types.SimpleNamespace(cuda=cuda, __version__="2.15.0")

    def pusher(self, url):
        from gpumem_push import Pusher
        pusher = Pusher()
        self.addCleanup(pusher.stop)
        pusher.start(url=url, interval=60)
        return pusher

    def test_each_push_says_what_became_of_it(self):
        import sys
        from gpumem_push import Outcome, Pusher
        # The pushers' threads find no torch in this process and idle: the pushes below are
        # the only ones.
        self.assertNotIn("torch", sys.modules)
        torch = self.torch()
        self.assertIs(Pusher().push(torch).outcome, Outcome.EMPTY, "not started")

        agent = Agent()
        self.addCleanup(agent.close)
        pusher = self.pusher(agent.url)
        sent = pusher.push(torch)
        self.assertIs(sent.outcome, Outcome.SENT, agent.recorder.refused())
        uuid = agent.recorder.accepted()[0]["devices"][0]["uuid"]
        self.assertEqual(uuid, "GPU-6a1f0e2c-0000-4000-8000-000000000000")
        self.assertIs(pusher.push(torch, min_gap=60).outcome, Outcome.EARLY)
        self.assertEqual(pusher.stats()["sent"], 1)

        for status in (429, 503):
            refusing = Agent(Recorder(status=status))
            self.addCleanup(refusing.close)
            result = self.pusher(refusing.url).push(torch)
            self.assertIs(result.outcome, Outcome.REFUSED)
            self.assertEqual((result.status, result.rate_limited), (status, status == 429))

        gone = self.pusher("unix:" + os.path.join(tempdir(self), "no-agent.sock"))
        self.assertIs(gone.push(torch, timeout=0.5).outcome, Outcome.DROPPED)
        self.assertEqual(gone.stats()["dropped"], 1)


if __name__ == "__main__":
    unittest.main()
