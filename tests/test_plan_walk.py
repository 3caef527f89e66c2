"""An operator's walk through schedule files, ``plan`` and ``warm``: what they see is right.

Schedule files as people write them (zones or none, typos, tabs, duplicates),
plans whose times, reasons and lists a person can act on, and properties of
the planner that hold for any schedule. Commands run as real processes
against a real ``edgecache serve`` node on loopback, in an 80-column pipe.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from edgeutil import edgecache, publish, write_parquet_shards
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.cache.errors import ConfigFileError
from edgecache.cache.planner import Job, RegionState, plan
from edgecache.clients.node_client import start_local_node
from edgecache.clients.topology import load_schedule

NOW = datetime(2026, 12, 1, tzinfo=UTC)
GB = 10**9
PLUS2 = timezone(timedelta(hours=2))


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


def test_one_dataset_may_be_written_without_a_list(tmp_path: Path) -> None:
    # 'datasets: pq@1' said "Input should be a valid list".
    text = "jobs:\n  - name: a\n    region: eu\n    start: 2026-12-01T09:00:00Z\n"
    job = load_schedule(write(tmp_path / "s.yaml", text + "    datasets: pq@1\n")).jobs[0]
    assert job.datasets == ["pq@1"]


@pytest.mark.parametrize("text", ["", "# jobs to come\n"])
def test_an_empty_schedule_says_what_to_write(tmp_path: Path, text: str) -> None:
    # It said "the schedule must be a mapping".
    message = refusal(write(tmp_path / "s.yaml", text))
    assert "is empty" in message and "jobs: []" in message, message


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
    # 10 GB in 3,600 s is 22.22 Mbit/s: rounded up, so that the speed advised is enough
    assert "22.3 Mbit/s" in why and "origin_bandwidth" in why, why


def test_not_enough_capacity_says_how_much_more_and_when_room_frees_up() -> None:
    first = Job("first", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 1),))
    second = Job("second", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 2),))
    sizes = {("ds", 1): 6 * GB, ("ds", 2): 6 * GB}
    result = plan([first, second], {"eu": region()}, sizes, now=NOW)
    (why,) = [i.reason for i in result.infeasible if i.job == "second"]
    assert "not enough capacity" in why and "in use then: ds@1" in why, why
    assert "add at least 2.0 GB" in why or "add at least 1.9 GiB" in why, why
    # When first stops reading ds@1 (05:00), and the 6 GB staged after, with its margin (it
    # said "after 05:00", and a start then had no time to stage it).
    assert "start second at 2026-12-01 05:06 or later" in why, why
    moved = Job("second", "eu", datetime(2026, 12, 1, 5, 6, tzinfo=UTC), NOW + timedelta(hours=9),
                (("ds", 2),))  # fmt: skip
    assert not plan([first, moved], {"eu": region()}, sizes, now=NOW).infeasible  # it is enough


def test_a_running_job_that_does_not_fit_is_not_told_to_start_later() -> None:
    """A job that started an hour ago was advised "start second after …" (now "at … or later")."""
    first = Job("first", "eu", NOW - timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 1),))
    second = Job("second", "eu", NOW - timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 2),))
    sizes = {("ds", 1): 6 * GB, ("ds", 2): 6 * GB}
    result = plan([first, second], {"eu": region()}, sizes, now=NOW)
    (why,) = [i.reason for i in result.infeasible if i.job == "second"]
    assert "not enough capacity" in why and "add at least" in why, why
    assert "start second at" not in why and "start second after" not in why, why


def test_an_eviction_reason_gives_the_next_use_in_utc_whatever_the_job_zone() -> None:
    """It printed a +02:00 time with a 'Z' after it: two hours off."""
    start = datetime(2026, 12, 1, 12, tzinfo=PLUS2)  # 10:00 UTC
    later = Job("later", "eu", start, start + timedelta(hours=1), (("ds", 1),))
    sooner = Job("sooner", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=2), (("ds", 2),))
    state = region(capacity=GB, resident={("ds", 1): GB})
    result = plan([later, sooner], {"eu": state}, {("ds", 1): GB, ("ds", 2): GB}, now=NOW)
    reasons = [e.reason for e in result.regions["eu"].evictions if e.version == ("ds", 1)]
    assert reasons == ["next needed at 2026-12-01T10:00Z, furthest ahead"], reasons


# ------------------------------------------------------------------ plan against a real node


def config(root: Path) -> Path:
    return root / "edgecache.yaml"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Region ``eu``: one real node with room for everything, and pq@1 in the registry."""
    root = tmp_path_factory.mktemp("walk")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "origin", 1, rows=500)
    publish(registry, f"file://{root}/origin", "pq")
    node = start_local_node("eu", root / "cache-eu", registry, capacity="1GiB")
    try:
        write(
            root / "edgecache.yaml",
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n",
        )
        yield root
    finally:
        node.stop()


