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

Nested values are held to the same rules as the values they hold: the items
of lists, the keys and values of maps and each field of a struct are checked
as columns of their own, vectorised throughout (no value goes through
Python), so a nested cast costs about what a flat one does.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgecache.cache.preprocess.byte_types import is_text_or_binary

__all__ = ["lossless_cast"]

_EXAMPLES = 3
# Text a float parse may turn into ±inf or 0 without losing anything: it says so.
_SPELLS_INF_OR_ZERO = r"^[+-]?inf(inity)?$|^[+-]?(0+\.?0*|\.0+)([eE][+-]?[0-9]+)?$"
_LISTS = (pa.ListArray, pa.LargeListArray, pa.FixedSizeListArray)


def lossless_cast(array: pa.Array, target: pa.DataType) -> pa.Array:
    """``array`` cast to ``target``, keeping every value (floats: the nearest one).

    Raises:
        ValueError: pyarrow refuses the cast (``pa.ArrowInvalid`` is one), a value
            would change (the message counts them and shows some, e.g. ``2 → True``),
            or pyarrow cannot cast the result back or compare it, so the values
            cannot be checked.
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
    """The innermost values of (nested) lists and maps, in order, nulls among the lists left out.

    Counting and showing these, rather than whole lists, makes the error name
    the value that changes (``2 → True``, not two lists of 2048 items). A
    map's values are its entries, ``{key, value}`` structs.
    """
    array = _plain(array)
    while isinstance(array, _LISTS):
        array = _plain(array.flatten())
    return array


def _plain(array: pa.Array) -> pa.Array:
    """The same values in a layout the checks below take.

    Dictionaries are decoded (pyarrow compares the values, not the indices), and
    a map becomes the list of its entries: ``MapArray`` is a ``ListArray`` whose
    ``flatten()`` has no kernel, and as a list of ``{key, value}`` structs its keys
    and values are checked as two fields.
    """
    if isinstance(array, pa.DictionaryArray):
        return array.dictionary_decode()
    if isinstance(array, pa.MapArray):
        return _entries(array)
    return array


def _entries(maps: pa.MapArray) -> pa.ListArray:
    """``maps`` as a list of its ``{key, value}`` entries, its nulls kept.

    pyarrow will not combine a null mask with offsets that start past 0 (a
    sliced map), so the offsets are rebased onto the slice of entries they use.
    """
    if len(maps) == 0:
        return pa.array([], pa.list_(pa.struct([maps.type.key_field, maps.type.item_field])))
    offsets = maps.offsets
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    return pa.ListArray.from_arrays(
        pc.subtract(offsets, pa.scalar(start, offsets.type)),
        maps.values.slice(start, end - start),
        mask=maps.is_null(),
    )


def _changed(was: pa.Array, became: pa.Array) -> pa.BooleanArray | None:
    """True where a value of ``was`` is not what ``became`` holds; None: none can differ."""
    was, became = _plain(was), _plain(became)
    source, target = was.type, became.type
    if was.null_count == len(was) or (pa.types.is_integer(source) and pa.types.is_integer(target)):
        return None  # safe=True checks integer ranges exactly
    if isinstance(was, pa.StructArray):
        return _struct_changed(was, became)
    if isinstance(was, _LISTS):
        return _lists_changed(was, became)
    if is_text_or_binary(source) and not is_text_or_binary(target):
        if not pa.types.is_floating(target):
            return None  # parsed exactly (numbers, bools, dates), or refused
        return _text_out_of_range(was, became)
    if pa.types.is_floating(source) and pa.types.is_floating(target):
        if target.bit_width < source.bit_width:
            return _out_of_range(was, became)
    if pa.types.is_floating(source) and pa.types.is_decimal(target):
        # pyarrow's decimal to float cast is not correctly rounded (1.900 gives
        # 1.9000000000000001, refusing 1.9); a decimal's text is exact, and parsing it is.
        return _differs(was, became.cast(pa.string()).cast(source))
    try:
        back = became.cast(source, safe=False)
    except pa.ArrowNotImplementedError:
        raise ValueError(
            f"pyarrow cannot cast {target} back to {source}, so it cannot check that no value "
            "is lost; convert the column in a transform of your own"
        ) from None
    return _differs(was, back)


def _struct_changed(was: pa.StructArray, became: pa.StructArray) -> pa.BooleanArray | None:
    """Where any field of a struct changes, each field checked by the rules for its type.

    Fields are paired by name, as pyarrow's cast pairs them; a field the target
    lacks is dropped by the cast, so each value it held is lost. ``flatten()``
    gives each field the struct's nulls, so a null struct changes nothing.
    """
    kept = {became.type.field(i).name: field for i, field in enumerate(became.flatten())}
    found: list[pa.BooleanArray] = []
    for i, field in enumerate(was.flatten()):
        name = was.type.field(i).name
        changed = _changed(field, kept[name]) if name in kept else field.is_valid()
        if changed is not None:
            found.append(changed)
    return functools.reduce(pc.or_, found) if found else None


def _lists_changed(was: pa.Array, became: pa.Array) -> pa.BooleanArray | None:
    """Where a list holds an item that changes (lists inside structs: one flag per list)."""
    changed = _changed(was.flatten(), became.flatten())
    if changed is None:
        return None
    # One list index per item of flatten(), which leaves out what null lists hold.
    parents = pc.list_parent_indices(was)
    parents = parents.filter(pc.is_valid(was).take(parents))
    lists = np.zeros(len(was), dtype=np.bool_)
    lists[parents.filter(changed).to_numpy()] = True
    return pa.array(lists)


def _out_of_range(wide: pa.Array, narrow: pa.Array) -> pa.BooleanArray:
    """Where a float became ±inf or 0 without being it: more than rounding."""
    wide, narrow = _comparable(wide), _comparable(narrow)
    overflow = pc.and_(pc.is_finite(wide), pc.is_inf(narrow))
    underflow = pc.and_(pc.not_equal(wide, 0), pc.equal(narrow, 0))
    return pc.fill_null(pc.or_(overflow, underflow), False)


def _text_out_of_range(text: pa.Array, parsed: pa.Array) -> pa.BooleanArray:
    """Where text became ±inf or 0 without saying so ("1e400", or "1e-50" as float32).

    Any other float is the nearest one to what the text says, which is allowed.
    Only values that became ±inf or 0 (usually none) are matched against the
    spellings of those, since a regex over every value costs several times the
    parse itself.
    """
    parsed = _comparable(parsed)
    suspect = pc.fill_null(pc.or_(pc.is_inf(parsed), pc.equal(parsed, 0)), False)
    if not pc.any(suspect).as_py():
        return suspect
    said = pc.match_substring_regex(text.filter(suspect), _SPELLS_INF_OR_ZERO, ignore_case=True)
    return pc.replace_with_mask(suspect, suspect, pc.invert(said))


def _differs(was: pa.Array, back: pa.Array) -> pa.BooleanArray:
    """Where ``back`` (same type) does not hold ``was``'s value; NaN equals NaN."""
    was, back = _comparable(was), _comparable(back)
    try:
        same = pc.fill_null(pc.equal(was, back), False)
    except pa.ArrowNotImplementedError:
        raise ValueError(
            f"pyarrow cannot compare {was.type} values, so it cannot check that no value "
            "is lost; convert the column in a transform of your own"
        ) from None
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
