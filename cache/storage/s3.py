"""S3 and S3-compatible stores through one pooled aiobotocore client.

A direct aiobotocore client because staging speed depends on it: a bounded
connection pool, concurrent ranged GETs for large objects, ``If-Match`` on
every part so an object replaced mid-download is noticed, create-only PUTs
(``If-None-Match: *``) and compare-and-swap updates (``If-Match`` on the
ETag read) for the registry, and verification of the bytes
against the checksum S3 reports (a full-object CRC32 or SHA-256, or the MD5
ETag of a single-part object): S3-compatible stores have served flipped bytes silently.
Endpoint, region and credentials come from the standard AWS environment and
config files (``AWS_ENDPOINT_URL`` etc.), so any S3-compatible store works.

Request-level retries (503 SlowDown, 5xx, connection errors) are botocore's
"standard" mode: exponential backoff with jitter. A connection reset while
reading a body is retried here, the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from edgecache.cache.errors import ObjectExists, ObjectNotFound, OriginError
from edgecache.cache.storage.base import (
    ObjectInfo,
    ObjectStore,
    RetryStats,
    Slot,
    changed,
    no_slot,
    verify,
)

__all__ = [
    "MIN_PART_BYTES",
    "MULTIPART_THRESHOLD",
    "PART_BYTES",
    "PART_SECONDS",
    "PARTS_PER_OBJECT",
    "STREAMS",
    "LinkRate",
    "S3Store",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Objects above MULTIPART_THRESHOLD are fetched as parallel ranged parts: split
# into PARTS_PER_OBJECT parts, each at least MIN_PART_BYTES and at most PART_BYTES
# (so a large object gets more parts of PART_BYTES). Across a long, lossy path one
# TCP stream carries little (cubic at 80 ms RTT and 0.1 % loss: ~10 Mbit/s), so
# filling the bandwidth-delay product takes many streams, and parts give them
# without holding more shards in memory. A part's request costs one round trip,
# small next to moving a MiB; small parts also keep the bytes in flight few, so
# a caller that throttles per request (staging, see ``slot``) slows down soon.
# Smaller objects are fetched whole: their parallelism comes from fetching
# several at once, and a request each is cheaper for origin.
#
# Those sizes suit a long path, where each TCP stream is held back by loss and
# round trips. On a fast one (an origin in the same region, a local
# S3-compatible store) one stream can carry what the link does and a request
# is over in milliseconds, so the request itself becomes the cost: signing,
# parsing and the store's own handling, on the CPUs staging needs (moto's
# server on loopback served 1 MiB parts about 3x slower than whole objects).
# So parts are sized from what the link delivers to this store: the rate of
# all its GETs together while any runs (LinkRate), shared by STREAMS requests
# (staging fetches 4 objects at once), each lasting about PART_SECONDS. An
# object that fits in one such part is fetched whole. A 100 Mbit/s path
# (~12 MB/s) keeps its 1 MiB parts, and with them the many streams a lossy
# path needs; a store delivering 200 MB/s or more gets parts of 12 MB and up,
# so token shards of ~12 MB come whole. Until a bucket has been measured,
# parts are sized as for a long path.
MULTIPART_THRESHOLD = 8 << 20
MIN_PART_BYTES = 1 << 20
PART_BYTES = 16 << 20
# Seconds a request may wait for the next bytes of an answer (botocore's default is 60),
# and for a connection.
READ_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5.0
PARTS_PER_OBJECT = 12
PART_SECONDS = 0.25
STREAMS = 4
_MEASURED_BYTES = 256 << 10  # less than this says more about latency than rate


class LinkRate:
    """The bytes/s one store's GETs to a bucket deliver together, lately.

    Bytes of the GETs finished over the last ``window`` seconds during which
    any GET was running, over those seconds: what the link gave while it was
    used, however many requests shared it, and without the gaps in which
    staging was busy preprocessing instead.
    """

    def __init__(self, window: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._running = 0
        self._busy = 0.0  # seconds with a GET running, up to the last time none was
        self._since = 0.0  # when the GETs running now began
        self._done: deque[tuple[float, int]] = deque()  # (busy clock at the end, bytes)
        self.samples = 0

    def _busy_now(self) -> float:
        return self._busy + (self._clock() - self._since if self._running else 0.0)

    def started(self) -> None:
        """A GET began."""
        if not self._running:
            self._since = self._clock()
        self._running += 1

    def finished(self, nbytes: int) -> None:
        """A GET ended with ``nbytes`` (0 for one that failed)."""
        now = self._busy_now()
        self._running -= 1
        if not self._running:
            self._busy = now
        if nbytes:
            self._done.append((now, nbytes))
            self.samples += 1
        while self._done and self._done[0][0] < now - self.window:
            self._done.popleft()

    @property
    def bytes_per_second(self) -> float:
        """0 until at least ``_MEASURED_BYTES`` over 10 ms of use have been seen."""
        now = self._busy_now()
        recent = sum(n for at, n in self._done if at >= now - self.window)
        span = min(self.window, now)
        return recent / span if recent >= _MEASURED_BYTES and span >= 0.01 else 0.0


# S3's answers to a request signed for, or sent to, the wrong region.
_WRONG_REGION = frozenset(
    {"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}
)


def _max_attempts() -> int:
    """``$AWS_MAX_ATTEMPTS`` (botocore's setting: tries in all), else 6."""
    text = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if not text:
        return 6
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"AWS_MAX_ATTEMPTS={text!r} is not a whole number of tries (1 or more): set it "
            "to one, e.g. 6, or unset it"
        )
    return int(text)


