"""An operator's walk through schedule files, ``plan`` and ``warm``: what they see is right.

Schedule files as people write them (zones or none, typos, tabs, duplicates),
plans whose times, reasons and lists a person can act on, and properties of
the planner that hold for any schedule. Commands run as real processes
against a real ``edgecache serve`` node on loopback, in an 80-column pipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from edgecache.cache.errors import ConfigFileError
from edgecache.clients.topology import load_schedule

NARROW = {**os.environ, "COLUMNS": "80"}
NOW = datetime(2026, 12, 1, tzinfo=UTC)
GB = 10**9
PLUS2 = timezone(timedelta(hours=2))


def edgecache(*args: str) -> tuple[int, str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args],
        capture_output=True,
        text=True,
        env=NARROW,
        timeout=120,
    )
    return out.returncode, out.stdout, out.stderr


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def one_job(start: str, **extra: str) -> str:
    fields = "".join(f"    {k}: {v}\n" for k, v in extra.items())
    return f"jobs:\n  - name: a\n    region: eu\n    start: {start}\n    datasets: [pq@1]\n{fields}"


def refusal(path: Path) -> str:
    with pytest.raises(ConfigFileError) as caught:
        load_schedule(path)
    return str(caught.value)


# ------------------------------------------------------------------ schedule files


@pytest.mark.parametrize("start", ["2026-12-01T09:00", "2026-12-01T09:00:00", "2026-12-01"])
def test_a_start_without_a_zone_says_how_to_add_one(tmp_path: Path, start: str) -> None:
    """The bare pydantic message ('Input should have timezone info') said nothing to do."""
    message = refusal(write(tmp_path / "s.yaml", one_job(start)))
    assert message.startswith(f"{tmp_path / 's.yaml'}:4: jobs.0.start:"), message
    assert "timezone" in message and "Z" in message and "+02:00" in message, message


def test_a_start_with_an_offset_is_the_same_instant_in_utc(tmp_path: Path) -> None:
    """Every time a plan shows is UTC, so a +02:00 start is read as UTC too."""
    schedule = load_schedule(write(tmp_path / "s.yaml", one_job("2026-12-01T09:00:00+02:00")))
    (job,) = schedule.jobs
    assert job.start == datetime(2026, 12, 1, 7, tzinfo=UTC)
    assert job.start.utcoffset() == timedelta(0)


def test_a_duplicate_job_name_is_reported_at_its_own_line(tmp_path: Path) -> None:
    text = one_job("2026-12-01T09:00Z") + (
        "  - name: b\n    region: eu\n    start: 2026-12-01T09:00Z\n    datasets: [pq@1]\n"
        "  - name: a\n    region: us\n    start: 2026-12-01T09:00Z\n    datasets: [pq@1]\n"
    )
    message = refusal(write(tmp_path / "s.yaml", text))
    assert message.startswith(f"{tmp_path / 's.yaml'}:10: jobs.2.name:"), message
    assert "'a'" in message and "line 2" in message, message


def test_a_misspelt_key_is_named_with_the_key_it_meant(tmp_path: Path) -> None:
    text = "jobs:\n  - name: a\n    region: eu\n    strat: 2026-12-01T09:00Z\n    datasets: [x]\n"
    message = refusal(write(tmp_path / "s.yaml", text))
    assert f"{tmp_path / 's.yaml'}:4: jobs.0.strat:" in message, message
    assert "did you mean 'start'" in message, message


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("jobs:\n  - name: a\n\tregion: eu\n", 3, "tab"),
        ("jobs:\n  - name: a\n    region: eu\n   start: 2026-12-01T09:00Z\n", 4, "indent"),
    ],
)
def test_a_yaml_mistake_is_one_line_naming_file_line_and_column(
    tmp_path: Path, text: str, line: int, words: str
) -> None:
    """PyYAML's message ran over four lines and named '<unicode string>', not the file."""
    message = refusal(write(tmp_path / "s.yaml", text))
    assert "\n" not in message and "<unicode string>" not in message, message
    assert message.startswith(f"{tmp_path / 's.yaml'}:{line}:"), message
    assert words in message.lower(), message
