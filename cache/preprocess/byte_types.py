"""Which Arrow types hold their values as bytes: text (UTF-8) or binary, of any layout."""

from __future__ import annotations

import pyarrow as pa

__all__ = ["is_binary", "is_text", "is_text_or_binary"]

_CHECKS = (
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_string_view,
    pa.types.is_binary,
    pa.types.is_large_binary,
    pa.types.is_binary_view,
)


def is_text_or_binary(kind: pa.DataType) -> bool:
    """Whether ``kind`` holds variable-length bytes: string or binary, large or view.

    Fixed-size binary and dictionaries of these are not: their values are laid out
    differently.
    """
    return any(check(kind) for check in _CHECKS)


def is_text(kind: pa.DataType) -> bool:
    """UTF-8 text in any layout: string, large_string or string_view (Polars writes views)."""
    return (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    )


def is_binary(kind: pa.DataType) -> bool:
    """Variable-length bytes in any layout: binary, large_binary or binary_view."""
    return (
        pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)
    )
