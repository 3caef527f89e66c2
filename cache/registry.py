"""The version registry: immutable manifests in object storage.

Layout under a registry URL (``s3://bucket/_edgecache``, ``file:///srv/registry``, …)::

    <registry>/<dataset>/versions/<N>.json    one manifest per version, never overwritten
    <registry>/<dataset>/latest               the newest N, for people and tools

``versions/`` is the truth: "latest" resolves by listing it, so a publisher
killed between its two writes leaves nothing inconsistent. A version is
claimed with a create-only write (S3 ``If-None-Match: *``, or an atomic
``link()`` on local disks), so two publishers racing for the same N cannot
both succeed; the loser retries with N+1. A publisher killed before its
manifest write lands leaves no trace, and the next publish takes that N.
The ``latest`` pointer is raised with a compare-and-swap (S3 ``If-Match`` on
the ETag read, a lock on local disks), never lowered: publishers that finish
out of order cannot set it back to an older N.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import re
import shlex
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from typing import NamedTuple, TypeVar

import fsspec
import pyarrow as pa

from edgecache.cache.codec import CodecOptions
from edgecache.cache.errors import (
    MalformedShard,
    ManifestError,
    ObjectExists,
    ObjectNotFound,
    OriginError,
    VersionNotFound,
    causes,
)
from edgecache.cache.manifest import build_manifest, manifest_from_json, manifest_to_json
from edgecache.cache.names import VersionSpec, parse_spec, validate_name
from edgecache.cache.preprocess import (
    Transform,
    canonical_options,
    canonical_params,
    format_from_key,
    keeps_rows,
    limits,
    load_transform,
    resource_refs,
)
from edgecache.cache.preprocess.arrow_types import quote_name, type_label
from edgecache.cache.preprocess.compressed import strip_suffix
from edgecache.cache.preprocess.fixes import ParamMismatch, columns_text, schema_mismatch
from edgecache.cache.preprocess.formats import FORMATS, KIND_NAMES
from edgecache.cache.preprocess.mds import (
    LITDATA_ADVICE,
    MdsColumns,
    image_encoding_problem,
    is_litdata_index,
    mds_index,
)
from edgecache.cache.preprocess.nulls import NullCount, null_warnings
from edgecache.cache.preprocess.partitions import (
    RECORDED,
    hive_partitions,
    partition_fields,
    partition_nulls,
    partitioning_mode,
    recorded,
    with_partitions,
)
from edgecache.cache.preprocess.pipeline import Description, survey
from edgecache.cache.preprocess.source_options import delimiter_for_names
from edgecache.cache.storage import ObjectInfo, ObjectStore, Stores
from edgecache.cache.storage.base import unreachable
from edgecache.cache.wording import first_of
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "Registry",
    "Selection",
    "SourceObject",
    "fetch_resources",
    "location_url",
    "resource_url",
    "unread_text",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_PUBLISH_ATTEMPTS = 20
_DESCRIBE_CONCURRENCY = 16
_MAX_INDEX_BYTES = 64 << 20  # an index.json read to tell whether it is MDS's


@dataclass(frozen=True, slots=True)
class SourceObject:
    """One raw shard found at publish time."""

    info: ObjectInfo
    key: str  # relative to the source prefix
    rows: int | None = None  # when an index says (MDS), so the shard need not be read


_GLOB = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which objects under a source prefix are shards: ``--include`` / ``--exclude`` patterns.

    Patterns are matched against an object's key (its path relative to the source
    prefix) with :func:`fnmatch.fnmatchcase`: ``*`` and ``?`` match ``/`` too, so
    ``*.md`` leaves out a README in any folder. An object is kept when it matches
    ``glob`` (the source URL's last part, when that is a pattern: ``data/train-*``),
    at least one ``include`` (when there are any) and no ``exclude``. Nothing about
    the selection is recorded: the manifest lists the shards it chose.
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    glob: str | None = None

    def __post_init__(self) -> None:
        for flag, patterns in (("--include", self.include), ("--exclude", self.exclude)):
            for pattern in patterns:
                if not pattern.strip():
                    raise ValueError(f"{flag} needs a pattern, e.g. {flag} '*.parquet'")
                if pattern.startswith("/"):
                    raise ValueError(
                        f"{flag} {pattern!r}: patterns match keys relative to the source "
                        f"prefix, which never start with '/'; drop the leading '/'"
                    )

    def keeps(self, key: str) -> bool:
        """Whether the object at ``key`` (relative to the prefix) is selected."""
        if self.glob is not None and not fnmatchcase(key, self.glob):
            return False
        if self.include and not any(fnmatchcase(key, p) for p in self.include):
            return False
        return not any(fnmatchcase(key, p) for p in self.exclude)

    def text(self) -> str:
        """The patterns as a person gave them: ``the source's pattern 'train-*', --exclude …``."""
        parts = [f"the source's pattern {self.glob!r}"] if self.glob is not None else []
        parts += [f"--include {p!r}" for p in self.include]
        parts += [f"--exclude {p!r}" for p in self.exclude]
        return ", ".join(parts)


def _is_glob(name: str) -> bool:
    return any(c in _GLOB for c in name)


# An object store's scheme written with one slash or none (s3:/bucket, gs:bucket).
_SCHEME_TYPO = re.compile(r"(s3|gs|gcs|az|abfs|abfss|hf|http|https|ftp|sftp|memory):/?(?!/)")


def location_url(location: str, what: str) -> str:
    """The URL of a registry or source as the object stores name what they list.

    A plain path (``raw/pq``, ``/data/raw``) and a relative ``file://`` URL
    become absolute ``file://`` URLs, fsspec's convention for local files:
    listings name local objects by absolute ``file://`` URLs, and keys are cut
    from them by prefix, so the prefix must be spelled the same way. A scheme
    no store serves is refused here (``ValueError``, bad input), before any
    request, instead of failing every later request; ``what`` names the
    location in that message.
    """
    scheme, sep, rest = location.partition("://")
    if not sep and location.startswith("file:/"):  # RFC 8089's file:/abs/path
        rest = location.removeprefix("file:")
        return "file://" + os.path.abspath(rest) + ("/" if rest.endswith("/") else "")
    if not sep and (typo := _SCHEME_TYPO.match(location)):
        # s3:/bucket or s3:bucket: read as a local directory named "s3:", then "no
        # objects under file:///here/s3:/bucket", which hid the missing slash.
        raise ValueError(
            f"{what} {location!r} looks like a URL ({typo[1]}://) missing a slash: "
            f"write {typo[1]}://{location[typo.end() :]} (or ./{location} for a local "
            "directory of that name)"
        )
    if not sep:
        return "file://" + os.path.abspath(location) + ("/" if location.endswith("/") else "")
    if scheme == "file":
        return "file://" + os.path.abspath(rest) + ("/" if rest.endswith("/") else "")
    if scheme == "s3":
        return location
    for protocol in scheme.split("::"):  # chained fsspec URLs: simplecache::gs://…
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ValueError(
                f"{what} {location}: no object store serves {protocol}://; use s3://, "
                "file:// (or a local path) or another fsspec protocol"
            ) from None
        except ImportError as exc:
            raise ValueError(f"{what} {location}: {exc}") from None
    return location


def _local_path(url: str) -> str | None:
    """The directory a ``file://`` URL names, or None for other stores."""
    return url[len("file://") :] if url.startswith("file://") else None


# Where each location a message may name is set, so the message says what to check.
_WHERE = {
    "registry": "--registry (or registry: in the topology file)",
    "source": "the source URL",
}


def _unreachable_text(what: str, url: str, exc: OriginError) -> str:
    """``cannot reach registry URL: why; check …``: an error that names whom it could not reach.

    ``exc`` is the store's, raised from the socket's error (the ``why``); ``what``
    is ``registry`` or ``source``.
    """
    why = exc.__cause__
    said = str(why) or type(why).__name__  # a timeout says nothing: TimeoutError
    where = _WHERE[what]
    if url.startswith("s3://"):  # asked at the endpoint boto is given, not at the URL's host
        where += ", AWS_ENDPOINT_URL (the S3 endpoint asked)"
    return f"cannot reach {what} {url}: {said}; check {where} and the network"


