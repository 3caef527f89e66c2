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
  with ``header=true``: the file's header is replaced); a name holding a comma
  or ``=`` in double quotes, ``"x, y",z``, here and in ``column_types``;
* ``delimiter``: one character, or ``comma``, ``tab``, ``space``,
  ``semicolon``, ``pipe``, or ``whitespace`` (runs of spaces and tabs, as in
  aligned text tables); without it, a file that parses as one column while
  every line holds the same number of another separator is refused, naming it;
* ``skip_rows``: rows to drop before the header (or the first data row);
* ``column_types``: ``a=int32,b=string`` (Arrow type names, see
  :func:`~edgecache.cache.preprocess.arrow_types.parse_type`), applied to the
  final column names;
* ``null_values``: ``NA,N/A``: cell texts that read as null, besides an empty
  unquoted cell (the only null without it). pyarrow's own list (``NA``,
  ``null``, ``N/A``, ``nan``, …) read Namibia's country code, a text column of
  notes and every ``nan`` as nulls, silently: every version records its list,
  and one recorded without (published before) is read by pyarrow's, as it was.
"""

from __future__ import annotations

import csv
import io
import re
import shlex
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import param_names, param_pairs, parse_type, quote_name
from edgecache.cache.preprocess.arrow_types import type_name as spelled
from edgecache.cache.preprocess.compressed import strip_suffix
from edgecache.cache.preprocess.fixes import COLUMN_FIX
from edgecache.cache.preprocess.webdataset import MEMBER_RULES, MEMBER_RULES_OPTION
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "CSV_OPTIONS",
    "DELIMITERS",
    "canonical_options",
    "column_types",
    "delimiter_for_names",
    "read_csv",
]

CSV_OPTIONS = ("header", "column_names", "delimiter", "skip_rows", "column_types", "null_values")
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


def _cast_param(name: str, kind: pa.DataType) -> str:
    """``cast=NAME=TYPE`` as a shell takes it, the name quoted as params quote names."""
    return shlex.quote(f"cast={quote_name(name)}={spelled(kind)}")


def _type_pairs(
    text: str, fmt: pb.SourceFormat.ValueType = pb.SOURCE_FORMAT_JSONL
) -> dict[str, pa.DataType]:
    """``a=int32,b=string`` parsed; nested types only where ``fmt`` holds them (JSON Lines)."""
    out: dict[str, pa.DataType] = {}
    for name, type_name, eq in param_pairs(text):
        if not eq or not name or not type_name or name in out:
            raise ValueError(
                f"column_types={text!r}: expected unique NAME=TYPE pairs, "
                "e.g. 'age=int32,name=string'"
            )
        kind = parse_type(type_name)
        if fmt == pb.SOURCE_FORMAT_CSV and (
            pa.types.is_nested(kind) or pa.types.is_dictionary(kind)
        ):
            raise ValueError(
                f"column_types {name}={type_name}: a CSV cell holds one value, not a "
                f"{spelled(kind)}; read the column as string (or leave it out), or publish the "
                "data as JSON Lines or Parquet, which hold lists and structs"
            )
        if fmt == pb.SOURCE_FORMAT_JSONL and (bad := _unreadable_json_type(kind)):
            raise ValueError(
                f"column_types {name}={type_name}: the JSON Lines reader cannot read a value as "
                f"{spelled(bad)}; use list<T> for a JSON array (cast it afterwards with "
                f"--transform columns --param {_cast_param(name, kind)})"
            )
        out[name] = kind
    return out


def _unreadable_json_type(kind: pa.DataType) -> pa.DataType | None:
    """The part of ``kind`` pyarrow's JSON reader has no conversion to, or None."""
    if pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return kind
    if pa.types.is_list(kind):
        return _unreadable_json_type(kind.value_type)
    if pa.types.is_struct(kind):
        found = (_unreadable_json_type(kind.field(i).type) for i in range(kind.num_fields))
        return next((bad for bad in found if bad is not None), None)
    return None


