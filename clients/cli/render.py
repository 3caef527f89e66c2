"""How commands print: one console for results, one for errors, sizes in one format."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from edgecache.cache.units import format_bytes

__all__ = ["console", "err_console", "error", "format_bytes", "warning"]

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """``error: message`` on stderr, never wrapped (scripts grep it) nor marked up."""
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)


def warning(message: str) -> None:
    """``warning: message`` on stderr."""
    err_console.print(
        f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True, highlight=False
    )
