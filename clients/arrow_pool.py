"""Arrow's memory pool (mimalloc) as the ``edgecache`` command runs it.

The command sets these where the environment does not, before pyarrow loads
(``edgecache.clients.cli`` says why each); whatever starts nodes through it
(``bench.staging``) reads the settings they run with here. Nothing is imported:
this module must load before pyarrow does.
"""

from __future__ import annotations

__all__ = ["ARROW_POOL_OPTIONS"]

ARROW_POOL_OPTIONS = {"MIMALLOC_PURGE_DELAY": "10000", "MIMALLOC_ALLOW_THP": "0"}
