"""Build hook: generate ``edgecache.v1`` from ``proto/`` before packaging.

Generated protobuf/gRPC code is never committed (it pins a protobuf runtime
version of its own); every build, editable or not, regenerates it with the
grpcio-tools pinned in ``pyproject.toml``.
"""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    """Run ``proto/generate.py`` first, so the generated modules get packaged."""

    def run(self) -> None:
        """Generate, then build as usual."""
        runpy.run_path(str(ROOT / "proto" / "generate.py"))["generate"]()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
