"""Transform parameters: Arrow type strings (``cast=x=list<float>``), lists, known names."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa

__all__ = [
    "binary_column",
    "check_param_names",
    "parse_type",
    "param_names",
    "param_pairs",
    "quote_name",
    "split_params",
    "unquote",
    "type_label",
    "type_name",
]

_PRIMITIVES = (
    "int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 float double bool "
    "string utf8 large_string binary large_binary date32 timestamp[unit] decimal128(P,S)"
)
_LIST = re.compile(r"(large_list|list|fixed_size_list)\s*<(.*)>\s*(?:\[\s*(\d+)\s*\])?", re.S)
_FIELD_NAME = re.compile(r"^\s*\w+\s*:\s*")  # pyarrow prints list<item: int32>
_STRUCT = re.compile(r"struct\s*<(.*)>", re.S)
_DECIMAL = re.compile(r"decimal(128|256)?\s*\(\s*(\d+)\s*,\s*(-?\d+)\s*\)")


def parse_type(text: str) -> pa.DataType:
    """Parse an Arrow type string: ``int32``, ``list<string>``, ``fixed_size_list<float, 8>``, ...

    Also accepts pyarrow's own spelling, e.g. ``fixed_size_list<item: float>[64]``.

    Raises:
        ValueError: the string is not a type this parser knows; the message names it.
    """
    spec = text.strip()
    if match := _STRUCT.fullmatch(spec):
        return _struct(spec, match.group(1))
    if match := _DECIMAL.fullmatch(spec):
        bits, precision, scale = match.groups()
        try:  # integers past uint64 fit decimal128(38, 0); 39 digits and more need 256
            make = pa.decimal256 if bits == "256" else pa.decimal128
            return make(int(precision), int(scale))
        except ValueError as exc:
            raise ValueError(f"bad Arrow type {spec!r}: {exc}") from None
    if not (match := _LIST.fullmatch(spec)):
        try:  # the names str(type) prints, and aliases: timestamp[ms], halffloat, utf8, ...
            return pa.type_for_alias(spec)
        except ValueError:
            raise ValueError(
                f"unknown Arrow type {spec!r}; known: {_PRIMITIVES.replace(' ', ', ')}"
                ", list<T>, large_list<T>, fixed_size_list<T, N>, struct<name: T, ...>"
            ) from None
    kind, inner, size = match.groups()
    if kind == "fixed_size_list" and size is None:
        inner, _, size = inner.rpartition(",")
    if (kind == "fixed_size_list") != bool(size) or (size and not size.strip().isdigit()):
        raise ValueError(
            f"bad Arrow type {spec!r}: fixed_size_list needs a size N, other lists none"
        )
    item = parse_type(_FIELD_NAME.sub("", inner, count=1))
    if kind == "fixed_size_list":
        return pa.list_(item, int(size))
    return pa.list_(item) if kind == "list" else pa.large_list(item)


def _struct(spec: str, inner: str) -> pa.DataType:
    """``struct<a: int32, b: list<string>>``: the fields of a JSON object column."""
    fields: list[tuple[str, pa.DataType]] = []
    for part in split_params(inner):
        name, colon, kind = part.partition(":")
        if not colon or not name.strip() or name.strip() in dict(fields):
            raise ValueError(
                f"bad Arrow type {spec!r}: a struct lists unique fields as NAME: TYPE, "
                "e.g. struct<id: uint64, name: string>"
            )
        fields.append((name.strip(), parse_type(kind)))
    if not fields:
        raise ValueError(f"bad Arrow type {spec!r}: a struct needs at least one field")
    return pa.struct(fields)


def _cuts(value: str, sep: str, *, brackets: bool = True) -> Iterator[int]:
    """Where ``sep`` stands in ``value`` outside double quotes.

    With ``brackets``, outside <...>, [...] and (...) too (types hold commas).
    """
    depth, quoted = 0, False
    for i, char in enumerate(value):
        if char == '"':
            quoted = not quoted  # "" inside quotes closes and reopens: a quote, kept
        elif not quoted:
            if brackets:
                depth += (char in "<[(") - (char in ">])")
            if char == sep and depth == 0:
                yield i


def split_params(value: str) -> list[str]:
    """Split on commas outside <...>, [...], (...) and double quotes.

    Brackets keep nested and decimal types whole (``cast=x=list<int32>,y=decimal128(9, 2)``);
    quotes keep a column name whole whatever it holds (``select="Income, USD",age``:
    :func:`param_names` and :func:`param_pairs` take the quotes off). Parts keep their quotes.
    """
    ends = [*_cuts(value, ","), len(value)]
    starts = [0, *(end + 1 for end in ends[:-1])]
    parts = (value[start:end].strip() for start, end in zip(starts, ends, strict=True))
    return [part for part in parts if part]


_PLAIN = re.compile(r'[^,="<>\[\]()]+')


def quote_name(name: str) -> str:
    """``name`` as a param writes it, so that :func:`param_names` gives it back.

    In double quotes when it holds , = " < > [ ] ( ) or starts or ends with a space
    (which params strip); ``""`` stands for a quote inside them.
    """
    if _PLAIN.fullmatch(name) and name == name.strip():
        return name
    return '"' + name.replace('"', '""') + '"'


def unquote(text: str) -> str:
    """A name as :func:`quote_name` wrote it, quotes taken off (a plain name: stripped)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1].replace('""', '"')
    return text