def _canonical_types(text: str, fmt: pb.SourceFormat.ValueType) -> str:
    """``column_types`` as the manifest records it: ``a=int32,b=float32`` ("" for none).

    Types are spelled as publish prints the schema (``float32``, not pyarrow's
    ``float``), so what is echoed is what is used.
    """
    return ",".join(f"{quote_name(k)}={spelled(v)}" for k, v in _type_pairs(text, fmt).items())


def column_types(options: Mapping[str, str]) -> dict[str, pa.DataType]:
    """The ``column_types`` of canonical ``options``, parsed (empty without any)."""
    return _type_pairs(options["column_types"]) if "column_types" in options else {}


def _webdataset_options(opts: Mapping[str, str]) -> dict[str, str]:
    """WebDataset's one recorded option: the member rules a version's tars are read by.

    Every version published from now on records WebDataset's own rules
    (``webdataset.MEMBER_RULES``); one without the option was published under the
    earlier rules and is read by them, so its rows and types stay as recorded.
    """
    rules = opts.get(MEMBER_RULES_OPTION, MEMBER_RULES)
    if set(opts) - {MEMBER_RULES_OPTION} or rules != MEMBER_RULES:
        raise ValueError(
            f"WebDataset sources take no reader options (got "
            f"{', '.join(f'{k}={v}' for k, v in sorted(opts.items()))}); reader options are "
            f"for CSV: {', '.join(CSV_OPTIONS)}"
        )
    return {MEMBER_RULES_OPTION: MEMBER_RULES}


def canonical_options(fmt: pb.SourceFormat.ValueType, options: Mapping[str, str]) -> dict[str, str]:
    """Validate reader options for ``fmt`` and spell them one way (what the manifest records).

    Raises:
        ValueError: an unknown option, an option the format has none of, or a bad value;
            the message names the allowed ones.
    """
    opts = {str(k).strip(): str(v) for k, v in options.items()}
    if fmt == pb.SOURCE_FORMAT_WEBDATASET:
        return _webdataset_options(opts)
    if fmt == pb.SOURCE_FORMAT_CSV:
        # Recorded on every CSV version, the empty list too: see null_values above.
        opts.setdefault("null_values", "")
    if not opts:
        return {}
    if fmt == pb.SOURCE_FORMAT_JSONL and set(opts) <= {"column_types"}:
        # JSON holds its own names and values; only a type can need saying (an integer
        # past int64, which pyarrow would otherwise read as float64, losing digits).
        typed = _canonical_types(opts["column_types"], fmt)
        return {"column_types": typed} if typed else {}
    if fmt != pb.SOURCE_FORMAT_CSV:
        jsonl = " (JSON Lines: column_types only)" if fmt == pb.SOURCE_FORMAT_JSONL else ""
        raise ValueError(
            f"{_NAMES.get(fmt, 'this format')} sources take no reader options{jsonl} (got "
            f"{', '.join(sorted(opts))}); reader options are for CSV: {', '.join(CSV_OPTIONS)}"
        )
    if unknown := sorted(set(opts) - set(CSV_OPTIONS)):
        raise ValueError(
            f"unknown CSV options {', '.join(unknown)}; known: {', '.join(CSV_OPTIONS)}"
        )
    out: dict[str, str] = {}
    if "header" in opts:
        value = opts["header"].strip().lower()
        if value not in ("true", "false", "auto"):
            raise ValueError(f"header must be true, false or auto, got {opts['header']!r}")
        if value != "auto":
            out["header"] = value
    if "column_names" in opts:
        names = param_names(opts["column_names"])
        if not names or len(set(names)) != len(names):
            raise ValueError(f"column_names={opts['column_names']!r}: give unique names, a,b,c")
        out["column_names"] = ",".join(quote_name(n) for n in names)
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
        if typed := _canonical_types(opts["column_types"], fmt):
            out["column_types"] = typed
    if "null_values" in opts:
        texts = param_names(opts["null_values"]) if opts["null_values"].strip() else []
        out["null_values"] = ",".join(quote_name(t) for t in dict.fromkeys(t for t in texts if t))
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
    rows = _first_rows(text, delimiter, skip, 2)
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
    first = header[0].strip() if header else ""
    below = text.splitlines()[skip + 1 :]
    if first.isdigit() and len(text) < 1 << 20 and int(first) == sum(1 for x in below if x.strip()):
        drop = f" (a count line: its first cell, {first}, is the number of rows below it)"
    elif len(rows) > 1 and len(header) < len(rows[1]):
        drop = f" (it has {len(header)} cells where the next row has {len(rows[1])}: a title line)"
    else:
        drop = ""
    # Dropped, the line leaves the next row first: data too (a count line's rows), it needs
    # --no-header as well, or the advice followed is refused again with "--skip-rows N+1",
    # which would drop a row of data.
    after = rows[1] if len(rows) > 1 else []
    # Numbers only: an empty cell is also a pandas-style header's first (",a,b").
    data_next = any(_is_number(c.strip()) for c in after)
    then = " --no-header (the rows below it are data)" if data_next else ""
    raise MalformedShard(
        f"{source}: the first row (row {skip + 1}: {delimiter.join(header)[:80]!r}) does not look "
        f"like a header: {what}. If it is data, publish with --no-header (columns are named "
        "f0, f1, … unless you give --column-names a,b,c); if it is a line to drop"
        f"{drop}, add --skip-rows {skip + 1}{then}; if it really is the header, pass --header"
    )