def check_environment() -> None:
    """Refuse AWS settings that would fail every S3 request, at a node's start.

    Read only when the first S3 request is made, a bad one would otherwise
    fail every Stage that reaches an ``s3://`` origin, long after the node
    said it was serving. Raises ValueError naming the variable.
    """
    _max_attempts()


def _botocore_retries(response: dict[str, Any]) -> int:
    """The retries botocore made inside one call, from its response or error response."""
    attempts = response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
    return attempts if isinstance(attempts, int) else 0


_FAILED = "edgecache-failed"  # botocore's request context: why the last try failed
# The tries botocore made of the S3 call running in this task (its retry quota may stop
# it short of AWS_MAX_ATTEMPTS): what an error after them says.
_TRIES: contextvars.ContextVar[int] = contextvars.ContextVar("edgecache_s3_tries", default=0)


def _note_failure(
    request_dict: dict[str, Any], caught_exception: Exception | None = None, **_: Any
) -> None:
    """Keep why a try failed (no answer, a reset) for the log line of the next one."""
    if caught_exception is not None:
        request_dict.setdefault("context", {})[_FAILED] = caught_exception


def _unanswered(exc: Exception) -> ConnectionError:
    """``exc`` as the cause of an OriginError when nothing answered at all.

    A ConnectionError (base.UNANSWERED), so a caller that knows the URL is the
    registry's says so, and which setting names it.
    """
    unanswered = ConnectionError(str(exc))
    unanswered.__cause__ = exc
    return unanswered


class _BodyBroken(Exception):
    """A GET's body broke off after its response began: botocore does not retry that; _call does."""


async def _body(body: Any) -> bytes:
    """The whole body of a response, a break in it raised as :class:`_BodyBroken`.

    Its own type because botocore has already tried the request itself as often
    as allowed when a timeout or a reset comes from the call: only a body cut
    short after the response began is this module's to retry.
    """
    from botocore.exceptions import IncompleteReadError, ResponseStreamingError

    try:
        data: bytes = await body.read()
        return data
    except (
        ResponseStreamingError,
        IncompleteReadError,
        OSError,
        asyncio.IncompleteReadError,
    ) as exc:
        raise _BodyBroken(str(exc)) from exc
    except Exception as exc:  # aiohttp's payload errors are not OSErrors
        if type(exc).__module__.startswith("aiohttp"):
            raise _BodyBroken(str(exc)) from exc
        raise


