"""plan and warm as an operator reviewed them: ended jobs, warm's record, pins, error lines.

Every command runs as a real process (``python -m edgecache.clients.cli``)
against real nodes on loopback and a real file:// registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import pins_on, publish, write_parquet_shards

from edgecache.clients.node_client import LocalNode, start_local_node

ENV = {**os.environ, "COLUMNS": "80"}


def edgecache(root: Path, *args: str) -> tuple[int, str, str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            *args,
            "--config",
            str(root / "edgecache.yaml"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    return out.returncode, out.stdout, out.stderr


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, LocalNode]]:
    """One region (us-east) with one node, and iris@1 published."""
    write_parquet_shards(tmp_path / "origin", 2, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "iris")
    node = start_local_node("us-east", tmp_path / "cache", registry, capacity="256MiB")
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  us-east:\n    nodes: ['{node.address}']\n"
    )
    yield tmp_path, node
    node.stop()


def job(name: str, start: datetime, datasets: str, duration: str = "2h") -> str:
    return (
        f"  - name: {name}\n    region: us-east\n    start: {start.isoformat()}\n"
        f"    datasets: [{datasets}]\n    duration: {duration}\n"
    )


def test_a_job_that_has_ended_shows_as_over_with_no_false_claims(site) -> None:
    """A job that ended days ago read "iris: not in the registry", state late, "started
    before its data was complete": the plan leaves ended jobs out, so their specs were not
    resolved, and nothing recorded what the job had at its start."""
    root, _ = site
    assert edgecache(root, "warm", "iris@1", "--region", "us-east")[0] == 0
    schedule = root / "schedule.yaml"
    now = datetime.now(UTC)
    schedule.write_text(
        "jobs:\n"
        + job("old", now - timedelta(days=3), "iris", duration="1h")
        + job("next", now + timedelta(days=1), "iris@1")
    )
    code, out, err = edgecache(root, "plan", str(schedule), "--status", "--json")
    assert code == 0, (out, err)
    views = {v["job"]: v for v in json.loads(out)}
    old = views["old"]
    assert old["state"] == "over", old
    assert old["missing"] == [] and old["why"] is None, old
    assert old["hint"].startswith("ended ") and "no record" in old["hint"], old
    assert views["next"]["state"] == "ready", views["next"]
    code, out, err = edgecache(root, "plan", str(schedule), "--status")
    assert code == 0, (out, err)
    said = " ".join(out.split())
    assert "not in the registry" not in said and "before its data" not in said, out
    assert "state: over" in said or " over " in said, out


def test_plan_shows_its_pins_without_explain_and_no_nothing_to_do_for_a_silent_region(
    site,
) -> None:
    """The pins the plan places were shown only with --explain, though warm and the
    controller carry them out; and with the only node down, plan said "region us-east:
    nothing to do" before its exit-1 error."""
    root, node = site
    schedule = root / "schedule.yaml"
    start = datetime.now(UTC) + timedelta(days=1)
    schedule.write_text("jobs:\n" + job("next", start, "iris@1", duration="3h"))
    until = start + timedelta(hours=3)
    code, out, err = edgecache(root, "plan", str(schedule))
    assert code == 0, (out, err)
    assert f"us-east: pin iris@1 until {until:%Y-%m-%d %H:%M}" in out, out
    assert edgecache(root, "warm", str(schedule))[0] == 0
    code, out, err = edgecache(root, "plan", str(schedule))  # staged: only the pin is left
    assert code == 0, (out, err)
    assert "nothing to do" not in out, out
    assert f"us-east: pin iris@1 until {until:%Y-%m-%d %H:%M}" in out, out
    node.stop()
    code, out, err = edgecache(root, "plan", str(schedule))
    assert code == 1, (out, err)
    assert (
        "nothing to do" not in out
        and "region us-east: not planned: its nodes' state is unknown" in out
    )
    assert "error:" in err and "us-east" in err, err


@pytest.fixture
def two(site) -> tuple[Path, LocalNode]:
    """The site with a second dataset, "other", for the jobs that stay in the schedule."""
    root, node = site
    write_parquet_shards(root / "origin-other", 1, rows=100)
    publish(f"file://{root}/registry", f"file://{root}/origin-other", "other")
    return root, node


