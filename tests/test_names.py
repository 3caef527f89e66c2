import pytest

from edgecache.cache.errors import InvalidName
from edgecache.cache.names import MAX_NAME_LENGTH, VersionSpec, parse_spec, validate_name


@pytest.mark.parametrize("name", ["tokens-en", "a", "img.v2_hq", "0abc", "x" * MAX_NAME_LENGTH])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "../x",
        "..",
        ".",
        "a/b",
        "a..b",
        "-flag",
        "Tokens",
        "x" * 500,
        "tab\there",
        "nul\x00",
        "bell\x07",
        "ünï",
        "a b",
        "a@b",
    ],
)
def test_invalid_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidName) as info:
        validate_name(name)
    assert "dataset name" in str(info.value)


def test_invalid_name_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        validate_name("../etc")


def test_non_string_name() -> None:
    with pytest.raises(InvalidName, match="must be a string"):
        validate_name(7)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tokens-en", VersionSpec("tokens-en", None)),
        ("tokens-en@latest", VersionSpec("tokens-en", None)),
        ("tokens-en@3", VersionSpec("tokens-en", 3)),
    ],
)
def test_parse_spec(spec: str, expected: VersionSpec) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["tokens@0", "tokens@-1", "tokens@x", "tokens@", "tokens@٣", "@3"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidName):
        parse_spec(spec)


def test_spec_str_round_trips() -> None:
    assert str(parse_spec("a@4")) == "a@4"
    assert str(parse_spec("a")) == "a@latest"
