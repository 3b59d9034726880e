"""gpumem_torch: where it finds libgpumem_torch.so, and enable() with the stand-in torch."""

import os
import unittest
from unittest import mock

import gpumem_torch
from support import Child, child_env, tempdir


class FindLibrary(unittest.TestCase):
    def setUp(self):
        self.tmp = tempdir(self)
        self.lib = os.path.join(self.tmp, "libgpumem_torch.so")
        with open(self.lib, "wb") as f:
            f.write(b"\x7fELF stand-in")
        self.beside = os.path.join(os.path.dirname(gpumem_torch.__file__), "libgpumem_torch.so")
        self.assertFalse(os.path.exists(self.beside), "a library left beside the package")
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop("GPUMEM_TORCH_LIB", None)

    def test_gpumem_torch_lib(self):
        os.environ["GPUMEM_TORCH_LIB"] = self.lib
        with mock.patch.object(gpumem_torch, "IMAGE_LIBRARY", os.path.join(self.tmp, "no")):
            self.assertEqual(gpumem_torch.find_library(), self.lib)

    def test_a_wrong_gpumem_torch_lib_is_an_error_not_a_fallback(self):
        missing = os.path.join(self.tmp, "missing.so")
        os.environ["GPUMEM_TORCH_LIB"] = missing
        with mock.patch.object(gpumem_torch, "IMAGE_LIBRARY", self.lib):
            with self.assertRaises(FileNotFoundError) as caught:
                gpumem_torch.find_library()
        self.assertIn(missing, str(caught.exception))
        self.assertIn("GPUMEM_TORCH_LIB", str(caught.exception))

    def test_the_image_location(self):
        self.assertEqual(gpumem_torch.IMAGE_LIBRARY, "/usr/lib/gpumem/libgpumem_torch.so")
        with mock.patch.object(gpumem_torch, "IMAGE_LIBRARY", self.lib):
            self.assertEqual(gpumem_torch.find_library(), self.lib)

    def test_beside_the_package_comes_before_the_image(self):
        with open(self.beside, "wb") as f:
            f.write(b"\x7fELF stand-in")
        self.addCleanup(os.unlink, self.beside)
        with mock.patch.object(gpumem_torch, "IMAGE_LIBRARY", self.lib):
            self.assertEqual(os.path.realpath(gpumem_torch.find_library()),
                             os.path.realpath(self.beside))

    def test_the_error_lists_where_it_looked(self):
        image = os.path.join(self.tmp, "usr", "lib", "gpumem", "libgpumem_torch.so")
        with mock.patch.object(gpumem_torch, "IMAGE_LIBRARY", image):
            with self.assertRaises(FileNotFoundError) as caught:
                gpumem_torch.find_library()
        message = str(caught.exception)
        self.assertIn(os.path.realpath(self.beside), message)
        self.assertIn(image, message)
        self.assertIn("GPUMEM_TORCH_LIB", message)
        self.assertIn("does not bundle", message)


class Enable(unittest.TestCase):
    CODE = """
import json, os, sys, torch, gpumem_torch
if ARGS == ["late"]:
    torch._fake.init()
try:
    allocator = gpumem_torch.enable(conf="expandable_segments:True",
                                    metrics_listen="127.0.0.1:9418")
    installed = torch._fake.allocator
    print(json.dumps([installed is allocator, allocator.path, allocator.alloc_fn_name,
                      allocator.free_fn_name, os.environ["GPUMEM_ALLOC_CONF"],
                      os.environ["GPUMEM_METRICS_LISTEN"]]))
except RuntimeError as error:
    print(json.dumps(["refused", str(error), torch._fake.allocator]))
"""

    def run_enable(self, *args):
        tmp = tempdir(self)
        lib = os.path.join(tmp, "libgpumem_torch.so")
        with open(lib, "wb") as f:
            f.write(b"\x7fELF stand-in")
        child = Child("ARGS = %r\n" % list(args) + self.CODE,
                      child_env(tmp, GPUMEM_TORCH_LIB=lib), tmp).finish()
        self.assertEqual(child.rc, 0, child.stderr)
        return lib, child.result

    def test_enable_installs_the_pluggable_allocator(self):
        lib, result = self.run_enable()
        self.assertEqual(result, [True, lib, "gpumem_alloc", "gpumem_free",
                                  "expandable_segments:True", "127.0.0.1:9418"])

    def test_enable_after_cuda_started_is_refused(self):
        _, result = self.run_enable("late")
        self.assertEqual(result[0], "refused")
        self.assertIn("before the first CUDA operation", result[1])
        self.assertIsNone(result[2])


if __name__ == "__main__":
    unittest.main()
