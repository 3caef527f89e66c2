"""The ``edgecache`` command line: operate caches and run the demo.

Each module holds one group of commands and reads as: parse the options,
call :mod:`edgecache.clients.ops` (or the registry), render the result.
:mod:`.context` holds what every command shares (the topology and token
options, exit codes, and the one place errors become messages);
:mod:`.render` holds tables and formatting.
"""

from __future__ import annotations

from edgecache.clients.cli.app import app, main

# Importing a command module registers its commands; --help lists them in this order.
# isort: off
from edgecache.clients.cli import demo, publishing, staging, controlling, nodes  # noqa: F401
# isort: on

__all__ = ["app", "main"]
