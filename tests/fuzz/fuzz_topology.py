"""atheris harness: the topology file (edgecache.yaml), whole file as the input.

YAML is parsed by PyYAML's pure-Python loader, so it is instrumented too:
coverage then steers the fuzzer into tags, anchors and odd scalars.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["fuzztargets", "edgecache", "yaml"]):
    import fuzztargets as t

import _harness  # noqa: E402

PATH = Path(tempfile.mkdtemp(prefix="fuzz-topology-")) / "edgecache.yaml"


@atheris.instrument_func
def one_input(data: bytes) -> None:
    t.check_topology(data, PATH)


if __name__ == "__main__":
    _harness.main(one_input, lambda: t.TOPOLOGY_SEEDS)
