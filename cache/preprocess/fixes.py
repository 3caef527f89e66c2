"""What an error about a raw object tells its reader to do, said the same way everywhere.

The advice depends on whose mistake it most likely is: the object's (corrupt,
empty, rows that do not fit: :data:`FIX`), or the publisher's, a parameter
or reader option that does not fit the data (:class:`MissingColumn`,
:class:`ParamMismatch`, :func:`options_fix`), which publish meets on the
first object and which a new version with the right value fixes.
"""

from __future__ import annotations

from collections.abc import Mapping

from edgecache.cache.errors import MalformedShard

__all__ = ["COLUMN_FIX", "FIX", "PARAM_FIX", "MissingColumn", "ParamMismatch", "options_fix"]

# The object is wrong (corrupt, empty, rows that do not fit): a version is immutable.
FIX = "fix or remove the object and publish a new version"
# A column a parameter names is not in the data: most often the parameter is wrong.
COLUMN_FIX = (
    "if the parameter that names it is wrong, fix it and publish again; if this object lacks "
    "the column, fix or remove the object and publish a new version"
)
# A parameter's value does not fit the data (a column of another type, a name taken).
PARAM_FIX = (
    "fix the --param and publish again; if only this object differs from the others, fix or "
    "remove it and publish a new version"
)


class MissingColumn(MalformedShard):
    """A column a parameter names is missing from the data, or there twice.

    Said with :data:`COLUMN_FIX` rather than "fix the object": a typo in the
    parameter is the likelier cause, and publish finds it on the first object.
    """


class ParamMismatch(MalformedShard):
    """A transform's parameter does not fit the data: said with :data:`PARAM_FIX`."""


def options_fix(options: Mapping[str, str]) -> str:
    """The advice for an object that does not parse with the reader options given.

    Without options the object is at fault (:data:`FIX`); with them, options
    that do not match the file (a column count, rows to skip) are as likely.
    """
    if not options:
        return FIX
    given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    return (
        f"if the reader options ({given}) do not match the file, fix them and publish again; "
        f"else {FIX}"
    )
