"""Preprocessing: the raw bytes of one origin object → Arrow record batches of a version's schema.

It lives in cache/ (not edge/) because publishing, a registry operation the CLI
runs too, must apply the same transforms to record schemas and row counts.
Edge nodes run this once per shard, in a worker thread, before encoding the
batches into cached chunks; publish runs :func:`describe` to record a shard's
schema and row count. A version's :class:`~edgecache.v1.manifest_pb2.PreprocessSpec`
names a transform (built-in, registered in-process, or installed as a Python
entry point in group ``edgecache.transforms``), so the same raw data with a
different spec is a different version.

The package reads as the pipeline's story: :mod:`.compressed` unwraps
gzip/zstd/bz2/xz objects, :mod:`.formats` parses raw objects (with
:mod:`.source_options` for CSV, :mod:`.webdataset` for tars, :mod:`.mds` for
MosaicML shards), :mod:`.arrow_types` reads type strings, :mod:`.transforms`
holds the transform registry and the built-ins (:mod:`.images`, :mod:`.text`
for the big ones), :mod:`.context` tells a transform which shard and sample it
is on, :mod:`.partitions` adds the columns Hive-style ``key=value`` folders
name, and :mod:`.pipeline` chains them.

Every way a raw object can be unusable surfaces as :class:`MalformedShard`
naming the object (and the line or row where that can be known), because the
message ends up in front of an operator who must fix or drop that object.
"""

from edgecache.cache.preprocess.arrow_types import parse_type
from edgecache.cache.preprocess.context import ShardContext
from edgecache.cache.preprocess.formats import (
    FORMATS,
    KIND_NAMES,
    format_from_key,
    format_from_name,
    read_source,
)
from edgecache.cache.preprocess.pipeline import describe, preprocess
from edgecache.cache.preprocess.source_options import canonical_options
from edgecache.cache.preprocess.transforms import (
    ENTRY_POINT_GROUP,
    Transform,
    TransformFactory,
    canonical_params,
    is_builtin,
    keeps_rows,
    load_transform,
    register_transform,
    resource_refs,
    unregister_transform,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "FORMATS",
    "KIND_NAMES",
    "ShardContext",
    "Transform",
    "TransformFactory",
    "canonical_options",
    "canonical_params",
    "describe",
    "format_from_key",
    "format_from_name",
    "is_builtin",
    "keeps_rows",
    "load_transform",
    "parse_type",
    "preprocess",
    "read_source",
    "register_transform",
    "resource_refs",
    "unregister_transform",
]
