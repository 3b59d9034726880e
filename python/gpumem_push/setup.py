"""Build hook of gpumem-push (the metadata is in pyproject.toml).

Puts gpumem_push.pth at the root of the wheel, which installs it into site-packages: the
interpreter then imports _gpumem_push_hook at start, which starts the pusher when
GPUMEM_PUSH=1 (and does nothing else).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "gpumem_push.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)


class BuildPyWithPth(build_py):
    """build_py that also places gpumem_push.pth beside the packages."""

    def run(self):
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return list(super().get_outputs(include_bytecode)) + [os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):  # setuptools >= 64, for editable installs
        mapping = dict(super().get_output_mapping())
        mapping[os.path.join(self.build_lib, PTH)] = SOURCE
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