def test_warm_of_the_same_schedule_releases_the_pins_of_a_job_removed_from_it(two) -> None:
    """warm merged its jobs into _warm/jobs.json across runs: a job removed from the
    schedule kept its record and its pins, so evict still refused, naming it, and advised
    "Change the schedule", which did nothing; only --force helped."""
    root, node = two
    start = datetime.now(UTC) + timedelta(days=1)
    path = root / "a.yaml"
    path.write_text("jobs:\n" + job("jl", start, "iris@1") + job("keep", start, "other@1"))
    assert edgecache(root, "warm", str(path))[0] == 0
    assert "iris@1" in pins_on(node)
    code, out, err = edgecache(root, "evict", "iris@1", "--region", "us-east")
    assert code == 2 and "read by jl (us-east" in err, (out, err)
    said = " ".join(err.split())
    again = f"`edgecache warm {path} --config {root / 'edgecache.yaml'}` again"
    assert f"Remove the job from {path} and run {again}" in said, err
    path.write_text("jobs:\n" + job("keep", start, "other@1"))  # jl removed
    code, out, err = edgecache(root, "warm", str(path), "--dry-run")
    assert code == 0 and "us-east: would release the pin of iris@1 on" in out, (out, err)
    assert "iris@1" in pins_on(node)  # a rehearsal releases nothing
    code, out, err = edgecache(root, "warm", str(path))
    assert code == 0, (out, err)
    assert "us-east: released the pin of iris@1 on" in out, out
    assert set(pins_on(node)) == {"other@1"}, pins_on(node)
    record = json.loads((root / "registry" / "_warm" / "jobs.json").read_text())
    assert [j["name"] for j in record["jobs"]] == ["keep"], record
    code, out, err = edgecache(root, "evict", "iris@1", "--region", "us-east")
    assert code == 0, (out, err)  # no --force needed


def test_warm_that_cannot_write_its_record_pins_nothing_and_fails(site) -> None:
    """warm warned "could not record the jobs …", pinned anyway and exited 0: the pin then
    outlived its job (a later warm cannot release what no record names), evict refused it
    without --force."""
    root, node = site
    (root / "registry" / "_warm").write_text("a file where warm's folder goes")
    path = root / "a.yaml"
    path.write_text("jobs:\n" + job("jl", datetime.now(UTC) + timedelta(days=1), "iris@1"))
    code, out, err = edgecache(root, "warm", str(path))
    said = " ".join(err.split())
    assert code == 1, (out, err)
    assert "could not record the jobs warm pins versions for" in said, said
    assert "nothing was pinned or staged" in said and "make the registry writable" in said
    assert pins_on(node) == {}, pins_on(node)
    (root / "registry" / "_warm").unlink()  # writable again: the same run works
    assert edgecache(root, "warm", str(path))[0] == 0
    assert "iris@1" in pins_on(node)


def test_a_dry_run_of_a_version_held_in_part_says_what_the_real_run_moves(
    tmp_path: Path,
) -> None:
    """A region held 3 of 4 shards: the dry run said the whole version's bytes would move
    (1.8 MiB), the real run then moved a quarter (470 KiB)."""
    from edgeutil import stub

    from edgecache.v1 import edge_pb2

    write_parquet_shards(tmp_path / "origin", 4, rows=2000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tok")
    node = start_local_node("us-east", tmp_path / "cache", registry)
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  us-east:\n    nodes: ['{node.address}']\n"
        )
        request = edge_pb2.StageRequest(dataset="tok", version=1, shards=[0, 1, 2])
        for _ in stub(node.address).Stage(request, timeout=60):
            pass
        schedule = tmp_path / "a.yaml"
        schedule.write_text("jobs:\n" + job("j", datetime.now(UTC) + timedelta(days=1), "tok@1"))
        for args in (["warm", "tok@1", "--region", "us-east"], ["warm", str(schedule)]):
            code, out, err = edgecache(tmp_path, *args, "--dry-run")
            said = " ".join(out.split())
            assert code == 0, (out, err)
            rehearsed = said.split("would stage tok@1 (about ")[1].split(":")[0]
            assert "the shards not held yet" in said, said
        code, out, err = edgecache(tmp_path, "warm", "tok@1", "--region", "us-east")
        assert code == 0, (out, err)
        moved = " ".join(out.split()).split("staged tok@1 (")[1].split(")")[0]
        # The mean shard's bytes: within a few percent of the shard left (the whole was 4x).
        (said_n, said_unit), (moved_n, moved_unit) = rehearsed.split(), moved.split()
        assert said_unit == moved_unit and abs(float(said_n) / float(moved_n) - 1) < 0.05, (
            rehearsed,
            moved,
        )
    finally:
        node.stop()