@contextlib.contextmanager
def _reaching(what: str, url: str) -> Iterator[None]:
    """Say which location did not answer, and where it is set, for a store that could not reach it.

    The store names a URL deep in the registry (or source) and says to check "the
    URL": the person running the command needs to hear it is the registry (or
    source) they gave, and which option gives it. A refusal or another failure of
    the store is said as the registry's (or source's), not "origin"'s; every other
    error passes as it is (an object not found, a version taken).
    """
    try:
        yield
    except OriginError as exc:
        if unreachable(exc):
            raise OriginError(_unreachable_text(what, url, exc)) from exc
        said = str(exc)
        if type(exc) is OriginError and said.startswith("origin "):
            from edgecache.cache.registry_match import shown_url  # it imports this module

            # The store calls whatever it reads "origin": a registry that refused access
            # was "origin refused access to …", sending the reader to the source's
            # credentials. The chain is kept, so a refusal still reads as one. The URL
            # (and each under it) is shown without credentials it may carry.
            shown = shown_url(url)
            said = said.removeprefix("origin ").replace(url, shown)
            raise OriginError(f"{what} {shown} {said}") from exc
        raise


def resource_url(source_url: str, ref: str) -> str:
    """Where a transform's file lives: a URL as given, or a key under the source prefix.

    An absolute path (``tokenizer=/data/tok.json``) is a local file, never a
    key: with a ``file://`` source the nodes read that filesystem anyway, so
    it is ``file://`` + the path; with an object-store source no node can
    read the publisher's disk, so it is refused (its leading ``/`` used to be
    dropped silently, turning it into a key under the prefix).
    """
    if "://" in ref:
        return ref
    if ref.startswith("/"):
        if source_url.startswith("file://"):
            return "file://" + ref
        raise ValueError(
            f"{ref!r} is a path on this machine, which the nodes reading {source_url} cannot "
            f"see; upload the file under the source prefix and give its key (e.g. "
            f"{ref.rsplit('/', 1)[-1]}), or name it by its full URL"
        )
    if ".." in ref.split("/"):
        raise ValueError(
            f"{ref!r} climbs out of the source prefix with '..': give a key under "
            f"{source_url} or the file's full URL"
        )
    # ``./tokenizer.json`` is the key ``tokenizer.json``: the one the listing names, so
    # the file is left out of the shards, and the one an object store holds.
    key = "/".join(part for part in ref.split("/") if part not in ("", "."))
    return (source_url if source_url.endswith("/") else source_url + "/") + key


async def fetch_resources(
    stores: Stores, source_url: str, spec: pb.PreprocessSpec
) -> dict[str, bytes]:
    """The files the spec's transform needs (a tokenizer), fetched from origin by reference.

    Raises:
        ObjectNotFound: a file is not there; the message names the param and URL.
    """
    out = {}
    for ref in resource_refs(spec.transform, spec.params):
        url = resource_url(source_url, ref)
        store = stores.for_url(url)
        try:
            info = await store.head(url)
            if info.size > limits.MAX_RESOURCE_BYTES:  # read whole into every node's memory
                raise MalformedShard(
                    f"transform {spec.transform!r} needs {ref!r}, but {url} is {info.size:,} "
                    f"bytes, more than the {limits.MAX_RESOURCE_BYTES:,} a node reads for a "
                    "transform's file; point the param at the right file"
                )
            out[ref] = await store.get(url, expect=info)
        except ObjectNotFound as exc:
            raise ObjectNotFound(
                f"transform {spec.transform!r} needs {ref!r}, but there is no object at {url}; "
                "put the file there or name it by its full URL"
            ) from exc
    return out


