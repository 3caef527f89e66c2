"""Rendezvous hashing, as clients use it (the code lives in :mod:`edgecache.cache.rendezvous`).

Edge nodes rank peers with the same function when they copy a version from
another region, so it lives in ``cache``; this module keeps the client-side
import path.
"""

from edgecache.cache.rendezvous import owned_shards, owner, rank, region_names, unique_names

__all__ = ["owned_shards", "owner", "rank", "region_names", "unique_names"]