def test_warm_of_another_schedule_keeps_the_jobs_and_pins_of_the_first(two) -> None:
    """Each warm run owns its schedule file's records: warm of b.yaml leaves a.yaml's job
    and pin alone, and a.yaml dropping a version b.yaml's job reads leaves b's pin."""
    root, node = two
    start = datetime.now(UTC) + timedelta(days=1)
    a, b = root / "a.yaml", root / "b.yaml"
    a.write_text("jobs:\n" + job("ja", start, "iris@1"))
    b.write_text("jobs:\n" + job("jb", start, "iris@1") + job("jo", start, "other@1"))
    assert edgecache(root, "warm", str(a))[0] == 0
    assert edgecache(root, "warm", str(b))[0] == 0
    a.write_text("jobs:\n" + job("ja2", start, "other@1"))  # ja gone; jb still reads iris@1
    code, out, err = edgecache(root, "warm", str(a))
    assert code == 0 and "released" not in out, (out, err)
    assert set(pins_on(node)) == {"iris@1", "other@1"}, pins_on(node)
    record = json.loads((root / "registry" / "_warm" / "jobs.json").read_text())
    assert sorted(j["name"] for j in record["jobs"]) == ["ja2", "jb", "jo"], record
    code, out, err = edgecache(root, "evict", "iris@1", "--region", "us-east")
    assert code == 2 and "read by jb (us-east" in err and "ja " not in err, (out, err)
    again = f"run `edgecache warm {b} --config {root / 'edgecache.yaml'}` again"
    assert again in " ".join(err.split()), err
    b.write_text("jobs:\n" + job("jo", start, "other@1"))  # now nobody reads iris@1
    code, out, err = edgecache(root, "warm", str(b))
    assert code == 0 and "released the pin of iris@1" in out, (out, err)
    assert set(pins_on(node)) == {"other@1"}, pins_on(node)


def test_a_controller_job_of_the_same_name_does_not_hide_the_warm_job_that_pins(two) -> None:
    """The controller's record and warm's were merged by job name alone: with a controller
    job called eval-us elsewhere (the demo's schedule has one), the warm job eval-us that
    held the pin was dropped, and evict said no one had recorded which job reads it."""
    from edgecache.clients.controller import STATE_NAME, ControllerState, JobRecord

    root, node = two
    start = datetime.now(UTC) + timedelta(days=1)
    path = root / "a.yaml"
    path.write_text("jobs:\n" + job("eval-us", start, "iris@1"))
    assert edgecache(root, "warm", str(path))[0] == 0
    theirs = JobRecord(
        name="eval-us",
        region="eu-west",
        start=(start + timedelta(days=3)).isoformat(),
        end=(start + timedelta(days=4)).isoformat(),
        versions=["other@1"],
    )
    state = ControllerState(jobs={"eval-us": theirs})
    (root / "registry" / STATE_NAME).parent.mkdir(parents=True, exist_ok=True)
    (root / "registry" / STATE_NAME).write_bytes(state.to_json())
    code, out, err = edgecache(root, "evict", "iris@1", "--region", "us-east")
    assert code == 2 and "read by eval-us (us-east" in err, (out, err)
    assert "neither warm nor the controller recorded" not in err, err


def _plan_controller_warm_keep_iris_1(
    root: Path, node: LocalNode, schedule: Path, *unsaid: str
) -> None:
    """plan, controller --once and warm, in turn, each exit 0 and keep the job on iris@1."""
    runs = (
        ("plan", str(schedule)),
        ("controller", "--schedule", str(schedule), "--once"),
        ("warm", str(schedule)),
    )
    for command in runs:
        code, out, err = edgecache(root, *command)
        said = " ".join((out + err).split())
        assert code == 0, (command, out, err)
        assert not any(word in said for word in ("iris@2", *unsaid)), (command, said)
    assert "iris@1" in pins_on(node) and "iris@2" not in pins_on(node), pins_on(node)


def test_warm_alone_keeps_a_started_job_on_the_version_it_pinned_for_it(site) -> None:
    """Without the controller, warm's record was not read: run again after the job started
    and a new version was published, warm staged and pinned the new one for the job,
    released the pin of the one it reads ("no job of the schedule reads it"), and evict
    then freed it under the running job; plan and warm exited 3 ("already started").
    The controller read its own record alone, and did the same."""
    root, node = site
    schedule = root / "schedule.yaml"
    # warm must end before the start, and the start is fixed before it runs (warm's record
    # is keyed by it): 12 s, not 4, since warm is a whole CLI process, which a loaded host
    # can take many seconds to start. The test sleeps until the start anyway.
    start = datetime.now(UTC) + timedelta(seconds=12)
    schedule.write_text("jobs:\n" + job("train", start, "iris", duration="4h"))
    code, out, err = edgecache(root, "warm", str(schedule))
    assert code == 0, (out, err)
    assert datetime.now(UTC) < start, "warm ended after the start: the test proves nothing"
    assert "iris@1" in pins_on(node), pins_on(node)
    time.sleep(max(0.0, (start - datetime.now(UTC)).total_seconds()) + 0.5)  # it has started
    write_parquet_shards(root / "origin-2", 2, rows=150)
    publish(f"file://{root}/registry", f"file://{root}/origin-2", "iris")  # iris@2
    # The controller too (a round that never saw the job before its start): it read its
    # own record alone, staged iris@2 for the job, said it "cannot be met" (exit 3), and
    # recorded iris@2, so the warm after it released the pin of iris@1.
    _plan_controller_warm_keep_iris_1(root, node, schedule, "released")
    code, out, err = edgecache(root, "evict", "iris@1")
    assert code != 0 and "train" in " ".join((out + err).split()), (out, err)


