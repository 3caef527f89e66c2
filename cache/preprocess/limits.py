"""How far a node lets one origin object expand while it is preprocessed.

Origin is not trusted to be well-formed (docs/security.md, "A compromised
origin"): a few kilobytes of gzip, zstd, bz2 or xz can claim or produce many
gigabytes, a Parquet dictionary page can repeat one large value for every
row, and a node holds a shard's decoded bytes (and its frames) in memory
while it encodes it. Each limit below turns such an object into a
:class:`~edgecache.cache.errors.MalformedShard` naming it, instead of a node
killed for memory. They are read at call time, so tests (and, if ever
needed, an operator's sitecustomize) can lower them.

The figures are far above real shards (a few hundred MB raw is typical; the
node keeps a whole shard in memory anyway) and far below a node's memory.
"""

from __future__ import annotations

__all__ = [
    "BATCH_DECODED_BYTES",
    "MAX_DECODED_BYTES",
    "MAX_DECOMPRESSED_BYTES",
    "MAX_INFLATION",
    "MAX_RESOURCE_BYTES",
    "MIN_INFLATION_LIMIT",
]

# A compressed object (gzip, zstd, bz2, xz) is refused once it inflates past this.
MAX_DECOMPRESSED_BYTES = 4 << 30
# ... or past this many times its own size, once past MIN_INFLATION_LIMIT. Real data
# (JSON Lines, CSV, text) compresses 3-20x, rarely 100x; a bomb 1000x and more. Without
# it, each of the fetches a node runs at once (fetch + staging concurrency: 8) could
# hold 4 GiB of a few KB of zeros, past a pod's memory limit.
MAX_INFLATION = 200
MIN_INFLATION_LIMIT = 256 << 20
# The Arrow data one shard decodes to, summed over its batches (before the transform).
MAX_DECODED_BYTES = 16 << 30
# Parquet string/binary columns are decoded in slices of about this many bytes, so a
# dictionary page that repeats one large value is never expanded in one allocation.
BATCH_DECODED_BYTES = 256 << 20
# A transform's file (a tokenizer.json) larger than this is refused before it is read.
MAX_RESOURCE_BYTES = 1 << 30
