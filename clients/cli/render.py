"""How commands print: one console for results, one for errors, tables that read at any width.

Tables never cut an identifier (a version, a node address, a date): a table
whose identifiers do not fit the terminal is printed as a list instead, one
block per row, so an 80-column terminal or a pipe reads as well as a wide
screen. Sizes go through one formatter (binary units, precision that fits), and so do
the times every command's ``--json`` writes (:func:`json_time`).
Scripts use ``--json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from edgecache.cache.units import format_bytes

__all__ = [
    "Column",
    "console",
    "err_console",
    "error",
    "format_bytes",
    "json_ms",
    "json_time",
    "line",
    "progress",
    "table",
    "warning",
]

# Soft wrap: a line is never broken by the console (a terminal still wraps it on screen,
# a pipe or a log keeps it whole, so scripts can grep it). Tables lay themselves out.
console = Console(soft_wrap=True, emoji=False)  # ":abc:" in a name or URL stays text
err_console = Console(stderr=True, soft_wrap=True, emoji=False)


def json_time(when: datetime) -> str:
    """A time as every command's ``--json`` writes it: ISO 8601 in UTC, ``+00:00``.

    ``YYYY-MM-DDTHH:MM:SS+00:00``, with ``.ffffff`` (always six digits) before
    the offset when the second has a fraction: what ``datetime.isoformat`` writes
    for a UTC time, so one instant is one string in every command (``status``'s
    ``pinned_until`` equals ``plan``'s ``pins[].until`` as text). This form, not
    RFC 3339's ``Z``, because most places already wrote it (``plan``, ``plan
    --status`` and ``warm``: every time of a plan; only ``status`` and ``versions``
    wrote protobuf's ``Z`` with 0, 3, 6 or 9 digits), the controller's record in the
    registry stores it, every ``datetime.fromisoformat`` reads it, and strings of one
    form sort in time order (``…:00+00:00`` < ``…:00.5…``; a ``Z`` sorts after
    ``.``). A naive time is taken as UTC (protobuf's ``ToDatetime()`` gives one).
    Nanoseconds are cut to microseconds (a ``datetime`` holds no finer).
    """
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).isoformat()


def json_ms(value: float | None) -> float | None:
    """Milliseconds as every command's ``--json`` writes them: two decimals (10 µs).

    As the tables show an RTT or a jitter (``0.44 ms``), and finer than a
    loopback health check can tell apart; ``status`` and ``doctor`` agree.
    """
    return None if value is None else round(value, 2)


def _indented(message: str) -> str:
    """``message`` with each line after the first that is flush left indented two spaces.

    A message of several lines is one error or warning: after its ``error:``
    line, a line flush left read as unrelated output in a log. Lines indented
    already (a list under a heading) keep their indent.
    """
    first, *rest = message.split("\n")
    return "\n".join([first, *(f"  {text}" if text[:1].strip() else text for text in rest)])


def error(message: str) -> None:
    """``error: message`` on stderr, never wrapped (scripts grep it) nor marked up.

    Its lines after the first are indented under it (:func:`_indented`).
    """
    err_console.print(
        f"[red]error:[/red] {escape(_indented(message))}", soft_wrap=True, highlight=False
    )


def warning(message: str) -> None:
    """``warning: message`` on stderr; its lines after the first indented under it."""
    err_console.print(
        f"[yellow]warning:[/yellow] {escape(_indented(message))}", soft_wrap=True, highlight=False
    )


def line(text: str, *, to_stderr: bool = False) -> None:
    """One line of output, never broken by the terminal's width (it may wrap on screen)."""
    (err_console if to_stderr else console).print(text, soft_wrap=True, highlight=False)


@dataclass(frozen=True)
class Column:
    """A table column; its cells are never broken, unless it is free text (``wrap``).

    Names, addresses, dates and figures stay whole; a reason or a verdict may wrap.
    """

    name: str
    ident: bool = False  # an identifier: says what the row is (kept for readers)
    right: bool = False
    wrap: bool = False


def _min_width(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> int:
    """The narrowest the table can be with every unbreakable cell whole.

    (rich's own measurement lets a no-wrap cell shrink to its longest word.)
    """
    total = len(columns) + 1  # the vertical borders
    for index, column in enumerate(columns):
        cells = [Text.from_markup(row[index]) for row in rows if index < len(row)]
        if column.wrap:
            words = [w for cell in cells for w in cell.plain.split()] + column.name.split()
            widest = max((cell_len(w) for w in words), default=1)
        else:
            lines = [line for cell in cells for line in cell.plain.splitlines()] + [column.name]
            widest = max(cell_len(line) for line in lines)
        total += widest + 2  # one space of padding on each side
    return total


def table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """A table if it fits the terminal with its identifiers whole, else a list.

    Cells may hold rich markup (colours); a cell with several lines (one per
    version, say) stays a list of lines in either layout.
    """
    grid = Table(title=title)
    for column in columns:
        grid.add_column(
            column.name,
            no_wrap=not column.wrap,
            justify="right" if column.right else "left",
            overflow="fold",
        )
    for row in rows:
        grid.add_row(*row)
    if _min_width(columns, rows) <= console.width:
        console.print(grid)
        return
    console.print(f"[bold]{title}[/bold]" if title else "")
    for row in rows:
        head, *rest = row
        console.print(head, soft_wrap=True)
        for column, cell in zip(columns[1:], rest, strict=False):
            if not cell:
                continue
            cell_lines = cell.splitlines()
            if len(cell_lines) == 1:
                console.print(f"  {column.name}: {cell}", soft_wrap=True)
            else:
                console.print(f"  {column.name}:", soft_wrap=True)
                for each in cell_lines:
                    console.print(f"    {each}", soft_wrap=True)


def progress(*, disable: bool = False, label_width: int = 32, speed: bool = True) -> Progress:
    """Transfer progress bars that fit the terminal: labels whole, fewer columns when narrow.

    Only on a terminal: in a pipe or a log the bars would print after the lines
    written meanwhile, out of order, so they are left out there.
    """
    width = console.width
    columns: list[ProgressColumn] = [
        TextColumn(f"{{task.description:<{min(label_width, max(width - 52, 12))}}}"),
        BarColumn(bar_width=max(min(width - 90, 40), 10)),
        DownloadColumn(binary_units=True),
    ]
    if speed:
        columns.append(TransferSpeedColumn())
    if width >= 100:
        columns.append(TimeElapsedColumn() if not speed else TimeRemainingColumn())
    return Progress(*columns, console=console, disable=disable or not console.is_terminal)
