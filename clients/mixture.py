"""Weighted mixtures of dataset versions, and ``rows=`` splits: what each component yields.

``EdgeDataset({"web@3": 0.7, "code@2": 0.3}, samples_per_epoch=…)`` reads a
mixture. Each component is a pinned version (resolved once, like a single
one); component ``i`` contributes ``round(w_i * samples_per_epoch)`` samples
to every epoch (:func:`allocate`: the shares add up to the epoch exactly and
each is within one sample of its weight). A component is drawn without
replacement and continues through its rows across epochs before any row
repeats (:func:`edgecache.clients.shuffle.component_epoch`). A plain string
is a mixture of one component with all the samples: the ordinary case.

``rows=(a, b)`` keeps part of every component's *canonical* row order (shards
in manifest order, rows in order): fractions in ``[0, 1]`` or row numbers.
Splits that share a boundary, ``(0.0, 0.95)`` and ``(0.95, 1.0)``, never
overlap and together cover every row, on every run (:func:`split_extents`).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from edgecache.cache.names import VersionSpec, parse_spec
from edgecache.clients.shuffle import Extent

__all__ = [
    "MixtureSpec",
    "allocate",
    "check_shares",
    "common_columns",
    "parse_mixture",
    "parse_rows",
    "split_extents",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixtureSpec:
    """The components asked for (specs as given, parsed) and their weights, in the given order."""

    texts: tuple[str, ...]
    specs: tuple[VersionSpec, ...]
    weights: tuple[float, ...]

    @property
    def single(self) -> bool:
        """A plain string spec: one component, all of its rows every epoch."""
        return len(self.specs) == 1 and math.isnan(self.weights[0])


def parse_mixture(spec: str | Mapping[str, float]) -> MixtureSpec:
    """Parse ``"name@N"`` or ``{"name@N": weight, …}``; raise ValueError on bad weights."""
    if isinstance(spec, str):
        return MixtureSpec((spec,), (parse_spec(spec),), (math.nan,))
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(
            "pass a dataset spec ('name@N') or a non-empty mapping of specs to weights "
            f"({{'web@3': 0.7, 'code@2': 0.3}}), got {spec!r}"
        )
    texts, specs, weights = [], [], []
    for text, weight in spec.items():
        specs.append(parse_spec(text))
        texts.append(text)
        weights.append(_weight(text, weight))
    return MixtureSpec(tuple(texts), tuple(specs), tuple(weights))


def _weight(text: str, weight: object) -> float:
    """A component's weight as a float: any real number > 0 (numpy and 0-d torch scalars too).

    Weights are often computed (``np.array(tokens) / total``), so a ``np.float32``
    or a 0-d tensor counts as the number it holds; a string or a bool does not.
    """
    value = math.nan
    if not isinstance(weight, (bool, str, bytes)) and hasattr(weight, "__float__"):
        try:
            value = float(weight)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # a tensor of more than one element, say
            pass
    if math.isnan(value):
        raise ValueError(
            f"the weight of {text!r} must be a positive number, got {weight!r} "
            f"({type(weight).__name__}): pass a number such as 0.3"
        )
    if math.isinf(value) and value > 0:
        # Positive, yet every other weight would be 0 beside it: "not a positive number"
        # named the wrong fault (a helper's hunt).
        raise ValueError(
            f"the weight of {text!r} must be a finite number, got {weight!r}: weights are "
            "relative (normalised to add up to 1), so give each its share, e.g. 0.7 and 0.3"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"the weight of {text!r} must be a positive number, got {weight!r}: weights are "
            f"relative (normalised to add up to 1); to not read {text!r}, leave it out of "
            "the mapping"
        )
    return value


def check_distinct(mixture: MixtureSpec, resolved: Sequence[str]) -> None:
    """Refuse a mixture whose components resolve to one version more than once.

    Checked on the resolved ``name@N`` of each component, so every spelling of
    a version is caught (``web@1``, ``web@01``, ``web`` when 1 is its latest):
    read as two components, each of its rows would come twice an epoch.
    """
    same = sorted({name for name in resolved if resolved.count(name) > 1})
    if same:
        raise ValueError(
            f"{', '.join(mixture.texts)}: {', '.join(same)} is named twice; give each version once"
        )


def allocate(weights: Sequence[float], samples: int) -> list[int]:
    """Samples per component: ``round(w * samples)`` (weights normalised), adding up exactly.

    Largest remainders: every share is within one sample of ``w * samples``.
    """
    if samples < 0:
        raise ValueError(f"samples_per_epoch must be positive, got {samples}")
    total = sum(weights)
    ideal = [w / total * samples for w in weights]
    shares = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - ideal[i], i))
    for i in by_remainder[: samples - sum(shares)]:
        shares[i] += 1
    return shares


def check_shares(names: Sequence[str], weights: Sequence[float], shares: Sequence[int]) -> None:
    """Refuse a mixture in which a component gets no sample of any epoch.

    ``round(w * samples_per_epoch)`` is the same every epoch: a component whose
    share rounds to 0 would never be read, though it was asked for.
    """
    total = sum(weights)
    for name, weight, share in zip(names, weights, shares, strict=True):
        if share == 0:
            needed = math.ceil(total / weight)
            raise ValueError(
                f"{name} gets no sample of the {sum(shares)} an epoch at weight {weight:g} "
                f"({weight / total:.3g} of the mixture): raise samples_per_epoch to at least "
                f"{needed} or its weight, or leave it out of the mapping"
            )


def parse_rows(rows: object) -> tuple[float, float] | tuple[int, int] | None:
    """Check a ``rows=`` argument: None, two fractions in [0, 1], or two row numbers."""
    if rows is None:
        return None
    if not isinstance(rows, (tuple, list)) or len(rows) != 2:
        raise ValueError(f"rows must be (start, end): fractions or row numbers, got {rows!r}")
    a, b = rows
    # numpy's integers and floats are numbers too (np.int64 row counts, np.float32
    # fractions); what is kept is plain int or float, for JSON states.
    if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (a, b)):
        if not 0 <= a <= b:
            raise ValueError(f"rows=({a}, {b}): row numbers must satisfy 0 <= start <= end")
        return (int(a), int(b))
    if all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (a, b)):
        # A float makes both fractions; an integer beside it other than 0 or 1 was meant
        # as a row number ((0.0, 6000) was refused as a bad fraction, saying nothing of it).
        # 0 and 1 are fractions too: (0, 0.5) is the first half, (1, 1.0) an empty split.
        mixed = [x for x in (a, b) if isinstance(x, numbers.Integral) and x not in (0, 1)]
        if mixed:
            # The row numbers meant, where both are whole: a fixed example (0, 10800) was
            # past the end of smaller versions, refused again when followed.
            whole = [str(int(x)) if float(x).is_integer() else None for x in (a, b)]
            meant = f"rows=({whole[0]}, {whole[1]})" if None not in whole else "rows=(start, end)"
            raise ValueError(
                f"rows=({a}, {b}) mixes a fraction and a row number ({mixed[0]}): give two "
                f"integer row numbers ({meant}) or two fractions (rows=(0.0, 0.9))"
            )
        if not 0.0 <= a <= b <= 1.0:
            raise ValueError(
                f"rows=({a}, {b}): a float makes both fractions; fractions must satisfy "
                "0 <= start <= end <= 1 (or give two integer row numbers)"
            )
        return (float(a), float(b))
    raise ValueError(f"rows must be two fractions or two row numbers, got {rows!r}")


def split_extents(
    shard_rows: Sequence[int], rows: tuple[float, float] | tuple[int, int] | None
) -> tuple[Extent, ...]:
    """The rows a ``rows=`` split keeps, as extents of the canonical order.

    A fraction ``f`` is row ``floor(f * total)``, the same number for every
    split that names it; row numbers past the end are clipped.
    """
    total = sum(shard_rows)
    if rows is None:
        lo, hi = 0, total
    elif isinstance(rows[0], float) or isinstance(rows[1], float):
        lo, hi = (math.floor(rows[0] * total), math.floor(rows[1] * total))
        if rows[1] == 1.0:
            hi = total
    else:
        lo, hi = min(int(rows[0]), total), min(int(rows[1]), total)
    out = []
    first = 0
    for shard, count in enumerate(shard_rows):
        a, b = max(lo, first), min(hi, first + count)
        if a < b:
            out.append(Extent(shard, a - first, b - a))
        first += count
    return tuple(out)


def common_columns(schemas: Sequence[pa.Schema], names: Sequence[str]) -> list[str]:
    """Columns every component has with the same type, in the first one's order.

    Raises ValueError naming each component's columns when there are none.
    """
    first = schemas[0]
    shared = [
        f.name
        for f in first
        if all(f.name in s.names and s.field(f.name).type == f.type for s in schemas[1:])
    ]
    left_out = [
        f"{column} ({', '.join(_column_type(s, column) for s in schemas)})"
        for column in dict.fromkeys(c for s in schemas for c in s.names)
        if column not in shared
    ]
    if shared and left_out:
        # Said now: the training loop's batch["label"] would only raise a bare KeyError.
        log.warning(
            "the mixture %s reads the columns its components share with one type, %s; left "
            "out: %s (in component order). Cast them to one type when publishing, or pass "
            "columns= to choose and have any difference raised",
            " + ".join(names),
            shared,
            "; ".join(left_out),
        )
    if not shared:
        listing = "; ".join(f"{n}: {s.names}" for n, s in zip(names, schemas, strict=True))
        raise ValueError(
            f"the components share no column of the same type ({listing}); "
            "publish them with a common schema or pass columns= that each has"
        )
    return shared


def _column_type(schema: pa.Schema, column: str) -> str:
    return str(schema.field(column).type) if column in schema.names else "missing"