class Registry:
    """Read and publish dataset versions under one registry URL."""

    def __init__(self, url: str, stores: Stores | None = None) -> None:
        if not url:
            raise ValueError("a registry URL is required, e.g. s3://bucket/_edgecache")
        # The URL every message names the registry by: a local path as its file:// URL.
        self.url = location_url(url, "registry").rstrip("/")
        self._stores = stores or Stores()
        self._own_stores = stores is None

    async def close(self) -> None:
        """Close the stores this registry opened itself."""
        if self._own_stores:
            await self._stores.close()

    async def __aenter__(self) -> Registry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @classmethod
    def run(cls, url: str, work: Callable[[Registry], Awaitable[T]]) -> T:
        """Run ``work(registry)`` on a fresh event loop: for synchronous callers (the CLI)."""

        async def go() -> T:
            async with cls(url) as registry:
                return await work(registry)

        return asyncio.run(go())

    def _store(self, url: str) -> ObjectStore:
        return self._stores.for_url(url)

    def version_url(self, dataset: str, version: int) -> str:
        """Where a version's manifest lives."""
        return f"{self.url}/{validate_name(dataset)}/versions/{version}.json"

    async def datasets(self) -> list[str]:
        """Every dataset with at least one version."""
        with _reaching("registry", self.url):
            found = await self._store(self.url).list(self.url + "/")
        names = set()
        for obj in found:
            parts = obj.url[len(self.url) + 1 :].split("/")
            if len(parts) == 3 and parts[1] == "versions" and parts[2].endswith(".json"):
                names.add(parts[0])
        return sorted(names)

    async def versions(self, dataset: str) -> list[int]:
        """Published version numbers of a dataset, ascending."""
        prefix = f"{self.url}/{validate_name(dataset)}/versions/"
        numbers = []
        with _reaching("registry", self.url):
            found = await self._store(prefix).list(prefix)
        for obj in found:
            name = obj.url.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                numbers.append(int(name[:-5]))
        return sorted(numbers)

    async def published(self, dataset: str) -> list[int]:
        """Published version numbers of a dataset; :class:`VersionNotFound` if there are none.

        For readers, to whom a dataset without versions is a mistake (a typo in
        the name or the registry URL); publishers list with :meth:`versions`.
        """
        numbers = await self.versions(dataset)
        if not numbers:
            raise await self._no_versions(dataset)
        return numbers

    async def latest(self, dataset: str) -> int:
        """The newest version number; :class:`VersionNotFound` if there is none."""
        return (await self.published(dataset))[-1]

    async def _no_versions(self, dataset: str) -> VersionNotFound:
        """The error for a dataset without versions, saying what the registry does hold.

        An object store has no empty folders: a registry nothing was published
        to and one that was never created look the same, except on a local disk.
        """
        names = await self.datasets()
        if names:
            shown = first_of(names, 20)
            return VersionNotFound(
                f"dataset {dataset!r} has no versions in {self.url}, which holds {shown}; "
                "check the name, or publish it (edgecache publish)"
            )
        local = _local_path(self.url)
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            return VersionNotFound(
                f"the registry {self.url} is a file, not a directory, so dataset {dataset!r} "
                "has no versions there; check the registry URL (--registry, or registry: in "
                "the topology file): a local registry is a directory"
            )
        state = "does not exist" if local and not os.path.isdir(local) else "holds no datasets"
        return VersionNotFound(
            f"the registry {self.url} {state}, so dataset {dataset!r} has no versions there; "
            "check the registry URL (--registry, or registry: in the topology file), or "
            "publish a version there (edgecache publish creates the registry)"
        )

    async def manifest(self, dataset: str, version: int) -> pb.Manifest:
        """Read and verify one version's manifest."""
        url = self.version_url(dataset, version)
        try:
            with _reaching("registry", self.url):
                text = await self._store(url).get(url)
        except ObjectNotFound as exc:
            known = await self.published(dataset)  # none: says what the registry holds
            raise VersionNotFound(
                f"{dataset}@{version} is not in {self.url} (known versions: "
                f"{', '.join(map(str, known))})"
            ) from exc
        manifest = manifest_from_json(text, source=url)
        if (manifest.dataset, manifest.version) != (dataset, version):
            raise ManifestError(
                f"{url} holds {manifest.dataset}@{manifest.version}, not {dataset}@{version}"
            )
        return manifest

    async def resolve(self, spec: str | VersionSpec) -> pb.Manifest:
        """The manifest for ``name``, ``name@latest`` or ``name@N``."""
        parsed = parse_spec(spec) if isinstance(spec, str) else spec
        version = parsed.version or await self.latest(parsed.dataset)
        return await self.manifest(parsed.dataset, version)

    async def commit(self, manifest: pb.Manifest) -> pb.Manifest:
        """Write ``manifest`` as the next free version number and return it as written.

        The manifest's own version number is a starting guess; a taken number is
        skipped. The digest does not cover the number, so it stays valid. Nor does it
        cover ``created_at``, stamped here, as the version is written: it says which
        version was the newest when a job started (``clients/ops/at_start.py``), and
        stamped when the manifest was built (seconds earlier, after reading every
        shard's metadata) a job starting meanwhile was matched to a version it could
        not yet have read.
        """
        validate_name(manifest.dataset)
        existing = await self.versions(manifest.dataset)
        number = max(existing[-1] + 1 if existing else 1, manifest.version or 1)
        for _ in range(_PUBLISH_ATTEMPTS):
            candidate = pb.Manifest()
            candidate.CopyFrom(manifest)
            candidate.version = number
            candidate.created_at.FromDatetime(datetime.now(UTC))
            url = self.version_url(manifest.dataset, number)
            try:
                await self._store(url).put(
                    url, manifest_to_json(candidate).encode(), if_absent=True
                )
            except ObjectExists:
                log.info("%s taken by another publisher; trying %d", url, number + 1)
                number += 1
                continue
            except OriginError as exc:  # the create-only write left nothing behind
                raise OriginError(
                    _unwritable(self.url, f"{manifest.dataset}@{number}", exc)
                ) from exc
            latest = f"{self.url}/{manifest.dataset}/latest"
            try:
                await self._store(latest).update(latest, functools.partial(_raised_to, number))
            except OriginError as exc:
                # The version is published (versions/ is the truth); failing now would
                # have the user publish it again as a copy under the next number. The
                # pointer is replaced whole or not at all, so it keeps its old value.
                log.warning(
                    "%s@%d is published, but its latest pointer %s could not be updated "
                    "(%s); readers list versions/, so nothing depends on it",
                    manifest.dataset,
                    number,
                    latest,
                    exc,
                )
            return candidate
        raise ObjectExists(
            f"could not claim a version number for {manifest.dataset} after "
            f"{_PUBLISH_ATTEMPTS} attempts; too many concurrent publishers?"
        )

    async def list_sources(
        self,
        source_url: str,
        fmt: pb.SourceFormat.ValueType | None = None,
        *,
        exclude: frozenset[str] = frozenset(),
        select: Selection | None = None,
    ) -> tuple[list[SourceObject], pb.SourceFormat.ValueType]:
        """The raw shards under a prefix, and their format (given, or guessed from names).

        ``exclude``: keys that are not shards (a transform's files, e.g. a tokenizer).
        ``select``: the ``--include``/``--exclude`` patterns (a glob in the source URL's
        last part is added to them). An MDS dataset's shards are the ones its
        ``index.json`` files list. A single object given as the source is the one
        shard, its key cut from its folder.
        """
        prefix, single, glob = await self._source(location_url(source_url, "source"))
        chosen = _with_glob(select or Selection(), glob)
        return await self._listed(prefix, single, fmt, exclude, chosen)

    async def _source(self, url: str) -> tuple[str, SourceObject | None, str | None]:
        """The source's prefix; when ``url`` names one object, that object; or its pattern.

        A person publishing one file (``raw/a.parquet``) means that file: it is a
        version of one shard, whose prefix is the file's folder (nodes fetch prefix +
        key). A URL ending in ``/`` is a prefix, and so is one naming no object (a
        directory, or an object-store prefix): one HEAD request tells them apart. A
        last part that names nothing and holds ``*``, ``?`` or ``[``
        (``data/train-*.parquet``) is a pattern over the keys under its folder.
        """
        if url.endswith("/"):
            return url, None, None
        scheme, _, rest = url.partition("://")
        if scheme == "s3" and "/" not in rest:  # a bucket alone: no object's name
            return url + "/", None, None
        folder, _, name = url.rpartition("/")
        local = _local_path(url)
        if local is not None and not os.path.isfile(local):
            if _is_glob(name) and not os.path.isdir(local):
                return folder + "/", None, name
            return url + "/", None, None
        try:
            info = await self._store(url).head(url)
        except OriginError:  # none there; refused (reads granted under the prefix alone);
            # or unreachable, which the listing below says naming the source (_reaching)
            if _is_glob(name):
                return folder + "/", None, name
            return url + "/", None, None  # the listing then says what is wrong, as it did
        return folder + "/", SourceObject(info=info, key=name), None

    async def _listed(
        self,
        prefix: str,
        single: SourceObject | None,
        fmt: pb.SourceFormat.ValueType | None,
        exclude: frozenset[str],
        select: Selection,
    ) -> tuple[list[SourceObject], pb.SourceFormat.ValueType]:
        """The shards under ``prefix`` (or ``single`` alone) and their format.

        An ``index.json`` is never data: LitData's is refused (its chunks are no
        source), and MDS's, under another ``--format``, is left out of the shards.
        """
        if single is not None and not select.keeps(single.key):
            raise ObjectNotFound(
                f"the source {single.info.url} is one object, and {select.text()} leaves it "
                "out; drop the pattern, or give the folder as the source"
            )
        found = [single] if single is not None else await self._objects(prefix, exclude, select)
        if fmt is None or fmt == pb.SOURCE_FORMAT_UNSPECIFIED:
            fmt = await self._guess_format(prefix, found)
        elif fmt != pb.SOURCE_FORMAT_MDS:
            found = await self._not_indexes(prefix, found, fmt)
        if single is not None and fmt == pb.SOURCE_FORMAT_MDS:
            # An MDS dataset is its directory: one of its files (its index.json) names it.
            found = await self._objects(prefix, exclude, select)
        return found, fmt

    async def _not_indexes(
        self, prefix: str, found: list[SourceObject], fmt: pb.SourceFormat.ValueType
    ) -> list[SourceObject]:
        """``found`` less the MDS indexes among them; a LitData index refused."""
        kept = []
        for obj in found:
            shape = await self._index_shape(obj)
            if shape == "litdata":
                raise MalformedShard(_litdata(obj.info.url))
            if shape != "mds":
                kept.append(obj)
        if not kept:
            raise ObjectNotFound(
                f"the only objects under {prefix} are MDS index.json files, which are no "
                f"{KIND_NAMES[fmt]} data: publish the MDS directory without --format"
            )
        return kept

    async def _objects(
        self, prefix: str, exclude: frozenset[str], select: Selection
    ) -> list[SourceObject]:
        """Every object under ``prefix`` that may be a shard; refused if there is none."""
        found, unselected = [], []
        with _reaching("source", prefix):
            infos = await self._store(prefix).list(prefix)
        for info in infos:
            if not info.url.startswith(prefix):  # a key must rebuild the URL: prefix + key
                raise ValueError(
                    f"the store lists {info.url} under {prefix}; give the source as the store "
                    "spells its URLs"
                )
            key = info.url[len(prefix) :]
            if any(part.startswith(("_", ".")) for part in key.split("/")) or key in exclude:
                continue  # _SUCCESS, .crc and similar markers are not data
            if not select.keeps(key):
                unselected.append(key)
                continue
            found.append(SourceObject(info=info, key=key))
        keys = sorted([*unselected, *(o.key for o in found)])
        listed = first_of(keys, 5)
        if not found and unselected:
            raise ObjectNotFound(
                f"no object under {prefix} is selected by {select.text()} (patterns match "
                f"each key relative to the prefix, * and ? also across '/'); the keys there "
                f"are {listed}"
            )
        # Each --include on its own: a typo in one of two was dropped without a word while
        # the other matched, and the version was published without that split.
        if found and (
            idle := [p for p in select.include if not any(fnmatchcase(k, p) for k in keys)]
        ):
            raise ObjectNotFound(
                f"{', '.join(f'--include {p!r}' for p in idle)} selects no object under "
                f"{prefix} (patterns match each key relative to the prefix, * and ? also "
                f"across '/'); the keys there are {listed}: correct the pattern or leave it out"
            )
        if not found:
            local = _local_path(prefix)
            if local and not os.path.isdir(local):
                raise ObjectNotFound(
                    f"no objects under {prefix}: there is no directory {local.rstrip('/')}; "
                    "give the source as an existing directory or a URL (s3://…, file:///…)"
                )
            raise ObjectNotFound(f"no objects under {prefix}; check the source URL")
        return found

    async def _guess_format(
        self, prefix: str, found: list[SourceObject]
    ) -> pb.SourceFormat.ValueType:
        """The objects' format from their names; MDS from its ``.mds`` shards or its index.

        An ``index.json`` of MDS's shape (``{"shards": [...], "version": ...}``) makes
        the source MDS even without a shard beside it: guessed from the names alone,
        an index whose shards were not uploaded was published as a one-row JSON Lines
        version of the index itself; as MDS it is refused, naming the missing shards.
        """
        if any(strip_suffix(o.key).lower().endswith(".mds") for o in found):
            return pb.SOURCE_FORMAT_MDS
        for obj in found:
            shape = await self._index_shape(obj)
            if shape == "mds":
                return pb.SOURCE_FORMAT_MDS
            if shape == "litdata":  # never a one-row JSON Lines version of the index
                raise MalformedShard(_litdata(obj.info.url))
        guesses = {format_from_key(obj.key) for obj in found}
        if len(guesses) > 1 and None not in guesses:
            raise MalformedShard(_mixed_formats(prefix, found))
        if len(guesses) != 1 or None in guesses:
            raise MalformedShard(_unknown_format(prefix, found))
        fmt = guesses.pop()
        assert fmt is not None
        return fmt

    async def _index_shape(self, obj: SourceObject) -> str | None:
        """Whose index an ``index.json`` is: ``"mds"``, ``"litdata"``, or None (no index).

        MDS's is an object with a list of ``shards``; LitData's (``optimize()``) has
        ``chunks`` and ``config``. Objects of other names are not read.
        """
        if obj.key.rsplit("/", 1)[-1] != "index.json" or obj.info.size > _MAX_INDEX_BYTES:
            return None  # not an index a person would upload
        text = await self._store(obj.info.url).get(obj.info.url, expect=obj.info)
        try:
            index = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if is_litdata_index(index):
            return "litdata"
        return "mds" if isinstance(index, dict) and isinstance(index.get("shards"), list) else None

    async def _mds_sources(
        self,
        prefix: str,
        found: list[SourceObject],
        select: Selection | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[list[SourceObject], MdsColumns]:
        """The shards the ``index.json`` files under ``prefix`` list, with their row counts.

        Reads only the indexes: publishing an MDS dataset never downloads its shards.
        Each shard is taken once, however many indexes list it (a root ``index.json``
        from ``merge_index`` lists the shards of the streams' own indexes again): the
        indexes are read shallowest first, then by key, so a merged root's order is the
        version's. Two indexes that disagree about a shard's samples are refused. A
        compressed shard found only decompressed under its ``raw_data`` name (a
        Streaming local cache) is taken as that file: nodes read either alike.
        """
        by_key = {obj.key: obj for obj in found}
        indexes = sorted(
            (o for o in found if o.key.rsplit("/", 1)[-1] == "index.json"),
            key=lambda o: (o.key.count("/"), o.key),
        )
        if not indexes:
            raise ObjectNotFound(
                f"no index.json under {prefix}: an MDS dataset is the directory its "
                "index.json lists (publish that directory, and let --include/--exclude keep "
                "its index.json)"
            )
        columns: MdsColumns | None = None
        shards: list[SourceObject] = []
        missing: list[tuple[str, SourceObject]] = []  # (shard key, the index that lists it)
        taken: dict[str, tuple[str, int]] = {}  # key → (the index that listed it, samples)
        for index in indexes:
            text = await self._store(index.info.url).get(index.info.url, expect=index.info)
            these, listed = mds_index(text, index.info.url)
            if columns is not None and these != columns:
                raise MalformedShard(
                    f"{index.info.url} lists columns {', '.join(these.names)} but "
                    f"{indexes[0].info.url} lists {', '.join(columns.names)}; publish them "
                    "apart (choose one's folder with --include 'FOLDER/*')"
                )
            columns = these
            folder = index.key.rpartition("/")[0]
            for shard in listed:
                key = f"{folder}/{shard.key}" if folder else shard.key
                raw = (f"{folder}/{shard.raw}" if folder else shard.raw) if shard.raw else None
                if key not in by_key and raw is not None and raw in by_key:
                    key = raw  # a local cache: the shard kept decompressed, the zip gone
                if key in taken:
                    first, samples = taken[key]
                    if samples != shard.samples:
                        raise MalformedShard(
                            f"{first} says {key} holds {samples:,} samples but "
                            f"{index.info.url} says {shard.samples:,}; one of them is stale: "
                            "rewrite it (streaming.base.util.merge_index rebuilds a root "
                            "index from the streams' own), or leave it out with --exclude, "
                            "and publish again"
                        )
                    continue
                taken[key] = (index.info.url, shard.samples)
                if shard.samples == 0:
                    # MDSWriter leaves an empty shard where one sample outgrew size_limit:
                    # no rows to serve (a shard of none was refused, and excluded, missing),
                    # and Streaming reads the directory without it.
                    continue
                obj = by_key.get(key)
                if obj is None:
                    missing.append((key, index))
                    continue
                if key == strip_suffix(key) and 4 * (shard.samples + 2) > obj.info.size:
                    raise MalformedShard(
                        f"{index.info.url} says {shard.key} holds {shard.samples:,} samples, but "
                        f"it is {obj.info.size:,} bytes, too small for their offsets alone; fix "
                        "the index or the shard and publish again"
                    )
                shards.append(SourceObject(info=obj.info, key=key, rows=shard.samples))
        if missing and select is not None and select != Selection():
            # Left out by the patterns, not absent: uploading "the whole directory" again
            # would change nothing (a hunt found that advice followed in vain).
            there = {o.key for o in await self._objects(prefix, exclude, Selection())}
            left_out = [(key, index) for key, index in missing if key in there]
            if len(left_out) == len(missing):
                raise ObjectNotFound(_selected_away(select, left_out, indexes))
            missing = [(key, index) for key, index in missing if key not in there]
        if missing:
            keys = [key for key, _ in missing]
            raise ObjectNotFound(_missing_shards(prefix, indexes, keys, len(shards)))
        assert columns is not None
        return shards, columns

    async def publish(
        self,
        source_url: str,
        dataset: str,
        *,
        fmt: pb.SourceFormat.ValueType | None = None,
        spec: pb.PreprocessSpec,
        if_changed: bool = False,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        nulls: list[NullCount] | None = None,
        dropped: list[Dropped] | None = None,
    ) -> pb.Manifest:
        """Snapshot a prefix of raw shards as the next version of ``dataset``.

        Records each object's ETag, size and row count and the schema after
        preprocessing; every object must give the same schema. Parquet is read
        from its footer alone and MDS from its ``index.json`` alone when the
        transform keeps every row; other formats (and row-changing transforms)
        are read once. ``spec.source_options`` are validated and recorded in
        one spelling; the transform's params are pinned (``canonical_params``:
        the image decoder, the tokenizer's SHA-256), its files fetched from
        origin and left out of the shards. Hive-style ``key=value`` folders in
        the keys become columns after the data's own (see
        :mod:`~edgecache.cache.preprocess.partitions`; ``partitioning=none`` in
        ``spec.source_options`` turns that off). With ``if_changed``, when a
        version already has this content (the same digest: the same objects,
        schema and preprocessing), the newest such version is returned and no
        new one is written, even when a newer version of other content exists
        (a re-run pipeline means "no new version"; ``latest`` never moves back,
        so the CLI says which version ``name`` resolves to). ``include``/``exclude``
        choose the objects under the prefix by pattern (:class:`Selection`; a
        pattern in the source URL's last part is one more); one ``.mds`` shard
        given as the source is a version of that shard.

        Nulls in the columns EdgeDataset makes tensors of (numbers, booleans,
        fixed-size lists of them) are not refused (a reader may leave the column
        out), but each would fail a training batch: they are appended to ``nulls``
        when given (the CLI warns), else logged as warnings. They come from what
        is read anyway (:mod:`~edgecache.cache.preprocess.nulls`): a Parquet
        footer's statistics, or the object read whole; none are recorded.

        Samples the transform drops (``images`` with ``on_error=skip``: publish
        decodes every image to count the rows) are appended to ``dropped`` per
        object when given, else logged as a warning (:func:`dropped_text`): the
        version is published without them, and nobody should learn that from a
        row count alone.
        """
        validate_name(dataset)
        codec = CodecOptions.from_spec(spec)  # a level or chunk size no node could encode
        source_url, single, glob = await self._source(location_url(source_url, "source"))
        select = Selection(tuple(include), tuple(exclude), glob)
        resources = await fetch_resources(self._stores, source_url, spec)
        name = spec.transform or "identity"
        spec = _copy(spec)
        # The level the nodes encode with, in one spelling: 0 is 1, and uncompressed
        # chunks read none; a level recorded as given made two versions (two digests)
        # of byte-identical chunks, and --if-changed took them for different content.
        spec.compression_level = codec.level
        params = canonical_params(name, dict(spec.params), resources)
        spec.params.clear()
        spec.params.update(params)
        transform = load_transform(name, params, resources)  # fail fast on names and params
        # A transform's files under the source prefix (named by key or by full URL) are
        # not shards.
        refs = frozenset(
            url[len(source_url) :]
            for url in (resource_url(source_url, r) for r in resource_refs(name, params))
            if url.startswith(source_url)
        )
        objects, fmt = await self._listed(source_url, single, fmt, refs, select)
        given = dict(spec.source_options)
        partitioning = partitioning_mode(given)  # any format's; the others are the reader's
        options = canonical_options(fmt, given) if fmt != pb.SOURCE_FORMAT_MDS else {}
        if fmt == pb.SOURCE_FORMAT_CSV and "delimiter" not in options:
            implied = delimiter_for_names([o.key for o in objects])
            if implied is not None:
                options = canonical_options(fmt, {**options, "delimiter": implied})
        if fmt == pb.SOURCE_FORMAT_MDS:
            if given:
                raise ValueError("MDS sources take no reader options: index.json says it all")
            objects, columns = await self._mds_sources(source_url, objects, select, refs)
            if single is not None and single.key.rsplit("/", 1)[-1] != "index.json":
                objects = _one_mds_shard(single, objects)
            if name == "images" and (why := image_encoding_problem(columns, params.get("column"))):
                raise ParamMismatch(why)  # every read would fail, and on_error=skip drop all
            options = {"columns": columns.to_option()}
        if partitioning == "hive":  # from the keys alone: no reads
            if partitions := hive_partitions([(o.info.url, o.key) for o in objects]):
                options[RECORDED] = recorded(partitions)
        spec.source_options.clear()
        spec.source_options.update(options)
        limit = asyncio.Semaphore(_DESCRIBE_CONCURRENCY)
        named = _named_format(objects)  # what the names say, when --format says otherwise
        misnamed = named if named not in (None, fmt) else None

        async def one(obj: SourceObject) -> Description:
            async with limit:
                return await self._describe(obj, fmt, spec, transform, misnamed)

        described = await asyncio.gather(*(one(obj) for obj in objects))
        empty = [o.info.url for o, d in zip(objects, described, strict=True) if not d.rows]
        if empty:
            raise MalformedShard(_no_rows(empty, name, keeps_rows(name, params)))
        first = _reference(objects, described, fmt)
        schema = described[first].schema
        odd = [i for i, d in enumerate(described) if not d.schema.equals(schema)]
        if odd:
            text = schema_mismatch(
                objects[odd[0]].info.url,
                described[odd[0]].schema,
                objects[first].info.url,
                schema,
                fmt,
                name,
                others=[described[i].schema for i in odd[1:]],
                column_types=options.get("column_types", ""),
                cast=params.get("cast", ""),
            )
            kept = [_sidecar(o, d, fmt) for o, d in zip(objects, described, strict=True)]
            # Files beside shards only when some object is a shard: one-row .json files
            # alone are the data.
            strays = [objects[i].key for i in odd if kept[i]] if not all(kept) else []
            raise MalformedShard(text + (_stray_advice(strays) if strays else ""))
        if repeated := sorted({n for n in schema.names if schema.names.count(n) > 1}):
            raise MalformedShard(
                f"the columns after preprocessing ({columns_text(schema)}) name "
                f"{', '.join(repeated)} more than once, and readers find a column by its name; "
                + _repeated_advice(schema.names, fmt, options, name)
            )
        own = schema.names  # what a columns transform can select: not the partitions
        # Hive partition columns, after the data's own (a column of the same name refused).
        schema = with_partitions(
            schema, partition_fields(options), objects[0].info.url, transform=name, params=params
        )
        shards = [
            pb.Shard(
                index=i,
                source_key=obj.key,
                source_etag=obj.info.etag,
                source_size=obj.info.size,
                row_count=rows,
            )
            for i, (obj, rows) in enumerate(zip(objects, (d.rows for d in described), strict=True))
        ]
        found = _null_counts(objects, described, schema)
        # A NAME=__HIVE_DEFAULT_PARTITION__ folder: every row under it null in column NAME.
        found += partition_nulls(
            partition_fields(options),
            [(o.info.url, o.key, d.rows) for o, d in zip(objects, described, strict=True)],
        )
        if nulls is not None:
            nulls.extend(found)
        else:
            for text in null_warnings(found, own, name, dict(spec.params)):
                log.warning("%s", text)
        gone = [
            Dropped(o.info.url, d.skipped, d.notes)
            for o, d in zip(objects, described, strict=True)
            if d.skipped
        ]
        if dropped is not None:
            dropped.extend(gone)
        elif gone:
            log.warning("%s", dropped_text(gone, sum(d.rows for d in described)))
        manifest = build_manifest(
            dataset=dataset,
            version=1,
            source_url=source_url,
            source_format=fmt,
            schema=schema,
            preprocess=spec,
            shards=shards,
        )
        if if_changed:
            # Asked before anything is written, so an answer it cannot give fails the
            # publish: skipping an unreadable version wrote a copy of the content it held.
            unread: list[int] = []
            if same := await self.same_content(dataset, manifest.digest, skipped=unread):
                return same
            if unread:
                listed = ", ".join(f"{dataset}@{n}" for n in unread)
                raise OriginError(
                    f"--if-changed cannot tell whether {dataset} holds this content already: "
                    f"the manifest of {listed} could not be read (edgecache versions {dataset} "
                    "says why). Nothing was published; restore that manifest and publish "
                    "again, or publish without --if-changed to write a new version regardless"
                )
        return await self.commit(manifest)

    async def same_content(
        self,
        dataset: str,
        digest: str,
        numbers: Sequence[int] | None = None,
        skipped: list[int] | None = None,
    ) -> pb.Manifest | None:
        """The newest version of ``dataset`` whose digest is ``digest``, or None.

        Every version is compared, not the newest alone: content published as
        ``tok@1``, then ``tok@2`` with other chunks, then ``tok@1``'s content again
        is ``tok@1``'s (--if-changed used to write it as ``tok@3``, a copy a region
        holding ``tok@1`` would stage again). ``numbers``: the versions to compare
        (default: all of them). The manifests are small and read concurrently.

        A manifest that cannot be read or verified is left out of the comparison,
        not raised: the answer is advice (publish asks after its version is
        written, and failing then would have a retrying script publish a copy).
        Their numbers are appended to ``skipped`` when given (the CLI warns), else
        said in one warning; each one's reason is logged at debug.
        """
        numbers = list(numbers) if numbers is not None else await self.versions(dataset)
        limit = asyncio.Semaphore(_DESCRIBE_CONCURRENCY)
        unread: list[int] = []

        async def one(number: int) -> pb.Manifest | None:
            async with limit:
                try:
                    return await self.manifest(dataset, number)
                except Exception as exc:  # noqa: BLE001 - any unreadable one is skipped
                    log.debug("%s@%d not compared: %s", dataset, number, exc)
                    unread.append(number)
                    return None

        found = await asyncio.gather(*(one(n) for n in numbers))
        if unread:
            unread.sort()
            if skipped is not None:
                skipped.extend(unread)
            else:
                log.warning("%s", unread_text(dataset, unread))
        same = [m for m in found if m is not None and m.digest == digest]
        return max(same, key=lambda m: m.version) if same else None

    async def _describe(
        self,
        obj: SourceObject,
        fmt: pb.SourceFormat.ValueType,
        spec: pb.PreprocessSpec,
        transform: Transform,
        named: pb.SourceFormat.ValueType | None = None,
    ) -> Description:
        """What ``obj`` holds once preprocessed: its schema and rows.

        ``named``: the format every object's name says, when ``fmt`` (``--format``)
        is another; an object that does not read as ``fmt`` is then refused
        saying so, not with the parser's error on its bytes.
        """
        info = obj.info
        store = self._store(info.url)
        keeps = keeps_rows(spec.transform, spec.params)
        if obj.rows is not None and keeps:  # an index says it (MDS): read nothing
            columns = MdsColumns.from_option(spec.source_options["columns"], info.url)
            empty = pa.RecordBatch.from_pylist([], schema=columns.schema())
            return Description(transform(empty).schema, obj.rows, None)
        data = None
        try:
            if fmt == pb.SOURCE_FORMAT_PARQUET and keeps and info.size > 12:
                data = await _parquet_footer(store, info)  # rows kept: the footer says all
            if data is None:
                data = await store.get(info.url, expect=info)
            described = await asyncio.to_thread(
                survey, data, fmt=fmt, source=info.url, spec=spec, transform=transform
            )
        except MalformedShard as exc:
            if _is_sidecar(obj.key) and (spec.transform or "identity") != "identity":
                # A tokenizer.json beside the text: the transform failed on it first, and
                # its error sent the user to the transform's params (a helper's hunt).
                raise MalformedShard(
                    f"{info.url} is {obj.key.rsplit('/', 1)[-1]}, a file kept beside the "
                    f"shards, not one of them, and the {spec.transform} transform cannot read "
                    f"it ({exc}); leave it out with {_excludes([obj.key])}"
                ) from exc
            if named is None:
                raise
            raise MalformedShard(_named_otherwise(obj, named, fmt)) from exc
        first = described.schema.names[0] if described.schema.names else ""
        if named == pb.SOURCE_FORMAT_JSONL and fmt == pb.SOURCE_FORMAT_CSV and first[:1] == "{":
            # JSON Lines parse as CSV (commas split each object): no error to catch, and
            # pieces of JSON would be published as columns.
            raise MalformedShard(
                _named_otherwise(
                    obj,
                    named,
                    fmt,
                    f"reads as CSV only as pieces of JSON (a column named {first[:30]!r})",
                )
            )
        return described


# Files kept beside shards that are no shard of them: a tokenizer (docs/preprocessing.md
# says to ship it under the source prefix), a model or dataset card's JSON.
_SIDECARS = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "config.json",
        "generation_config.json",
        "dataset_info.json",
        "dataset_dict.json",
        "state.json",
        "metadata.json",
    }
)


