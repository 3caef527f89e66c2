"""Warm shortens its own pin when its schedule moves a job's end earlier, against a real node.

A node keeps one pin time per version, and warm sends no Pin that would
shorten a longer one (it may be another schedule's). Its own stale pin was
treated the same: the schedule moved its job from +7 h to +3 h, warm said
"its nodes keep it until +7 h already, for a job another schedule or the
controller recorded" (no record had one), recorded +3 h, and once the
schedule was emptied found +7 h on the node, not its +3 h, and released
nothing: the version stayed pinned for no job until +7 h (review 41).

Region ``small`` of ``test_plan_pins``: one node on loopback, real LMDB, a
file:// registry, pq@2 staged.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, stub
from test_plan_defects import resident, schedule

from edgecache.clients.node_client import LocalNode
from edgecache.v1 import edge_pb2


def pinned_until(node: LocalNode) -> datetime | None:
    held = resident(node, "pq", 2)
    return held.pinned_until.ToDatetime(tzinfo=UTC) if held.HasField("pinned_until") else None


def near(when: datetime | None, expected: datetime) -> bool:
    return when is not None and abs(when - expected) < timedelta(seconds=2)


def said(text: str) -> str:
    """Output as one line: the CLI wraps at 80 columns."""
    return " ".join(text.split())


def warmed(small, hours: int) -> tuple[Path, LocalNode, Path, datetime, list[str]]:  # noqa: ANN001
    """pq@2 pinned by a warm of schedule ``a`` whose one job starts in ``hours`` (an hour long)."""
    root, node = small
    now = datetime.now(UTC)
    config = ["--config", str(root / "small.yaml")]
    a = schedule(root, "a", ("long", "small", now + timedelta(hours=hours), "pq@2"))
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0 and near(pinned_until(node), now + timedelta(hours=hours + 1)), (out, err)
    return root, node, a, now, config


def test_a_schedule_that_moves_its_job_earlier_shortens_its_own_pin(small) -> None:
    root, node, a, now, config = warmed(small, 6)
    # The job moves: it ends at +3 h now. A dry run says it would shorten, and touches nothing.
    a = schedule(root, "a", ("long", "small", now + timedelta(hours=2), "pq@2"))
    code, out, err = edgecache("warm", str(a), "--dry-run", *config)
    assert code == 0 and "would shorten the pin of pq@2" in said(out), (out, err)
    assert near(pinned_until(node), now + timedelta(hours=7))
    code, out, err = edgecache("warm", str(a), "--json", *config)
    assert code == 0, (out, err)
    done = json.loads(out)
    (released,) = done["released"]
    assert near(datetime.fromisoformat(released["shortened_to"]), now + timedelta(hours=3))
    (pin,) = done["pins"]
    assert pin["held_until"] is None, pin  # the node keeps what the plan says
    assert near(pinned_until(node), now + timedelta(hours=3)), pinned_until(node)
    # Said as what it is, not as another schedule's job, on a run with nothing to shorten too.
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0 and "another schedule" not in said(out), out
    assert f"pinned pq@2 until {now + timedelta(hours=3):%Y-%m-%d %H:%M}" in said(out), out
    # The schedule is emptied: the pin is released, not left to its old end.
    a.write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0 and "released the pin of pq@2" in said(out), (out, err)
    assert pinned_until(node) is None


def test_the_own_pin_is_shortened_only_to_what_another_schedules_job_needs(small) -> None:
    """a (+7 h) and b (+5 h) read pq@2; a moves to +3 h: the pin goes to b's +5 h, not a's
    +3 h. Then b goes: back to a's +3 h. Then a goes: released."""
    root, node = small
    now = datetime.now(UTC)
    config = ["--config", str(root / "small.yaml")]
    a = schedule(root, "a", ("long", "small", now + timedelta(hours=6), "pq@2"))
    b = schedule(root, "b", ("mid", "small", now + timedelta(hours=4), "pq@2"))
    for path in (a, b):
        code, out, err = edgecache("warm", str(path), *config)
        assert code == 0, (out, err)
    assert near(pinned_until(node), now + timedelta(hours=7))
    a = schedule(root, "a", ("long", "small", now + timedelta(hours=2), "pq@2"))
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0, (out, err)
    text = said(out)
    assert "shortened the pin of pq@2" in text and "now ends at" in text, text
    assert "a job another schedule or the controller recorded reads it until then" in text
    assert near(pinned_until(node), now + timedelta(hours=5)), pinned_until(node)
    code, out, err = edgecache("warm", str(a), "--json", *config)
    assert code == 0, (out, err)
    (pin,) = json.loads(out)["pins"]
    assert near(datetime.fromisoformat(pin["held_until"]), now + timedelta(hours=5)), pin
    b.write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(b), *config)
    assert code == 0 and "shortened the pin of pq@2" in said(out), (out, err)
    assert near(pinned_until(node), now + timedelta(hours=3)), pinned_until(node)
    a.write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0 and "released the pin of pq@2" in said(out), (out, err)
    assert pinned_until(node) is None


