"""atheris harness: chunk frames, as a client receives them or the store reads them back.

The first byte picks the mode; the rest is a frame:

* bits 0-1: 0 the frame as given; 1 checksum recomputed; 2 checksum and
  length fields recomputed; 3 the rest is ``rows`` (one byte) and a raw Arrow
  IPC stream, wrapped into a correct frame (zstd-compressed if bit 5 is set).
  Modes 1-3 get mutations past the checksum into zstd and the Arrow reader.
* bits 2-3: the schema the caller expects: none, tokens, mixed, none.
* bit 4: ``verify=False`` (the store's path, for bytes verified on write).
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports(include=["fuzztargets", "edgecache"]):
    import fuzztargets as t

import _harness  # noqa: E402

SCHEMAS = (None, t.TOKEN_SCHEMA, t.MIXED_SCHEMA, None)


@atheris.instrument_func
def frame_for(mode: int, body: bytes) -> bytes:
    """The frame a mode byte and the rest of the input describe."""
    kind = mode & 3
    if kind == 0:
        return body
    if kind in (1, 2):
        return t.reseal(body, fix_lengths=kind == 2)
    if not body:
        return body
    return t.wrap_payload(body[1:], rows=body[0], zstd=bool(mode & 0x20))


@atheris.instrument_func
def one_input(data: bytes) -> None:
    if not data:
        return
    mode = data[0]
    t.check_chunk(frame_for(mode, data[1:]), SCHEMAS[(mode >> 2) & 3], verify=not mode & 0x10)


def seeds() -> list[bytes]:
    out = []
    for frame, schema in t.chunk_seeds():
        bits = (1 if schema.equals(t.TOKEN_SCHEMA) else 2) << 2
        for kind in (0, 1, 2):
            out.append(bytes([bits | kind]) + frame)
        header = t.read_header(frame)
        raw = t.raw_payload(frame)
        for zstd in (0, 0x20):
            out.append(bytes([bits | 3 | zstd, header.rows]) + raw)
    return out


if __name__ == "__main__":
    _harness.main(one_input, seeds)