def _named_format(objects: Sequence[SourceObject]) -> pb.SourceFormat.ValueType | None:
    """The one format the objects' names all say, or None (no telling, or names that differ).

    All of them: a stray file among the shards (a wids index beside tars) is that
    file's problem, which the reader names, not a sign that ``--format`` is wrong.
    """
    named = {format_from_key(o.key) for o in objects}
    return named.pop() if len(named) == 1 else None


def _named_otherwise(
    obj: SourceObject,
    named: pb.SourceFormat.ValueType,
    given: pb.SourceFormat.ValueType,
    how: str | None = None,
) -> str:
    """Why an object ``--format`` says is of one format, named as another, did not read.

    The parser's own error quoted the object's first bytes (Parquet's binary as a
    CSV row); the names said what it was, and that is the likelier fix.
    """

    def flag(kind: pb.SourceFormat.ValueType) -> str:  # its first name, as --help gives it
        return next(name for name, each in FORMATS.items() if each == kind)

    name = obj.key.rsplit("/", 1)[-1]
    return (
        f"{obj.info.url} {how or f'does not read as {KIND_NAMES[given]}'}: its name, {name}, says "
        f"{KIND_NAMES[named]}, and --format says {flag(given)}; drop --format to read the "
        f"objects as their names say (or pass --format {flag(named)}), or, if it really is "
        f"{KIND_NAMES[given]}, rename it"
    )


