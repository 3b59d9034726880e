"""The packages as pip installed them into this virtual environment (scripts/test-python):
versions agree with the Rust crate's, the wheels hold what they should, and gpumem_push.pth is
in site-packages."""

import os
import re
import sys
import sysconfig
import unittest
from importlib import metadata

from support import REPO

PACKAGES = {"gpumem-push": "gpumem_push", "gpumem-torch": "gpumem_torch"}


def toml_version(path, table):
    """`version` of [table] in a TOML file (tomllib where there is one, Python >= 3.11)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        import tomllib
    except ImportError:
        text = data.decode()
        section = re.search(r"^\[" + re.escape(table) + r"\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        return re.search(r'^version\s*=\s*"([^"]+)"', section.group(1), re.M).group(1)
    return tomllib.loads(data.decode())[table]["version"]


class Versions(unittest.TestCase):
    def test_the_packages_have_the_crate_version(self):
        crate = toml_version(os.path.join(REPO, "Cargo.toml"), "package")
        for name, module in PACKAGES.items():
            source = os.path.join(REPO, "python", module, "pyproject.toml")
            self.assertEqual(toml_version(source, "project"), crate, source)
            self.assertEqual(metadata.version(name), crate, name)
            self.assertEqual(__import__(module).__version__, crate, module)


class Installed(unittest.TestCase):
    def test_imported_from_site_packages_not_the_checkout(self):
        purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
        self.assertTrue(sys.prefix != sys.base_prefix, "run inside scripts/test-python's venv")
        for module in PACKAGES.values():
            path = os.path.realpath(__import__(module).__file__)
            self.assertTrue(path.startswith(purelib + os.sep), path)

    def test_the_pth_hook_is_in_site_packages(self):
        purelib = sysconfig.get_paths()["purelib"]
        with open(os.path.join(purelib, "gpumem_push.pth")) as f:
            self.assertEqual(f.read(), "import _gpumem_push_hook\n")
        self.assertTrue(os.path.isfile(os.path.join(purelib, "_gpumem_push_hook.py")))

    def test_the_wheels_hold_the_modules_and_nothing_else(self):
        def files(name):
            return sorted(str(f) for f in metadata.files(name)
                          if ".dist-info/" not in str(f) and "__pycache__" not in str(f))

        self.assertEqual(files("gpumem-push"), [
            "_gpumem_push_hook.py", "gpumem_push.pth", "gpumem_push/__init__.py",
            "gpumem_push/cadence.py", "gpumem_push/config.py", "gpumem_push/history.py",
            "gpumem_push/limits.py", "gpumem_push/pusher.py", "gpumem_push/readings.py",
            "gpumem_push/sharing.py", "gpumem_push/sleeping.py", "gpumem_push/transport.py",
            "gpumem_push/xla.py"])
        # No libgpumem_torch.so: the wheel does not bundle the shared library.
        self.assertEqual(files("gpumem-torch"), ["gpumem_torch/__init__.py"])

    def test_no_dependencies(self):
        for name in PACKAGES:
            self.assertEqual(metadata.requires(name) or [], [], name)


if __name__ == "__main__":
    unittest.main()
