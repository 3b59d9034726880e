"""gpumem_push in JAX jobs: a stand-in jax (tests/fake_jax) with PJRT's memory_stats(), and a
real jax (the CPU wheel) where scripts/test-python installed one (GPUMEM_JAX_PYTHON)."""

import os
import textwrap
import unittest

from support import Agent, Child, child_env, tempdir
from test_push import REPORT, WAIT_SENT, PushTest

GIB = 1 << 30
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]

# What the stand-in jax says of itself, on the child's last line but one.
JAX_REPORT = """
import json as _j, sys as _s
_b = _s.modules.get("jax._src.xla_bridge")
print(_j.dumps({"initialisations": _b.initialisations if _b else None}))
"""


def figures(index, old=False):
    """The stand-in's memory_stats() of device `index` (tests/fake_jax/jax/__init__.py)."""
    out = {"num_allocs": 100 + index, "bytes_in_use": (3 + index) * GIB,
           "peak_bytes_in_use": (5 + index) * GIB, "largest_alloc_size": GIB,
           "bytes_limit": 60 * GIB, "bytes_reserved": 0, "peak_bytes_reserved": 0,
           "bytes_reservable_limit": 0, "largest_free_block_bytes": (50 - index) * GIB,
           "pool_bytes": 60 * GIB, "peak_pool_bytes": 60 * GIB}
    if old:
        del out["pool_bytes"], out["peak_pool_bytes"]
    return out


class JaxJobs(PushTest):
    def spawn_jax(self, body, **env):
        code = WAIT_SENT + textwrap.dedent(body) + JAX_REPORT + REPORT
        return Child(code, self.env(**env), self.tmp)

    def test_each_gpu_is_pushed_with_its_figures_under_its_uuid(self):
        child = self.spawn_jax("""
            import jax
            jax.devices()
            wait_sent(2)
            """, NVIDIA_VISIBLE_DEVICES=",".join(UUIDS),
            XLA_PYTHON_CLIENT_MEM_FRACTION=".75").finish(20)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertEqual(child.stderr, "")
        self.assertNoRefusals()
        pushes = self.agent.recorder.accepted()
        self.assertGreaterEqual(len(pushes), 2)
        for p in pushes:
            self.assertNotIn("torch_version", p, "no torch in this job")
            self.assertEqual(p["jax_version"], "0.10.2+fake")
            self.assertEqual(p["xla_conf"], "XLA_PYTHON_CLIENT_MEM_FRACTION=.75")
            devices = p["devices"]
            self.assertEqual([(d["index"], d["uuid"], d["allocator"]) for d in devices],
                             [(0, UUIDS[0], "xla"), (1, UUIDS[1], "xla")])
            for d in devices:
                want = figures(d["index"])
                if d["index"] == 0:
                    want["num_ooms"] = 0  # the hook's count, on the first device
                self.assertEqual(d["stats"], want)
        self.assertEqual(pushes[-1].get("reason"), "exit")
        self.assertEqual(child.result["stats"]["errors"], 0, child.result["stats"])

    def test_jax_imported_but_never_used_pushes_nothing_and_stays_uninitialised(self):
        child = self.spawn_jax("""
            import time, jax
            time.sleep(1.5)
            """).finish(20)
        self.assertEqual(child.rc, 0, child.stderr)
        report = [line for line in child.stdout.splitlines() if "initialisations" in line]
        self.assertEqual(report, ['{"initialisations": []}'], "the hook initialised JAX")
        self.assertEqual(self.agent.recorder.pushes, [])

    def test_cpu_devices_are_not_pushed(self):
        child = self.spawn_jax("""
            import time, jax
            jax.devices()
            time.sleep(1.5)
            """, FAKE_JAX_PLATFORM="cpu").finish(20)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertEqual(self.agent.recorder.pushes, [])
        self.assertEqual(child.result["stats"]["errors"], 0)

    def test_an_uncaught_out_of_memory_error_is_counted_and_pushed(self):
        child = self.spawn_jax("""
            import jax
            jax.devices()
            wait_sent(1)
            jax.out_of_memory(80 << 30)
            """, NVIDIA_VISIBLE_DEVICES=",".join(UUIDS)).finish(20)
        self.assertEqual(child.rc, 1)
        self.assertIn("RESOURCE_EXHAUSTED", child.stderr, "the job's own traceback still shows")
        self.assertNoRefusals()
        pushes = self.agent.recorder.accepted()
        reasons = [p.get("reason") for p in pushes if "reason" in p]
        self.assertEqual(reasons, ["oom", "exit"])
        oom = next(p for p in pushes if p.get("reason") == "oom")
        self.assertEqual(oom["devices"][0]["stats"]["num_ooms"], 1)
        self.assertNotIn("num_ooms", oom["devices"][1]["stats"])
        self.assertIn("last_oom_unix_seconds", oom)

    def test_an_error_in_another_thread_is_seen_too_and_others_are_not_counted(self):
        child = self.spawn_jax("""
            import threading, jax
            jax.devices()
            wait_sent(1)
            def step():
                jax.out_of_memory(1 << 40)
            t = threading.Thread(target=step)
            t.start(); t.join()
            try:
                jax.out_of_memory(1 << 40)  # caught by the job: not seen
            except jax.XlaRuntimeError:
                pass
            import sys
            try:
                raise ValueError("not XLA's")
            except ValueError as e:
                sys.excepthook(type(e), e, e.__traceback__)
            wait_sent(3)
            """, NVIDIA_VISIBLE_DEVICES=",".join(UUIDS)).finish(20)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertIn("ValueError", child.stderr)
        last = self.agent.recorder.accepted()[-1]
        self.assertEqual(last["devices"][0]["stats"]["num_ooms"], 1)

    def test_a_job_with_both_frameworks_pushes_both(self):
        child = self.spawn_jax("""
            import torch, jax
            torch._fake.allocate(0, 3 << 20)
            jax.devices()
            wait_sent(2)
            """, FAKE_JAX_GPUS="1", FAKE_JAX_KEYS="old").finish(20)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNoRefusals()
        last = self.agent.recorder.accepted()[-1]
        self.assertEqual(last["torch_version"], "2.5.1+fake")
        kinds = [(d["index"], d["uuid"], d.get("allocator", "pytorch")) for d in last["devices"]]
        # No variable names the device: the job's PyTorch does, for the same CUDA ordinal.
        uuid = "GPU-6a1f0e2c-0000-4000-8000-000000000000"
        self.assertEqual(kinds, [(0, uuid, "pytorch"), (0, uuid, "xla")])
        want = figures(0, old=True)
        want["num_ooms"] = 0
        self.assertEqual(last["devices"][1]["stats"], want)