def _sidecar(obj: SourceObject, described: Description, fmt: pb.SourceFormat.ValueType) -> bool:
    """Whether ``obj`` is clearly a file kept beside the shards, not one of them.

    A known sidecar name (``tokenizer.json``), or among JSON Lines a ``.json``
    file that reads as one row: a single JSON object (a config, a vocabulary).
    """
    name = obj.key.rsplit("/", 1)[-1].lower()
    if name in _SIDECARS:
        return True
    single = strip_suffix(name).endswith(".json") and described.rows == 1
    return fmt == pb.SOURCE_FORMAT_JSONL and single


def _reference(
    objects: Sequence[SourceObject],
    described: Sequence[Description],
    fmt: pb.SourceFormat.ValueType,
) -> int:
    """The object whose schema the others are held to: the most common one among shards.

    The first object used to be the reference, so a ``tokenizer.json`` listed
    before ``train.jsonl`` made every real shard the odd one out.
    """
    groups: list[tuple[pa.Schema, list[int]]] = []
    for i, d in enumerate(described):
        if _sidecar(objects[i], d, fmt) and len(objects) > 1:
            continue
        for schema, members in groups:
            if schema.equals(d.schema):
                members.append(i)
                break
        else:
            groups.append((d.schema, [i]))
    if not groups:
        return 0
    return max(groups, key=lambda g: (len(g[1]), -g[1][0]))[1][0]


