"""The distribution's shape: one namespace, generated code present, no torch needed at the edge."""

import subprocess
import sys
from pathlib import Path

from edgecache.v1 import manifest_pb2, store_pb2


def test_folders_are_not_top_level_modules(tmp_path) -> None:
    # In a clean interpreter outside the checkout: what the installed distribution exposes.
    code = (
        "import importlib.util\n"
        "leaked = [n for n in ('cache', 'edge', 'clients', 'proto', 'v1')"
        " if importlib.util.find_spec(n) is not None]\n"
        "assert not leaked, leaked\n"
        "import edgecache.cache, edgecache.edge, edgecache.clients, edgecache.v1\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_generated_code_matches_the_protos() -> None:
    assert manifest_pb2.DESCRIPTOR.package == "edgecache.v1"
    assert {"Manifest", "Shard", "DatasetVersion", "PreprocessSpec", "ShardRef"} <= set(
        manifest_pb2.DESCRIPTOR.message_types_by_name
    )
    assert {"StoredShard", "StoredVersion"} <= set(store_pb2.DESCRIPTOR.message_types_by_name)


def test_edge_node_and_cache_need_no_torch(tmp_path) -> None:
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('no torch here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import edgecache.cache.store, edgecache.edge.server, edgecache.clients.cli\n"
        "import edgecache.clients.node_client\n"
        "from edgecache.clients.demo import run_demo\n"
        "try:\n"
        "    run_demo(sys.argv[1], total_mib=2, shards=2)\n"
        "except RuntimeError as e:\n"
        "    assert \"pip install 'edgecache[torch]'\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('demo ran without torch')\n"
        "try:\n"
        "    from edgecache.clients import EdgeDataset\n"
        "except ImportError as e:\n"
        "    assert 'edgecache[torch]' in str(e)\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_cli_help_and_demo_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "demo" in out.stdout


def test_clients_do_not_import_the_node_but_for_serve() -> None:
    """architecture.md: clients may import cache but not edge, serve the one exception.
    The controller's --metrics-listen imported the node's settings module to parse an
    address; an import from a client module to edge is found here, at the source."""
    import ast

    root = Path(__file__).resolve().parent.parent / "clients"
    allowed = {root / "cli" / "nodes.py"}  # `edgecache serve` runs a node
    found = []
    for path in sorted(root.rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            found += [
                f"{path.relative_to(root)}: {n}" for n in names if n.startswith("edgecache.edge")
            ]
    assert not found, found
