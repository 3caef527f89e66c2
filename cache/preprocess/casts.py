"""Casts that keep every value: pyarrow's safe cast, then a check of what it let through.

``Array.cast(safe=True)`` refuses integer overflow, float to integer
truncation, timestamp unit truncation and text it cannot parse, but lets
through: numbers to bool (2 becomes True), integers to float16 (2049 becomes
2048), timestamps to dates (the time of day goes), floats to decimals
(rounded), floats overflowing a narrower float or text overflowing a float
(to ±inf or 0). :func:`lossless_cast` refuses those too: the result, cast
back, must give the values it started from.

One loss is allowed, because asking for it is what a narrower float means:
a float (or text) becomes the nearest value the target float holds; only a
value it cannot hold at all (overflowing to ±inf, or a nonzero becoming 0)
fails.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["lossless_cast"]

_EXAMPLES = 3
_SPELLS_INF = r"^[+-]?inf(inity)?$"
_SPELLS_ZERO = r"^[+-]?(0+\.?0*|\.0+)([eE][+-]?[0-9]+)?$"


def lossless_cast(array: pa.Array, target: pa.DataType) -> pa.Array:
    """``array`` cast to ``target``, keeping every value (floats: the nearest one).

    Raises:
        ValueError: pyarrow refuses the cast (``pa.ArrowInvalid`` is one), a value
            would change (the message counts them and shows some, e.g. ``2 → True``),
            or pyarrow cannot cast the result back, so the values cannot be checked.
        pa.ArrowNotImplementedError: pyarrow has no such cast.
    """
    out = array.cast(target, safe=True)
    was, became = _leaves(array), _leaves(out)
    changed = _changed(was, became)
    if changed is not None and (lost := pc.sum(changed).as_py()):
        shown = _examples(was.filter(changed), became.filter(changed))
        raise ValueError(f"{lost} of {len(was)} values in one batch would change, e.g. {shown}")
    return out


def _leaves(array: pa.Array) -> pa.Array:
    """The innermost values of (nested) lists, in order, nulls among the lists left out."""
    while isinstance(array, (pa.ListArray, pa.LargeListArray, pa.FixedSizeListArray)):
        array = array.flatten()
    if isinstance(array, pa.DictionaryArray):
        return array.dictionary_decode()
    return array


def _changed(was: pa.Array, became: pa.Array) -> pa.BooleanArray | None:
    """True where a value of ``was`` is not what ``became`` holds; None: none can differ."""
    source, target = was.type, became.type
    if was.null_count == len(was) or (pa.types.is_integer(source) and pa.types.is_integer(target)):
        return None  # safe=True checks integer ranges exactly
    if _is_text(source) and not _is_text(target):
        if not pa.types.is_floating(target):
            return None  # parsed exactly (numbers, bools, dates), or refused
        parsed = was.cast(pa.float64())  # the nearest float64: the value the text says
        return pc.or_(_out_of_range(parsed, became), _text_out_of_range(was, parsed))
    if pa.types.is_floating(source) and pa.types.is_floating(target):
        if target.bit_width < source.bit_width:
            return _out_of_range(was, became)
    try:
        back = became.cast(source, safe=False)
    except pa.ArrowNotImplementedError:
        raise ValueError(
            f"pyarrow cannot cast {target} back to {source}, so it cannot check that no value "
            "is lost; convert the column in a transform of your own"
        ) from None
    return _differs(was, back)


def _is_text(kind: pa.DataType) -> bool:
    return any(
        check(kind)
        for check in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_string_view,
            pa.types.is_binary_view,
        )
    )


def _out_of_range(wide: pa.Array, narrow: pa.Array) -> pa.BooleanArray:
    """Where a float became ±inf or 0 without being it: more than rounding."""
    wide, narrow = _comparable(wide), _comparable(narrow)
    overflow = pc.and_(pc.is_finite(wide), pc.is_inf(narrow))
    underflow = pc.and_(pc.not_equal(wide, 0), pc.equal(narrow, 0))
    return pc.fill_null(pc.or_(overflow, underflow), False)


def _text_out_of_range(text: pa.Array, parsed: pa.Array) -> pa.BooleanArray:
    """Where text parsed as ±inf or 0 does not say so ("1e400", "1e-400")."""
    inf = pc.and_(pc.is_inf(parsed), pc.invert(_matches(text, _SPELLS_INF)))
    zero = pc.and_(pc.equal(parsed, 0), pc.invert(_matches(text, _SPELLS_ZERO)))
    return pc.fill_null(pc.or_(inf, zero), False)


def _matches(text: pa.Array, pattern: str) -> pa.BooleanArray:
    return pc.match_substring_regex(text, pattern, ignore_case=True)


def _differs(was: pa.Array, back: pa.Array) -> pa.BooleanArray:
    """Where ``back`` (same type) does not hold ``was``'s value; NaN equals NaN."""
    was, back = _comparable(was), _comparable(back)
    try:
        same = pc.fill_null(pc.equal(was, back), False)
    except pa.ArrowNotImplementedError:  # structs and the like: compared as Python values
        same = pa.array(
            [a == b for a, b in zip(was.to_pylist(), back.to_pylist(), strict=True)], pa.bool_()
        )
    if pa.types.is_floating(was.type):
        both_nan = pc.fill_null(pc.and_(pc.is_nan(was), pc.is_nan(back)), False)
        same = pc.or_(same, both_nan)
    return pc.and_(pc.is_valid(was), pc.invert(same))


def _comparable(array: pa.Array) -> pa.Array:
    """float16 as float32 (exactly): pyarrow's comparisons have no float16 kernels."""
    return array.cast(pa.float32()) if pa.types.is_float16(array.type) else array


def _examples(was: pa.Array, became: pa.Array) -> str:
    """Up to a few distinct changes, e.g. ``2 → True, 3 → True``."""
    pairs: dict[str, None] = {}  # ordered, distinct
    for before, after in zip(
        was.slice(0, 1000).to_pylist(), became.slice(0, 1000).to_pylist(), strict=True
    ):
        pairs[f"{_show(before)} → {_show(after)}"] = None
        if len(pairs) == _EXAMPLES:
            break
    return ", ".join(pairs)


def _show(value: object) -> str:
    return repr(value) if isinstance(value, (str, bytes)) else str(value)
