"""The versions a node serves: each one's manifest, kept and checked against the registry.

Version-based consistency lives here. A published ``name@N`` never changes, so
a node keeps each version's manifest (in memory and in its cache, beside the
shards made from it) and serves from that copy, also while the registry is
away. The copy is still read from the registry again, in the background every
``MANIFEST_RECHECK_SECONDS`` and at once when a reader pins the version or
holds another digest: a version changed in the registry after this node cached
it (a registry reset, a hand edit) is refused, naming both digests, until it is
evicted here, rather than serving two contents under one name. A damaged copy
kept here is replaced by the registry's, and a version whose data lies outside
the node's origins is refused before anything is read.

:class:`~edgecache.edge.node.EdgeNode` holds one :class:`Versions`; the node
writes through its single LMDB writer thread and counts registry retries with
its metrics, so both come in as callables.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any

from google.protobuf.message import DecodeError

from edgecache.cache.errors import (
    DiskFull,
    EdgeCacheError,
    ManifestError,
    OriginChanged,
    OriginError,
    StaleDigest,
    VersionNotFound,
)
from edgecache.cache.manifest import manifest_from_bytes
from edgecache.cache.names import LATEST, validate_name
from edgecache.cache.preprocess import resource_refs
from edgecache.cache.registry import Registry, resource_url
from edgecache.cache.registry_match import shown_url
from edgecache.cache.storage.base import unreachable
from edgecache.cache.store import CacheStore, VersionInfo
from edgecache.cache.units import format_bytes
from edgecache.edge.config import NodeConfig, origin_allowed
from edgecache.v1 import manifest_pb2

__all__ = [
    "DIGEST_RECHECK_SECONDS",
    "MANIFEST_RECHECK_SECONDS",
    "PIN_CHECK_WAIT",
    "Versions",
]

log = logging.getLogger(__name__)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

# The node's store writes: ``await write(fn, *args)`` runs ``fn(*args)`` on its writer thread.
Write = Callable[..., Coroutine[Any, Any, Any]]


# How often a manifest this node serves from its own copy is read from the registry
# again, in the background, to notice a published version that was changed there.
MANIFEST_RECHECK_SECONDS = 10.0
DIGEST_RECHECK_SECONDS = 1.0  # a reader's other digest asks the registry at most this often
PIN_CHECK_WAIT = 2.0  # a version pinned from a kept copy waits this long for the registry


def _clipped(text: str, limit: int = 80) -> str:
    """A caller's string for a message or log line: repr'd, at most ``limit`` characters."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[: limit - 1]}… ({len(text):,} characters)"


