"""A job whose image never installed gpumem_push, started with only what gpumem's admission
webhook injects: the directory scripts/python-inject assembles (the image carries it at
/usr/share/gpumem/python) first on PYTHONPATH, and GPUMEM_PUSH=1 with the agent's address.
The job runs on the base interpreter, outside the test's virtual environment, so neither the
wheel nor its .pth hook is anywhere on its path."""

import os
import subprocess
import sys
import textwrap
import unittest

from support import FAKE_TORCH, REPO, Agent, Child, child_env, tempdir

MIB = 1 << 20
BASE_PYTHON = getattr(sys, "_base_executable", None) or sys.executable

# The child's report: where gpumem_push and its start-up hook came from, the site directories
# holding the wheel's .pth (none), what the pusher says, and what the image's own
# sitecustomize left.
JOB = """
import json, os, site, sys, time
import torch
torch._fake.allocate(0, 3 << 20)
gp = sys.modules.get("gpumem_push")
deadline = time.monotonic() + 10
while gp is not None and gp.stats()["sent"] < 2 and time.monotonic() < deadline:
    time.sleep(0.02)
custom = sys.modules.get("sitecustomize")
print(json.dumps({
    "gpumem_push": getattr(gp, "__file__", None),
    "wheel_pth": [d for d in site.getsitepackages() + [site.getusersitepackages()]
                  if os.path.exists(os.path.join(d, "gpumem_push.pth"))],
    "hook": getattr(sys.modules.get("_gpumem_push_hook"), "__file__", None),
    "stats": gp.stats() if gp else None,
    "image_site_ran": os.environ.get("IMAGE_SITE_RAN"),
    "sitecustomize": getattr(custom, "__file__", None),
}))
"""


class Injected(unittest.TestCase):
    def setUp(self):
        self.tmp = tempdir(self)
        self.inject = os.path.join(self.tmp, "inject")
        subprocess.run([os.path.join(REPO, "scripts", "python-inject"), self.inject],
                       check=True)
        self.agent = Agent()
        self.addCleanup(self.agent.close)

    def run_job(self, image_site=None, **env):
        """The job, on the base interpreter, with the injected directory first on PYTHONPATH,
        then the stand-in torch, then (as an image's own site directory) `image_site`."""
        path = [self.inject, FAKE_TORCH]
        if image_site is not None:
            site_dir = os.path.join(self.tmp, "image-site")
            os.makedirs(site_dir, exist_ok=True)
            with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
                f.write(textwrap.dedent(image_site))
            path.append(site_dir)
        values = {"GPUMEM_PUSH": "1", "GPUMEM_PUSH_URL": self.agent.url,
                  "GPUMEM_PUSH_INTERVAL": "0.5"}
        values.update(env)
        environment = child_env(self.tmp, **{k: v for k, v in values.items() if v is not None})
        environment["PYTHONPATH"] = os.pathsep.join(path)
        child = Child(JOB, environment, self.tmp, python=BASE_PYTHON).finish()
        self.assertEqual(child.rc, 0, child.stderr)
        return child

    def test_a_job_pushes_with_only_the_injected_path_and_environment(self):
        child = self.run_job()
        r = child.result
        self.assertTrue(r["gpumem_push"].startswith(self.inject + os.sep), r["gpumem_push"])
        self.assertEqual(r["wheel_pth"], [], "the wheel's .pth is in a site directory")
        self.assertTrue(r["hook"].startswith(self.inject + os.sep), r["hook"])
        self.assertGreaterEqual(r["stats"]["sent"], 2, r["stats"])
        self.assertEqual(r["stats"]["errors"], 0, r["stats"])
        self.assertEqual(child.stderr, "")
        pushes = self.agent.recorder.accepted()
        self.assertGreaterEqual(len(pushes), 3, "periodic pushes and the exit push")
        self.assertEqual(self.agent.recorder.refused(), [])
        self.assertTrue(all(p["pid"] == child.pid for p in pushes))
        self.assertEqual(pushes[-1].get("reason"), "exit")
        device = pushes[0]["devices"][0]
        self.assertEqual(device["stats"]["allocated_bytes.all.current"], 3 * MIB)

    def test_the_images_own_sitecustomize_still_runs(self):
        image_site = """
            import os
            os.environ["IMAGE_SITE_RAN"] = "yes"
            """
        child = self.run_job(image_site)
        r = child.result
        self.assertEqual(r["image_site_ran"], "yes")
        self.assertTrue(r["sitecustomize"].endswith(os.path.join("image-site", "sitecustomize.py")),
                        r["sitecustomize"])
        self.assertGreaterEqual(r["stats"]["sent"], 2, r["stats"])
        # Without GPUMEM_PUSH nothing of gpumem loads, and the image's module runs all the same.
        child = self.run_job(image_site, GPUMEM_PUSH=None)
        self.assertIsNone(child.result["gpumem_push"])
        self.assertEqual(child.result["image_site_ran"], "yes")
        self.assertEqual(child.stderr, "")

    def test_a_failing_image_sitecustomize_costs_the_job_nothing(self):
        child = self.run_job("raise RuntimeError('broken image site')\n")
        self.assertIn("Error in sitecustomize", child.stderr)
        self.assertIn("broken image site", child.stderr)
        self.assertGreaterEqual(child.result["stats"]["sent"], 2, child.result["stats"])


if __name__ == "__main__":
    unittest.main()
