"""Code generated from ``proto/edgecache/v1/*.proto`` (the wire contract and on-disk records).

The ``*_pb2*`` modules are produced at build time by ``proto/generate.py``;
edit the ``.proto`` files, never the generated modules.
"""