def _stray_advice(keys: list[str]) -> str:
    """What to do with files among the shards that are no shards (a tokenizer beside JSONL)."""
    listed = first_of(keys, 3)
    return (
        f"; {listed} {'is' if len(keys) == 1 else 'are'} not a shard like the others (a file "
        f"kept beside the data: a tokenizer, a config): leave "
        f"{'it' if len(keys) == 1 else 'them'} out with {_excludes(keys)} (a transform's "
        "own file, e.g. --param tokenizer=tokenizer.json, is left out by itself)"
    )


def _null_counts(
    objects: Sequence[SourceObject], described: Sequence[Description], schema: pa.Schema
) -> list[NullCount]:
    """The nulls found in the version's tensor columns, column by column, then object by object.

    Read against the version's schema (after the transform), so a column the
    transform renamed is named as readers see it.
    """
    nulled = [(o, d.nulls) for o, d in zip(objects, described, strict=True) if d.nulls]
    out = []
    for field in schema:
        for obj, nulls in nulled:
            if count := nulls.get(field.name, 0):
                out.append(NullCount(field.name, type_label(field.type), obj.info.url, count))
    return out


def unread_text(dataset: str, numbers: Sequence[int]) -> str:
    """The warning for versions whose manifests could not be read to compare digests."""
    listed = ", ".join(f"{dataset}@{n}" for n in numbers[:5])
    more = f" and {len(numbers) - 5} more" if numbers[5:] else ""
    return (
        f"could not read the manifest of {listed}{more} to compare content (skipped): "
        f"an earlier version may hold the same content; check with edgecache versions "
        f"{dataset}"
    )


