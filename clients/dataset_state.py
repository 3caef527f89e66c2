"""EdgeDataset's resume state: what identifies an epoch's order, and where consumption stands.

A state is a small dict of plain values (portable: JSON, torch.save, another
region, another release of the same format)::

    {"format": 6, "components": [{dataset, version, digest, weight}, …],
     "order": {seed-independent knobs that fix the global order},
     "seed", "epoch",
     "remaining": what was left of the epoch when this stretch of it began
                  (None: the whole epoch),
     "world_size", "batch_size", "drop_last", "rank": how it was consumed,
     "batches": canonical batches each rank yielded since then (lockstep)}

Resuming with the same world size, batch size and ``drop_last`` continues
the same canonical batches at ``batches`` (exact for each DataLoader worker
too). Resuming with another world size or batch size is *elastic*: what every
rank consumed is removed (:meth:`Remaining.after`, from ``batches`` alone, as
DDP ranks step in lockstep) and what is left is split among the new ranks.
A state whose ``batches`` reach the end of its stretch resumes the next
epoch from its start, either way.
"""

from __future__ import annotations

import json
import logging
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgecache.cache.errors import StateMismatch
from edgecache.clients.mixture import allocate
from edgecache.clients.partition import RankBatches, Remaining

__all__ = ["FORMAT", "Resume", "SharedPosition", "make_state", "order_style", "resume_from"]

log = logging.getLogger(__name__)

FORMAT = 6
# 5: a component's passes in an epoch read side by side, not in turn (resumed in that
# order: see Resume); 4: that, and blocks permuted at random, not interleaved (likewise);
# 3: that and ranks splitting each lane on their own (resumed elastically, likewise);
# 2: windows of equal size per shard; 1: before batch-level shuffling (both refused).
SIDE_BY_SIDE_FORMAT = 5
PERMUTED_BLOCKS_FORMAT = 4
PER_LANE_FORMAT = 3


@dataclass(frozen=True)
class Resume:
    """Where a loaded state puts the dataset: seed, epoch, what is left, batches yielded."""

    seed: int
    epoch: int
    remaining: Remaining | None
    cursor: int
    elastic: bool
    # The format whose order the epoch is read in: a state saved before format 6 keeps
    # the order it was saved in (format 3's is format 4's), so that it resumes exactly.
    order_format: int = FORMAT


def order_style(order_format: int) -> tuple[bool, bool]:
    """(interleave, passes_in_turn) of the epoch order of states of ``order_format``.

    Blocks interleave their streams since format 5 (permuted at random before); a
    component's passes in one epoch are read in turn since format 6 (side by side
    before, :func:`~edgecache.clients.shuffle._keys`).
    """
    return order_format >= SIDE_BY_SIDE_FORMAT, order_format >= FORMAT


# What a single version's state repeats beside its component, for those who read it.
_SUMMARY = ("dataset", "version", "digest")


def make_state(
    *,
    components: Sequence[dict[str, Any]],
    order: dict[str, Any],
    seed: int,
    epoch: int,
    remaining: Remaining | None,
    layout: dict[str, Any],
    batches: int,
    order_format: int = FORMAT,
) -> dict[str, Any]:
    """A state dict (see the module docstring), of the format of the order it is read in.

    ``order_format`` 4 or 5 for an epoch resumed from an older state, read in its order.
    """
    state: dict[str, Any] = {
        "format": order_format,
        "components": [dict(c) for c in components],
        "order": dict(order),
        "seed": seed,
        "epoch": epoch,
        "remaining": None if remaining is None else remaining.to_json(),
        **layout,
        "batches": batches,
    }
    if len(components) == 1:  # the plain-string case reads as before
        state.update({k: components[0][k] for k in _SUMMARY})
    return state


