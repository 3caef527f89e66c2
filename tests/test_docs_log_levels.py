"""The log levels the docs list are the ones ``--log-level`` takes (serve and controller)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import LogLevel

ROOT = Path(__file__).resolve().parent.parent


def _levels_in(text: str) -> set[str]:
    return set(re.findall(r"`(DEBUG|INFO|WARNING|ERROR|CRITICAL)`", text))


def test_edge_node_md_lists_every_log_level_and_says_any_case() -> None:
    """It listed DEBUG, INFO or WARNING after ERROR and any case were accepted."""
    doc = (ROOT / "docs" / "edge-node.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith("| `--log-level`")]
    assert _levels_in(row) == {level.value for level in LogLevel}, row
    assert "any case" in row, row


def test_operations_md_lists_the_controllers_log_levels() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("### `edgecache controller --schedule SCHEDULE`")[1].split("\n#")[0]
    assert _levels_in(section) >= {level.value for level in LogLevel}, section


FAILS_LATER = {  # each fails after its options were converted, on something else
    "serve": ["serve", "--listen", "nowhere"],
    "controller": ["controller", "--schedule", "/nonexistent/s.yaml", "--config", "/nonexistent"],
}


@pytest.mark.parametrize("command", sorted(FAILS_LATER))
@pytest.mark.parametrize("level", ["error", "Warning", "DEBUG", "info"])
def test_the_levels_the_docs_list_are_taken_in_any_case(command: str, level: str) -> None:
    result = CliRunner().invoke(app, [*FAILS_LATER[command], "--log-level", level])
    assert result.exit_code == 2 and "--log-level" not in result.output, result.output
    result = CliRunner().invoke(app, [*FAILS_LATER[command], "--log-level", "verbose"])
    assert result.exit_code == 2 and "--log-level" in result.output, result.output