def _raised_to(number: int, current: bytes | None) -> bytes | None:
    """A ``latest`` pointer's new content: ``number``, unless it already names a newer one.

    Publishers finish in any order; the pointer only ever moves forward. One
    that cannot be read as a number is replaced.
    """
    text = (current or b"").decode("ascii", "replace").strip()
    if text.isdigit() and text.isascii() and int(text) >= number:
        return None
    return f"{number}\n".encode()


def _out_of_space(exc: BaseException) -> bool:
    """Whether a store error is, or stands on, a full disk or quota (ENOSPC, EDQUOT)."""
    return any(
        isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        for cause in causes(exc, itself=True)
    )


def _unwritable(registry: str, version: str, exc: OriginError) -> str:
    """Why ``version`` could not be written to ``registry``, and what to do about it.

    The store's own message names a file deep in the registry and an errno; the
    person publishing needs to hear which registry refused and how to fix it: a
    full volume is freed, a read-only one or a file is replaced by a registry they
    can write (``--registry``, or ``registry:`` in the topology file).
    """
    if _out_of_space(exc):
        return (
            f"cannot publish {version}: the registry {registry} is out of space (no space "
            "left on device); nothing was published — free space on its volume and publish "
            "again"
        )
    codes = {c.errno for c in causes(exc, itself=True) if isinstance(c, OSError)}
    if codes & {errno.EROFS, errno.EACCES, errno.EPERM}:
        why = "read-only file system" if errno.EROFS in codes else "permission denied"
        return (
            f"cannot publish {version}: the registry {registry} is not writable ({why}); "
            "nothing was published — make it writable, or publish to a registry you can "
            "write (--registry URL, or registry: in the topology file)"
        )
    if errno.ENOTDIR in codes:
        return (
            f"cannot publish {version}: the registry {registry} is not a directory (it, or a "
            "folder above it, is a file); nothing was published — give --registry (or "
            "registry: in the topology file) a directory, new or already a registry"
        )
    return (
        f"cannot publish {version} to the registry {registry} ({exc}); nothing was published "
        "— check the registry URL (--registry, or registry: in the topology file) and that "
        "you may write there, then publish again"
    )


def _missing_shards(
    prefix: str, indexes: list[SourceObject], missing: list[str], present: int
) -> str:
    """Which shards the MDS index lists that are not under the prefix, and what to do."""
    listed = first_of(missing, 5)
    where = ", ".join(o.info.url for o in indexes[:3]) + (", …" if indexes[3:] else "")
    total = len(missing) + present
    return (
        f"{where} {'lists' if len(indexes) == 1 else 'list'} {total} MDS shard"
        f"{'s' if total != 1 else ''}, but {len(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not under {prefix}: {listed}; upload the "
        "whole MDS directory (the index.json with every shard it lists) and publish that "
        "directory"
    )


def _selected_away(
    select: Selection, left_out: list[tuple[str, SourceObject]], kept: list[SourceObject]
) -> str:
    """Shards an ``index.json`` kept by the patterns lists, that the patterns leave out.

    Leaving that index out too is the fix only where other kept indexes remain (the
    streams' own beside a ``merge_index`` root); a folder of one index has none.
    """
    listed = first_of([key for key, _ in left_out], 5)
    indexes = list(dict.fromkeys(index.key for _, index in left_out))
    where = ", ".join(indexes[:3]) + (", …" if indexes[3:] else "")
    said = (
        f"{where} {'lists' if len(indexes) == 1 else 'list'} {listed}, left out by "
        f"{select.text()}: an index and the shards it lists go together (readers would "
        "look for them); "
    )
    if any(index.key not in indexes for index in kept):
        leave = " ".join(f"--exclude {shlex.quote(key)}" for key in indexes[:3])
        return said + (
            f"leave the index out too ({leave}: the other indexes list the shards you "
            "keep), or select those shards as well"
        )
    return said + (
        "no other index lists the shards you keep: select those shards as well, or write "
        "the ones you want with an index of their own (MDSWriter) and publish that"
    )


def _with_glob(select: Selection, glob: str | None) -> Selection:
    """``select`` with the source URL's pattern (``data/train-*``) added, if it has one."""
    return select if glob is None else Selection(select.include, select.exclude, glob)


def _litdata(url: str) -> str:
    """Why a LitData ``optimize()`` output is no source, and what to do instead."""
    return f"{url} is a LitData index (optimize() output: chunks and config); {LITDATA_ADVICE}"


def _one_mds_shard(single: SourceObject, shards: list[SourceObject]) -> list[SourceObject]:
    """The one shard a person named as the source (``shard.00000.mds``), as its index lists it.

    ``--help`` says one object is a version of one shard; an MDS shard file used to
    publish its whole directory.
    """
    chosen = [s for s in shards if s.key == single.key]
    if not chosen:
        raise ObjectNotFound(
            f"{single.info.url} is not a shard the index.json beside it lists (it lists "
            f"{', '.join(s.key for s in shards[:5])}{', …' if shards[5:] else ''}); give a "
            "listed shard, or the MDS directory to publish all of them"
        )
    return chosen


def _copy(spec: pb.PreprocessSpec) -> pb.PreprocessSpec:
    out = pb.PreprocessSpec()
    out.CopyFrom(spec)
    return out


async def _parquet_footer(store: ObjectStore, info: ObjectInfo) -> bytes | None:
    """Only a Parquet file's footer, framed as a file pyarrow can read metadata from.

    Two small ranged reads instead of downloading the whole object. None when the
    object does not end as Parquet does: a compressed one (``part.parquet.gz``) is
    read whole and decompressed, and anything else is then refused by the reader
    with the reason (not Parquet, or not readable).
    """
    tail = await store.get_range(info.url, info.size - 8, info.size)
    if tail[4:] != b"PAR1":
        return None
    length = int.from_bytes(tail[:4], "little")
    if length + 12 > info.size:
        raise MalformedShard(f"{info.url}: Parquet footer length {length} exceeds the file")
    return b"PAR1" + await store.get_range(info.url, info.size - 8 - length, info.size)


def _no_rows(urls: list[str], transform: str, keeps: bool) -> str:
    """Why objects that give no rows are no shards, and what to do about them.

    A shard of a version holds at least one row (a node refuses to stage an
    empty one), so an empty object is refused at publish, where the fix is
    still the publisher's, rather than failing every node's staging later.
    """
    listed = first_of(urls, 3)
    cause = (
        "it is empty, or holds a header alone"
        if keeps
        else f"the {transform!r} transform dropped every row of it (corrupt samples skipped, "
        "or too little text for one row)"
    )
    return (
        f"{listed} {'gives' if len(urls) == 1 else 'give'} no rows after preprocessing "
        f"({cause}); every shard of a version needs at least one row: leave such objects out "
        "with --exclude PATTERN (matched against keys under the source prefix; or move them "
        "out of it), or change the options that drop their rows, and publish again"
    )


class Dropped(NamedTuple):
    """Samples of one object that the transform dropped at publish, with the first few named."""

    url: str
    samples: int
    notes: tuple[str, ...]


def dropped_text(dropped: Sequence[Dropped], kept: int) -> str:
    """The warning for samples ``on_error=skip`` dropped: how many, which, and what then.

    Publish decodes every image to count the rows that remain, so it knows: a
    version that silently lost a tenth of its images looked like any other.
    """
    count = sum(d.samples for d in dropped)
    notes = [n for d in dropped for n in d.notes][:3]
    more = f"; and {count - len(notes)} more" if count > len(notes) else ""
    objects = len(dropped)
    return (
        f"{count:,} sample{'s' if count != 1 else ''} of {kept + count:,} "
        f"{'are' if count != 1 else 'is'} left out of the version (on_error=skip), in "
        f"{objects} object{'s' if objects != 1 else ''}: {'; '.join(notes)}{more}; fix or "
        "remove those samples and publish again to keep them, or pass --param on_error=fail "
        "to fail on them instead (publish refuses only Arrow IPC objects so; in Parquet, "
        "WebDataset and MDS the node staging the shard fails it, naming the sample)"
    )