def _backoff(attempt: int, base: float = 0.1, cap: float = 5.0) -> float:
    """Full-jitter exponential backoff (the AWS architecture blog's recommendation)."""
    return random.uniform(0, min(cap, base * 2**attempt))


_UPDATE_ATTEMPTS = 20  # compare-and-swap rounds before update() gives up


class _PreconditionFailed(OriginError):
    """An If-Match / If-None-Match condition did not hold."""


def _denied(exc: BaseException) -> PermissionError:
    """A ``PermissionError`` caused by ``exc``, to raise an :class:`OriginError` ``from``.

    Bad credentials or client settings are a refusal no retry can fix: a node's
    status mapping reads a ``PermissionError`` among an error's causes as one
    (FAILED_PRECONDITION), where a bare botocore error would read as transient.
    """
    denied = PermissionError(str(exc))
    denied.__cause__ = exc
    return denied


def _setup_error(exc: BaseException) -> OriginError:
    """The error for an S3 client that cannot be made from the AWS settings, naming them."""
    from botocore.exceptions import PartialCredentialsError, ProfileNotFound

    if isinstance(exc, PartialCredentialsError):
        return OriginError(
            f"incomplete AWS credentials ({exc}): set both AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones), or neither "
            "to use AWS_PROFILE or a role"
        )
    if isinstance(exc, ProfileNotFound):
        profile = exc.kwargs.get("profile", "")
        return OriginError(
            f"AWS profile {profile!r} (AWS_PROFILE) is not in ~/.aws/config or "
            "~/.aws/credentials (or the files AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE "
            "name): add it there, or set AWS_PROFILE to one that is, or unset it"
        )
    if isinstance(exc, ValueError) and "endpoint" in str(exc).lower():
        named = ", ".join(
            f"{name}={os.environ[name]}"
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
            if os.environ.get(name)
        )
        return OriginError(
            f"the S3 endpoint is not a URL ({exc}{'; ' + named if named else ''}): set "
            "AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3, or endpoint_url in the AWS profile) to "
            "a URL with its scheme, e.g. http://localhost:9000, or unset it for AWS itself"
        )
    return OriginError(f"cannot make an S3 client from the AWS settings: {exc}; fix them")