class DeviceNames(unittest.TestCase):
    def test_the_environment_names_a_cuda_ordinal(self):
        from gpumem_push.xla import visible_uuid
        a, b, mig = UUIDS[0], UUIDS[1], "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
        cases = [
            ({"NVIDIA_VISIBLE_DEVICES": f"{a},{b}"}, 1, b),
            ({"NVIDIA_VISIBLE_DEVICES": f"{a}, {mig}"}, 1, mig),
            ({"NVIDIA_VISIBLE_DEVICES": f"{a},{b}", "CUDA_VISIBLE_DEVICES": "1"}, 0, b),
            ({"CUDA_VISIBLE_DEVICES": f"{b},{a}"}, 0, b),
            ({"NVIDIA_VISIBLE_DEVICES": "all"}, 0, None),
            ({"NVIDIA_VISIBLE_DEVICES": "0,1"}, 1, None),
            ({"NVIDIA_VISIBLE_DEVICES": f"{a},{b}", "CUDA_VISIBLE_DEVICES": "7"}, 0, None),
            ({"NVIDIA_VISIBLE_DEVICES": f"{a}"}, 3, None),
            ({"CUDA_VISIBLE_DEVICES": "MIG-GPU-x/1/0"}, 0, None),  # the legacy MIG form
            ({"CUDA_VISIBLE_DEVICES": "GPU-11111111"}, 0, None),  # a prefix: no exact name
            ({}, 0, None),
        ]
        for environ, ordinal, want in cases:
            self.assertEqual(visible_uuid(ordinal, environ), want, (environ, ordinal))

    def test_only_xlas_out_of_memory_error_is_recognised(self):
        from gpumem_push.xla import is_out_of_memory

        class XlaRuntimeError(RuntimeError):
            pass

        oom = XlaRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.")
        self.assertTrue(is_out_of_memory(oom))
        self.assertFalse(is_out_of_memory(XlaRuntimeError("INTERNAL: something else")))
        self.assertFalse(is_out_of_memory(XlaRuntimeError("RESOURCE_EXHAUSTED: no more handles")))
        self.assertFalse(is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: not XLA's type")))
        wrapped = ValueError("during the step")
        wrapped.__cause__ = oom
        self.assertTrue(is_out_of_memory(wrapped), "a cause is followed")
        looped = ValueError("a cycle")
        looped.__context__ = looped
        self.assertFalse(is_out_of_memory(looped), "a cycle ends")


class RealJax(unittest.TestCase):
    """A real jax (the CPU wheel, pip-installed by scripts/test-python into a venv of its own
    with this hook): a job starts with the hook and pushes nothing for CPU devices."""

    def setUp(self):
        self.python = os.environ.get("GPUMEM_JAX_PYTHON")
        if not self.python:
            self.skipTest("GPUMEM_JAX_PYTHON names no Python with jax (scripts/test-python does)")
        self.tmp = tempdir(self)
        self.agent = Agent()
        self.addCleanup(self.agent.close)

    def test_a_cpu_jax_job_runs_with_the_hook_and_pushes_nothing(self):
        env = child_env(self.tmp, GPUMEM_PUSH="1", GPUMEM_PUSH_URL=self.agent.url,
                        GPUMEM_PUSH_INTERVAL="0.5", JAX_PLATFORMS="cpu")
        del env["PYTHONPATH"]  # the real jax, not the stand-ins
        code = textwrap.dedent("""
            import json, time, jax, jax.numpy as jnp
            from gpumem_push import xla
            found = xla.backends()
            before = None if found is None else sorted(found)
            x = jnp.ones((256, 256))
            y = (x @ x).block_until_ready()
            time.sleep(1.5)
            import gpumem_push
            print(json.dumps({"platforms": sorted({d.platform for d in jax.devices()}),
                              "sum": float(y.sum()), "stats": gpumem_push.stats(),
                              "backends": [before, sorted(xla.backends() or ["none"])],
                              "running": gpumem_push.settings()["running"]}))
            """)
        child = Child(code, env, self.tmp, python=self.python).finish(120)
        self.assertEqual(child.rc, 0, child.stderr)
        self.assertNotIn("gpumem_push", child.stderr)
        self.assertEqual(child.result["platforms"], ["cpu"])
        # Where this JAX keeps its backends is where the hook looks: none before use, then
        # the CPU's (so on a GPU machine the GPU's).
        self.assertEqual(child.result["backends"], [[], ["cpu"]])
        self.assertEqual(child.result["sum"], 256.0 ** 3)
        self.assertTrue(child.result["running"], "the hook ran")
        self.assertEqual(child.result["stats"]["errors"], 0, child.result["stats"])
        self.assertEqual(self.agent.recorder.pushes, [], "nothing pushed for CPU devices")
