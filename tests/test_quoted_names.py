"""Column names holding a comma, an ``=`` or a bracket in transform params and reader options.

``select=a,b`` splits on commas, so a column named ``Income, USD`` (a CSV header
people write) could not be selected, renamed or cast, and the advice publish gave
for such columns was left out. Params take double-quoted names
(``select="Income, USD",age``); the advice quotes what needs it, and can be pasted.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from edgeutil import publish_cli as publish
from hypothesis import given
from hypothesis import strategies as st

from edgecache.cache.preprocess.arrow_types import param_names, param_pairs, quote_name


@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6))
def test_quoted_names_come_back_whole(names: list[str]) -> None:
    written = ",".join(quote_name(n) for n in names)
    assert param_names(written) == names
    renames = ",".join(f"{quote_name(n)}={quote_name(n[::-1])}" for n in names)
    assert param_pairs(renames) == [(n, n[::-1], True) for n in names]


@given(st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,10}", fullmatch=True), min_size=1))
def test_plain_names_are_written_as_before(names: list[str]) -> None:
    """Versions published before quoting keep their params' meaning, and their digests."""
    assert [quote_name(n) for n in names] == names
    assert param_names(",".join(names)) == names


def test_types_keep_their_brackets_beside_quoted_names() -> None:
    pairs = param_pairs('"a,b"=fixed_size_list<int32, 4>,c=decimal128(9, 2)')
    assert pairs == [("a,b", "fixed_size_list<int32, 4>", True), ("c", "decimal128(9, 2)", True)]


def columns(code: int, out: str) -> list[tuple[str, str]]:
    """The (name, type) of each column of a ``publish --json`` that succeeded."""
    assert code == 0, out
    return [(c["name"], c["type"]) for c in json.loads(out)["schema"]]


@pytest.fixture
def csv_dir(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "x.csv").write_text('id,"Income, USD",a=b\n1,10.5,x\n2,,y\n3,7.25,z\n')
    return raw


def test_a_name_with_a_comma_is_selected_renamed_and_cast(tmp_path: Path, csv_dir: Path) -> None:
    params = [
        'select="a=b","Income, USD"',
        'rename="Income, USD"=income,"a=b"="tag, text"',
        "cast=income=float32",
    ]
    published = publish(
        tmp_path,
        csv_dir,
        *("--dataset", "q", "--transform", "columns", "--json"),
        *(arg for param in params for arg in ("--param", param)),
    )
    assert columns(*published) == [("tag, text", "string"), ("income", "float")]


def test_the_null_advice_quotes_such_names_and_its_command_works(
    tmp_path: Path, csv_dir: Path
) -> None:
    """The empty 'Income, USD' cell is a null in a tensor column: publish warns and names
    the select= that leaves it out. That select= had to name 'a=b' and 'id' as they are."""
    code, out = publish(tmp_path, csv_dir, "--dataset", "n")
    assert code == 0, out
    said = " ".join(out.split())
    assert """--param 'select=id,"a=b"'""" in said, out
    advice = said.split("--transform columns --param ", 1)[1].split(")")[0]
    pasted = publish(
        tmp_path,
        csv_dir,
        "--dataset",
        "n2",
        "--transform",
        "columns",
        "--param",
        *shlex.split(advice),
        "--json",
    )
    assert [name for name, _ in columns(*pasted)] == ["id", "a=b"]


def test_column_names_with_commas_name_a_headerless_csv(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "x.csv").write_text("1,2\n3,4\n")
    names, types = '"x, y",z', '"x, y"=int16'
    published = publish(
        tmp_path, raw, "--dataset", "h", "--column-names", names, "--column-types", types, "--json"
    )
    assert columns(*published) == [("x, y", "int16"), ("z", "int64")]