def test_a_longer_pin_no_record_explains_is_kept_and_not_called_another_schedules(
    small,
) -> None:
    """Pinned to +9 h by a bare Pin call (no warm, no controller): warm keeps it, and says
    so without naming a schedule or the controller as its owner."""
    root, node = small
    now = datetime.now(UTC)
    request = edge_pb2.PinRequest(dataset="pq", version=2)
    request.until.FromDatetime((now + timedelta(hours=9)).replace(tzinfo=None))
    stub(node.address).Pin(request)
    a = schedule(root, "a", ("job", "small", now + timedelta(hours=2), "pq@2"))
    code, out, err = edgecache("warm", str(a), "--config", str(root / "small.yaml"))
    assert code == 0, (out, err)
    text = said(out)
    assert "its nodes keep it until" in text and "no job of warm's or the controller's" in text
    assert "another schedule" not in text, text
    assert near(pinned_until(node), now + timedelta(hours=9))


def test_plan_plans_on_the_pins_as_warm_leaves_its_own(small) -> None:
    """plan made its own stale +7 h pin someone else's: a job reading pq@1 after the moved
    job (room for one version) could not be met, though warm, which shortens the pin first,
    then met it. plan now plans as warm acts, and says it would shorten the pin."""
    root, node = small
    now = datetime.now(UTC)
    config = ["--config", str(root / "small.yaml")]
    a = schedule(root, "a", ("long", "small", now + timedelta(hours=6), "pq@2"))
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0 and near(pinned_until(node), now + timedelta(hours=7)), (out, err)
    moved = now + timedelta(minutes=10)
    a = schedule(
        root,
        "a",
        ("long", "small", moved, "pq@2"),
        ("next", "small", now + timedelta(hours=3), "pq@1"),
    )
    code, out, err = edgecache("plan", str(a), *config)
    text = said(out)
    assert code == 0, (out, err)
    assert "small: warm would shorten the pin of pq@2" in text, text
    assert f"to {moved + timedelta(hours=1):%Y-%m-%d %H:%M}" in text, text
    assert "evict" in text and "pq@1" in text, text
    code, out, err = edgecache("plan", str(a), "--json", *config)
    assert code == 0, (out, err)
    planned = json.loads(out)
    (released,) = planned["released"]
    assert near(datetime.fromisoformat(released["shortened_to"]), moved + timedelta(hours=1))
    assert [t["version"] for t in planned["regions"]["small"]["tasks"]] == ["pq@1"]
    assert near(pinned_until(node), now + timedelta(hours=7))  # plan changes nothing
    # warm rehearses the same: pq@1 is staged once the shortened pin has run out.
    code, out, err = edgecache("warm", str(a), "--dry-run", *config)
    assert code == 0, (out, err)
    assert "would shorten the pin of pq@2" in said(out), out
    assert "pq@1" in said(err) and "the plan starts it at" in said(err), err


