"""What an error about a raw object tells its reader to do, said the same way everywhere."""

from __future__ import annotations

__all__ = ["COLUMN_FIX", "FIX"]

# The object is wrong (corrupt, empty, rows that do not fit): a version is immutable.
FIX = "fix or remove the object and publish a new version"
# A column a parameter names is not in the data: most often the parameter is wrong.
COLUMN_FIX = (
    "if the parameter that names it is wrong, fix it and publish again; if this object lacks "
    "the column, fix or remove the object and publish a new version"
)
