"""Errors raised by edgecache.

Every error is an :class:`EdgeCacheError`; most also inherit the builtin a
caller would naturally catch, so ``except KeyError`` still works::

    EdgeCacheError
    ├── InvalidName (ValueError)               a dataset name or "name@N" spec is malformed
    ├── ManifestError (ValueError)             a manifest cannot be parsed or fails its digest
    ├── ConfigError (ValueError)               a node setting is missing or invalid
    │   └── ConfigFileError                    a topology or schedule file is missing or invalid
    ├── InvalidEndpoint (ValueError)           an endpoint string, list or region cannot be used
    ├── StateMismatch (ValueError)             a resume state of another version or layout
    ├── VersionNotFound (KeyError)             no such dataset or version in the registry
    ├── VersionExists                          another publisher took that version number first
    ├── VersionPinned (ValueError)             an eviction refused: a scheduled job reads it
    ├── PinChanged                             a conditional pin change found another time held
    ├── MalformedShard (ValueError)            a raw shard cannot be parsed; names object and row
    ├── UnknownTransform (ValueError)          no built-in or entry-point transform of that name
    ├── ObjectExists (FileExistsError)         a create-only write found the object already there
    ├── OriginError (OSError)                  origin storage cannot be reached or refuses
    │   ├── ObjectNotFound (FileNotFoundError) no object at that URL
    │   └── OriginChanged                      an object differs from what the version recorded
    ├── CodecError (ValueError)
    │   ├── ChunkCorrupt                       the bytes changed after encoding: never use them
    │   │   └── ChunkTruncated                 fewer bytes than the frame header promises
    │   ├── SchemaMismatch                     data does not have the schema the version declares
    │   ├── EmptyShard                         a shard with no rows
    │   └── ChunkTooLarge                      a chunk larger than a reader accepts
    ├── StoreError (OSError)
    │   ├── CacheDirError                      the cache dir is missing, unwritable or foreign
    │   ├── WriterLocked                       another process holds the cache's writer lock
    │   ├── ReadOnlyStore                      a write on a store opened read-only
    │   ├── StoreForked                        a store used in a child after fork()
    │   ├── ShardNotCached (KeyError)          the shard is not resident (a miss)
    │   └── CacheFull                          no room even after evicting everything allowed
    │       └── ShardTooLarge                  one shard is larger than the whole capacity
    └── NodeError                              a node answered a call with an error status
        ├── NodeUnavailable (ConnectionError)  unreachable, draining, or out of time
        ├── InvalidRequest (ValueError)        the node refused the request's arguments
        ├── AccessDenied (PermissionError)     a token or certificate is missing or wrong
        └── AllNodesFailed (ConnectionError)   every endpoint failed; each one's error listed

Messages say what to do next, because they end up in front of operators.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

__all__ = [
    "AccessDenied",
    "AllNodesFailed",
    "CacheDirError",
    "CacheFull",
    "DiskFull",
    "ChunkCorrupt",
    "ChunkTruncated",
    "CodecError",
    "ConfigError",
    "ConfigFileError",
    "EdgeCacheError",
    "EmptyShard",
    "ChunkTooLarge",
    "InvalidEndpoint",
    "InvalidName",
    "InvalidRequest",
    "MalformedShard",
    "NodeError",
    "NodeUnavailable",
    "ObjectExists",
    "ObjectNotFound",
    "ManifestError",
    "OriginChanged",
    "OriginError",
    "PinChanged",
    "ReadOnlyStore",
    "SchemaMismatch",
    "ShardNotCached",
    "ShardTooLarge",
    "StateMismatch",
    "StoreError",
    "StoreForked",
    "UnknownTransform",
    "VersionExists",
    "VersionNotFound",
    "VersionPinned",
    "WriterLocked",
    "causes",
]


class EdgeCacheError(Exception):
    """Base of every edgecache error."""


class InvalidName(EdgeCacheError, ValueError):
    """A dataset name or version spec does not follow the naming rules."""


class ManifestError(EdgeCacheError, ValueError):
    """A manifest is malformed or its digest does not match its content."""


class ConfigError(EdgeCacheError, ValueError):
    """A setting is missing or invalid."""


class ConfigFileError(ConfigError):
    """A topology or schedule file is missing or invalid; the message names file and line."""


class InvalidEndpoint(EdgeCacheError, ValueError):
    """An endpoint cannot be used: not ``host:port``, not a list, or an unknown region."""


class StateMismatch(EdgeCacheError, ValueError):
    """A resume state dict from another dataset, version or layout."""


class VersionNotFound(EdgeCacheError, KeyError):
    """The registry has no such dataset or version."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class VersionExists(EdgeCacheError):
    """A version number was taken by another publisher; publish again for the next one."""


