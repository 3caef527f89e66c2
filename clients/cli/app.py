"""The typer application every command module registers with."""

from __future__ import annotations

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    name="edgecache",
    help="Stage training data into regional caches next to the GPUs.\n\n"
    "Exit codes: 0 ok; 1 failed (a node, a transfer, the origin: retrying may help); "
    "2 bad input (options, files, names: it will not); 3 a scheduled job cannot be met; "
    "130 interrupted by Ctrl-C (run it again to resume). Every command's --help says which "
    "it uses; docs/operations.md has a section per command.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Stage training data into regional caches next to the GPUs.

    Exit codes: 0 ok; 1 failed (a node, a transfer, the origin); 2 bad input
    (options, files, names); 3 a scheduled job cannot be met; 130 interrupted.
    """


def main() -> None:
    """Console-script entry point."""
    app()