def _check_named_header(
    text: bytes, delimiter: str, skip: int, names: list[str], source: str
) -> None:
    """Refuse ``column_names`` over a file whose first row is its own header.

    Given names without ``--header``, the first row is data; when it is text over
    columns of numbers (or the very names given), it is the file's header, and
    reading it as a row would turn every column it sits on into strings.
    """
    rows = [row for row in _first_rows(text, delimiter, skip, 21) if row]
    if len(rows) < 2:
        return
    first, rest = [cell.strip() for cell in rows[0]], rows[1:]
    # Its empty cells say nothing either way: pandas writes its index column's header
    # empty (",x,y"), and such a header was read as a row, its numbers made strings.
    if not any(first) or any(_is_number(cell) for cell in first):
        return
    numbers = [
        i
        for i in range(len(first))
        if first[i] and all(i < len(row) and _is_number(row[i].strip()) for row in rest)
    ]
    if first != names and not numbers:
        return
    over = ", ".join(first[i] for i in numbers[:4])
    why = (
        "it holds the very names given"
        if first == names
        else f"its cells are text over columns of numbers ({over}), which it would make strings"
    )
    raise MalformedShard(
        f"{source}: --column-names was given, so the first row (row {skip + 1}: "
        f"{','.join(first)[:80]!r}) is read as data, but it looks like the file's header: {why}. "
        f"Add --header to replace the file's header with these names (or --skip-rows "
        f"{skip + 1} to drop it); if that row really is data, pass --no-header"
    )


def _check_header_names(text: bytes, delimiter: str, skip: int, source: str) -> None:
    """Refuse a header (``--header``, no names given) with an empty cell: a column named ""."""
    rows = _first_rows(text, delimiter, skip, 1)
    if not rows:
        return
    empty = [i + 1 for i, cell in enumerate(rows[0]) if not cell.strip()]
    if empty:
        which = ("column " if len(empty) == 1 else "columns ") + ", ".join(map(str, empty[:8]))
        raise MalformedShard(
            f"{source}: the header (row {skip + 1}) has no name for {which}"
            f" (of {len(rows[0])}), and readers find a column by its name: name every "
            "column with --column-names a,b,c (with --header they replace the file's header)"
        )


def _comment_lines(lines: list[str]) -> int:
    """How many of ``lines`` (from the first) are ``#`` comments, blank lines among them.

    Blank lines count (0 if there is no comment): ``--skip-rows`` counts every line
    of the file, blank or not, so advice to skip the comments must count them too.
    """
    count = 0
    while count < len(lines) and (not lines[count].strip() or lines[count].lstrip()[0] == "#"):
        count += 1
    return count if any(line.strip() for line in lines[:count]) else 0


