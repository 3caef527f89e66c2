"""SharedPosition: the training process's place, read by persistent DataLoader workers.

A worker may read while the training process writes (``set_epoch`` called
while workers start a pass): every read must be a whole position, never a
mix of two, which a reader in another process checks here against a writer
that keeps rewriting positions of changing lengths.
"""

from __future__ import annotations

import multiprocessing as mp

from edgecache.clients.dataset_state import SharedPosition


def _position(n: int) -> dict:
    return {"epoch": n, "pad": "x" * (n % 977)}


def _reader(shared: SharedPosition, reads: int, out: mp.Queue) -> None:
    torn, seen = 0, 0
    for _ in range(reads):
        generation, position = shared.read()
        if position is None:
            continue
        seen += 1
        if len(position["pad"]) != position["epoch"] % 977 or generation != position["epoch"]:
            torn += 1
    out.put((seen, torn))


def test_round_trip_and_generations() -> None:
    shared = SharedPosition()
    assert shared.read() == (0, None) and shared.generation == 0
    assert shared.write(_position(1)) == 1
    assert shared.read() == (1, _position(1))
    assert shared.write(_position(2)) == 2 and shared.generation == 2


def test_a_reader_never_sees_a_torn_position() -> None:
    shared = SharedPosition()
    shared.write(_position(1))
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    child = ctx.Process(target=_reader, args=(shared, 5_000, out))
    child.start()
    n = 1
    while child.is_alive():
        n += 1
        shared.write(_position(n))  # generation == n: the epoch written is its generation
        if n > 2_000_000:
            break
    seen, torn = out.get(timeout=60)
    child.join(timeout=10)
    assert seen > 0 and torn == 0, f"{torn} of {seen} reads mixed two positions"


def test_a_position_too_large_is_not_shared(caplog) -> None:
    shared = SharedPosition()
    shared.write({"pad": "x" * (SharedPosition.CAPACITY + 1)})
    assert shared.read() == (1, None)
    assert "does not fit shared memory" in caplog.text