class VersionPinned(EdgeCacheError, ValueError):
    """An eviction was refused: the version is pinned for a scheduled job (--force overrides)."""


class PinChanged(EdgeCacheError):
    """A pin was to change only if still held until a time, and another time is held.

    Someone pinned the version again since the caller placed or last saw its
    pin (another tool, another schedule): the pin is theirs too, so it stays.
    ``held`` is the time the node holds (None: not pinned).
    """

    def __init__(self, message: str, held: datetime | None) -> None:
        super().__init__(message)
        self.held = held


class MalformedShard(EdgeCacheError, ValueError):
    """A raw shard cannot be turned into the version's Arrow schema."""


class UnknownTransform(EdgeCacheError, ValueError):
    """A preprocessing spec names a transform nobody registered."""


class OriginError(EdgeCacheError, OSError):
    """Origin storage is unreachable or refused a request (after retries)."""


class ObjectNotFound(OriginError, FileNotFoundError):
    """No object at that URL."""


class ObjectExists(EdgeCacheError, FileExistsError):
    """A create-only write found the object already there."""


class OriginChanged(OriginError):
    """An origin object no longer matches the ETag/size/checksum the version recorded."""


class StaleDigest(OriginChanged):
    """A reader's digest of a version is not the one the node and its registry hold.

    The reader's to fix (resolve the version again), not the node's: counted
    apart in the node's read metrics, so the failing-reads alert does not page
    an operator to republish data for a stale or misconfigured reader.
    """


class CodecError(EdgeCacheError, ValueError):
    """Stored chunk bytes could not be encoded or decoded."""


class ChunkCorrupt(CodecError):
    """A chunk's checksum does not match its bytes; the data must not be used."""


class ChunkTruncated(ChunkCorrupt):
    """A chunk is shorter than its header says: damage like any other, never served."""


class SchemaMismatch(CodecError):
    """Record batches do not carry the schema the shard was declared with."""


class EmptyShard(CodecError):
    """A shard has no rows at all."""


class ChunkTooLarge(CodecError):
    """A chunk's frame is larger than any reader accepts in one message: never stored."""


class StoreError(EdgeCacheError, OSError):
    """The LMDB cache store cannot do what was asked."""


class CacheDirError(StoreError):
    """The cache directory is missing, not writable, or not an edgecache store."""


class WriterLocked(StoreError):
    """Another process already holds the store's single writer lock."""


class ReadOnlyStore(StoreError):
    """A write was attempted on a store opened with ``readonly=True``."""


class StoreForked(StoreError):
    """A store object crossed ``fork()``; LMDB environments must not."""


class ShardNotCached(StoreError, KeyError):
    """The requested shard is not resident in this cache."""

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0]) if self.args else ""


class CacheFull(StoreError):
    """A shard does not fit even after evicting every unpinned shard."""


class ShardTooLarge(CacheFull):
    """A single shard is larger than the cache's whole capacity."""


class DiskFull(CacheFull):
    """The volume under the cache ran out of space before the cache's capacity did.

    A :class:`CacheFull` (RESOURCE_EXHAUSTED to callers), kept apart so a node
    can tell an operator once that the disk, not the LRU, is the limit.
    """


class NodeError(EdgeCacheError):
    """A node answered a call with an error status.

    ``endpoint`` is the node, ``code`` the gRPC status name (``""`` when the
    failure was not a status), so scripts can tell causes apart without
    importing grpc.
    """

    def __init__(self, message: str, *, endpoint: str = "", code: str = "") -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.code = code


class NodeUnavailable(NodeError, ConnectionError):
    """A node cannot be reached, is draining, or did not answer in time."""


class InvalidRequest(NodeError, ValueError):
    """A node refused the arguments of a call (INVALID_ARGUMENT)."""


class AccessDenied(NodeError, PermissionError):
    """A node refused the call's credentials (bearer token or client certificate)."""


class AllNodesFailed(NodeError, ConnectionError):
    """Every endpoint failed; the message lists each with its last error."""


def causes(exc: BaseException, *, itself: bool = False) -> Iterator[BaseException]:
    """What ``exc`` was raised ``from``, nearest first: its ``__cause__``, then that one's.

    With ``itself``, ``exc`` comes first: for a question the error may answer
    as well as what it stands on (is this a full disk?), where a wrapper such as
    :class:`OriginError` is itself an ``OSError``.
    """
    cause = exc if itself else exc.__cause__
    while cause is not None:
        yield cause
        cause = cause.__cause__
