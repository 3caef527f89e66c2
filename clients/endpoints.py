"""Endpoints: where a reader can get shards, as written by a user or a topology file.

``host:port`` (``grpc://`` optional), ``grpcs://host:port`` (TLS) or
``lmdb:///path/to/cache`` (a node's cache directory on this host: read
directly, no gRPC).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from edgecache.cache.errors import InvalidEndpoint

__all__ = ["Endpoint", "parse_endpoint"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One place to read from."""

    text: str
    kind: str  # "grpc", "grpcs" or "lmdb"
    target: str  # host:port, or a directory

    @property
    def local(self) -> bool:
        """Whether this is a cache directory on this host."""
        return self.kind == "lmdb"


def parse_endpoint(text: str) -> Endpoint:
    """``host:port``, ``grpc://host:port``, ``grpcs://host:port`` or ``lmdb:///dir``."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidEndpoint(f"endpoint must be a non-empty string, got {text!r}")
    raw = text.strip()
    if raw.startswith("lmdb://"):
        path = raw[len("lmdb://") :]
        if not path.startswith("/"):
            raise InvalidEndpoint(f"{text!r}: use lmdb:///absolute/path/to/cache")
        return Endpoint(raw, "lmdb", path)
    scheme, _, rest = raw.rpartition("://") if "://" in raw else ("grpc", "", raw)
    if scheme not in ("grpc", "grpcs"):
        raise InvalidEndpoint(
            f"{text!r}: unknown scheme {scheme!r}; use host:port, grpcs://host:port or lmdb:///path"
        )
    try:  # urlsplit refuses a bracketed host that is no IP ("[*a]") with a bare ValueError
        parts = urlsplit(f"//{rest}")
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise InvalidEndpoint(f"{text!r} is not host:port (e.g. eu-1.internal:7070)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return Endpoint(raw, scheme, f"{host}:{port}")