def _check_comment_lines(text: bytes, delimiter: str, skip: int, source: str) -> None:
    """Refuse ``#`` lines above a header when they parsed as the header.

    A comment with as many cells as the rows (``# generated by tool, v2`` above
    ``x,y``) raises no parse error, so :func:`_leading_prose` never saw it: the
    comment became the column names and the real header a row, which made every
    number column text. The line after the comments is taken for the header when
    none of its cells is a number and the rows below it hold numbers; a ``#``
    line that is itself the header (``#chrom,start``) above data is left alone.
    """
    lines = text[: 1 << 20].decode("utf-8", errors="replace").splitlines()[skip : skip + 60]
    count = _comment_lines(lines)
    if not count or count == len(lines):
        return
    rows = [row for row in _first_rows(text, delimiter, skip + count, 60) if row]
    if len(rows) < 2 or any(_is_number(cell) for cell in rows[0]):
        return
    if any(_is_number(cell) for row in rows[1:] for cell in row):
        lines_ = f"{count} lines" if count > 1 else "line"
        blank = " or blank" if any(not line.strip() for line in lines[:count]) else ""
        raise MalformedShard(
            f"{source}: its first {lines_} ({lines[0][:60]!r}) {'are' if count > 1 else 'is a'} "
            f"comment{'s' if count > 1 else ''}{blank}, and the line after "
            f"({lines[count][:60]!r}) names the columns: publish with --skip-rows {skip + count}"
        )


def _check_one_column(
    table: pa.Table, text: bytes, skip: int, source: str, has_header: bool, runs: bool
) -> None:
    """Refuse a file that parsed as one column but is plainly separated by something else.

    A separator character on every line the same number of times names it; runs of
    blanks the same number of times on every line (an aligned table, where the
    blanks between columns vary with the numbers' widths) name ``whitespace``, with
    ``runs`` (publish: versions published before that check read as recorded).
    """
    if table.num_columns != 1:
        return
    raw = text[: 1 << 16].decode("utf-8", errors="replace").splitlines()[skip : skip + 20]
    comments = _comment_lines(raw)  # a title or note above the table has no separators
    lines = [line for line in raw[comments:] if line.strip()]
    if not lines:
        lines, comments = [line for line in raw if line.strip()], 0
    if not lines:
        return
    parsed = f"{source} parsed as one column ({table.column_names[0][:60]!r}), but"
    keep = "or with --delimiter , to keep one column"
    first = lines[0].strip()
    skip_too = f" --skip-rows {skip + comments}" if comments else ""
    for char, name in _SNIFF.items():
        counts = {line.strip().count(char) for line in lines}
        if len(counts) != 1 or not counts.pop():
            continue
        if char in " \t" and any(line != line.strip() or char * 2 in line for line in lines):
            continue  # blanks at the edges or doubled: an aligned table, told below
        no_header = _no_header_hint(first, char, has_header)
        blanks = " (or --delimiter whitespace for runs of blanks)" if char in " \t" else ""
        raise MalformedShard(
            f"{parsed} every line holds the same number of {name}s: it looks "
            f"{name}-separated. Publish with --delimiter {name}{skip_too}{no_header}{blanks}, "
            f"{keep}"
        )
    found = {len(re.findall(r"[ \t]+", line.strip())) for line in lines} if runs else set()
    if len(found) == 1 and (count := found.pop()) > 0:
        no_header = _no_header_hint(first, None, has_header)
        raise MalformedShard(
            f"{parsed} every line holds {count + 1} values between runs of blanks: it looks "
            f"like an aligned text table. Publish with --delimiter whitespace{skip_too}"
            f"{no_header}, {keep}"
        )


_OTHER_DELIMITERS = {",": "comma", "\t": "tab", ";": "semicolon", "|": "pipe"}


_DELIMITER_NAMES = {**_OTHER_DELIMITERS, **_SNIFF}  # every separator a file is sniffed for