def test_a_pin_on_a_node_the_run_does_not_list_is_kept_not_forgotten(small) -> None:
    """warm pinned pq@2 with small.yaml; warm then ran with another topology of the same
    registry (the folder's edgecache.yaml, say) that does not list the node: with the
    schedule emptied, or unchanged and region small listing another node. Either way the
    run dropped the pin from its record while the node kept it: only evict --force then
    freed the room (a helper's hunt, and a review). The record keeps it, the run says so
    (a note: a node taken out of the topology is not a failure), and warm with small.yaml
    then releases it."""
    from test_plan_defects import topology_file

    from edgecache.clients.node_client import start_local_node

    root, node, a, now, _ = warmed(small, 2)
    registry = (root / "small.yaml").read_text().splitlines()[0].removeprefix("registry: ")
    record = root / "registry" / "_warm" / "jobs.json"
    other = start_local_node("other", root / "cache-other", registry)
    try:
        # The same schedule, region small served by another node now.
        moved = topology_file(root / "moved.yaml", registry, small=other.address)
        code, out, err = edgecache("warm", str(a), "--config", str(moved))
        assert code == 0, (code, out, err)
        pinned = {(p["node"], p["version"]) for p in json.loads(record.read_text())["pins"]}
        assert (node.address, "pq@2") in pinned, pinned
        # The schedule emptied, with a topology without region small at all.
        a.write_text("jobs: []\n")
        elsewhere = topology_file(root / "other.yaml", registry, other=other.address)
        code, out, err = edgecache("warm", str(a), "--config", str(elsewhere))
    finally:
        other.stop()
    noted = said(err)
    assert code == 0 and "note:" in noted, (code, out, err)
    assert f"does not list {node.address} in region small" in noted, err
    assert near(pinned_until(node), now + timedelta(hours=3))  # not released: not asked
    code, out, err = edgecache("warm", str(a), "--config", str(root / "small.yaml"))
    assert code == 0 and "released the pin of pq@2" in said(out), (out, err)
    assert pinned_until(node) is None


def test_a_pin_on_a_node_that_does_not_answer_is_said_kept_not_passed_over(small) -> None:
    """The schedule no longer reads pq@2 in region small, whose one node is down: warm
    kept the pin for the next run but said nothing and exited 0, since no job's region
    was down (a helper's hunt). It says which pin stays and why, and fails."""
    root, node, a, _, config = warmed(small, 2)
    a.write_text("jobs: []\n")
    node.stop()
    # plan, which plans on the pins as warm leaves them, says the same of that pin.
    code, out, err = edgecache("plan", str(a), *config)
    said = " ".join(err.split())
    assert "release would fail:" in said and f"the pin of pq@2 on {node.address}" in said, err
    code, out, err = edgecache("plan", str(a), "--json", *config)
    shown = json.loads(out)
    assert any(node.address in p for p in shown["release_failures"]), shown
    code, out, err = edgecache("warm", str(a), *config)
    said = " ".join(err.split())
    assert code == 1, (code, out, err)
    assert f"the pin of pq@2 on {node.address}" in said and "did not answer" in said, err
    record = json.loads((root / "registry" / "_warm" / "jobs.json").read_text())
    assert [p["version"] for p in record["pins"]] == ["pq@2"], record


def test_two_schedules_jobs_of_one_name_are_both_recorded(small) -> None:
    """Warm's record kept one job per name: b's ``etl`` replaced a's, whose pin of pq@2
    then named no job, and evict said nobody would release it before it ran out, though
    a's warm would (a helper's hunt)."""
    root, node = small
    now = datetime.now(UTC)
    config = ["--config", str(root / "small.yaml")]
    a = schedule(root, "a", ("etl", "small", now + timedelta(hours=2), "pq@2"))
    # Room for one version: b's pq@1 is staged once a's job is over.
    b = schedule(root, "b", ("etl", "small", now + timedelta(hours=6), "pq@1"))
    for path in (a, b):
        code, out, err = edgecache("warm", str(path), *config)
        assert code == 0, (out, err)
    code, out, err = edgecache("evict", "pq@2", *config)
    text = said(err)
    assert code == 2 and "read by etl (small" in text, (out, err)
    assert "neither warm nor the controller recorded" not in text, text
    assert f"Remove the job from {a}" in text, text
