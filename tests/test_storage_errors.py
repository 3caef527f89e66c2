"""The fsspec store's failures, against real servers on loopback: no answer is never "none".

fsspec's HTTP filesystem answers ``exists`` False and ``info`` "not found" for a
host it could not reach, and an unreachable registry then listed as an empty
one; an ``ftp://`` filesystem connects when opened and its socket error
escaped raw; an HTTP 5xx is aiohttp's ``ClientResponseError`` (no ``OSError``)
and escaped as a traceback. Each is an :class:`OriginError` naming the URL, and
only an answer that nothing is there (a 404, a missing file) is
:class:`ObjectNotFound`, or an empty listing.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from edgeutil import write_parquet_shards
from typer.testing import CliRunner

from edgecache.cache.errors import ObjectNotFound, OriginError
from edgecache.cache.storage import FsspecStore
from edgecache.cache.storage.base import unreachable
from edgecache.clients.cli import app

Op = Callable[[FsspecStore, str], Awaitable[object]]
OPS: dict[str, Op] = {
    "list": lambda store, url: store.list(url + "/"),
    "head": lambda store, url: store.head(url),
    "get": lambda store, url: store.get(url),
    "get_range": lambda store, url: store.get_range(url, 0, 4),
}


def failure(op: str, url: str) -> OriginError:
    """The error ``op`` on ``url`` raises (it must raise one)."""
    with pytest.raises(OriginError) as caught:
        asyncio.run(OPS[op](FsspecStore(), url))
    return caught.value


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves ``files/`` from a directory (with its listings); answers ``/<status>/…`` so."""

    def send_head(self):  # noqa: ANN201 - the stdlib's own signature, untyped
        first = self.path.lstrip("/").split("/", 1)[0]
        if first == "files":
            return super().send_head()
        status = int(first) if first.isdigit() else 404
        self.send_error(status)
        return None

    def translate_path(self, path: str) -> str:
        return super().translate_path(path.removeprefix("/files"))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``reg``, a registry with ``ds@1`` published (as ``file://``)."""
    root = tmp_path_factory.mktemp("served")
    write_parquet_shards(root / "raw", 2, rows=20)
    code, out = cli(
        "publish", str(root / "raw"), "--dataset", "ds", "--registry", str(root / "reg")
    )
    assert code == 0, out
    return root


@pytest.fixture(scope="module")
def server(served: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT``: ``/files/`` serves ``served``; ``/500/…`` answers 500."""

    def handler(*args: object) -> _Handler:
        return _Handler(*args, directory=str(served))  # type: ignore[arg-type]

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# ------------------------------------------------------------------ nothing answers


@pytest.mark.parametrize("op", OPS)
def test_a_refused_http_location_is_unreachable_never_empty_or_absent(
    op: str, closed_port: int
) -> None:
    """``list`` said ``[]`` (``exists`` False), ``head`` "no object at": the network, blamed on
    the data."""
    url = f"http://127.0.0.1:{closed_port}/reg/ds"
    error = failure(op, url)
    assert not isinstance(error, ObjectNotFound), error
    assert str(error).startswith(f"cannot reach {url}"), error
    assert "check the URL and the network" in str(error), error
    assert unreachable(error) and isinstance(error.__cause__, ConnectionRefusedError), error


@pytest.mark.parametrize("op", ["list", "get"])
def test_a_filesystem_that_connects_when_opened_names_the_url(op: str, closed_port: int) -> None:
    """``ftp://`` connects in the filesystem's constructor: ``[Errno 111]`` came out alone."""
    url = f"ftp://127.0.0.1:{closed_port}/reg"
    error = failure(op, url)
    assert str(error).startswith(f"cannot reach {url}"), error
    assert unreachable(error), error


# ------------------------------------------------------------------ the server answers


@pytest.mark.parametrize("op", OPS)
def test_an_http_5xx_is_an_origin_error_naming_the_url_and_status(op: str, server: str) -> None:
    """aiohttp's ``ClientResponseError`` is no ``OSError``: it escaped as a traceback."""
    url = f"{server}/500/reg/ds"
    error = failure(op, url)
    assert not isinstance(error, ObjectNotFound), error
    assert url in str(error) and "HTTP 500" in str(error) and "try again later" in str(error)
    assert not unreachable(error), error  # it answered: the network is not to blame


@pytest.mark.parametrize("op", ["head", "get"])
def test_an_http_403_is_a_refusal(op: str, server: str) -> None:
    """Raised from a ``PermissionError``, as a node's status mapping reads a refusal."""
    url = f"{server}/403/reg/ds/latest"
    error = failure(op, url)
    assert not isinstance(error, ObjectNotFound) and "HTTP 403" in str(error), error
    assert isinstance(error.__cause__, PermissionError), error


@pytest.mark.parametrize("op", ["head", "get", "get_range"])
def test_an_http_404_is_not_found(op: str, server: str) -> None:
    url = f"{server}/404/reg/ds/latest"
    with pytest.raises(ObjectNotFound, match=f"no object at {url}"):
        asyncio.run(OPS[op](FsspecStore(), url))


def test_an_absent_prefix_on_a_server_that_answers_lists_as_empty(server: str) -> None:
    assert asyncio.run(FsspecStore().list(f"{server}/404/reg/")) == []
    assert asyncio.run(FsspecStore().list(f"{server}/files/reg/nothing/")) == []


def test_an_http_listing_gives_every_file_with_its_size(server: str, served: Path) -> None:
    """A listing page's links carry no size (it was ``int(None)``), and are whole URLs (they
    were listed as ``http://http://…``)."""
    listed = asyncio.run(FsspecStore().list(f"{server}/files/reg/"))
    files = sorted(p for p in (served / "reg").rglob("*") if p.is_file())
    assert len(files) > 1
    assert [(o.url, o.size) for o in listed] == [
        (f"{server}/files/{p.relative_to(served)}", p.stat().st_size) for p in files
    ]


# ------------------------------------------------------------------ local disks


def test_a_local_prefix_that_is_missing_or_under_a_file_lists_as_empty(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    store = FsspecStore()
    assert asyncio.run(store.list(f"file://{tmp_path}/missing/")) == []
    assert asyncio.run(store.list(f"file://{tmp_path}/file/below/")) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_local_prefix_is_an_error_not_empty(tmp_path: Path) -> None:
    """``find`` leaves out what it cannot list: an unreadable registry held "no datasets"."""
    (tmp_path / "reg" / "ds").mkdir(parents=True)
    (tmp_path / "reg").chmod(0)
    try:
        error = failure("list", f"file://{tmp_path}/reg")
    finally:
        (tmp_path / "reg").chmod(0o755)
    assert isinstance(error.__cause__, PermissionError) and not unreachable(error), error


# ------------------------------------------------------------------ through the CLI


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (503, "request for {url}/ds/versions/ failed"),
        # The store calls what it reads "origin": "origin refused access to …" sent the
        # reader to the source's credentials for the registry's refusal.
        (403, "refused access to {url}/ds/"),
    ],
)
def test_a_registry_that_fails_or_refuses_is_named_without_a_traceback(
    server: str, status: int, said: str
) -> None:
    url = f"{server}/{status}/reg"
    code, out = cli("versions", "ds", "--registry", url)
    assert code == 1, out
    assert out.startswith(f"error: registry {url} " + said.format(url=url)), out
    assert f"HTTP {status}" in out and "Traceback" not in out and "origin" not in out, out


def test_a_registry_served_over_http_reads_and_one_absent_holds_nothing(server: str) -> None:
    code, out = cli("versions", "ds", "--registry", f"{server}/files/reg", "--json")
    assert code == 0, out
    assert [v["version"] for v in json.loads(out)] == [1], out
    code, out = cli("versions", "ds", "--registry", f"{server}/404/reg")
    assert code == 2 and "holds no datasets" in out, out


def test_a_registry_refusal_shows_its_url_without_credentials(server: str) -> None:
    # Said twice since the registry is named beside the store's URL under it: both bare.
    url = f"{server}/403/reg".replace("http://", "http://alice:s3cret@")
    code, out = cli("versions", "ds", "--registry", url)
    assert code == 1, out
    assert "s3cret" not in out and "alice" not in out, out
    assert out.startswith(f"error: registry {server}/403/reg refused access to {server}/"), out
