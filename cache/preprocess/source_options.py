"""Reader options for source formats, and the CSV reader that honours them.

Real CSV files do not all start with a header row: scikit-learn's ``iris.csv``
starts with a count line (``150,4,setosa,…``), its ``linnerud_exercise.csv``
is space-separated, ``diabetes_data_raw.csv.gz`` has no header at all. Read
with defaults, such a file publishes with columns named ``150`` and ``4``, or
as one string column — silently wrong. So the CSV reader takes the options
people expect, recorded in the version's spec (``source_options``) so every
node parses the same way, and refuses to guess where guessing goes wrong:

* ``header``: ``true``, ``false`` or ``auto`` (the default: the first row is a
  header unless a cell of it is a number or empty, which is refused with what
  to pass instead);
* ``column_names``: ``a,b,c`` (given without ``header``: the first row is data;
  with ``header=true``: the file's header is replaced);
* ``delimiter``: one character, or ``comma``, ``tab``, ``space``,
  ``semicolon``, ``pipe``, or ``whitespace`` (runs of spaces and tabs, as in
  aligned text tables); without it, a file that parses as one column while
  every line holds the same number of another separator is refused, naming it;
* ``skip_rows``: rows to drop before the header (or the first data row);
* ``column_types``: ``a=int32,b=string`` (Arrow type names, see
  :func:`~edgecache.cache.preprocess.arrow_types.parse_type`), applied to the
  final column names.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import parse_type, split_params
from edgecache.cache.preprocess.compressed import strip_suffix
from edgecache.cache.preprocess.fixes import COLUMN_FIX
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "CSV_OPTIONS",
    "DELIMITERS",
    "canonical_options",
    "column_types",
    "delimiter_for_names",
    "read_csv",
]

CSV_OPTIONS = ("header", "column_names", "delimiter", "skip_rows", "column_types")
DELIMITERS: Mapping[str, str] = MappingProxyType(
    {
        "comma": ",",
        "tab": "\t",
        "space": " ",
        "semicolon": ";",
        "pipe": "|",
        "whitespace": "whitespace",
    }
)
_SNIFF = {" ": "space", "\t": "tab", ";": "semicolon", "|": "pipe"}
_NAMES = {
    pb.SOURCE_FORMAT_CSV: "CSV",
    pb.SOURCE_FORMAT_JSONL: "JSON Lines",
    pb.SOURCE_FORMAT_PARQUET: "Parquet",
    pb.SOURCE_FORMAT_ARROW_IPC: "Arrow IPC",
    pb.SOURCE_FORMAT_WEBDATASET: "WebDataset",
    pb.SOURCE_FORMAT_MDS: "MDS",
}


def _split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _type_pairs(text: str) -> dict[str, pa.DataType]:
    out: dict[str, pa.DataType] = {}
    for part in split_params(text):
        name, eq, type_name = (s.strip() for s in part.partition("="))
        if not eq or not name or not type_name or name in out:
            raise ValueError(
                f"column_types={text!r}: expected unique NAME=TYPE pairs, "
                "e.g. 'age=int32,name=string'"
            )
        kind = parse_type(type_name)
        if pa.types.is_nested(kind) or pa.types.is_dictionary(kind):
            raise ValueError(
                f"column_types {name}={type_name}: a CSV cell holds one value, not a "
                f"{kind}; read the column as string (or leave it out), or publish the data "
                "as JSON Lines or Parquet, which hold lists and structs"
            )
        out[name] = kind
    return out


def _canonical_types(text: str) -> str:
    """``column_types`` as the manifest records it: ``a=int32,b=string`` ("" for none)."""
    return ",".join(f"{k}={v}" for k, v in _type_pairs(text).items())


def column_types(options: Mapping[str, str]) -> dict[str, pa.DataType]:
    """The ``column_types`` of canonical ``options``, parsed (empty without any)."""
    return _type_pairs(options["column_types"]) if "column_types" in options else {}


def canonical_options(fmt: pb.SourceFormat.ValueType, options: Mapping[str, str]) -> dict[str, str]:
    """Validate reader options for ``fmt`` and spell them one way (what the manifest records).

    Raises:
        ValueError: an unknown option, an option the format has none of, or a bad value;
            the message names the allowed ones.
    """
    opts = {str(k).strip(): str(v) for k, v in options.items()}
    if not opts:
        return {}
    if fmt == pb.SOURCE_FORMAT_JSONL and set(opts) <= {"column_types"}:
        # JSON holds its own names and values; only a type can need saying (an integer
        # past int64, which pyarrow would otherwise read as float64, losing digits).
        spelled = _canonical_types(opts["column_types"])
        return {"column_types": spelled} if spelled else {}
    if fmt != pb.SOURCE_FORMAT_CSV:
        jsonl = " (JSON Lines: column_types only)" if fmt == pb.SOURCE_FORMAT_JSONL else ""
        raise ValueError(
            f"{_NAMES.get(fmt, 'this format')} sources take no reader options{jsonl} (got "
            f"{', '.join(sorted(opts))}); reader options are for CSV: {', '.join(CSV_OPTIONS)}"
        )
    if unknown := sorted(set(opts) - set(CSV_OPTIONS)):
        raise ValueError(f"unknown CSV options {unknown}; known: {', '.join(CSV_OPTIONS)}")
    out: dict[str, str] = {}
    if "header" in opts:
        value = opts["header"].strip().lower()
        if value not in ("true", "false", "auto"):
            raise ValueError(f"header must be true, false or auto, got {opts['header']!r}")
        if value != "auto":
            out["header"] = value
    if "column_names" in opts:
        names = _split_list(opts["column_names"])
        if not names or len(set(names)) != len(names):
            raise ValueError(f"column_names={opts['column_names']!r}: give unique names, a,b,c")
        out["column_names"] = ",".join(names)
    if "delimiter" in opts:
        raw = opts["delimiter"]
        value = DELIMITERS.get(raw.strip().lower(), raw)
        if value == "\\t":
            value = "\t"
        if value != "whitespace" and (len(value) != 1 or value in "\r\n\"'"):
            raise ValueError(
                f"delimiter must be one character or one of {', '.join(DELIMITERS)}, got {raw!r}"
            )
        out["delimiter"] = value
    if "skip_rows" in opts:
        text = opts["skip_rows"].strip()
        if not text.isdigit():
            raise ValueError(f"skip_rows must be a whole number, got {opts['skip_rows']!r}")
        if int(text):
            out["skip_rows"] = str(int(text))
    if "column_types" in opts:
        if spelled := _canonical_types(opts["column_types"]):
            out["column_types"] = spelled
    return out


def _first_rows(text: bytes, delimiter: str, skip: int, count: int) -> list[list[str]]:
    lines = text[: 1 << 20].decode("utf-8", errors="replace").splitlines()[skip : skip + count]
    if delimiter == "whitespace":
        return [line.split() for line in lines]
    try:
        return list(csv.reader(io.StringIO("\n".join(lines)), delimiter=delimiter))
    except csv.Error:  # a cell over Python's 128 KiB field limit: judge the row as split
        return [line.split(delimiter) for line in lines]


def _is_number(cell: str) -> bool:
    # A digit is required: float() also reads "NaN", "inf" and "Infinity", which are
    # fine column names (and a header of them is a header).
    if not any(ch.isdigit() for ch in cell):
        return False
    try:
        float(cell)
    except ValueError:
        return False
    return True


def delimiter_for_names(names: list[str]) -> str | None:
    """The delimiter that object names imply: tab for ``.tsv`` (compressed too), else None.

    A prefix of ``.tsv`` files read with a comma would publish tab-joined column
    names, or split a field that holds a comma: silently wrong. A prefix that
    mixes ``.tsv`` with other names implies nothing and is refused, since one
    version has one delimiter.

    Raises:
        ValueError: some names end in ``.tsv`` and others do not.
    """
    tsv = [strip_suffix(name).lower().endswith(".tsv") for name in names]
    if not any(tsv):
        return None
    if not all(tsv):
        other = next(n for n, t in zip(names, tsv, strict=True) if not t)
        first = next(n for n, t in zip(names, tsv, strict=True) if t)
        raise ValueError(
            f"the source mixes tab-separated .tsv objects ({first}) with others ({other}); "
            "one version has one delimiter: pass --delimiter (tab or comma), or publish them "
            "as separate datasets"
        )
    return "\t"


def _check_header(text: bytes, delimiter: str, skip: int, source: str) -> None:
    rows = _first_rows(text, delimiter, skip, 1)
    if not rows:
        return
    header = rows[0]
    numeric = [cell for cell in header if _is_number(cell.strip())]
    blank = sum(1 for cell in header if not cell.strip())
    if not numeric and not blank:
        return
    if numeric:
        verb = "is a number" if len(numeric) == 1 else "are numbers"
        what = f"{', '.join(repr(c) for c in numeric[:4])} {verb}"
    else:
        what = f"{blank} of its cells {'is' if blank == 1 else 'are'} empty"
    raise MalformedShard(
        f"{source}: the first row (row {skip + 1}: {','.join(header)[:80]!r}) does not look "
        f"like a header: {what}. If it is data, publish with --no-header (columns are named "
        "f0, f1, … unless you give --column-names a,b,c); if it is a line to drop (iris.csv "
        f"starts with a count line), add --skip-rows {skip + 1}; if it really is the header, "
        "pass --header"
    )


def _check_one_column(table: pa.Table, text: bytes, skip: int, source: str) -> None:
    """Refuse a file that parsed as one column but is plainly separated by something else."""
    if table.num_columns != 1:
        return
    lines = [
        line
        for line in text[: 1 << 16].decode("utf-8", errors="replace").splitlines()[skip : skip + 20]
        if line.strip()
    ]
    if not lines:
        return
    for char, name in _SNIFF.items():
        counts = {line.strip().count(char) for line in lines}
        if len(counts) == 1 and counts.pop() > 0:
            raise MalformedShard(
                f"{source} parsed as one column ({table.column_names[0][:60]!r}), but every line "
                f"holds the same number of {name}s: it looks {name}-separated. Publish with "
                f"--delimiter {name} (or --delimiter whitespace for runs of spaces), or with "
                "--delimiter , to keep one column"
            )


def _single_spaced(text: bytes) -> bytes:
    """``text`` with each run of blanks outside quotes one space, and none at line edges.

    pyarrow splits on one character, so runs of spaces and tabs (aligned text
    tables) become single spaces first. Quoted fields keep their blanks: the
    text is split at double quotes, and with CSV's quoting (a quote inside a
    field is doubled) the even pieces are outside quotes, the odd ones inside.
    A blank next to a quote separates fields; only those at line edges go.
    """
    pieces = text.split(b'"')
    last = len(pieces) - 1
    for i in range(0, len(pieces), 2):
        piece = re.sub(rb"[ \t]+", b" ", pieces[i])
        piece = re.sub(rb"(?<=\n) | (?=\r?\n)", b"", piece)
        if i == 0:
            piece = piece.removeprefix(b" ")
        if i == last:
            piece = re.sub(rb" (\r?)\Z", rb"\1", piece)
        pieces[i] = piece
    return b'"'.join(pieces)


def read_csv(
    buf: pa.Buffer,
    options: Mapping[str, str],
    source: str,
    *,
    threads: bool,
    block_size: int | None,
) -> pa.Table:
    """Parse a whole CSV object with ``options`` (canonical, see :func:`canonical_options`).

    Raises:
        MalformedShard: the first row is not plainly a header (with ``header`` auto), or the
            file is plainly separated by something other than the delimiter used.
        pyarrow.ArrowInvalid: a row does not parse; the caller names the row.
    """
    delimiter = options.get("delimiter", ",")
    skip = int(options.get("skip_rows", "0"))
    names = _split_list(options.get("column_names", ""))
    header = options.get("header", "auto")
    if delimiter == "whitespace":
        buf = pa.py_buffer(_single_spaced(memoryview(buf).tobytes()))
    head = memoryview(buf)[: 1 << 20].tobytes()  # enough lines to judge the first rows
    if header == "auto" and not names:
        _check_header(head, delimiter if delimiter != "whitespace" else " ", skip, source)
    has_header = header == "true" or (header == "auto" and not names)
    read: dict[str, Any] = {"use_threads": threads}
    if block_size:
        read["block_size"] = block_size
    if names:
        read.update(column_names=names, skip_rows=skip + (1 if has_header else 0))
    elif not has_header:
        read.update(autogenerate_column_names=True, skip_rows=skip)
    else:
        read.update(skip_rows=skip)
    types = column_types(options)
    # An empty unquoted field is null and "" is an empty string, as pyarrow writes them.
    convert = pa_csv.ConvertOptions(
        strings_can_be_null=True, quoted_strings_can_be_null=False, column_types=types
    )
    parse = pa_csv.ParseOptions(delimiter=" " if delimiter == "whitespace" else delimiter)
    table = pa_csv.read_csv(
        pa.BufferReader(buf),
        read_options=pa_csv.ReadOptions(**read),
        parse_options=parse,
        convert_options=convert,
    )
    if types and (missing := sorted(set(types) - set(table.column_names))):
        raise MalformedShard(
            f"{source}: column_types names {missing}, but the columns are "
            f"{', '.join(table.column_names)}; {COLUMN_FIX}"
        )
    if "delimiter" not in options:
        _check_one_column(table, head, skip, source)
    return table
