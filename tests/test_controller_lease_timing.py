"""A leader never skips a call because its renewal schedule left it a sliver of the lease.

Every Pin and Evict call ends half the lease after the last renewal, and none
is begun with less than ``MIN_CALL_SECONDS`` left. The lease was renewed only
once a third of it had gone: with a 2 s lease, a call from 0.5 s to 0.67 s
after a renewal was skipped as out of time and nothing renewed the lease.
The controller runs in-process on a file:// registry against a real node on
loopback; the seconds clock its lease is timed on (``time.monotonic`` in the
controller and the executor) is one the test moves, so where a round's calls
fall in the lease does not depend on the machine's speed.

The calls themselves are real, and their timeouts are what the lease leaves
them: at a 2 s lease about 1 s, which a loaded host's node can miss (a failure
of the round). So the lease, the times the test sets and the controller's
margins (``MIN_CALL_SECONDS``, ``RENEW_AHEAD``, the status floor) are all
``SCALE`` times the product's: each call falls where it did in the lease, and
has ten times as long to be answered.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from edgeutil import pins_on, stub
from test_controller import Clock, job, one_region

import edgecache.clients.controller as controller_module
import edgecache.clients.executor as executor_module
from edgecache.cache.lease import Lease
from edgecache.clients.controller import Controller
from edgecache.clients.node_client import LocalNode
from edgecache.v1 import edge_pb2

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
SCALE = 10  # the lease and every time of it, as a multiple of the product's (see above)


class LeaseTime:
    """The ``time`` module as the controller and the executor see it, on a clock the test moves.

    ``monotonic`` reads 0 until the controller holds the lease, then
    ``after_taking``: the round spent that long between taking the lease and
    its calls. Each read from the executor (one per call it is about to
    make) moves the clock on by ``per_call`` after answering: each call took
    that long. Everything else is the real ``time``.
    """

    def __init__(self, lease: Lease, after_taking: float, per_call: float = 0.0) -> None:
        self.lease, self.after_taking, self.per_call = lease, after_taking, per_call
        self.calls = 0.0  # seconds the calls made so far took

    def now(self) -> float:
        return 0.0 if self.lease.generation is None else self.after_taking + self.calls

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class TimeView:
    """One module's view of :class:`LeaseTime`: the executor's reads are each a call, which
    takes time (``reads_are_calls``); the controller's take none."""

    def __init__(self, shared: LeaseTime, *, reads_are_calls: bool) -> None:
        self.shared, self.reads_are_calls = shared, reads_are_calls

    def monotonic(self) -> float:
        now = self.shared.now()
        if self.reads_are_calls:
            self.shared.calls += self.shared.per_call
        return now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller's margins, ``SCALE`` times the product's, for a lease as scaled."""
    min_call = executor_module.MIN_CALL_SECONDS * SCALE
    monkeypatch.setattr(executor_module, "MIN_CALL_SECONDS", min_call)
    monkeypatch.setattr(controller_module, "MIN_CALL_SECONDS", min_call)
    renew_ahead = controller_module.RENEW_AHEAD * SCALE
    monkeypatch.setattr(controller_module, "RENEW_AHEAD", renew_ahead)
    for name in ("STATUS_FLOOR", "STATUS_TIMEOUT"):
        monkeypatch.setattr(controller_module, name, getattr(controller_module, name) * SCALE)


def resident_b_and_c(
    root: Path, registry: str, node: LocalNode, lease_ttl: float = 2 * SCALE
) -> Controller:
    """b@1 and c@1 staged on the node, read by jobs j and k later today; a 2 s lease,
    scaled (see the module's docstring)."""
    for name in ("b", "c"):
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset=name, version=1)))
    one_region(
        root,
        registry,
        node,
        job("j", "eu", T0 + 2 * HOUR, 1, "b@1"),
        job("k", "eu", T0 + 4 * HOUR, 1, "c@1"),
    )
    return Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), lease_ttl=lease_ttl
    )


def on_lease_time(monkeypatch: pytest.MonkeyPatch, shared: LeaseTime) -> None:
    modules: list[tuple[ModuleType, object]] = [
        (controller_module, TimeView(shared, reads_are_calls=False)),
        (executor_module, TimeView(shared, reads_are_calls=True)),
    ]
    for module, seen in modules:
        monkeypatch.setattr(module, "time", seen)


def test_calls_late_in_the_window_renew_the_lease_first_instead_of_being_skipped(
    eu, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, registry, node = eu
    scaled(monkeypatch)
    ctl = resident_b_and_c(root, registry, node)
    try:
        # Status and planning took 0.55 s of the 2 s lease: 0.45 s is left before the calls'
        # deadline (1 s), too little to begin one, and a third of the lease has not gone.
        on_lease_time(monkeypatch, LeaseTime(ctl.lease, after_taking=0.55 * SCALE))
        assert ctl.tick() is not None
        assert ctl.failures == []  # not "this round ran out of time"
        assert pins_on(node) == {"b@1": T0 + 3 * HOUR, "c@1": T0 + 5 * HOUR}
    finally:
        ctl.close()


def test_a_call_that_would_not_fit_after_the_one_before_renews_the_lease_first(
    eu, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, registry, node = eu
    scaled(monkeypatch)
    ctl = resident_b_and_c(root, registry, node)
    try:
        # The round's calls begin at once, and each takes 0.55 s: the first (b@1) leaves
        # 0.45 s for the second (c@1), which must renew the lease before it begins.
        per_call = 0.55 * SCALE
        on_lease_time(monkeypatch, LeaseTime(ctl.lease, after_taking=0.0, per_call=per_call))
        assert ctl.tick() is not None
        assert ctl.failures == []
        assert pins_on(node) == {"b@1": T0 + 3 * HOUR, "c@1": T0 + 5 * HOUR}
    finally:
        ctl.close()


def test_a_node_slow_to_answer_on_a_loaded_host_is_not_held_down_under_a_short_lease(
    eu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a 2 s lease each status call had a fifth of half the lease, 0.2 s: a node busy
    staging, or a controller sharing its cores, missed it and the round held a healthy node
    as down. The rule is checked, not raced: a stalled node (SIGSTOP) would make the test
    depend on how fast this machine resumes it. The round runs scaled (see the module's
    docstring): its calls then have 10 s, not 1 s, which a loaded host's node may miss."""
    root, registry, node = eu
    short = resident_b_and_c(root, registry, node, lease_ttl=2)  # the product's own times
    try:
        assert short._status_timeout() >= 1.0
    finally:
        short.close()
    scaled(monkeypatch)
    ctl = resident_b_and_c(root, registry, node)
    try:
        # The floor, not the share (a fifth of half the lease, 2 s scaled): the same rule.
        assert ctl._status_timeout() >= controller_module.STATUS_FLOOR
        assert ctl.tick() is not None
        assert ctl.state.down_since == {}
        assert ctl.failures == []
        assert set(pins_on(node)) == {"b@1", "c@1"}
    finally:
        ctl.close()


def test_a_lease_too_short_to_hold_a_renewal_and_a_call_is_refused(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + 2 * HOUR, 1, "b@1"))
    with pytest.raises(ValueError, match=r"--lease-ttl\) must be at least 2 s, got 1"):
        Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), lease_ttl=1)