def test_plan_prints_every_time_in_utc_whatever_zone_the_schedule_used(site: Path) -> None:
    """A +02:00 job's deadline printed as written (09:00) beside tasks' UTC times."""
    start = (datetime.now(UTC) + timedelta(days=2)).replace(
        hour=9, minute=0, second=0, microsecond=0
    )
    local = start.replace(tzinfo=PLUS2)
    path = write(site / "zone.yaml", one_job(local.isoformat()))
    code, out, err = edgecache("plan", str(path), "--config", str(site / "edgecache.yaml"))
    assert code == 0, (out, err)
    assert f"deadline: {start - timedelta(hours=2):%Y-%m-%d} 07:00" in out, out
    code, out, err = edgecache(
        "plan", str(path), "--json", "--config", str(site / "edgecache.yaml")
    )
    (task,) = json.loads(out)["regions"]["eu"]["tasks"]
    assert task["deadline"].endswith("07:00:00+00:00"), task


def test_a_thousand_jobs_plan_fast_and_each_task_names_a_few_of_its_jobs(site: Path) -> None:
    """Every job reading one version was listed on one line: 1,000 names for one task."""
    start = datetime.now(UTC) + timedelta(days=1)
    jobs = "".join(
        f"  - name: job-{i:04d}\n    region: eu\n"
        f"    start: {(start + timedelta(minutes=i)).isoformat()}\n"
        "    duration: 1h\n    datasets: [pq@1]\n"
        for i in range(1000)
    )
    path = write(site / "big.yaml", "jobs:\n" + jobs)
    began = time.monotonic()
    code, out, err = edgecache("plan", str(path), "--config", str(site / "edgecache.yaml"))
    assert code == 0, (out, err)
    assert time.monotonic() - began < 30
    assert max(len(text) for text in out.splitlines()) <= 100, out
    assert "job-0000, job-0001, job-0002 and 997 more" in out, out
    code, out, err = edgecache(
        "plan", str(path), "--json", "--config", str(site / "edgecache.yaml")
    )
    (task,) = json.loads(out)["regions"]["eu"]["tasks"]
    assert len(task["jobs"]) == 1000  # scripts get every name


def test_a_job_that_has_ended_is_said_to_have_ended_not_dropped_in_silence(site: Path) -> None:
    """A start a year off (2025 for 2026) gave 'nothing to do', exit 0, and no word of it."""
    path = write(site / "ended.yaml", one_job("2025-12-01T09:00:00Z"))
    code, out, err = edgecache("plan", str(path), "--config", str(site / "edgecache.yaml"))
    assert code == 0, (out, err)
    assert "a ended at 2025-12-02 09:00" in err and "nothing is planned" in err, err