def _names(components: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{c['dataset']}@{c['version']}" for c in components)


def _spec(components: Sequence[dict[str, Any]]) -> str:
    """The spec that reads ``components`` (a state's), as it would be written."""
    if len(components) == 1 and components[0].get("weight") is None:
        return repr(f"{components[0]['dataset']}@{components[0]['version']}")
    return repr({f"{c['dataset']}@{c['version']}": c.get("weight") for c in components})


def _shares(components: Sequence[dict[str, Any]], samples: object) -> list[int] | None:
    """Each component's samples of an epoch of ``samples``: what its weights decide."""
    weights = [c.get("weight") for c in components]
    if not isinstance(samples, int) or any(
        not isinstance(w, (int, float)) or w <= 0 for w in weights if w is not None
    ):
        return None
    if any(w is None for w in weights):
        return [samples] if len(weights) == 1 else None
    return allocate([float(w) for w in weights], samples)  # type: ignore[arg-type]


def _same(fixes: Any, saved: object, mine: object) -> bool:
    """Whether two values of a knob fix the same order (a saved value that fails: not)."""
    try:
        return bool(fixes(saved) == fixes(mine))
    except (TypeError, ValueError, IndexError, KeyError):
        return False


_DERIVED = frozenset({"samples_per_epoch", "window_rows"})  # worked out from other knobs

# A state's fields and what each must be: a state edited by hand or carried in another
# format failed later with a bare KeyError, TypeError or IndexError, or resumed
# nonsense (a negative batch count, rank 5 of 1).
# Abstract types: a state kept in a config library's containers (OmegaConf's) or with
# numpy integers loads as it did before these checks.
_FIELDS: dict[str, tuple[type, ...]] = {
    "components": (Sequence,),
    "order": (Mapping,),
    "seed": (numbers.Integral,),
    "epoch": (numbers.Integral,),
    "remaining": (Sequence, type(None)),
    "world_size": (numbers.Integral,),
    "rank": (numbers.Integral,),
    "batch_size": (numbers.Integral, type(None)),
    "drop_last": (bool, np.bool_),
    "batches": (numbers.Integral,),
}


def _check_fields(state: dict[str, Any]) -> None:
    """StateMismatch naming the first field of ``state`` that is missing or out of range."""
    for name, kinds in _FIELDS.items():
        if name not in state:
            raise StateMismatch(
                f"the state has no {name!r}: not a whole EdgeDataset state dict (save one with "
                "state_dict() and load it unchanged)"
            )
        value = state[name]
        integer = kinds[0] is numbers.Integral
        text = isinstance(value, (str, bytes))  # a Sequence, but no list of anything
        if not isinstance(value, kinds) or text or (integer and isinstance(value, bool)):
            wanted = " or ".join(dict.fromkeys(_KIND[k] for k in kinds))
            raise StateMismatch(f"the state's {name!r} is {value!r}, not {wanted}")
    least = {"epoch": 0, "batches": 0, "world_size": 1, "rank": 0, "batch_size": 1}
    for name, minimum in least.items():
        if state[name] is not None and state[name] < minimum:
            raise StateMismatch(f"the state's {name!r} is {state[name]}, less than {minimum}")
    if state["rank"] >= state["world_size"]:
        raise StateMismatch(
            f"the state's 'rank' {state['rank']} is not one of its 'world_size' "
            f"{state['world_size']} ranks"
        )


def _check_summary(state: dict[str, Any], theirs: Sequence[dict[str, Any]]) -> None:
    """StateMismatch where the top-level dataset, version or digest is not its component's.

    A single version's state repeats them beside its component for the tools and
    people who read it (the documented fields). Only the component was compared,
    so a state whose copies disagree (edited, or put together from two) loaded as
    the component's while it said another version to whoever read it.
    """
    if len(theirs) != 1:
        return
    differ = [
        f"{key!r} is {state[key]!r} where its component's is {theirs[0][key]!r}"
        for key in _SUMMARY
        if key in state and state[key] != theirs[0][key]
    ]
    if differ:
        raise StateMismatch(
            f"the state's {'; '.join(differ)}: its two copies disagree, so which version it "
            "is for cannot be told (edited, or put together by hand); save one with "
            "state_dict() and load it unchanged"
        )


_KIND: dict[type, str] = {
    Sequence: "a list",
    Mapping: "a dict",
    numbers.Integral: "an integer",
    bool: "True or False",
    np.bool_: "True or False",
    type(None): "None",
}


def resume_from(
    state: object,
    *,
    components: Sequence[dict[str, Any]],
    order: dict[str, Any],
    layout: dict[str, Any],
    lane_lengths: Any,
    seed: int | None = None,
    fixes: Mapping[str, Any] | None = None,
    knob: Mapping[str, str] | None = None,
) -> Resume:
    """Check ``state`` against this dataset and say where to resume; StateMismatch if it cannot.

    ``lane_lengths(seed, epoch)`` gives the lanes of the state's epoch, to check
    its intervals. ``seed``, the dataset's own, must be the state's: the seed
    fixes the order like the knobs do, and taking the state's in its place
    quietly (as before) made ``EdgeDataset(seed=10)`` read seed 9's epochs,
    this one and every later one. ``fixes[key]`` maps a knob's value to what
    fixes the order (``rows=(0.5, 1.0)`` and ``(10000, 20000)`` of 20,000 rows
    keep the same rows); ``knob[key]`` names the setting the user gave for a
    derived one (``window_rows`` comes from ``window_bytes``).
    """
    known = (FORMAT, SIDE_BY_SIDE_FORMAT, PERMUTED_BLOCKS_FORMAT, PER_LANE_FORMAT)
    newer = state.get("format") if isinstance(state, dict) else None
    if isinstance(newer, int) and not isinstance(newer, bool) and newer > max(known):
        # Saved by a newer edgecache: upgrading resumes it exactly, where the advice for
        # old formats (start the epoch again) threw the checkpoint's progress away.
        raise StateMismatch(
            f"this state dict was saved by a newer edgecache (format {newer}; this one reads "
            f"formats up to {max(known)}): upgrade edgecache to resume it"
        )
    if not isinstance(state, dict) or state.get("format") not in known:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise StateMismatch(
            f"not an EdgeDataset state dict of format {', '.join(map(str, known))} (got "
            f"format {found!r}): states of format 1 (before batch-level shuffling) and 2 "
            "(before windows were aligned with chunks) describe another order and cannot be "
            "resumed exactly; start the epoch again with set_epoch(epoch)"
        )
    _check_fields(state)
    order_format = max(int(state["format"]), PERMUTED_BLOCKS_FORMAT)
    theirs = state.get("components", [])
    keys = [(c["dataset"], c["version"], c["digest"]) for c in theirs]
    ours = [(c["dataset"], c["version"], c["digest"]) for c in components]
    if keys != ours and sorted(keys) == sorted(ours):
        raise StateMismatch(
            f"the state is for the same versions in another order ({_names(theirs)}; this "
            f"dataset reads {_names(components)}), and the order of the components is part of "
            f"the epoch's order: create EdgeDataset with {_spec(theirs)} to resume it"
        )
    if keys != ours and [k[:2] for k in keys] == [k[:2] for k in ours]:
        changed = [
            f"{t['dataset']}@{t['version']}: {t['digest']} in the state, {o['digest']} here"
            for t, o in zip(theirs, components, strict=True)
            if t["digest"] != o["digest"]
        ]
        raise StateMismatch(
            f"the state is for other content under the same names ({'; '.join(changed)}): "
            "the version was resolved from another registry (staging and production, say) "
            "or one rebuilt since, and its rows are not the state's; read the registry the "
            "state was saved against (its nodes, or their lmdb:// caches) to resume it, or "
            "start the epoch again with set_epoch(epoch)"
        )
    if keys != ours:
        raise StateMismatch(
            f"the state is for {_names(theirs)} but this dataset reads {_names(components)}; "
            f"create EdgeDataset with the state's versions to resume it"
        )
    _check_summary(state, theirs)
    # Weights are relative: what fixes the order is each component's share of the epoch,
    # so {0.7, 0.3} resumes {7, 3}, and a plain string spec {name: 1.0}.
    samples = order.get("samples_per_epoch")
    if _shares(theirs, samples) != _shares(components, samples):
        raise StateMismatch(
            f"the state's mixture weights {[c.get('weight') for c in theirs]} differ from this "
            f"dataset's {[c.get('weight') for c in components]}; use the same weights to resume"
        )
    # The knobs a user sets before those derived from them: a state of another rows= split
    # named samples_per_epoch, which the user never set, as the difference.
    fixes, knob = fixes or {}, knob or {}
    for key, mine in sorted(order.items(), key=lambda item: item[0] in _DERIVED):
        saved = state["order"].get(key)
        if saved == mine or (key in fixes and _same(fixes[key], saved, mine)):
            continue
        if key in knob:  # derived: say it in the words of what the user set
            raise StateMismatch(
                f"{_names(components)}: the state was saved with {key}={saved!r}, this "
                f"dataset's {knob[key]} gives {mine!r}; the epoch's order depends on it: "
                f"create EdgeDataset with the {knob[key].split('=')[0]} the run was saved with"
            )
        raise StateMismatch(
            f"{_names(components)}: the state was saved with {key}={saved!r}, this "
            f"dataset has {mine!r}; the epoch's order depends on it, use the same value"
        )
    if seed is not None and int(state["seed"]) != seed:
        raise StateMismatch(
            f"{_names(components)}: the state was saved with seed={state['seed']!r}, this "
            f"dataset has seed={seed!r}; the epoch's order depends on it: create EdgeDataset "
            f"with seed={state['seed']!r} to resume it (or start a new run with set_epoch)"
        )
    seed, epoch = int(state["seed"]), int(state["epoch"])
    lengths = lane_lengths(seed, epoch)  # the same in either order of blocks
    try:
        remaining = (
            None if state["remaining"] is None else Remaining.from_json(state["remaining"], lengths)
        )
    except (ValueError, TypeError) as exc:
        raise StateMismatch(f"{_names(components)}: the state's remaining samples: {exc}") from exc
    batches = int(state["batches"])
    # Format 3 states were consumed by ranks that split each lane on its own: with more
    # than one rank, what they consumed is removed that way and the rest resumed
    # elastically (exact, at any layout); one rank consumed the same either way.
    per_lane = state["format"] == PER_LANE_FORMAT and state["world_size"] > 1
    start = remaining or Remaining.whole(lengths)
    # batch_size=None reads one sample at a time: batches of one (as the epoch's order).
    batch_size = state["batch_size"] or 1
    count = _batch_count(state, start, batch_size, per_lane)
    if batches > count:
        raise StateMismatch(
            f"{_names(components)}: the state's batches={batches} is more than the "
            f"{count} batches of its stretch of epoch {epoch}: not a state this dataset saved "
            "(with workers, state_dict(batches=steps) takes the steps since the last resume)"
        )
    if batches == count:
        # The whole stretch was consumed (a checkpoint after an epoch's last step, with
        # workers): the next epoch, from its start, as a state saved at num_workers=0 says.
        # Resumed as it stands, it was an empty epoch: len() 0 and a pass of nothing.
        return Resume(seed, epoch + 1, None, 0, elastic=False)
    same = all(state[k] == layout[k] for k in ("world_size", "batch_size", "drop_last"))
    if same and not per_lane:
        return Resume(seed, epoch, remaining, batches, False, order_format)
    left = start.after(
        state["world_size"], batch_size, state["drop_last"], batches, per_lane=per_lane
    )
    return Resume(seed, epoch, left, 0, True, order_format)


def _batch_count(state: dict[str, Any], start: Remaining, batch_size: int, per_lane: bool) -> int:
    """Batches each rank of the state's layout had in its stretch (lockstep: rank 0's)."""
    world_size = int(state["world_size"])
    rank = state.get("rank")
    rank = rank if isinstance(rank, int) and 0 <= rank < world_size else 0
    try:
        return RankBatches(
            start, world_size, rank, batch_size, bool(state["drop_last"]), per_lane=per_lane
        ).batch_count
    except ValueError as exc:
        raise StateMismatch(f"the state's layout cannot be resumed: {exc}") from exc


class SharedPosition:
    """The training process's place in the epochs, readable by persistent DataLoader workers.

    A worker that is not persistent gets a fresh copy of the dataset for every
    pass, so it starts where the training process put it (``set_epoch``,
    ``load_state_dict``). A persistent one keeps its own copy, which those calls
    never reach: after a pass broken off (a ``break``, every node down) it went
    on from wherever it had read ahead, losing the batches the loop never saw,
    whatever epoch or checkpoint the loop asked for. The training process writes
    its position here on every such call; a worker takes it when it changed.

    Since that position, the workers of every pass (any loader, persistent or
    not) record where they began and whether each read its share to its end:
    the next pass, with workers or without, goes on from there (the next epoch
    once every worker of the last pass read it whole), as one process reading
    every pass would.

    Shared memory (torch tensors) crosses ``fork`` as it is and ``spawn``
    through torch's pickling of shared tensors. A single writer (the training
    process) and a generation number written last make a torn read detectable.
    """

    CAPACITY = 256 << 10  # bytes of JSON; a position is a few hundred
    WORKERS = 1024  # DataLoader workers whose passes are tracked (more: see all_finished)

    def __init__(self) -> None:
        # A sequence lock: [sequence, length]; the sequence is odd while a write is under
        # way and 2 × generation once it is done, so a reader can tell a torn copy.
        self._header = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._blob = torch.zeros(self.CAPACITY, dtype=torch.uint8).share_memory_()
        # Written by the workers, read by the workers and the training process: per
        # worker, the (loader, pass) it last read to its end.
        self._workers = torch.zeros(2 * self.WORKERS, dtype=torch.int64).share_memory_()
        # The last pass a worker began: [generation + 1 (0: none), the epoch it began,
        # loader, pass]. Every worker of a pass writes the same values: the epoch the
        # workers are in, which the training process follows (EdgeDataset._follow_workers).
        self._start = torch.zeros(4, dtype=torch.int64).share_memory_()
        # The last pass a worker read to its end: [loader, workers, pass, generation, the
        # epoch after it]. Fresh workers (not persistent: new ones every pass) have no
        # pass of their own to go by; this tells them the previous loader's workers all
        # finished the epoch. Every worker of a pass writes the same values.
        self._last_pass = torch.zeros(5, dtype=torch.int64).share_memory_()

    @property
    def generation(self) -> int:
        """How many positions were written (0: none since the dataset was made)."""
        return (int(self._header[0]) + 1) // 2

    def write(self, position: dict[str, Any]) -> int:
        """Publish ``position`` (plain JSON values); returns its generation."""
        data = json.dumps(position).encode()
        generation = self.generation + 1
        self._header[0] = 2 * generation - 1  # odd: a reader now waits or copies again
        if len(data) > self.CAPACITY:
            log.warning(
                "EdgeDataset position of %d bytes does not fit shared memory (%d): persistent "
                "DataLoader workers keep their own; recreate the DataLoader to apply it",
                len(data),
                self.CAPACITY,
            )
            self._header[1] = -1
        else:
            self._blob[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._header[1] = len(data)
        self._header[0] = 2 * generation  # even again: the blob and length are whole
        return generation

    # ------------------------------------------------ what the workers did by themselves

    def finished(
        self,
        worker: int,
        loader: int,
        serial: int,
        *,
        workers: int,
        generation: int,
        next_epoch: int,
    ) -> None:
        """Worker ``worker`` (of ``workers``) of DataLoader ``loader`` read pass ``serial`` whole.

        The pass began from the position of ``generation``; the epoch after it is
        ``next_epoch``.
        """
        if worker < self.WORKERS:
            self._workers[2 * worker + 1] = serial
            self._workers[2 * worker] = loader
        self._last_pass.copy_(
            torch.tensor([loader, workers, serial, generation, next_epoch], dtype=torch.int64)
        )

    def epoch_read_since(self, generation: int) -> int | None:
        """The epoch after the last pass all workers read to its end, if begun at ``generation``.

        None when no such pass: none ended since the training process last put
        the dataset (a new position since), or some worker of it stopped short (a
        ``break``). Read by a worker at a pass's start, when the last pass's workers
        have all answered the DataLoader, so it is whole.
        """
        loader, workers, serial, began, next_epoch = (int(x) for x in self._last_pass.tolist())
        if workers <= 0 or began != generation:
            return None
        return next_epoch if self.all_finished(workers, loader, serial) else None

    def pass_read(self, generation: int, loader: int, serial: int) -> int | None:
        """The epoch after pass ``serial`` of ``loader`` if every worker read it to its end.

        For the training process, which cannot tell when a pass ends: None while that
        pass runs, or when it was broken off, or when it is not the last one a worker
        finished (begun at ``generation``).
        """
        last = [int(x) for x in self._last_pass.tolist()]
        if last[0] != loader or last[2] != serial or last[3] != generation:
            return None
        return self.epoch_read_since(generation)

    def all_finished(self, workers: int, loader: int, serial: int) -> bool:
        """Whether every worker of ``loader`` read pass ``serial`` to its end.

        A worker writes this before its StopIteration reaches the DataLoader, and the
        DataLoader starts a pass only after every worker has answered the last, so
        what the workers read here at a pass's start is whole and final. Beyond
        :attr:`WORKERS` workers, False: the next pass starts where the dataset was put.
        """
        if workers > self.WORKERS:
            return False
        marks = self._workers[: 2 * workers].view(workers, 2)
        return bool(((marks[:, 0] == loader) & (marks[:, 1] == serial)).all())

    def started(self, generation: int, epoch: int, loader: int, serial: int) -> None:
        """A worker began pass ``serial`` of ``loader``, of ``epoch``, from ``generation``."""
        self._start.copy_(torch.tensor([generation + 1, epoch, loader, serial], dtype=torch.int64))

    def last_started(self, generation: int) -> tuple[int, int, int] | None:
        """(epoch, loader, pass) of the last pass a worker began from ``generation``, if any.

        Its epoch is where the workers are since that position: passes only move on
        from it (to the next epoch once one was read whole by every worker).
        """
        while True:  # the workers of a pass starting write the same values: read it whole
            first = self._start.tolist()
            if self._start.tolist() == first:
                break
        began, epoch, loader, serial = (int(x) for x in first)
        return None if began != generation + 1 else (epoch, loader, serial)

    def started_since(self, generation: int) -> bool:
        """Whether a worker began a pass since the position of ``generation`` was written."""
        return self.last_started(generation) is not None

    def read(self) -> tuple[int, dict[str, Any] | None]:
        """(generation, position); position None when none was written or it did not fit."""
        while True:
            sequence, length = (int(x) for x in self._header.tolist())
            if sequence % 2:  # a write under way in the training process: a moment
                time.sleep(0.0001)
                continue
            if sequence == 0 or length < 0:
                return sequence // 2, None
            data = bytes(self._blob[:length].numpy())
            if int(self._header[0]) == sequence:  # not rewritten while copying
                return sequence // 2, json.loads(data)