def _shown(delimiter: str) -> str:
    """A delimiter as a person reads it: ``,`` is "commas", a blank is "spaces"."""
    return _DELIMITER_NAMES.get(delimiter, repr(delimiter)) + "s"


def _separated_by(text: bytes, skip: int, values: int, used: str) -> tuple[str, str] | None:
    """(what, --delimiter value) splitting every data line into ``values``; None if none does.

    Single characters first (the same count on every line), then runs of blanks
    (an aligned table): the separator a file whose lines did not split on
    ``used`` is plainly written with.
    """
    raw = text[: 1 << 16].decode("utf-8", errors="replace").splitlines()[skip : skip + 20]
    lines = [line.strip() for line in raw if line.strip()]
    if not lines:
        return None
    for char, name in _DELIMITER_NAMES.items():
        if char != used and all(line.count(char) == values - 1 for line in lines):
            if char not in " \t" or not any(char * 2 in line for line in lines):
                return _shown(char), name
    if all(len(re.findall(r"[ \t]+", line)) == values - 1 for line in lines):
        return "runs of blanks", "whitespace"
    return None


def _check_given_delimiter(
    table: pa.Table, text: bytes, skip: int, source: str, delimiter: str
) -> None:
    """Refuse a ``--delimiter`` that splits no line while another splits every one alike.

    ``--delimiter ';'`` on a comma-separated file used to publish one string column
    named ``sensor_id,timestamp,…``. Lines quoted whole (one text column that holds
    commas) are left alone.
    """
    lines = [
        line.strip()
        for line in text[: 1 << 16].decode("utf-8", errors="replace").splitlines()[skip : skip + 20]
        if line.strip()
    ]
    if not lines or any(delimiter in line or line.startswith('"') for line in lines):
        return
    for char, name in _OTHER_DELIMITERS.items():
        counts = {line.count(char) for line in lines}
        if len(counts) == 1 and (count := counts.pop()):
            raise MalformedShard(
                f"{source} parsed as one column ({table.column_names[0][:60]!r}): the "
                f"delimiter given ({delimiter!r}) is in none of its lines, but every line holds "
                f"{count} {name}{'s' if count != 1 else ''}: it is {name}-separated. Publish "
                f"with --delimiter {name}"
            )


def _no_header_hint(line: str, char: str | None, has_header: bool) -> str:
    """`` --no-header (…)`` when a header is expected but ``line`` is all numbers, else ""."""
    cells = line.split(char)
    if not has_header or not cells or not all(_is_number(cell.strip()) for cell in cells):
        return ""
    # Cut, it says so: a line cut at 40 characters without a mark read as the whole line.
    shown = repr(line) if len(line) <= 40 else f"{line[:40]!r}…"
    return f" --no-header (its first line, {shown}, is data, not names)"


def _leading_prose(text: bytes, delimiter: str, skip: int) -> list[str]:
    """The lines before the first row (after ``skip``) that are comments or prose.

    Those starting with ``#``, or holding another number of cells than the rows
    below mostly do: a title, a source note above the header. Never a line of
    more cells than those rows that the next line matches: that is a header and
    its first row (or two rows) above ragged rows, which are the object's fault,
    not a title's (``id,name,note`` / ``1,a,hello`` / ``2,b`` was called two title
    lines, and ``--skip-rows 2`` then published the rest without its header and a
    column). Titles of a comma each above a wider header stay titles.
    """
    rows = _first_rows(text, delimiter, skip, 60)
    lines = text[: 1 << 20].decode("utf-8", errors="replace").splitlines()[skip : skip + 60]
    counts = [len(row) for row in rows]
    if len(counts) < 2 or len(counts) != len(lines):
        return []
    body = max(set(counts[1:]), key=counts[1:].count)
    lead = 0
    while lead < len(lines) and (lines[lead].lstrip().startswith("#") or counts[lead] != body):
        lead += 1
    for at in range(lead):
        comment = lines[at].lstrip().startswith("#")
        if (
            not comment
            and counts[at] > max(body, 1)
            and at + 1 < lead
            and counts[at + 1] == counts[at]
        ):
            return []
    return lines[:lead] if body > 1 and lead <= len(lines) // 2 else []


