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
from edgecache.cache.planner import Job, RegionState, plan
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


# ------------------------------------------------------------------ the planner's reasons


def region(name: str = "eu", capacity: int = 10 * GB, bandwidth: float = 1e9, **kw) -> RegionState:  # noqa: ANN003
    return RegionState(name=name, capacity_bytes=capacity, origin_bandwidth=bandwidth, **kw)


def test_a_link_too_slow_says_when_the_job_could_start_or_how_fast_the_link_must_be() -> None:
    """It said 'needs 10,000 s at 0.01 Gbit/s … only 3,600 s': why, but not what to change."""
    job = Job("train", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=9), (("ds", 1),))
    result = plan([job], {"eu": region(bandwidth=1e6)}, {("ds", 1): 10 * GB}, now=NOW)
    (why,) = [i.reason for i in result.infeasible]
    assert "8 Mbit/s" in why, why  # a readable rate, not "0.01 Gbit/s"
    assert "start train at 2026-12-01 02:47 or later" in why, why  # 10,000 s after NOW
    assert "22.2 Mbit/s" in why and "origin_bandwidth" in why, why  # 10 GB in 3,600 s


def test_not_enough_capacity_says_how_much_more_and_when_room_frees_up() -> None:
    first = Job("first", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 1),))
    second = Job("second", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 2),))
    sizes = {("ds", 1): 6 * GB, ("ds", 2): 6 * GB}
    result = plan([first, second], {"eu": region()}, sizes, now=NOW)
    (why,) = [i.reason for i in result.infeasible if i.job == "second"]
    assert "not enough capacity" in why and "in use then: ds@1" in why, why
    assert "add at least 2.0 GB" in why or "add at least 1.9 GiB" in why, why
    assert "start second after 2026-12-01 05:00" in why, why  # when first stops reading ds@1


def test_an_eviction_reason_gives_the_next_use_in_utc_whatever_the_job_zone() -> None:
    """It printed a +02:00 time with a 'Z' after it: two hours off."""
    start = datetime(2026, 12, 1, 12, tzinfo=PLUS2)  # 10:00 UTC
    later = Job("later", "eu", start, start + timedelta(hours=1), (("ds", 1),))
    sooner = Job("sooner", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=2), (("ds", 2),))
    state = region(capacity=GB, resident={("ds", 1): GB})
    result = plan([later, sooner], {"eu": state}, {("ds", 1): GB, ("ds", 2): GB}, now=NOW)
    reasons = [e.reason for e in result.regions["eu"].evictions if e.version == ("ds", 1)]
    assert reasons == ["next needed at 2026-12-01T10:00Z, furthest ahead"], reasons