def param_names(value: str) -> list[str]:
    """``select=a,"b,c"``-style lists: the names, quotes taken off."""
    return [unquote(part) for part in split_params(value)]


def param_pairs(value: str) -> list[tuple[str, str, bool]]:
    """``rename=a=x,"b=c"=y``-style lists: (name, value, whether an ``=`` was there).

    The split is at the first ``=`` outside quotes; both sides lose their quotes,
    so a value that is a name (rename) may be quoted too. A type (cast) has none.
    """
    pairs = []
    for part in split_params(value):
        cut = next(_cuts(part, "=", brackets=False), None)
        if cut is None:
            pairs.append((unquote(part), "", False))
        else:
            pairs.append((unquote(part[:cut]), unquote(part[cut + 1 :]), True))
    return pairs


def check_param_names(transform: str, params: Iterable[str], allowed: Sequence[str]) -> None:
    """Refuse parameters a transform does not take, naming them, the likely meant one, all.

    At publish: a typo (``sise=``) would otherwise be carried into the version
    and fail, or be silently ignored, on every node that stages it.
    """
    unknown = sorted(set(params) - set(allowed))
    if not unknown:
        return
    meant = [
        f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
        for name in unknown
        for close in [difflib.get_close_matches(name, allowed, n=1)]
    ]
    raise ValueError(
        f"{transform} transform: unknown params {', '.join(meant)}; allowed: {', '.join(allowed)}"
    )


def binary_column(values: Sequence[memoryview | bytes | None], *, string: bool = False) -> pa.Array:
    """A binary (or UTF-8 string) array from byte slices, copying each once into one buffer.

    Container formats (tar members, MDS fields) hand out slices of the object
    they were read from; ``pa.array`` would want a ``bytes`` object per value.

    Raises:
        ValueError: ``string`` and a value is not valid UTF-8 (pyarrow's message says where).
    """
    import numpy as np

    sizes = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise ValueError("a batch of binary values must hold under 2 GiB; read smaller batches")
    data = b"".join(v for v in values if v is not None)
    valid = np.fromiter((v is not None for v in values), np.bool_, len(values))
    nulls = len(values) - int(valid.sum())
    mask = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    array = pa.Array.from_buffers(
        pa.string() if string else pa.binary(),
        len(values),
        [mask, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)],
        null_count=nulls,
    )
    if string:
        array.validate(full=True)
    return array


_PLAIN_NAMES = {"halffloat": "float16", "float": "float32", "double": "float64"}


def type_label(arrow: pa.DataType) -> str:
    """A type as a person reads it, e.g. ``uint8[224,224,3]`` for nested fixed-size lists.

    Lists read ``list<int32>``; every other type keeps Arrow's own name.
    """
    shape: list[int] = []
    inner = arrow
    while pa.types.is_fixed_size_list(inner):
        shape.append(inner.list_size)
        inner = inner.value_type
    if shape:
        return f"{type_label(inner)}[{','.join(map(str, shape))}]"
    if pa.types.is_list(arrow) or pa.types.is_large_list(arrow):
        kind = "list" if pa.types.is_list(arrow) else "large_list"
        return f"{kind}<{type_label(arrow.value_type)}>"
    return _PLAIN_NAMES.get(str(arrow), str(arrow))


def type_name(arrow: pa.DataType) -> str:
    """A type spelled the way :func:`parse_type` reads it back, and the way publish prints it.

    Floats are ``float32``/``float64`` (pyarrow's ``str`` says ``float`` and ``double``),
    lists ``list<T>`` without pyarrow's ``item:``, structs ``struct<a: T, b: U>``.
    """
    if pa.types.is_fixed_size_list(arrow):
        return f"fixed_size_list<{type_name(arrow.value_type)}, {arrow.list_size}>"
    if pa.types.is_list(arrow) or pa.types.is_large_list(arrow):
        kind = "list" if pa.types.is_list(arrow) else "large_list"
        return f"{kind}<{type_name(arrow.value_type)}>"
    if pa.types.is_struct(arrow):
        fields = (arrow.field(i) for i in range(arrow.num_fields))
        return f"struct<{', '.join(f'{f.name}: {type_name(f.type)}' for f in fields)}>"
    return _PLAIN_NAMES.get(str(arrow), str(arrow))