def _not_utf8(buf: pa.Buffer, names: list[str], source: str) -> MalformedShard:
    """The error for a file whose text is not UTF-8 (pyarrow reads such columns as binary)."""
    data = buf.to_pybytes()  # a copy, made only for a file that is refused
    try:
        data.decode("utf-8")
        where = ""
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        end = data.find(b"\n", exc.start)
        shown = data[start : end if end >= 0 else len(data)][:80]
        where = f" (line {line}: {shown!r}, byte 0x{data[exc.start]:02x})"
    typed = shlex.quote(",".join(f"{quote_name(name)}=binary" for name in names[:4]))
    return MalformedShard(
        f"{source} is not UTF-8 text{where}, so column{'s' if len(names) > 1 else ''} "
        f"{', '.join(names[:4])} would be read as bytes, not strings. Convert the file to UTF-8 "
        "(Latin-1 or Windows-1252 text: iconv -f latin1 -t utf-8) and publish again, or keep "
        f"the raw bytes with --column-types {typed}"
    )


# An integer literal from 9,000,000,000,000,000 up (16 digits starting with 9, or 17 or
# more), not part of a decimal or an exponent: a float64 holds every integer exactly only
# up to 2**53 (9,007,199,254,740,992), so in a column read as float64 (beside fractions,
# or past int64, where pyarrow reads the whole column as float64) a larger one can lose
# digits. Only lines it finds are parsed to look closer.
LONG_INTEGER = re.compile(rb"(?<![\w.+-])-?(?:9[0-9]{15}|[0-9]{17,})(?![\w.])")
_INT64 = 2**63
_EXACT = 2**53  # float64's 53-bit significand: every integer up to it is exact
# A decimal that holds any int64 (19 digits) and fractions of up to 9 places.
DECIMAL_HINT = "decimal128(38, 9)"


def rounds_in_float(value: int) -> bool:
    """Whether an integer in a column read as float64 does not come back as itself.

    Past int64 always (pyarrow reads its whole column as float64: the integers are
    no more); inside it, past 2**53 when the float's step there misses it.
    """
    if not -_INT64 <= value < _INT64:
        return True
    return not -_EXACT <= value <= _EXACT and float(value) != value


def integer_type_hint(value: int, fractions: bool = False) -> str:
    """The type, as ``--column-types`` takes it, that holds ``value`` exactly.

    Past int64, in a column of integers alone: the narrowest integer-like type.
    Inside int64, ``value`` only rounds because the column holds fractions too (it
    reads as float64); with ``fractions`` (the column holds some), past int64 too:
    an integer type would refuse them, and a decimal holds both.
    """
    digits = len(str(abs(value)))
    if fractions or -_INT64 <= value < _INT64:
        if digits <= 38 - 9:
            return DECIMAL_HINT
        # Fewer places beside a longer integer: the readers convert to no decimal256.
        return f"decimal128(38, {38 - digits})" if digits < 38 else "string"
    if 0 <= value < 2**64:
        return "uint64"
    return "decimal128(38, 0)" if digits <= 38 else "string"


def has_fractions(values: pa.Array | pa.ChunkedArray) -> bool:
    """Whether a float column holds a finite value that is not a whole number."""
    if not len(values):
        return False
    finite = pc.is_finite(values)
    broken = pc.not_equal(values, pc.floor(values))
    return bool(pc.any(pc.and_(finite, broken)).as_py())


