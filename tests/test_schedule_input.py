"""Schedule and topology input that used to be taken silently, or misread.

Duplicate YAML keys (the last one won), a duration without a unit (read as
seconds), ``warm SCHEDULE --region`` (the region was ignored), a mistyped
schedule path (asked for --region, as if it were NAME@N), and ``warm --json``
listing a failed pin under ``pins``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgecache.cache.errors import ConfigFileError
from edgecache.clients.cli import app
from edgecache.clients.topology import load_schedule, load_topology

runner = CliRunner()

JOB = "  - name: {name}\n    region: eu\n    start: 2026-12-01T08:00:00Z\n    datasets: [x@1]\n"


def _topology(root: Path) -> Path:
    # Nodes on ports nothing listens on: the commands below must refuse before dialling.
    config = root / "edgecache.yaml"
    config.write_text(
        f"registry: file://{root}/registry\n"
        "regions:\n  eu:\n    nodes: ['127.0.0.1:9']\n  us:\n    nodes: ['127.0.0.1:10']\n"
    )
    return config


def test_jobs_written_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("jobs:\n" + JOB.format(name="a") + "jobs:\n" + JOB.format(name="b"))
    with pytest.raises(ConfigFileError) as caught:
        load_schedule(schedule)
    message = str(caught.value)
    assert message.startswith(f"{schedule}:6: "), message
    assert "'jobs'" in message and "twice" in message and "line 1" in message, message


def test_a_key_written_twice_in_a_job_is_refused(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("jobs:\n" + JOB.format(name="a") + "    start: 2026-12-02T08:00:00Z\n")
    with pytest.raises(ConfigFileError) as caught:
        load_schedule(schedule)
    message = str(caught.value)
    assert message.startswith(f"{schedule}:6: "), message
    assert "'start'" in message and "twice" in message and "line 4" in message, message


def test_a_region_written_twice_in_the_topology_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "edgecache.yaml"
    config.write_text(
        "registry: file:///tmp/registry\n"
        "regions:\n"
        "  eu:\n    nodes: ['127.0.0.1:9']\n"
        "  us:\n    nodes: ['127.0.0.1:9']\n"
        "  eu:\n    nodes: ['127.0.0.1:10']\n"
    )
    with pytest.raises(ConfigFileError) as caught:
        load_topology(config)
    message = str(caught.value)
    assert message.startswith(f"{config}:7: "), message
    assert "'eu'" in message and "twice" in message and "line 3" in message, message


@pytest.mark.parametrize("price", ["yes", "true", ".inf", "1e400", ".nan"])
def test_a_yes_for_the_egress_price_is_refused_at_its_line(tmp_path: Path, price: str) -> None:
    """egress_price_per_gb: yes was read as 1.0, a dollar per GB, and plan priced jobs by it;
    .inf priced them $inf, and plan --json wrote Infinity, which is not JSON (reviews)."""
    config = tmp_path / "edgecache.yaml"
    config.write_text(
        "registry: file:///tmp/registry\n"
        f"regions:\n  eu:\n    nodes: ['127.0.0.1:9']\n    egress_price_per_gb: {price}\n"
    )
    with pytest.raises(ConfigFileError) as caught:
        load_topology(config)
    message = str(caught.value)
    assert message.startswith(f"{config}:5: "), message
    assert "is not a price" in message, message
    config.write_text(config.read_text().replace(price, "0.09"))
    assert load_topology(config).regions["eu"].egress_price_per_gb == 0.09


def test_a_merge_may_still_override_the_keys_it_brings(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "jobs:\n"
        "  - &a {name: a, region: eu, start: 2026-12-01T08:00:00Z, datasets: [x@1]}\n"
        "  - <<: *a\n    name: b\n"
    )
    assert [job.name for job in load_schedule(schedule).jobs] == ["a", "b"]


@pytest.mark.parametrize("duration", ["6", "6.5"])
def test_a_duration_without_a_unit_is_refused(tmp_path: Path, duration: str) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("jobs:\n" + JOB.format(name="a") + f"    duration: {duration}\n")
    with pytest.raises(ConfigFileError) as caught:
        load_schedule(schedule)
    message = str(caught.value)
    assert message.startswith(f"{schedule}:6: jobs.0.duration: "), message
    assert "no unit" in message and "6h" in message, message


def test_epochs_is_refused_at_its_line_pointing_at_duration(tmp_path: Path) -> None:
    """epochs: 3 was read and ignored: pins and evictions ended at start + duration."""
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("jobs:\n" + JOB.format(name="a") + "    epochs: 3\n")
    with pytest.raises(ConfigFileError, match="duration: 72h") as caught:
        load_schedule(schedule)
    assert str(caught.value).startswith(f"{schedule}:6: jobs.0.epochs: epochs is not used")


def test_plan_explain_gives_the_planners_reason_for_each_source(capsys) -> None:  # noqa: ANN001
    """--explain said a peer was chosen for being "faster than its origin link"; the planner
    takes a peer that holds the version in time whatever its speed (no origin egress)."""
    from edgecache.cache.planner import Plan, RegionPlan, StageTask
    from edgecache.clients.cli.staging import _print_plan

    now = datetime(2030, 1, 1, tzinfo=UTC)
    hour = timedelta(hours=1)
    tasks = [
        StageTask("eu", ("a", 1), 1, "us", now, now + hour, now + 2 * hour, ("j",)),
        StageTask("eu", ("b", 1), 1, "origin", now, now + hour, now + 2 * hour, ("j",)),
        StageTask("eu", ("c", 1), 1, "origin", now, now + 3 * hour, now + 2 * hour, ("j",)),
    ]
    plan = Plan({"eu": RegionPlan(tasks=tasks)}, [], {}, {})
    _print_plan(plan, True, unseen=set(), reported=set())
    out = " ".join(capsys.readouterr().out.split())
    assert "eu: a@1 from us: a peer region holds it in time: no origin egress" in out, out
    assert "eu: b@1 from origin: origin: no peer region holds it in time" in out, out
    assert "eu: c@1 from origin: late from any source: the one that finishes first" in out, out
    assert "faster" not in out, out


def test_a_duration_with_a_unit_is_still_read(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("jobs:\n" + JOB.format(name="a") + "    duration: 6h\n")
    assert load_schedule(schedule).jobs[0].duration == timedelta(hours=6)


def test_warm_a_schedule_with_region_is_refused(tmp_path: Path) -> None:
    config = _topology(tmp_path)
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("jobs:\n" + JOB.format(name="a"))
    for args in ([], ["--dry-run"]):
        result = runner.invoke(
            app, ["warm", str(schedule), "--region", "eu", "--config", str(config), *args]
        )
        assert result.exit_code == 2, result.output
        assert "--region is for warm NAME@N" in result.output, result.output
        assert "a schedule names its own regions" in result.output, result.output


@pytest.mark.parametrize("target", ["nosuch.yaml", "nosuch.yml", "plans/nosuch", "nosuch.json"])
def test_warm_a_missing_schedule_file_says_so(tmp_path: Path, target: str) -> None:
    config = _topology(tmp_path)
    result = runner.invoke(app, ["warm", str(tmp_path / target), "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert "no such schedule file" in result.output, result.output
    assert "--region" not in result.output, result.output
    # A relative name too, with no separator: the suffix says it is a file.
    result = runner.invoke(app, ["warm", target, "--config", str(config)])
    assert result.exit_code == 2 and "no such schedule file" in result.output, result.output


def test_warm_name_at_n_still_asks_for_region(tmp_path: Path) -> None:
    config = _topology(tmp_path)
    result = runner.invoke(app, ["warm", "tokens@1", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert "needs --region" in result.output, result.output


def test_warm_json_leaves_failed_pins_out_of_pins(capsys: pytest.CaptureFixture[str]) -> None:
    """As the text report does: a pin under pin_failures is not claimed under pins."""
    from edgecache.cache.planner import Plan, RegionPlan
    from edgecache.clients.cli.staging import _report_json, _ScheduleWork, _Warmed
    from edgecache.clients.executor import WarmOutcome
    from edgecache.clients.topology import Schedule

    until = datetime(2030, 1, 1, tzinfo=UTC)
    pins = {("web", 1): until, ("web", 10): until}
    plan = Plan({"eu": RegionPlan(pins=dict(pins)), "us": RegionPlan(pins=dict(pins))}, [], {}, {})
    failure = "pinning web@10 on us-1: UNAVAILABLE: Connection refused"
    outcome = WarmOutcome(pin_failures=[failure], pins_failed={("us", ("web", 10))})
    work = _ScheduleWork(Schedule(jobs=[]), plan, {}, datetime.now(UTC), {})
    _report_json(_Warmed(rows=[], failed=[], work=work, outcome=outcome), dry_run=False)
    out = json.loads(capsys.readouterr().out)
    assert [(p["region"], p["version"]) for p in out["pins"]] == [
        ("eu", "web@1"),
        ("eu", "web@10"),
        ("us", "web@1"),
    ]
    assert out["pin_failures"] == [failure]