def _unknown_format(prefix: str, found: list[SourceObject]) -> str:
    """Which objects' names tell no format, and what to do: move them, or say the format."""
    unknown = sorted(o.key for o in found if format_from_key(o.key) is None)
    listed = first_of(unknown, 5)
    if len(unknown) < len(found):  # others are known: these are most likely not shards
        # A model's config.json beside the shards is no shard either: an --include of
        # '*.json' led to "several formats" next (a helper's hunt).
        sidecars = sorted(o.key for o in found if _is_sidecar(o.key))
        known = sorted(
            {
                _pattern_of(o.key)
                for o in found
                if format_from_key(o.key) is not None and not _is_sidecar(o.key)
            }
        )
        return (
            f"the names of {listed} under {prefix} tell no format, beside shards that do; "
            "leave files that are not shards (a README, notes) out with "
            f"{_excludes(unknown + sidecars)}, "
            f"or choose the shards with {' '.join(f'--include {p!r}' for p in known[:3])} "
            "(or move files that are not shards out of the prefix); if they are shards of the "
            "same format, pass it (--format parquet, jsonl, csv, arrow, webdataset or mds)"
        )
    if all(_pattern_of(k).lower() in _IMAGE_PATTERNS for k in unknown):
        return _loose_images(prefix, unknown)
    return (
        f"cannot tell the format of the objects under {prefix} from their names ({listed}); "
        "pass the format explicitly (--format parquet, jsonl, csv, arrow, webdataset or mds)"
    )


_IMAGE_PATTERNS = frozenset(
    f"*.{ext}" for ext in ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
)


def _loose_images(prefix: str, keys: list[str]) -> str:
    """What to do with a prefix of image files: pack them into WebDataset tars first.

    No format reads a loose image as a row, and ``--format`` of any kind then
    failed on each file; a tar whose members are named ``KEY.EXT`` is a WebDataset
    shard of one sample per image (cache.preprocess.webdataset), whose column the
    images transform decodes. Mixed extensions are renamed to one (``.img``): the
    transform decodes the bytes whatever their format (``_member_renames``).
    """
    exts = sorted({_pattern_of(k)[2:].lower() for k in keys})
    local = _local_path(prefix)
    where = local.rstrip("/") if local else "a local copy of it"
    out = f"{local.rstrip('/')}-wds" if local else "OUT"
    column = exts[0] if len(exts) == 1 else "img"
    rename = _member_renames(keys, column)
    return (
        f"the objects under {prefix} are image files ({', '.join(keys[:3])}"
        f"{', …' if keys[3:] else ''}: {len(keys)} {', '.join(exts)}), which no format reads "
        "as rows; pack them into WebDataset tars first (each member named KEY.EXT, one dot: "
        f"one sample per image), e.g. mkdir -p {out} && (cd {where} && tar cf "
        f"{out}/images-000000.tar{rename} *), then publish {out} with --transform "
        f"images --param column={column} --param size=N (or store the bytes in a Parquet "
        "binary column: see docs/preprocessing.md, images)"
    )


def _member_renames(keys: list[str], column: str) -> str:
    """GNU tar's ``--transform`` that names every image ``KEY.{column}``, with one dot.

    A WebDataset key ends at the member's first dot, so ``2024.01.05.jpg`` would be
    key ``2024`` with a column ``01.05.jpg``, and the advice would lead back to the
    same refusal: dots in a name become ``_``. Several kinds of image become one
    column, ``img``, the original extension kept in the key (``x_png.img``) so that
    ``x.jpg`` and ``x.png`` stay two samples; one kind spelled otherwise (``.JPG``)
    is renamed to the column the transform decodes.
    """
    names = [k.rsplit("/", 1)[-1] for k in keys]
    spelled = {n.rsplit(".", 1)[-1] for n in names}
    if len({s.lower() for s in spelled}) > 1:
        steps = ["s/[.]/_/g", f"s/$/.{column}/"]
    else:
        steps = [] if spelled == {column} else [f"s/[.][^.]*$/.{column}/"]
        if any(n.count(".") > 1 for n in names):
            steps += ["s/[.]/_/g", f"s/_{column}$/.{column}/"]
    return f" --transform '{';'.join(steps)}'" if steps else ""


def _mixed_formats(prefix: str, found: list[SourceObject]) -> str:
    """Why objects of several formats under one prefix are no version, with which are which.

    ``--format`` would not help: the objects of the other formats would then
    fail to parse. A version is one format, so each format's objects need a
    prefix of their own.
    """
    keys: dict[str, list[str]] = {}
    for obj in found:
        fmt = format_from_key(obj.key)
        keys.setdefault(KIND_NAMES[fmt] if fmt is not None else "?", []).append(obj.key)
    listed = "; ".join(
        f"{name}: {', '.join(sorted(k)[:3])}{', …' if len(k) > 3 else ''} ({len(k)})"
        for name, k in sorted(keys.items())
    )
    # The example is the format with the most shards, not counting a model's config.json
    # and its kind (one Parquet shard beside a config.json was a tie, and the example
    # chose the JSON).
    shards = {name: [k for k in ks if not _is_sidecar(k)] for name, ks in keys.items()}
    most = max(shards.values(), key=len) or max(keys.values(), key=len)
    example = " ".join(f"--include {p!r}" for p in sorted({_pattern_of(k) for k in most})[:3])
    return (
        f"the objects under {prefix} are of several formats ({listed}); a version is one "
        f"format: choose one format's objects with --include or --exclude (e.g. {example}; "
        "patterns match keys under the prefix), or publish each format's objects from a "
        "prefix of their own"
    )


def _is_sidecar(key: str) -> bool:
    """Whether ``key`` is a file that ships beside shards (a model's config.json), by name."""
    return key.rsplit("/", 1)[-1] in _SIDECARS


def _pattern_of(key: str) -> str:
    """A pattern for the objects named like ``key``: ``*.parquet``, ``*.tar.gz``."""
    name = key.rsplit("/", 1)[-1]
    stem = strip_suffix(name)
    dot = stem.rfind(".")
    return f"*{name[dot:]}" if dot > 0 else name


def _excludes(keys: list[str]) -> str:
    """``--exclude`` options that leave ``keys`` out: by name when few, else by extension."""
    patterns = keys if len(keys) <= 3 else sorted({_pattern_of(k) for k in keys})
    if len(patterns) > 3:
        return "--exclude PATTERN"
    return " ".join(f"--exclude {p!r}" for p in patterns)


def _repeated_advice(names: list[str], fmt: int, options: Mapping[str, str], transform: str) -> str:
    """How to give each column a name of its own, in a way that works for this source.

    "--transform columns --param rename=OLD=NEW" was advised for a file's own
    repeated name, which no rename can address (which of the two is OLD?).
    """
    if transform != "identity":
        return f"give them names of their own in the {transform} transform's parameters"
    if fmt == pb.SOURCE_FORMAT_CSV:
        seen: dict[str, int] = {}
        apart = []
        for column in names:
            seen[column] = seen.get(column, 0) + 1
            apart.append(column if seen[column] == 1 else f"{column}_{seen[column]}")
        given = "--column-names" if "column_names" in options else "--header --column-names"
        listed = shlex.quote(",".join(quote_name(column) for column in apart))
        return f"name every column yourself, e.g. {given} {listed}"
    return (
        "the source's own columns do: rewrite its files with a name per column (pyarrow: "
        "table.rename_columns([...])); a transform cannot tell two columns of one name apart"
    )
