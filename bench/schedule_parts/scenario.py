"""The scenario: three regions, six dataset versions, twenty jobs over one simulated day.

The jobs follow a roll-out pattern: a version is trained on in one region and
read again in the others a few hours later (evaluation, fine-tuning), so a
region that needs a version often finds a peer region holding it. Every
version is read in at least two regions. Each region has room for about two
and a half versions while its jobs read four or five over the day, so room
must be made during the day (evictions are forced).

Times are hours after the start of the simulated day; durations in hours.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

__all__ = ["REGIONS", "SMOKE", "FULL", "Scenario", "ScheduledJob"]

REGIONS = ("eu", "us", "ap")


@dataclass(frozen=True)
class ScheduledJob:
    """One job: where, when (hours after the day starts), for how long, reading what."""

    name: str
    region: str
    start_h: float
    hours: float
    versions: tuple[str, ...]

    @property
    def end_h(self) -> float:
        return self.start_h + self.hours


@dataclass(frozen=True)
class Scenario:
    """The versions to publish (in order) and the jobs that read them."""

    versions: tuple[str, ...]
    jobs: tuple[ScheduledJob, ...]
    day_hours: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "versions": list(self.versions),
            "day_hours": self.day_hours,
            "jobs": [asdict(j) | {"versions": list(j.versions)} for j in self.jobs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        return cls(
            tuple(data["versions"]),
            tuple(ScheduledJob(**(j | {"versions": tuple(j["versions"])})) for j in data["jobs"]),
            data["day_hours"],
        )

    def regions_reading(self, spec: str) -> set[str]:
        return {j.region for j in self.jobs if spec in j.versions}


def _j(name: str, region: str, start: float, hours: float, *versions: str) -> ScheduledJob:
    return ScheduledJob(name, region, start, hours, versions)


FULL = Scenario(
    versions=("web@1", "web@2", "code@1", "code@2", "books@1", "chat@1"),
    jobs=(
        _j("eu-pretrain-web1", "eu", 1.5, 2.5, "web@1"),
        _j("eu-code1", "eu", 2.0, 2.5, "code@1"),
        _j("eu-eval-mix1", "eu", 4.75, 1.25, "web@1", "code@1"),
        _j("eu-pretrain-web2", "eu", 8.0, 3.0, "web@2"),
        _j("eu-books1", "eu", 11.5, 2.0, "books@1"),
        _j("eu-chat1", "eu", 15.0, 2.5, "chat@1", "code@2"),
        _j("eu-eval-web2", "eu", 20.0, 2.0, "web@2", "books@1"),
        _j("us-pretrain-web1", "us", 3.0, 3.0, "web@1"),
        _j("us-code1", "us", 4.0, 2.0, "code@1"),
        _j("us-eval-mix1", "us", 7.5, 1.5, "web@1", "code@1"),
        _j("us-pretrain-web2", "us", 10.5, 3.0, "web@2"),
        _j("us-books1", "us", 14.5, 2.0, "books@1"),
        _j("us-chat1", "us", 18.0, 2.5, "chat@1", "code@2"),
        _j("us-eval-web2", "us", 22.0, 1.5, "web@2", "books@1"),
        _j("ap-code2", "ap", 2.0, 2.5, "code@2"),
        _j("ap-pretrain-web1", "ap", 6.0, 2.0, "web@1"),
        _j("ap-chat1", "ap", 9.0, 2.5, "chat@1"),
        _j("ap-pretrain-web2", "ap", 13.0, 2.5, "web@2"),
        _j("ap-books1", "ap", 17.0, 2.0, "books@1"),
        _j("ap-eval-web2", "ap", 21.0, 2.0, "web@2", "chat@1"),
    ),
    day_hours=24.0,
)

# Toy size for the smoke test: three versions, six jobs over eight hours.
SMOKE = Scenario(
    versions=("web@1", "code@1", "chat@1"),
    jobs=(
        _j("eu-web1", "eu", 1.0, 2.0, "web@1"),
        _j("eu-code1", "eu", 3.5, 1.5, "code@1"),
        _j("us-web1", "us", 2.5, 2.0, "web@1"),
        _j("us-chat1", "us", 5.0, 2.0, "chat@1"),
        _j("ap-chat1", "ap", 2.0, 2.0, "chat@1"),
        _j("ap-code1", "ap", 6.0, 1.5, "code@1", "web@1"),
    ),
    day_hours=8.0,
)


def iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def write_schedule(path: Path, scenario: Scenario, t0: datetime) -> None:
    """The schedule file (absolute times from ``t0``), as an operator writes it."""
    jobs = [
        {
            "name": j.name,
            "region": j.region,
            "start": iso(t0 + timedelta(hours=j.start_h)),
            "duration": f"{round(j.hours * 60)}m",
            "datasets": list(j.versions),
        }
        for j in scenario.jobs
    ]
    path.write_text(yaml.safe_dump({"jobs": jobs}, sort_keys=False))


def write_topology(
    path: Path,
    registry: str,
    nodes: dict[str, str],
    origin_bandwidth: float,
    peer_bandwidth: float,
) -> None:
    """The topology file; bandwidths in *simulated* bytes per second (real ÷ speed)."""
    regions = {
        region: {
            "nodes": [address],
            "origin_bandwidth": max(int(origin_bandwidth), 1),
            "peers": {p: max(int(peer_bandwidth), 1) for p in nodes if p != region},
        }
        for region, address in nodes.items()
    }
    path.write_text(yaml.safe_dump({"registry": registry, "regions": regions}, sort_keys=False))