class Versions:
    """A node's manifests: which content each ``name@N`` it serves is, and whether it still is.

    ``write`` runs a store write on the node's writer thread (and awaits it);
    ``count_retries`` adds the registry's retries to the node's metrics.
    """

    def __init__(
        self,
        config: NodeConfig,
        registry: Registry,
        store: CacheStore,
        *,
        write: Write,
        count_retries: Callable[[], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.registry_shown = shown_url(registry.url)  # in messages: no credentials
        self.store = store
        self._write = write
        self._count_retries = count_retries
        self._manifests: dict[tuple[str, int], manifest_pb2.Manifest] = {}
        # When the registry was last asked for each manifest kept here (monotonic),
        # the checks in flight, and the registry's manifest of each version
        # that no longer agrees: a published version changed after this node cached it.
        self._manifest_asked: dict[tuple[str, int], float] = {}
        # (version, a reader's digest other than ours) -> when it last sent us to the registry
        self._digests_asked: dict[tuple[tuple[str, int], str], float] = {}
        self._manifest_checks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._changed: dict[tuple[str, int], manifest_pb2.Manifest] = {}

    async def resolve(self, dataset: str, version: str) -> manifest_pb2.Manifest:
        """Pin ``latest`` (or check ``N``) against the registry."""
        validate_name(dataset)
        text = (version or LATEST).strip()
        if text == LATEST:
            try:
                number = await self.registry.latest(dataset)
            finally:
                self._count_retries()
        elif text.isdigit() and text.isascii() and int(text) >= 1:
            number = int(text)
        else:
            raise ValueError(
                f"version must be 'latest' or a positive integer, got {_clipped(version)}"
            )
        return await self.manifest_to_pin(dataset, number)

    def without_secrets(self, text: str) -> str:
        """``text`` with the registry's URL (and the objects' under it) shown without secrets."""
        raw = self.registry.url
        return text.replace(raw, self.registry_shown) if raw != self.registry_shown else text

    async def manifest_to_pin(self, dataset: str, version: int) -> manifest_pb2.Manifest:
        """A version's manifest for a reader to pin: checked against the registry now.

        A job pins what this answers: it must be what the registry holds now, not an
        older copy kept here (a version rewritten in the registry, or a registry
        reset under the node, is refused instead). ``GetManifest`` served the kept
        copy unchecked: a reader pinned the old content's digest, and when this node
        then refused its shards, read them from a node of the old registry.
        """
        key = (dataset, version)
        asked = self._manifest_asked.get(key)
        manifest = await self.manifest(dataset, version)
        if self._manifests.get(key) is not manifest or self._manifest_asked.get(key) != asked:
            return manifest  # just read from the registry
        if asked is None or time.monotonic() - asked >= DIGEST_RECHECK_SECONDS:
            # Many readers starting at once share one read; a registry that does not
            # answer within PIN_CHECK_WAIT leaves the kept copy served, as while it is away.
            await self._check_now(key, manifest, wait=PIN_CHECK_WAIT)
        return self._current_manifest(key)

    async def manifest_as_read(
        self, dataset: str, version: int, digest: str
    ) -> manifest_pb2.Manifest:
        """The version's manifest for a reader holding ``digest`` (empty: any).

        A reader's digest that differs from the copy kept here means one of the two
        is out of date. The registry is asked at once (at most once a second per
        version and digest) rather than at the next background check: when it is this node's
        copy, the reader gets :meth:`_current_manifest`'s account (the version was
        changed in the registry; evict it here), not a refusal that blames it.
        """
        if digest and not _DIGEST.fullmatch(digest):
            # Checked first: a reader's digest is kept (and echoed) below, and up to
            # max_request_bytes of made-up digests would each be held and logged.
            raise ValueError(
                f"digest must be 'sha256:' and 64 hex digits, as manifests hold it, got "
                f"{_clipped(digest)}; pass the manifest's digest, or none"
            )
        manifest = await self.manifest(dataset, version)
        if not digest or digest == manifest.digest:
            return manifest
        key = (dataset, version)
        now = time.monotonic()
        asked = self._digests_asked.get((key, digest))
        if asked is None or now - asked >= DIGEST_RECHECK_SECONDS:
            if len(self._digests_asked) > 4096:  # readers with ever new digests: start over
                self._digests_asked.clear()
            self._digests_asked[(key, digest)] = now
            await self._check_now(key, manifest)
        manifest = self._current_manifest(key)  # OriginChanged when the registry's differs
        if digest != manifest.digest:
            raise StaleDigest(
                f"{dataset}@{version} has digest {manifest.digest} here and in the registry "
                f"{self.registry_shown}, not the reader's {digest}: the reader resolved it from "
                "another registry, or before the version was changed there; resolve the "
                "version again (a new EdgeDataset) against this node's registry"
            )
        return manifest

    async def manifest(self, dataset: str, version: int) -> manifest_pb2.Manifest:
        """A version's manifest: from memory, the local cache, or the registry (then kept).

        A copy kept here is read from the registry again every
        ``MANIFEST_RECHECK_SECONDS``, in the background; once the registry's
        differs (a published version was changed), the version is refused
        (:meth:`_current_manifest`) until it is evicted.
        """
        validate_name(dataset)
        if version < 1:
            raise ValueError(f"version must be >= 1, got {version}")
        key = (dataset, version)
        found = self._manifests.get(key)
        if found is None:
            kept = self.store.get_manifest(dataset, version)
            if kept is None:
                found = await self._registry_manifest(dataset, version, "was never seen")
                try:
                    await self._write(
                        self.store.put_manifest, dataset, version, found.SerializeToString()
                    )
                except DiskFull:
                    # The registry answered: serve its manifest, keeping no copy, so the
                    # next call stores one once there is room (shards will not fit anyway).
                    return found
            else:
                try:
                    found = manifest_from_bytes(
                        kept, source=f"cached manifest of {dataset}@{version}"
                    )
                except ManifestError as exc:
                    found = await self._replace_damaged_manifest(dataset, version, kept, exc)
                else:
                    self._check_origin(found)  # origins may have been narrowed since
            self._manifests.setdefault(key, found)
        self._recheck_later(key)
        return self._current_manifest(key)

    async def _registry_manifest(
        self, dataset: str, version: int, locally: str
    ) -> manifest_pb2.Manifest:
        """The registry's manifest of a version, checked against ``origins``.

        ``locally`` says, when the registry cannot be read, why the node had to
        ask it (the version "was never seen", or its kept copy is damaged).
        """
        try:
            found = await self.registry.manifest(dataset, version)
        except OriginError as exc:
            if isinstance(exc, VersionNotFound):
                raise
            # Unreachable only when nothing answered: a refusal (403, a missing bucket) is
            # the registry's answer, and was called "unreachable".
            state = "is unreachable" if unreachable(exc) else "could not be read"
            raise OriginError(
                f"the registry {self.registry_shown} {state} and {dataset}@{version} "
                f"{locally} by this node: {exc}"
            ) from exc
        finally:
            self._count_retries()
        self._check_origin(found)  # before it is kept: a refused one is not
        self._manifest_asked[(dataset, version)] = time.monotonic()
        return found

    async def _replace_damaged_manifest(
        self, dataset: str, version: int, kept: bytes, damage: ManifestError
    ) -> manifest_pb2.Manifest:
        """The registry's manifest, kept in place of a local copy that fails its checks.

        A flipped bit in the node's own copy refused the version for good (evict
        keeps manifests, a restart reads the same bytes), with advice to republish
        a registry copy that was intact. Like a damaged chunk, the copy is fetched
        again. The cached shards stay only if the registry's manifest carries the
        digest the damaged copy still records (the version they were staged for);
        otherwise which version they belong to is unknown, and they are dropped.
        """
        recorded = manifest_pb2.Manifest()
        try:
            recorded.ParseFromString(kept)
        except DecodeError:
            recorded.Clear()
        log.warning(
            "the manifest of %s@%s kept in %s is damaged (%s); reading the registry's again",
            dataset,
            version,
            self.config.cache_dir,
            damage,
        )
        found = await self._registry_manifest(dataset, version, "is damaged in the cache kept")
        if not recorded.digest or recorded.digest != found.digest:
            freed = await self._write(self.store.evict_version, dataset, version)
            log.warning(
                "%s@%s: the cached shards (%s) cannot be matched to the registry's manifest "
                "%s, so they were dropped and are fetched again",
                dataset,
                version,
                format_bytes(freed),
                found.digest,
            )
        await self._write(self.store.put_manifest, dataset, version, found.SerializeToString())
        return found

    def _check_origin(self, manifest: manifest_pb2.Manifest) -> None:
        """Refuse a version whose data (or a transform's file) lies outside ``origins``.

        The manifest comes from the registry: without this, whoever can write
        there could have the node read any file or URL it reaches (its own
        tokens, ``/proc/self/environ``, a metadata service) and serve the bytes
        back as rows.
        """
        prefixes = self.config.origin_prefixes()
        spec = manifest.preprocess
        try:
            urls = [manifest.source_url] + [
                resource_url(manifest.source_url, ref)
                for ref in resource_refs(spec.transform, spec.params)
            ]
        except ValueError as exc:  # a transform's file no node can read
            raise ManifestError(f"{manifest.dataset}@{manifest.version}: {exc}") from exc
        for url in urls:
            if not origin_allowed(url, prefixes):
                raise ManifestError(
                    f"{manifest.dataset}@{manifest.version} reads {url}, outside the origins "
                    f"this node may read ({', '.join(prefixes)}); a version is refused there "
                    "so that a registry entry cannot make the node read and serve other "
                    "files. If the version is trusted, add its origin's prefix to the node's "
                    "origins setting (EDGECACHE_ORIGINS); otherwise publish it from an "
                    "allowed origin"
                )

    def _current_manifest(self, key: tuple[str, int]) -> manifest_pb2.Manifest:
        """The manifest this node serves for a version; :class:`OriginChanged` if it changed.

        Its shards were made from the manifest kept here; serving them under the
        registry's new manifest would mix two contents under one ``name@N``, and
        serving the old one would hand out content the registry no longer has.
        """
        changed = self._changed.get(key)
        if changed is None:
            return self._manifests[key]
        kept = self._manifests[key]
        spec = f"{key[0]}@{key[1]}"
        raise OriginChanged(
            f"{spec} was changed in the registry {self.registry_shown} after this node cached "
            f"it: digest {kept.digest} here, {changed.digest} in the registry now. A "
            f"published version must never change (a registry reset or a hand edit?), so "
            f"this node serves neither as {spec}: publish the new content as a new version "
            f"(edgecache publish) and move readers to it, then evict {spec} from this node "
            f"(edgecache evict {spec}), after which it serves the registry's {spec}"
        )

    def _recheck_later(self, key: tuple[str, int]) -> None:
        """Read the registry's manifest again in the background, if it is time to."""
        asked = self._manifest_asked.get(key)
        if key in self._changed or key in self._manifest_checks:
            return
        if asked is not None and time.monotonic() - asked < MANIFEST_RECHECK_SECONDS:
            return
        self._start_check(key, self._manifests[key])

    def _start_check(self, key: tuple[str, int], kept: manifest_pb2.Manifest) -> asyncio.Task[None]:
        """Check ``key`` against the registry in a task of its own, the one in flight for it."""
        task = asyncio.create_task(self._check_manifest(key, kept))
        self._manifest_checks[key] = task
        task.add_done_callback(functools.partial(self._manifest_check_done, key))
        return task

    async def _check_now(
        self, key: tuple[str, int], kept: manifest_pb2.Manifest, *, wait: float | None = None
    ) -> None:
        """:meth:`_check_manifest` now, shared with any check of the version in flight.

        ``wait``: the longest to wait for it; past that the check goes on in the
        background and the caller is served the copy kept here.
        """
        running = self._manifest_checks.get(key) or self._start_check(key, kept)
        try:
            await asyncio.wait_for(asyncio.shield(running), wait)
        except TimeoutError:
            log.info(
                "the registry did not answer within %.0f s for %s@%d: serving the copy kept "
                "here meanwhile",
                wait,
                *key,
            )

    def _manifest_check_done(self, key: tuple[str, int], task: asyncio.Task[None]) -> None:
        self._manifest_checks.pop(key, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("checking %s@%d against the registry failed: %r", *key, exc)

    async def _check_manifest(self, key: tuple[str, int], kept: manifest_pb2.Manifest) -> None:
        """Compare the manifest kept here with the registry's; remember it if they differ.

        A registry that cannot be reached or read leaves the kept copy served (the
        node answers from it while the registry is away), as does a version the
        registry no longer lists: the next check tries again.
        """
        if key in self._changed:
            return
        dataset, version = key
        # Asked now, answered or not: an unreachable registry is tried again after the
        # interval, not on every read in between.
        self._manifest_asked[key] = time.monotonic()
        try:
            current = await self.registry.manifest(dataset, version)
        except EdgeCacheError as exc:
            log.info("could not check %s@%d against the registry: %s", dataset, version, exc)
            return
        finally:
            self._count_retries()
        if self._manifests.get(key) is not kept:
            return  # evicted and replaced meanwhile: that one is checked on its own
        if current.digest != kept.digest and key not in self._changed:
            # Holding none of its shards (evicted before anything here read it since the
            # change, or never staged), the node has nothing of the old content to mix
            # with the new: it serves the registry's, as a node that never saw the
            # version would. Refusing it asked for an evict that had already happened.
            # Refused first (serves() is False for the old manifest from here on, so no
            # shard of it is stored after), then asked on the writer thread, after any
            # shard of the old manifest already queued there.
            self._changed[key] = current
            held = await self._write(self.store.shards, dataset, version)
            if (
                not held
                and self._changed.get(key) is current
                and self._manifests.get(key) is kept
                and self._origin_allowed(current)
            ):
                await self._adopt(key, current, "this node holds none of its shards")
                return
            if self._changed.get(key) is not current:
                return  # evicted meanwhile: the evict adopted it
            log.warning(
                "%s@%d was changed in the registry %s after this node cached it (digest %s "
                "here, %s there): refusing it until it is evicted; publish the new content "
                "as a new version",
                dataset,
                version,
                self.registry_shown,
                kept.digest,
                current.digest,
            )

    # ------------------------------------------------------- for the node's other work

    def serves(self, manifest: manifest_pb2.Manifest) -> bool:
        """Whether ``manifest`` is what this node serves for its version.

        A shard made from another (the registry's version changed, or it was
        evicted and the registry's adopted, while the shard was fetched) must not
        be stored: it would be served under the other.
        """
        version = (manifest.dataset, manifest.version)
        serving = self._manifests.get(version, manifest)
        return version not in self._changed and serving.digest == manifest.digest

    async def evicted(self, dataset: str, version: int) -> None:
        """A version's shards were evicted: a changed one is served as the registry has it now.

        No shard of the old content is left, so nothing mixes the two any more.
        """
        changed = self._changed.get((dataset, version))
        if changed is not None:
            await self._adopt((dataset, version), changed, "evicted")

    async def _adopt(self, key: tuple[str, int], manifest: manifest_pb2.Manifest, why: str) -> None:
        """Serve the registry's ``manifest`` of a changed version, no shard of the old left.

        Served from now (before the copy kept on disk is written): from the first
        await on, a shard made from the old manifest must find it not served.
        """
        self._manifests[key] = manifest
        self._changed.pop(key, None)
        self._manifest_asked[key] = time.monotonic()
        with contextlib.suppress(DiskFull):
            await self._write(self.store.put_manifest, *key, manifest.SerializeToString())
        log.warning(
            "%s@%d was changed in the registry %s and %s: serving the registry's manifest "
            "(digest %s) from now on",
            *key,
            self.registry_shown,
            why,
            manifest.digest,
        )

    def _origin_allowed(self, manifest: manifest_pb2.Manifest) -> bool:
        """Whether ``manifest``'s sources lie within ``origins`` (:meth:`_check_origin`)."""
        try:
            self._check_origin(manifest)
        except ManifestError:
            return False
        return True

    def knows(self, dataset: str, version: int) -> bool:
        """Whether this node holds anything of a version: shards, a pin or its manifest."""
        key = (dataset, version)
        if key in self._manifests or key in self._changed:
            return True
        if self.store.get_manifest(dataset, version) is not None:
            return True
        return any((v.dataset, v.version) == key for v in self.store.versions())

    async def check_published(self, dataset: str, version: int, node_id: str) -> None:
        """:class:`VersionNotFound` unless the registry publishes ``dataset@version``.

        A registry that cannot be read says nothing either way: nothing is held
        here, so there is nothing to evict and no error to report.
        """
        try:
            await self.registry.manifest(dataset, version)
        except VersionNotFound as exc:
            raise VersionNotFound(
                f"{dataset}@{version} is not held by {node_id}, and {exc}; list the "
                f"published versions with `edgecache versions {dataset} --registry "
                f"{self.registry_shown}`"
            ) from exc
        except EdgeCacheError as exc:
            log.info("evict %s@%d: the registry could not be asked (%s)", dataset, version, exc)
        finally:
            self._count_retries()

    def held(self, v: VersionInfo) -> manifest_pb2.Manifest | None:
        """The manifest of a version the cache holds: the one served, else the copy kept.

        A restarted node knows its size (shards in all) and digest this way too.
        """
        found = self._manifests.get((v.dataset, v.version))
        if found is not None:
            return found
        raw = self.store.get_manifest(v.dataset, v.version)
        if raw is None:
            return None
        try:
            manifest = manifest_from_bytes(
                raw, source=f"cached manifest of {v.dataset}@{v.version}"
            )
        except EdgeCacheError:
            return None
        self._manifests[(v.dataset, v.version)] = manifest
        return manifest

    def checks(self) -> list[asyncio.Task[None]]:
        """The registry checks in flight (the node cancels them as it closes)."""
        return list(self._manifest_checks.values())
