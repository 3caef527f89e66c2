"""Which registry a node reads, against the one a tool uses: shown without secrets, compared.

A node says in ``Status`` which registry it reads (``NodeStatus.registry``);
the CLI and the controller take theirs from the topology file's ``registry:``.
A node pointed at another registry answers health checks and ``Status`` like
any other, and fails only when asked for a version published where the tool
looks (NOT_FOUND, naming its own registry). ``edgecache status`` and
``doctor`` say so, and ``warm`` (the controller too) refuses to stage on such
a node instead of failing there later.

Here, below the node and the clients both: the node shows its URL the way the
clients compare it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from edgecache.cache.registry import location_url

__all__ = ["RegistryCheck", "RegistryMatch", "check_registry", "registry_key", "shown_url"]


def shown_url(url: str) -> str:
    """``url`` without what could be a secret: ``user:password@``, ``?query``, ``#fragment``.

    A registry is a setting, and its URL may carry credentials
    (``https://user:token@host/reg``, a presigned ``?X-Amz-Signature=…``): a
    node reports this form in ``Status``, to any client allowed to call it,
    and tools print it. Chained fsspec URLs (``simplecache::s3://…``) are
    cleaned part by part. A ``file://`` URL is a local path, where ``?``,
    ``#`` and ``@`` are characters of a name, not secrets: it is kept whole.
    """
    parts = []
    for part in url.split("::"):
        scheme, sep, rest = part.partition("://")
        if not sep or scheme.lower() == "file":
            parts.append(part)
            continue
        rest = rest.split("#", 1)[0].split("?", 1)[0]
        authority, slash, path = rest.partition("/")
        parts.append(f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}")
    return "::".join(parts)


def registry_key(url: str) -> str:
    """``url`` spelled one way, without secrets: absolute ``file://`` URL, no trailing slash.

    What a node reports in ``Status``, and what two URLs are compared as.

    ``file:///x`` and ``file:///x/``, ``s3://b/p`` and ``s3://b/p/``, a plain
    path and its ``file://`` URL name one registry; so do two URLs that differ
    only in credentials (both sides are compared as :func:`shown_url` shows them).
    """
    try:
        url = location_url(url, "registry")
    except ValueError:  # a scheme this host has no store for: compared as spelled
        pass
    # The store a chain ends in is the registry (``simplecache::s3://b/p`` reads s3://b/p).
    scheme, sep, rest = shown_url(url).rpartition("::")[2].partition("://")
    if not sep:
        return url.rstrip("/") or url
    scheme = _ALIASES.get(scheme.lower(), scheme.lower())
    host, slash, path = rest.partition("/")
    port = _DEFAULT_PORTS.get(scheme)
    if port and host.endswith(port):
        host = host[: -len(port)]
    rest = host + slash + path
    return f"{scheme}://{rest.rstrip('/') or rest[:1]}"


_ALIASES = {"gcs": "gs", "s3a": "s3"}  # fsspec's names for one store
_DEFAULT_PORTS = {"https": ":443", "http": ":80"}


class RegistryMatch(Enum):
    """How a node's registry compares with the one a tool uses."""

    SAME = "same"
    UNKNOWN = "unknown"  # the node did not say (one older than NodeStatus.registry)
    DIFFERS = "differs"  # two object-store URLs that differ: surely another registry
    PATH_DIFFERS = "path_differs"  # a file:// path on one side: maybe one folder, mounted apart


@dataclass(frozen=True)
class RegistryCheck:
    """A node's registry (as it reported it) against the tool's (``ours``), and the verdict."""

    node: str  # the node's address
    ours: str  # as shown: no credentials
    theirs: str  # "" when the node did not say
    match: RegistryMatch

    @property
    def refuses(self) -> bool:
        """Whether staging on the node is refused: surely another registry."""
        return self.match is RegistryMatch.DIFFERS

    @property
    def differs(self) -> bool:
        """Whether the two are spelled differently (surely or maybe another registry)."""
        return self.match in (RegistryMatch.DIFFERS, RegistryMatch.PATH_DIFFERS)

    def message(self) -> str:
        """What is wrong and what to do, naming both registries ("" when nothing is)."""
        if self.match is RegistryMatch.DIFFERS:
            return (
                f"{self.node} reads the registry {self.theirs}, not the one the topology names "
                f"({self.ours}): it finds none of the versions published there (staging and "
                f"reads fail NOT_FOUND); point the node at {self.ours} (its --registry or "
                "EDGECACHE_REGISTRY; in Kubernetes, EDGECACHE_REGISTRY in the ConfigMap "
                "deploy/k8s/base/site.env, then restart the nodes), or, if the node's is the "
                "right one, fix registry: in the topology file"
            )
        if self.match is RegistryMatch.PATH_DIFFERS:
            return (
                f"{self.node} reads the registry {self.theirs}, the topology names "
                f"{self.ours}: a local path is read on each host, so the two may be one folder "
                "mounted at different paths (a container's volume, a bucket mounted as a "
                "folder); if they are not, the node finds none of the versions published "
                "there: point its --registry or EDGECACHE_REGISTRY at that folder, as the "
                "node's host mounts it"
            )
        return ""


def check_registry(node: str, ours: str, theirs: str) -> RegistryCheck:
    """Compare the registry a node reports (``theirs``) with the tool's (``ours``).

    An empty ``theirs`` is a node built before ``NodeStatus.registry``: unknown,
    never a mismatch. Spellings of one URL compare equal (:func:`registry_key`).
    Two different URLs are :attr:`RegistryMatch.DIFFERS`, which ``warm``
    refuses, only when neither is a ``file://`` path: a path means what it
    means on the host that reads it, and the tool and the node usually run on
    different hosts or in different containers: a volume mounts one folder at
    another path in each container, and a host may read a bucket
    mounted as a folder (``file:///mnt/bucket/_edgecache``) that its nodes
    read as ``s3://bucket/_edgecache``. Such a difference is
    :attr:`RegistryMatch.PATH_DIFFERS`: said as a warning, not refused, since
    refusing would stop a working setup, while a real mismatch still fails
    the node's staging with NOT_FOUND naming its registry.
    """
    mine = registry_key(ours)
    # Shown as compared: a local path as its absolute file:// URL, as the node reports its
    # own and the other commands show it (a bare path beside a URL looked like two kinds).
    shown = mine if mine.startswith("file://") else shown_url(ours)
    if not theirs:
        return RegistryCheck(node, shown, "", RegistryMatch.UNKNOWN)
    its = registry_key(theirs)
    if mine == its:
        match = RegistryMatch.SAME
    elif mine.startswith("file://") or its.startswith("file://"):
        match = RegistryMatch.PATH_DIFFERS
    else:
        match = RegistryMatch.DIFFERS
    return RegistryCheck(node, shown, shown_url(theirs), match)