def test_a_version_published_between_warm_and_the_start_is_the_one_the_job_reads(site) -> None:
    """warm's record is of its last run; a version published after it but before the job
    started is what the job resolved at its start: warm after the start stages and pins it,
    also once a later version was published after the start."""
    root, node = site
    schedule = root / "schedule.yaml"
    # warm and the publish of iris@2 must both end before the start, which is fixed before
    # they run (warm's record is keyed by it): 12 s, not 4, for a loaded host. The test
    # sleeps until the start anyway.
    start = datetime.now(UTC) + timedelta(seconds=12)
    schedule.write_text("jobs:\n" + job("train", start, "iris", duration="4h"))
    code, out, err = edgecache(root, "warm", str(schedule))  # records iris@1 for the job
    assert code == 0, (out, err)
    write_parquet_shards(root / "origin-2", 2, rows=150)
    publish(f"file://{root}/registry", f"file://{root}/origin-2", "iris")  # before the start
    assert datetime.now(UTC) < start, "iris@2 was published after the start"
    time.sleep(max(0.0, (start - datetime.now(UTC)).total_seconds()) + 0.5)
    # And iris@3 after the start: warm's record (iris@1) was compared with the newest alone,
    # which came after the start, so the record stood, and iris@2, which the job reads,
    # was neither staged nor pinned (a review).
    write_parquet_shards(root / "origin-3", 2, rows=200)
    publish(f"file://{root}/registry", f"file://{root}/origin-3", "iris")
    code, out, err = edgecache(root, "warm", str(schedule))
    assert code == 0, (out, err)  # staged now: "there now", not "cannot be met"
    pins = pins_on(node)
    assert "iris@2" in pins and "iris@3" not in pins, (pins, out, err)


def test_a_started_job_neither_record_holds_reads_the_version_newest_at_its_start(site) -> None:
    """A job no controller round and no warm saw start (the controller deployed after it,
    say) was resolved to the newest version when first seen: a version published while it
    ran was staged for it, the job called "cannot be met" (exit 3), and the version it
    reads left unpinned. The registry's publish times say which it read."""
    root, node = site
    code, out, err = edgecache(root, "warm", "iris@1", "--region", "us-east")  # no job
    assert code == 0, (out, err)
    start = datetime.now(UTC)  # after iris@1 was published, before iris@2
    schedule = root / "schedule.yaml"
    schedule.write_text("jobs:\n" + job("train", start, "iris", duration="4h"))
    time.sleep(0.05)
    write_parquet_shards(root / "origin-2", 2, rows=150)
    publish(f"file://{root}/registry", f"file://{root}/origin-2", "iris")  # iris@2
    _plan_controller_warm_keep_iris_1(root, node, schedule)
    # A job that started after iris@2 was published reads it.
    later = datetime.now(UTC)
    schedule.write_text("jobs:\n" + job("train2", later, "iris", duration="4h"))
    code, out, err = edgecache(root, "plan", str(schedule))
    assert "iris@2" in " ".join((out + err).split()), (out, err)


def test_warm_that_stages_a_started_jobs_data_says_it_is_there_now_and_exits_0(site) -> None:
    """warm said "cannot be met … the plan stages it now" of a job that started without its
    data, staged it, and exited 3 as if the job still lacked it; its JSON said the same.
    controller --once, whose round stages it and waits, did the same (a review)."""
    root, node = site
    schedule = root / "schedule.yaml"
    start = datetime.now(UTC) - timedelta(minutes=1)
    schedule.write_text("jobs:\n" + job("train", start, "iris", duration="2h"))
    code, out, err = edgecache(root, "warm", str(schedule), "--dry-run")
    assert code == 3, (out, err)  # before it moves data, the job lacks it
    code, out, err = edgecache(root, "warm", str(schedule), "--json")
    assert code == 0, (out, err)
    rows = json.loads(out)["infeasible"]
    assert [(r["job"], r["version"], r["there_now"]) for r in rows] == [("train", "iris@1", True)]
    said = " ".join(err.split())
    assert "there now: train iris@1 in us-east: staged whole by this run, train started" in said
    assert "iris@1" in pins_on(node)
    code, out, err = edgecache(root, "evict", "iris@1", "--force")
    assert code == 0 and "iris@1" not in pins_on(node), (out, err)
    code, out, err = edgecache(root, "controller", "--schedule", str(schedule), "--once")
    said = " ".join((out + err).split())
    assert code == 0, (out, err)
    assert "cannot be met" not in said, said
    assert "there now: train iris@1 in us-east: staged whole by this run, train started" in said
