"""The one walk down an error's cause chain, shared by the registry and the edge service."""

from __future__ import annotations

import errno

from edgecache.cache import registry
from edgecache.cache.errors import OriginError, causes
from edgecache.edge import service


def chained() -> tuple[OriginError, OSError, ValueError]:
    """An OriginError raised from an OSError raised from a ValueError."""
    root = ValueError("root")
    disk = OSError(errno.ENOSPC, "No space left on device")
    disk.__cause__ = root
    top = OriginError("write failed")
    top.__cause__ = disk
    return top, disk, root


def test_causes_walks_what_an_error_was_raised_from_nearest_first() -> None:
    top, disk, root = chained()
    assert list(causes(top)) == [disk, root]
    assert list(causes(top, itself=True)) == [top, disk, root]
    assert list(causes(root)) == []
    assert list(causes(root, itself=True)) == [root]


def test_causes_follows_raise_from() -> None:
    try:
        try:
            raise KeyError("k")
        except KeyError as exc:
            raise OriginError("unreachable") from exc
    except OriginError as exc:
        assert [type(c) for c in causes(exc)] == [KeyError]


def test_out_of_space_is_seen_on_the_error_itself_and_down_its_causes() -> None:
    top, disk, _ = chained()
    assert registry._out_of_space(top)
    assert registry._out_of_space(disk)  # the error itself counts
    assert registry._out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not registry._out_of_space(OriginError("refused"))


def test_the_edge_service_walks_the_same_chain() -> None:
    assert service.causes is causes
