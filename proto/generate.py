"""Generate the Python gRPC/protobuf modules for ``edgecache.v1``.

The ``.proto`` files live under ``proto/edgecache/v1/`` and declare
``package edgecache.v1``, so protoc run with ``-I proto`` writes modules whose
imports are already absolute (``from edgecache.v1 import manifest_pb2``) and
land beside the IDL, which the packaging maps to ``edgecache.v1``.

Run by ``setup.py`` on every build and by ``make proto`` after editing a
``.proto`` file. Needs ``grpcio-tools`` and ``mypy-protobuf``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


MYPY_PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")


def _find_plugin(name: str) -> str:
    """Find a mypy-protobuf plugin beside this interpreter (venvs are often not on PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install mypy-protobuf")
    return found


def generate() -> list[Path]:
    """Generate ``*_pb2.py``, ``*_pb2_grpc.py`` and their ``.pyi`` stubs in place."""
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(PROTO_ROOT.glob("edgecache/**/*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}/edgecache")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        *(f"--plugin={name}={_find_plugin(name)}" for name in MYPY_PLUGINS),
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        f"--mypy_out={PROTO_ROOT}",
        f"--mypy_grpc_out={PROTO_ROOT}",
        *(str(p.relative_to(PROTO_ROOT)) for p in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sources


if __name__ == "__main__":
    generated = generate()
    print(f"generated code for {len(generated)} proto files", file=sys.stderr)