def test_plan_help_says_what_json_carries_and_evictions_carry_their_next_use() -> None:
    """A script had to read the source to learn the keys; an eviction's next use was text only."""
    code, out, _ = edgecache("plan", "--help")
    words = " ".join(out.replace("│", " ").split())
    assert code == 0
    for key in ("tasks", "evictions", "pins", "infeasible", "transfers", "next_use", "until"):
        assert key in words, (key, words)
    from edgecache.clients.cli.staging import _plan_json

    later = Job("later", "eu", NOW + timedelta(hours=5), NOW + timedelta(hours=6), (("ds", 1),))
    sooner = Job("sooner", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=2), (("ds", 2),))
    state = region(capacity=GB, resident={("ds", 1): GB})
    result = plan([later, sooner], {"eu": state}, {("ds", 1): GB, ("ds", 2): GB}, now=NOW)
    evictions = _plan_json(result)["regions"]["eu"]["evictions"]  # type: ignore[index]
    assert evictions[0]["next_use"] == "2026-12-01T05:00:00+00:00", evictions


# ------------------------------------------------------------------ properties


@st.composite
def schedules(draw: st.DrawFn) -> tuple[list[Job], dict[str, RegionState], dict]:
    versions = [("ds", v) for v in range(1, draw(st.integers(1, 5)) + 1)]
    sizes = {v: draw(st.integers(1, 30)) * GB // 10 for v in versions}
    names = [f"r{i}" for i in range(draw(st.integers(1, 3)))]
    regions = {
        name: region(
            name,
            capacity=draw(st.integers(5, 60)) * GB // 10,
            bandwidth=draw(st.integers(1, 50)) * 1e7,
            peer_bandwidth={p: draw(st.integers(1, 50)) * 1e7 for p in names if p != name},
        )
        for name in names
    }
    jobs = []
    for i in range(draw(st.integers(1, 12))):
        start = NOW + timedelta(minutes=draw(st.integers(-60, 600)))
        jobs.append(
            Job(
                f"job{i}",
                draw(st.sampled_from(names)),
                start,
                start + timedelta(minutes=draw(st.integers(1, 300))),
                tuple(
                    draw(st.lists(st.sampled_from(versions), min_size=1, max_size=2, unique=True))
                ),
            )
        )
    return jobs, regions, sizes


@settings(max_examples=200, deadline=None)
@given(scenario=schedules())
def test_every_task_runs_at_the_plans_own_speed_one_at_a_time_per_origin_link(scenario) -> None:  # noqa: ANN001
    """Under the plan's speed model its times are consistent: a promise warm can keep."""
    jobs, regions, sizes = scenario
    result = plan(jobs, regions, sizes, now=NOW)
    ready: dict[tuple[str, tuple[str, int]], datetime] = {}
    for name, region_plan in result.regions.items():
        for task in region_plan.tasks:
            ready.setdefault((name, task.version), task.finish)
    for name, region_plan in result.regions.items():
        origin = sorted(
            (t for t in region_plan.tasks if t.source == "origin"), key=lambda t: t.start
        )
        for before, after in zip(origin, origin[1:], strict=False):
            assert after.start >= before.finish, (before, after)  # one link, one at a time
        for task in region_plan.tasks:
            assert task.start >= NOW
            rate = (
                regions[name].origin_rate
                if task.source == "origin"
                else regions[name].peer_bandwidth[task.source]
            )
            seconds = (task.finish - task.start).total_seconds()
            assert seconds == pytest.approx(sizes[task.version] / rate, rel=1e-6, abs=1e-3), task
            if task.source != "origin":  # a peer sends what it holds: by then it holds it
                assert ready[(task.source, task.version)] <= task.start, task


@settings(max_examples=100, deadline=None)
@given(scenario=schedules())
def test_the_same_instants_in_another_zone_make_the_same_plan(scenario) -> None:  # noqa: ANN001
    jobs, regions, sizes = scenario
    shifted = [
        Job(j.name, j.region, j.start.astimezone(PLUS2), j.end.astimezone(PLUS2), j.versions)
        for j in jobs
    ]
    utc, plus2 = plan(jobs, regions, sizes, now=NOW), plan(shifted, regions, sizes, now=NOW)
    assert [i.reason for i in utc.infeasible] == [i.reason for i in plus2.infeasible]
    for name in utc.regions:
        assert [e.reason for e in utc.regions[name].evictions] == [
            e.reason for e in plus2.regions[name].evictions
        ]
        assert utc.regions[name].tasks == plus2.regions[name].tasks