def rounded_integer_error(
    where: str,
    what: str,
    name: str,
    value: int,
    kind: str,
    rounded: str = "float64",
    *,
    fractions: bool = False,
) -> MalformedShard:
    """The error for an integer that pyarrow would read as a float, losing digits.

    Past int64, or (``rounds_in_float``) past 2**53 in a column of fractions.
    ``kind`` is the column's type that keeps it (:func:`integer_type_hint`),
    ``rounded`` the one that accepts the rounding; ``fractions``: the column holds
    some, which the type's decimal places are for (past uint64 a column of
    integers alone gets ``decimal128(38, 0)`` too, and then no word of fractions).
    """
    keep, accept = shlex.quote(f"{name}={kind}"), shlex.quote(f"{name}={rounded}")
    decimal = re.search(r"decimal128\(38, ([0-9]+)\)", kind)
    places = decimal.group(1) if decimal else None
    try:
        became = repr(float(value))
    except OverflowError:
        became = "inf"
    if -_INT64 <= value < _INT64:
        why = (
            "in a column read as float64 (it holds fractions, or integers past int64), which "
            f"holds integers exactly only up to 2**53 ({_EXACT}): it would become {became}"
        )
    else:
        side = "past int64" if value > 0 else "below int64's least"
        why = f"{side}, so it would be read as float64 and lose digits ({became})"
        if places is not None and fractions:
            why += ", beside fractions that an integer type would refuse"
        elif places is not None:
            why += "; past uint64 too, so" if value > 0 else ";"
            why += " no integer type holds it"
    scale = ""
    if places is not None and (fractions or -_INT64 <= value < _INT64):
        scale = (
            " (9 decimal places: raise the scale if the fractions need more)"
            if places == "9"
            else f" ({places} decimal places, all that 38 digits leave beside this integer)"
        )
    return MalformedShard(
        f"{where}: {what} holds the integer {value}, {why}; publish with --column-types "
        f"{keep}{scale} (or {accept} to accept the rounding)"
    )


