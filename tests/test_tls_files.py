"""Client TLS files: read and checked once per set of files, again when one changes on disk.

Every ``grpcs://`` channel (each Pin or Evict call, each status round) read the
CA bundle, certificate and key from disk and checked them again.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tlsutil import make_pki

from edgecache.cache.errors import InvalidEndpoint
from edgecache.clients.channels import client_credentials, open_channel

ENDPOINT = "grpcs://127.0.0.1:7070"
_opened: collections.Counter[str] | None = None


def _count_opens(event: str, args: tuple[object, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened[os.fsdecode(args[0])] += 1


sys.addaudithook(_count_opens)  # cannot be removed: it counts only while a test watches


@pytest.fixture
def opened() -> Iterator[collections.Counter[str]]:
    """How many times Python opened each path during the test."""
    global _opened
    _opened = collections.Counter()
    try:
        yield _opened
    finally:
        _opened = None


@pytest.fixture
def pki(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A CA, client certificate and key, named by the EDGECACHE_TLS_* variables."""
    (tmp_path / "pki").mkdir()
    files = make_pki(tmp_path / "pki")
    monkeypatch.setenv("EDGECACHE_TLS_CA", str(files["ca"]))
    monkeypatch.setenv("EDGECACHE_TLS_CERT", str(files["client"]))
    monkeypatch.setenv("EDGECACHE_TLS_KEY", str(files["client_key"]))
    return files


def _reads(opened: collections.Counter[str], pki: dict[str, Path]) -> dict[str, int]:
    return {name: opened[str(pki[name])] for name in ("ca", "client", "client_key")}


def test_two_channels_with_the_same_files_read_each_file_once(
    pki: dict[str, Path], opened: collections.Counter[str]
) -> None:
    for _ in range(2):
        open_channel(ENDPOINT).close()
    client_credentials()
    assert _reads(opened, pki) == {"ca": 1, "client": 1, "client_key": 1}


def test_a_certificate_replaced_on_disk_is_read_again(
    tmp_path: Path, pki: dict[str, Path], opened: collections.Counter[str]
) -> None:
    open_channel(ENDPOINT).close()
    (tmp_path / "rotated").mkdir()
    rotated = make_pki(tmp_path / "rotated")
    os.replace(rotated["client"], pki["client"])  # as a renewal does: a new file
    os.replace(rotated["client_key"], pki["client_key"])
    open_channel(ENDPOINT).close()
    open_channel(ENDPOINT).close()
    assert _reads(opened, pki) == {"ca": 2, "client": 2, "client_key": 2}  # the set, once


def test_a_file_rewritten_in_place_is_checked_again(
    pki: dict[str, Path], opened: collections.Counter[str]
) -> None:
    open_channel(ENDPOINT).close()
    pki["ca"].write_text("not a certificate\n")
    opened.clear()
    for _ in range(2):  # a file that fails its check is not kept: it fails every time
        with pytest.raises(InvalidEndpoint, match=r"\$EDGECACHE_TLS_CA \(.*\) holds no PEM"):
            open_channel(ENDPOINT)
    assert opened[str(pki["ca"])] == 2


def test_a_key_swapped_for_another_is_refused_naming_both_variables(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    open_channel(ENDPOINT).close()
    os.replace(pki["server_key"], pki["client_key"])
    with pytest.raises(InvalidEndpoint, match=r"the key is not the certificate's"):
        open_channel(ENDPOINT)


def test_another_path_is_read_and_a_missing_file_says_so_every_time(
    tmp_path: Path,
    pki: dict[str, Path],
    opened: collections.Counter[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    open_channel(ENDPOINT).close()
    copy = tmp_path / "ca-copy.pem"
    copy.write_bytes(pki["ca"].read_bytes())
    monkeypatch.setenv("EDGECACHE_TLS_CA", str(copy))
    opened.clear()
    open_channel(ENDPOINT).close()
    open_channel(ENDPOINT).close()
    assert opened[str(copy)] == 1
    copy.unlink()
    for _ in range(2):
        with pytest.raises(InvalidEndpoint, match=r"\$EDGECACHE_TLS_CA names .*cannot be read"):
            open_channel(ENDPOINT)


def test_a_given_ca_bundle_leaves_the_ca_variable_unread(
    pki: dict[str, Path], opened: collections.Counter[str]
) -> None:
    root = pki["ca"].read_bytes()
    opened.clear()
    for _ in range(2):
        open_channel(ENDPOINT, tls_root=root).close()
    assert _reads(opened, pki) == {"ca": 0, "client": 1, "client_key": 1}