class S3Store(ObjectStore):
    """S3 and S3-compatible stores through one pooled aiobotocore client."""

    def __init__(
        self,
        *,
        max_connections: int = 32,
        part_bytes: int = PART_BYTES,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        attempts: int | None = None,
        adaptive_parts: bool = True,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.stats = RetryStats()
        self.read_timeout = read_timeout
        self.part_bytes = part_bytes
        self.multipart_threshold = multipart_threshold
        self.adaptive_parts = adaptive_parts
        self.rates: dict[str, LinkRate] = {}  # by bucket: buckets may sit in other regions
        # AWS_MAX_ATTEMPTS is the standard knob; 6 tries ride out SlowDown bursts.
        self.attempts = attempts or _max_attempts()
        self._max_connections = max_connections
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock = asyncio.Lock()
        self._parts = asyncio.Semaphore(max_connections)

    async def _s3(self) -> Any:
        async with self._lock:
            if self._client is None:
                from aiobotocore.config import AioConfig
                from aiobotocore.session import get_session

                config = AioConfig(
                    max_pool_connections=self._max_connections,
                    # total_max_attempts counts every try, as AWS_MAX_ATTEMPTS does;
                    # botocore's max_attempts counts retries (one more request).
                    retries={"mode": "standard", "total_max_attempts": self.attempts},
                    connect_timeout=CONNECT_TIMEOUT,
                    read_timeout=self.read_timeout,
                )
                from botocore.exceptions import BotoCoreError

                stack = contextlib.AsyncExitStack()
                try:
                    self._client = await stack.enter_async_context(
                        get_session().create_client("s3", config=config)
                    )
                except (BotoCoreError, ValueError) as exc:  # "Invalid endpoint: …" is a ValueError
                    raise _setup_error(exc) from _denied(exc)
                events = self._client.meta.events
                events.register("needs-retry.s3", _note_failure)
                events.register("request-created.s3", self._say_retry)
                self._stack = stack
            return self._client

    def _say_retry(self, request: Any, operation_name: str = "request", **_: Any) -> None:
        """Count each try botocore makes and log one it makes after no answer or a reset.

        botocore retries such a request inside one call, up to ``attempts`` tries of
        ``read_timeout`` each: an S3 endpoint that accepts connections and never
        answers kept ``versions`` and the controller silent for minutes. Logged as
        the new try goes out, not when the last one failed: botocore's retry quota
        (standard mode) may give up earlier than ``attempts``, and a try announced
        then never came. A retried answer (503 SlowDown, 5xx) is counted from the
        response's ``RetryAttempts`` instead, and not logged: a throttling burst would
        fill the log.
        """
        context = getattr(request, "context", None) or {}
        attempt = int(context.get("retries", {}).get("attempt", 1))
        _TRIES.set(attempt)
        failed = context.pop(_FAILED, None)
        if attempt > 1 and failed is not None:
            self.stats.retries += 1
            log.warning(
                "S3 %s: %s (try %d of %d); trying again",
                operation_name,
                failed,
                attempt - 1,
                self.attempts,
            )

    async def close(self) -> None:
        """Close the client and its connection pool."""
        if self._stack is not None:
            await self._stack.aclose()
        self._client = self._stack = None

    def _no_bucket(self, url: str) -> str:
        """What to check when S3 says a bucket is not there: its name, or where we asked."""
        bucket = self._split(url)[0]
        endpoint = getattr(getattr(self._client, "meta", None), "endpoint_url", None) or "AWS"
        return (
            f"bucket {bucket!r} does not exist at {endpoint} (NoSuchBucket, asked for {url}): "
            "check the bucket name, and that the endpoint (AWS_ENDPOINT_URL, "
            "AWS_ENDPOINT_URL_S3 or the profile's endpoint_url) and account are the ones "
            "that hold it"
        )

    def _wrong_region(self, url: str, response: dict[str, Any]) -> str:
        """What to set when S3 says the bucket lives in another region than we signed for.

        botocore follows such a redirect itself only for AWS's own global endpoint;
        at a regional or S3-compatible endpoint the region must be set.
        """
        bucket = self._split(url)[0]
        error = response.get("Error", {})
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        region = error.get("Region") or headers.get("x-amz-bucket-region")
        asked = getattr(getattr(self._client, "meta", None), "region_name", None) or "none"
        where = f"is in region {region}" if region else "is in another region"
        fix = region or "the bucket's region"
        return (
            f"bucket {bucket!r} {where}, not {asked} ({error.get('Code') or 301}, asked for "
            f"{url}): set AWS_REGION={fix} (or AWS_DEFAULT_REGION, or region in the AWS "
            "profile), and the endpoint to that region's if one is set"
        )

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        """Bucket and key of ``s3://bucket/key``, the key exactly as S3 spells it.

        Not ``urlsplit``: a key may hold ``#`` and ``?``, which a URL parser takes
        for a fragment and a query, cutting the key short (s3fs splits the same way).
        """
        scheme, sep, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        if scheme != "s3" or not sep or not bucket:
            raise ValueError(f"not an s3:// URL: {url!r}; give it as s3://BUCKET/PREFIX")
        return bucket, key

    async def _call(self, url: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run one S3 call, turning botocore's errors into edgecache's, retrying body resets."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        for attempt in range(self.attempts):
            _TRIES.set(0)
            try:
                self.stats.requests += 1
                result = await op()
                if isinstance(result, dict):  # a response (a GET's are counted in _read)
                    self.stats.retries += _botocore_retries(result)
                return result
            except ClientError as exc:
                # botocore retried inside the call before giving up: those count too.
                self.stats.retries += _botocore_retries(exc.response)
                error = exc.response.get("Error", {})
                code = str(error.get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code == "NoSuchBucket":
                    raise ObjectNotFound(self._no_bucket(url)) from exc
                if code in ("NoSuchKey", "404", "NotFound"):
                    raise ObjectNotFound(f"no object at {url} ({code})") from exc
                # 409 ConditionalRequestConflict: another conditional write to the key
                # is in flight; like a 412, this one's condition may no longer hold.
                if code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or (
                    status == 412
                ):
                    raise _PreconditionFailed(url) from exc
                if code in _WRONG_REGION or status == 301:
                    raise OriginError(self._wrong_region(url, exc.response)) from _denied(exc)
                if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                    raise OriginError(
                        f"origin refused access to {url} ({code}): check the AWS credentials "
                        "and the bucket policy"
                    ) from exc
                raise OriginError(f"origin request for {url} failed: {exc}") from exc
            except EndpointConnectionError as exc:
                raise OriginError(
                    f"origin for {url} is unreachable ({exc}); check AWS_ENDPOINT_URL and the "
                    "network"
                ) from _unanswered(exc)
            except (ReadTimeoutError, ConnectTimeoutError) as exc:
                # botocore tried the request as often as it would already (each logged by
                # _say_retry): trying it again here made 36 tries of 30 s, 18 silent minutes.
                tries = _TRIES.get() or 1
                silence = (
                    f"did not accept a connection within {CONNECT_TIMEOUT:g} s"
                    if isinstance(exc, ConnectTimeoutError)
                    else f"did not answer within {self.read_timeout:g} s"
                )
                raise OriginError(
                    f"origin for {url} {silence}, {tries} "
                    f"{'try' if tries == 1 else 'tries'} ({exc}): check that AWS_ENDPOINT_URL "
                    "names a running S3 server and that the network reaches it "
                    "(AWS_MAX_ATTEMPTS sets the tries)"
                ) from _unanswered(exc)
            except (_BodyBroken, OSError) as exc:
                cause = exc.__cause__ if isinstance(exc, _BodyBroken) else exc
                if attempt + 1 == self.attempts:
                    raise OriginError(
                        f"reading {url} kept failing after {self.attempts} attempts: {cause}"
                    ) from cause
                log.warning(
                    "reading %s: %s (try %d of %d); trying again",
                    url,
                    cause,
                    attempt + 1,
                    self.attempts,
                )
            except NoCredentialsError as exc:  # none found at all; partial ones fail in _s3
                raise OriginError(
                    f"no AWS credentials to sign the request for {url} ({exc}): set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a "
                    "profile in ~/.aws/credentials or ~/.aws/config, or run with an instance "
                    "or pod role"
                ) from _denied(exc)
            except BotoCoreError as exc:
                raise OriginError(f"origin request for {url} failed: {exc}") from exc
            self.stats.retries += 1
            await asyncio.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    async def head(self, url: str) -> ObjectInfo:
        """HEAD the object, asking for its full-object checksum."""
        bucket, key = self._split(url)
        s3 = await self._s3()
        response = await self._call(
            url, lambda: s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        )
        return ObjectInfo(
            url=url,
            size=int(response["ContentLength"]),
            etag=response["ETag"].strip('"'),
            sha256=response.get("ChecksumSHA256"),
            crc32=response.get("ChecksumCRC32"),
        )

    async def list(self, prefix_url: str) -> list[ObjectInfo]:
        """ListObjectsV2 under the prefix, every page; directory markers left out.

        A key ending in ``/`` (what the S3 console's "Create folder" and some sync
        tools write) marks a folder, as s3fs and the console read it: it is no
        object, and a shard named by it would have no file name.
        """
        bucket, prefix = self._split(prefix_url)
        s3 = await self._s3()
        out: list[ObjectInfo] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._call(prefix_url, functools.partial(s3.list_objects_v2, **kwargs))
            for item in page.get("Contents", []):
                if item["Key"].endswith("/"):
                    continue
                out.append(
                    ObjectInfo(
                        url=f"s3://{bucket}/{item['Key']}",
                        size=int(item["Size"]),
                        etag=item["ETag"].strip('"'),
                    )
                )
            if not page.get("IsTruncated"):
                return sorted(out, key=lambda o: o.url)
            token = page["NextContinuationToken"]

    async def _read(self, url: str, **kwargs: Any) -> tuple[bytes, ObjectInfo]:
        """One GET; the bytes and what the response says about the object."""
        bucket, key = self._split(url)
        s3 = await self._s3()

        async def once() -> tuple[bytes, ObjectInfo]:
            link = self.rates.setdefault(bucket, LinkRate())
            link.started()
            data = b""
            try:
                response = await s3.get_object(Bucket=bucket, Key=key, **kwargs)
                # botocore's own retries (throttling, 5xx) happen inside the call: count them.
                self.stats.retries += _botocore_retries(response)
                async with response["Body"] as body:
                    data = await _body(body)
            finally:
                link.finished(len(data))
            self.stats.bytes_read += len(data)
            total = str(response.get("ContentRange", "")).rpartition("/")[2]
            info = ObjectInfo(
                url=url,
                size=int(total) if total.isdigit() else len(data),
                etag=str(response.get("ETag", "")).strip('"'),
                sha256=None if "Range" in kwargs else response.get("ChecksumSHA256"),
                crc32=None if "Range" in kwargs else response.get("ChecksumCRC32"),
            )
            return data, info

        return await self._call(url, once)

    async def get_range(self, url: str, start: int, end: int) -> bytes:
        """One ranged GET (``end`` exclusive)."""
        data, _ = await self._read(url, Range=f"bytes={start}-{end - 1}")
        return data

    async def get(
        self, url: str, *, expect: ObjectInfo | None = None, slot: Slot | None = None
    ) -> bytes:
        """The whole object, verified against origin's checksum.

        With ``expect`` (what a manifest recorded) no HEAD is needed: every GET
        carries ``If-Match`` on the recorded ETag, so a replaced object fails
        with :class:`OriginChanged` instead of mixing versions.
        """
        info = expect or await self.head(url)
        for attempt in range(2):
            try:
                data, seen = await self._get_parts(url, info, slot or no_slot)
            except _PreconditionFailed as exc:
                found = await self.head(url)
                if expect is None and attempt == 0:
                    # Rewritten between this call's own HEAD and GET (the controller saving
                    # its record as plan --status read it): no content was promised, so
                    # read what is there now. It was refused as a changed published object,
                    # with advice to publish anew (a helper's hunt).
                    info = found
                    continue
                raise changed(url, info, found) from exc
            if expect is not None and not expect.same_content(seen):
                raise changed(url, expect, seen)
            problem = verify(data, seen)
            if problem is None:
                return data
            log.warning("%s: %s (attempt %d)", url, problem, attempt + 1)
            self.stats.retries += 1
        raise OriginError(
            f"{url}: {problem}; origin keeps returning damaged bytes — check the storage backend"
        )

    def part_size(self, size: int, bucket: str | None = None) -> int:
        """Bytes per ranged part for an object of ``size`` bytes in ``bucket``.

        For a long path: ``PARTS_PER_OBJECT`` parts, each at least
        ``MIN_PART_BYTES`` and at most ``part_bytes``. Once the bucket's link
        rate is measured, parts are at least what one of ``STREAMS`` sharing
        it fetches in ``PART_SECONDS`` (a size of ``size`` or more means:
        fetch it whole).
        """
        wanted = -(-size // PARTS_PER_OBJECT)
        step = min(self.part_bytes, max(MIN_PART_BYTES, wanted))
        measured = self.rates.get(bucket or "")
        if self.adaptive_parts and measured is not None and measured.bytes_per_second:
            step = max(step, int(measured.bytes_per_second / STREAMS * PART_SECONDS))
        return step

    async def _get_parts(self, url: str, info: ObjectInfo, slot: Slot) -> tuple[bytes, ObjectInfo]:
        condition = {"IfMatch": f'"{info.etag}"', "ChecksumMode": "ENABLED"}
        step = self.part_size(info.size, self._split(url)[0])
        if info.size <= self.multipart_threshold or step >= info.size:
            async with slot():
                return await self._read(url, **condition)
        buffer = bytearray(info.size)
        seen: list[ObjectInfo] = []

        async def part(start: int) -> None:
            end = min(start + step, info.size)
            # The caller's slot first: a part waiting for it holds no connection.
            async with slot(), self._parts:
                chunk, part_info = await self._read(
                    url, Range=f"bytes={start}-{end - 1}", **condition
                )
            if len(chunk) != end - start:
                raise OriginError(f"{url}: range {start}-{end} returned {len(chunk)} bytes")
            buffer[start:end] = chunk
            seen.append(part_info)

        await asyncio.gather(*(part(s) for s in range(0, info.size, step)))
        return bytes(buffer), seen[0]

    async def put(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        """PUT; with ``if_absent``, ``If-None-Match: *`` makes it create-only.

        A create-only PUT whose answer was lost is sent again (by botocore, or by
        :meth:`_call`) and meets its own write: 412. The object then holding exactly
        ``data`` is that write, not another writer's, so the PUT succeeded (else a
        publish took its own version for a rival's and published the data again
        under the next number).
        """
        bucket, key = self._split(url)
        s3 = await self._s3()
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": data}
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            await self._call(url, lambda: s3.put_object(**kwargs))
        except _PreconditionFailed as exc:
            try:
                there, _ = await self._read(url)
            except ObjectNotFound:
                there = None  # deleted since: still not ours to claim
            if there == data:
                log.info("%s: a create-only write met itself (its answer was lost)", url)
                return
            raise ObjectExists(f"{url} already exists") from exc

    async def update(self, url: str, change: Callable[[bytes | None], bytes | None]) -> None:
        """Compare-and-swap: a PUT conditional on the ETag read, retried when it lost.

        ``If-Match`` on the ETag of what ``change`` saw (``If-None-Match: *`` when
        there was nothing): a write that lost to another reads again and retries.
        """
        bucket, key = self._split(url)
        s3 = await self._s3()
        for attempt in range(_UPDATE_ATTEMPTS):
            try:
                current, seen = await self._read(url)
                condition = {"IfMatch": f'"{seen.etag}"'}
            except ObjectNotFound:
                current, condition = None, {"IfNoneMatch": "*"}
            new = change(current)
            if new is None:
                return
            kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": new, **condition}
            try:
                await self._call(url, functools.partial(s3.put_object, **kwargs))
                return
            except _PreconditionFailed:
                log.info("%s changed while it was updated; reading it again", url)
                await asyncio.sleep(_backoff(attempt, base=0.05, cap=1.0))
        raise OriginError(
            f"could not update {url}: {_UPDATE_ATTEMPTS} conditional writes in a row lost to "
            "other writers"
        )

    async def delete(self, url: str) -> None:
        """DeleteObject (S3 answers success for a missing key too)."""
        bucket, key = self._split(url)
        s3 = await self._s3()
        await self._call(url, lambda: s3.delete_object(Bucket=bucket, Key=key))