def _refuse_rounded_integers(
    table: pa.Table,
    buf: pa.Buffer,
    delimiter: str,
    first_data_line: int,
    source: str,
    typed: Mapping[str, pa.DataType],
) -> None:
    """Refuse a CSV integer that a column read as float64 would round.

    Past int64 (pyarrow then reads the column as float64), or past 2**53 beside
    fractions. Only a float column inferred (not typed) whose values reach 2**53
    is a candidate (a vectorised min/max); only then are the lines with a long
    integer literal found (one regex pass) and split, to name the row.
    """
    suspects: dict[int, str] = {}
    for i, field in enumerate(table.schema):
        if not pa.types.is_floating(field.type) or field.name in typed:
            continue
        low, high = pc.min_max(table.column(i)).values()
        if (low.as_py() or 0) <= -_EXACT or (high.as_py() or 0) >= _EXACT:
            suspects[i] = field.name
    if not suspects:
        return
    data = buf.to_pybytes()  # a copy, made only for a column that reaches 2**53
    line, counted = 1, 0
    for match in LONG_INTEGER.finditer(data):
        line += data.count(b"\n", counted, match.start())
        counted = match.start()
        if line < first_data_line:
            continue
        start = data.rfind(b"\n", 0, match.start()) + 1
        end = data.find(b"\n", match.start())
        for row in _first_rows(data[start : end if end >= 0 else len(data)], delimiter, 0, 1):
            for i, name in suspects.items():
                cell = row[i].strip() if i < len(row) else ""
                if re.fullmatch(r"-?[0-9]{16,}", cell) and rounds_in_float(int(cell)):
                    value = int(cell)
                    fractions = has_fractions(table.column(i))
                    kind = integer_type_hint(value, fractions)
                    where = f"{source} line {line}"
                    raise rounded_integer_error(
                        where, f"column {name!r}", name, value, kind, fractions=fractions
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
    strict: bool = True,
) -> pa.Table:
    """Parse a whole CSV object with ``options`` (canonical, see :func:`canonical_options`).

    ``strict`` (publish) adds the checks of what parses but not as meant: an aligned
    table, names given over a header, an empty header name, text that is not UTF-8,
    integers past int64 read as floats. A node staging a version reads without them
    (see :func:`~edgecache.cache.preprocess.formats.open_source`).

    Raises:
        MalformedShard: the first row is not plainly a header (with ``header`` auto), or the
            file is plainly separated by something other than the delimiter used.
        pyarrow.ArrowInvalid: a row does not parse; the caller names the row.
    """
    delimiter = options.get("delimiter", ",")
    skip = int(options.get("skip_rows", "0"))
    names = param_names(options.get("column_names", ""))
    header = options.get("header", "auto")
    if delimiter == "whitespace":
        buf = pa.py_buffer(_single_spaced(memoryview(buf).tobytes()))
    head = memoryview(buf)[: 1 << 20].tobytes()  # enough lines to judge the first rows
    split = delimiter if delimiter != "whitespace" else " "
    if header == "auto" and not names:
        _check_header(head, split, skip, source)
    elif header == "auto" and strict:
        _check_named_header(head, split, skip, names, source)
    elif header == "true" and not names and strict:
        _check_header_names(head, split, skip, source)
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
    # An empty unquoted field is null and "" is an empty string, as pyarrow writes them;
    # other texts only as the version records (a version without the option: pyarrow's).
    recorded = options.get("null_values")
    nulls = {} if recorded is None else {"null_values": ["", *param_names(recorded)]}
    convert = pa_csv.ConvertOptions(
        strings_can_be_null=True, quoted_strings_can_be_null=False, column_types=types, **nulls
    )
    parse = pa_csv.ParseOptions(delimiter=split)
    try:
        table = pa_csv.read_csv(
            pa.BufferReader(buf),
            read_options=pa_csv.ReadOptions(**read),
            parse_options=parse,
            convert_options=convert,
        )
    except pa.ArrowInvalid as exc:
        first_row = skip + (1 if has_header else 0)
        widths = {len(row) for row in _first_rows(head, split, first_row, 20) if row}
        if names and "columns, got" in str(exc) and len(names) not in widths and widths:
            given = (
                f"{source}: --column-names gives {len(names)} name"
                f"{'s' if len(names) != 1 else ''} ({', '.join(names)[:80]}), but its rows "
                f"hold {' or '.join(str(w) for w in sorted(widths))} values"
            )
            other = _separated_by(head, skip + (1 if has_header else 0), len(names), split)
            if widths == {1} and other is not None:
                # The names are right and the separator wrong: "name every column" sent
                # users to name columns they had named (a helper's walk, on the files
                # the docs name: linnerud, diabetes, data_x_x2_x3).
                raise MalformedShard(
                    f"{given} split on {_shown(split)}, and every line holds {len(names)} "
                    f"values split on {other[0]}: publish with --delimiter {other[1]} ({exc})"
                ) from exc
            raise MalformedShard(f"{given}: name every column ({exc})") from exc
        if "columns, got" in str(exc) and (prose := _leading_prose(head, split, skip)):
            count = len(prose)
            raise MalformedShard(
                f"{source}: {exc}; its first {f'{count} lines' if count > 1 else 'line'} "
                f"({prose[0][:60]!r}) {'do' if count > 1 else 'does'} not fit the rows below "
                f"(a comment, title or count line): publish with --skip-rows {skip + count}"
            ) from exc
        raise
    if types and (missing := sorted(set(types) - set(table.column_names))):
        raise MalformedShard(
            f"{source}: column_types names {', '.join(missing)}, but the columns are "
            f"{', '.join(table.column_names)}; {COLUMN_FIX}"
        )
    if strict and has_header and not names and table.num_columns > 1:
        _check_comment_lines(head, split, skip, source)
    if "delimiter" not in options:
        _check_one_column(table, head, skip, source, has_header and not names, strict)
    elif strict and table.num_columns == 1 and delimiter != "whitespace":
        _check_given_delimiter(table, head, skip, source, delimiter)
    if not strict:
        return table
    if binary := [
        f.name for f in table.schema if pa.types.is_binary(f.type) and f.name not in types
    ]:
        raise _not_utf8(buf, binary, source)
    first_data_line = skip + 1 + (1 if has_header else 0)
    _refuse_rounded_integers(table, buf, split, first_data_line, source, types)
    return table
