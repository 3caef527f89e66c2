"""atheris harness: manifests, as JSON from origin and as protobuf over gRPC.

The first byte picks how the rest is read: 0 JSON, 1 protobuf, 2 protobuf and
3 JSON parsed leniently with the digest recomputed, so that mutations also
reach what is checked after the digest (names, shard numbering, the Arrow
schema, timestamps) instead of all stopping at "digest does not match".
"""

from __future__ import annotations

import atheris

INSTRUMENTED = ["fuzztargets", "edgecache", "google.protobuf.json_format"]
with atheris.instrument_imports(include=INSTRUMENTED):
    import fuzztargets as t

import _harness  # noqa: E402


@atheris.instrument_func
def one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % 4, data[1:]
    if mode == 0:
        t.check_manifest_json(body)
    elif mode == 1:
        t.check_manifest_bytes(body)
    else:
        t.check_manifest_restamped(body, from_json=mode == 3)


def seeds() -> list[bytes]:
    out = []
    for manifest in t.manifest_seeds():
        text, binary = t.manifest_to_json(manifest).encode(), manifest.SerializeToString()
        out += [b"\0" + text, b"\1" + binary, b"\2" + binary, b"\3" + text]
    return out


if __name__ == "__main__":
    _harness.main(one_input, seeds)
