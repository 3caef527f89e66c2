"""The topology file (edgecache.yaml) and schedule files, validated strictly.

An error names the file, the line and the field, and says what is expected,
because these files are written by hand and read by scripts.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from edgecache.cache.errors import ConfigFileError, InvalidEndpoint
from edgecache.cache.names import parse_spec
from edgecache.cache.units import parse_rate
from edgecache.cache.yaml_strict import StrictLoader, yaml_problem
from edgecache.clients.endpoints import parse_endpoint

__all__ = [
    "RegionConfig",
    "Schedule",
    "ScheduledJob",
    "Topology",
    "find_topology",
    "load_schedule",
    "load_topology",
    "nodes_nearest_first",
]


def _address(address: str) -> str:
    parse_endpoint(address)
    return address


def _spec(spec: str) -> str:
    parse_spec(spec)
    return spec


class RegionConfig(BaseModel):
    """One region: its nodes and, optionally, its links."""

    model_config = ConfigDict(extra="forbid")

    # Each address checked on its own (here, not when a command first dials it), so every
    # typo is reported with the file and its line like every other mistake in the file.
    nodes: list[Annotated[str, AfterValidator(_address)]] = Field(min_length=1)
    origin_bandwidth: float | None = None  # bytes/s; written like 10Gbit/s
    peers: dict[str, float] = Field(default_factory=dict)  # region → bytes/s
    egress_price_per_gb: float = Field(0.0, ge=0)

    @field_validator("origin_bandwidth", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        return None if value is None else _parse_rate(value)

    @field_validator("egress_price_per_gb", mode="before")
    @classmethod
    def _price(cls, value: Any) -> Any:
        # Pydantic's lax mode read YAML's yes/true as 1.0: a dollar per GB, without a word;
        # an infinite or undefined price is no price either.
        if isinstance(value, bool):
            raise ValueError(
                f"{str(value).lower()} is not a price: give the dollars per GB, e.g. 0.09"
            )
        try:
            finite = math.isfinite(float(value))
        except (TypeError, ValueError):
            return value  # pydantic says what it is not
        if not finite:  # .inf priced every job $inf, and --json wrote Infinity (not JSON)
            raise ValueError(f"{value!r} is not a price: give the dollars per GB, e.g. 0.09")
        return value

    @field_validator("peers", mode="before")
    @classmethod
    def _peer_rates(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: _parse_rate(v) for k, v in value.items()}
        return value


def _parse_rate(value: Any) -> int:
    # Pydantic turns only ValueError into a validation message; parse_rate
    # would raise AttributeError on a list or None and OverflowError on 1e400.
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"invalid rate {value!r}: use e.g. 200MB/s, 1GiB/s or 10Gbit/s")
    try:
        rate = parse_rate(value)
    except OverflowError:
        raise ValueError(f"rate {value!r} is too large to be a rate") from None
    if rate < 1:
        # 0 read as "not given": the plan took the measured rate (or 1 Gbit/s) and said
        # "ready by" seconds from now for a region written as having no link at all.
        raise ValueError(
            f"rate {value!r} is under 1 byte/s, which no link is: give the link's rate "
            "(e.g. 200MB/s), or leave it out (origin_bandwidth: the rate measured, else "
            "1 Gbit/s; a peer: no link to it)"
        )
    return rate


class Topology(BaseModel):
    """Where the registry is and which nodes serve which region."""

    model_config = ConfigDict(extra="forbid")

    registry: str = Field(min_length=1)
    regions: dict[str, RegionConfig] = Field(min_length=1)

    def lists(self, node: str, region: str) -> bool:
        """Whether ``node`` is one of ``region``'s nodes here (no such region: no)."""
        found = self.regions.get(region)
        return found is not None and node in found.nodes


_DURATION = re.compile(r"(\d+)\s*(s|m|h|d)")


class ScheduledJob(BaseModel):
    """One job of a schedule."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    region: str
    start: AwareDatetime
    datasets: list[Annotated[str, AfterValidator(_spec)]] = Field(min_length=1)  # each at its line
    priority: Literal["low", "normal", "high"] = "normal"
    # Not a setting: a job reads for its duration whatever its epochs. Accepted only to
    # refuse it at its own line, saying what to write (see _no_epochs).
    epochs: Any = Field(None, exclude=True)
    duration: timedelta = timedelta(hours=24)

    @field_validator("epochs")
    @classmethod
    def _no_epochs(cls, value: Any) -> None:
        # Read and ignored before: pins and the eviction guard end at start + duration
        # (24 h by default), so epochs: 3 with no duration let a 3-day job's data go.
        if value is not None:
            raise ValueError(
                "epochs is not used: a job reads from its start for its duration (24h "
                "unless given), so write how long it reads instead, e.g. duration: 72h"
            )
        return None

    @field_validator("start", mode="before")
    @classmethod
    def _zoned(cls, value: Any) -> Any:
        # Pydantic's own words ("Input should have timezone info") say what is wrong but
        # not what to write; a start is misread by hours without its zone, so say how.
        example = "e.g. 2026-12-01T09:00:00Z (UTC) or 2026-12-01T09:00:00+02:00"
        when = value
        if isinstance(value, str):
            text = value.strip()
            try:
                date.fromisoformat(text)
            except ValueError:
                pass
            else:
                raise ValueError(
                    f"{text} is a date alone: give the time and its timezone, {example}"
                )
            try:
                when = datetime.fromisoformat(text)
            except ValueError:
                raise ValueError(f"{text!r} is not a time: write ISO 8601, {example}") from None
        elif isinstance(value, date) and not isinstance(value, datetime):
            raise ValueError(f"{value} is a date alone: give the time and its timezone, {example}")
        elif isinstance(value, bool | int | float):
            raise ValueError(f"{value!r} is not a time: write ISO 8601, {example}")
        if isinstance(when, datetime) and when.tzinfo is None:
            raise ValueError(
                f"{when:%Y-%m-%dT%H:%M:%S} has no timezone: add Z for UTC or the offset, "
                f"e.g. {when:%Y-%m-%dT%H:%M:%S}Z or {when:%Y-%m-%dT%H:%M:%S}+02:00"
            )
        return when

    @field_validator("start")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        # Plans, pins and reasons print times without a zone: all of them are UTC, so a
        # start written with an offset is the same instant in UTC, never shown as written.
        try:
            return value.astimezone(UTC)
        except OverflowError:  # 0001-01-01T00:00:00+23:59: before the first UTC instant
            raise ValueError(
                f"{value.isoformat()} is out of the range of times (years 1 to 9999 in UTC); "
                "give the job's real start"
            ) from None

    @field_validator("datasets", mode="before")
    @classmethod
    def _one(cls, value: Any) -> Any:
        # 'datasets: tokens@1' reads as plainly as '[tokens@1]': take it as that list.
        return [value] if isinstance(value, str) else value

    @field_validator("duration", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        # Pydantic would read a bare number as seconds: 'duration: 6' meant 6h more
        # likely than 6 s, so a unit is required.
        if isinstance(value, bool | int | float):
            like = f"{value}h, {value}m" if type(value) is int and value > 0 else "90m, 6h"
            raise ValueError(
                f"{value!r} has no unit: write a duration like {like} or 2d "
                "(s, m, h or d after the number)"
            )
        if isinstance(value, str):
            match = _DURATION.fullmatch(value.strip())
            if not match:
                raise ValueError("use a duration like 90m, 6h or 2d")
            unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]
            try:
                return timedelta(**{unit: int(match.group(1))})
            except OverflowError:
                raise ValueError(f"duration {value!r} is too long") from None
        return value

    @field_validator("duration")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError(f"duration must be positive, got {value}; e.g. 90m, 6h or 2d")
        return value

    @model_validator(mode="after")
    def _ends(self) -> ScheduledJob:
        try:
            self.end  # noqa: B018 - the planner computes it; fail here, with the file's line
        except OverflowError:
            raise ValueError("start + duration is past the year 9999") from None
        return self

    @property
    def end(self) -> datetime:
        """When the job stops reading."""
        return self.start + self.duration


class Schedule(BaseModel):
    """What jobs will run, where and when."""

    model_config = ConfigDict(extra="forbid")

    jobs: list[ScheduledJob]

    @field_validator("jobs")
    @classmethod
    def _unique(cls, value: list[ScheduledJob]) -> list[ScheduledJob]:
        # Reported at the second job's own name (jobs.N.name). A file's duplicates are
        # named by load_schedule's own check, with the first one's line, beside any other
        # error; this one is for schedules built in code.
        seen: dict[str, int] = {}
        problems = []
        for index, job in enumerate(value):
            if job.name in seen:
                problems.append(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "duplicate_name",
                            "job name '{name}' appears twice; names must be unique "
                            "(the first is jobs.{first})",
                            {"name": job.name, "first": seen[job.name]},
                        ),
                        loc=(index, "name"),
                        input=job.name,
                    )
                )
            seen.setdefault(job.name, index)
        if problems:
            raise ValidationError.from_exception_data("Schedule", problems)
        return value


_SAFE_LOADER = StrictLoader


def _line(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (as deep as it exists)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # The last of a repeated key: its value is the one the data holds.
            found = next((v for k, v in reversed(node.value) if k.value == str(part)), None)
            key = next((k for k, _ in reversed(node.value) if k.value == str(part)), None)
            if found is None:
                return line
            line, node = (key or found).start_mark.line + 1, found
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


# What each file is at its top, for the message when it is empty or not a mapping.
_SHAPES = {
    "schedule": "a mapping with a 'jobs' list ('jobs: []' for none)",
    "topology": "a mapping with 'registry' and 'regions'",
}


# A check of a file's data as read, before (and whatever) the model says of it: the
# problems that span fields, each as (where, as the model's fields name it; what is wrong).
_Check = Callable[[dict[Any, Any], yaml.Node], list[tuple[tuple[Any, ...], str]]]


def _load_with_tree(
    path: Path, model: type[BaseModel], what: str, check: _Check | None = None
) -> tuple[Any, yaml.Node | None]:
    """The validated model of a YAML file, and its node tree (for lines).

    Every problem of the file is reported at once, each with its line, in the
    file's order: the model's field errors and ``check``'s problems that span
    fields (a duplicate name, an unknown region), which the model alone only
    reached once every field was right, one fix and one run at a time.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        fix = " (check the path)" if isinstance(exc, FileNotFoundError) else ""
        raise ConfigFileError(f"cannot read {what} {path}: {exc.strerror}{fix}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"{path}: the {what} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from exc
    loader = _SAFE_LOADER(text)
    try:
        # One parse: the node tree gives line numbers for errors, the data is built from it.
        tree = loader.get_single_node()
        data = None if tree is None else loader.construct_document(tree)
    except yaml.YAMLError as exc:
        raise ConfigFileError(yaml_problem(path, exc)) from exc
    except RecursionError as exc:
        raise ConfigFileError(f"{path}: not valid YAML (nested too deeply)") from exc
    except Exception as exc:
        # PyYAML's safe constructors leak builtin errors on bad scalars:
        # ValueError (2024-13-45, !!int 0x), KeyError (!!bool x), IndexError
        # (!!int ''), AttributeError (!!timestamp x).
        raise ConfigFileError(
            f"{path}: not valid YAML (a value cannot be read: {type(exc).__name__}: {exc})"
        ) from exc
    finally:
        loader.dispose()
    # (line, field, message): a repeated key's own line, with no field path to name.
    repeated: list[tuple[int, str | None, str]] = [
        (
            dup.second,
            None,
            f"key {dup.key!r} appears twice in one mapping (first at line {dup.first}); YAML "
            "would keep only the last: merge them or remove one",
        )
        for dup in loader.duplicates
    ]
    if not isinstance(data, dict):
        shape = _SHAPES.get(what, "a mapping")
        if data is None:  # an empty file, or only comments
            raise ConfigFileError(f"{path} is empty: a {what} is {shape} (see docs/operations.md)")
        raise ConfigFileError(f"{path}: the {what} must be {shape} (see docs/operations.md)")
    problems = check(data, tree) if check is not None else []
    result, invalid = None, None
    try:
        result = model.model_validate(data)
    except ValidationError as exc:
        invalid = exc
        for error in exc.errors():
            if error["type"] == "duplicate_name":
                continue  # ``check`` names it, even beside other errors
            loc = tuple(p for p in error["loc"] if not str(p).startswith("function-after"))
            # A validator's own message is the whole story: pydantic's "Value error, "
            # before it is noise.
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message += _did_you_mean(model, loc)
            problems.append((loc, message))
    if not problems and not repeated:
        return result, tree
    lines: list[tuple[int, str | None, str]] = [
        (_line(tree, loc) or 0, ".".join(map(str, loc)), message) for loc, message in problems
    ]
    lines += repeated
    # One error, one problem a line: the first after "error:", the others indented under it
    # (as every multi-line error is): flush left, they read in a log as lines of some other
    # output. In the file's order, so the first to fix comes first.
    raise ConfigFileError(
        "\n  ".join(
            f"{path}:{line}: " + ("" if field is None else f"{field or '(top level)'}: ") + message
            for line, field, message in sorted(lines, key=lambda problem: problem[0])
        )
    ) from invalid


def _did_you_mean(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The suffix ``(did you mean 'start'?)`` for a misspelt key, from the fields allowed there."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", {})
        if isinstance(part, str) and part in fields:
            current = fields[part].annotation
        while get_origin(current) in (list, dict):
            current = get_args(current)[-1]
    known = list(getattr(current, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1) if loc else []
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"


def find_topology(path: str | os.PathLike[str] | None = None) -> Path:
    """``--config``, then ``$EDGECACHE_CONFIG``, then ``./edgecache.yaml``.

    A file named by either of the first two is the one used, or an error: a
    mistyped ``$EDGECACHE_CONFIG`` fell back to the working directory's own
    ``edgecache.yaml`` (another site's, as often as not) without a word.
    """
    if path:
        return Path(path)
    if named := os.environ.get("EDGECACHE_CONFIG"):
        if not Path(named).exists():
            raise ConfigFileError(
                f"EDGECACHE_CONFIG names {named}, which does not exist: set it to the topology "
                "file, or unset it (then --config FILE, or ./edgecache.yaml, is read)"
            )
        return Path(named)
    if Path("edgecache.yaml").exists():
        return Path("edgecache.yaml")
    raise ConfigFileError(
        "no topology file: pass --config FILE, set EDGECACHE_CONFIG, or create ./edgecache.yaml"
    )


def _topology_problems(data: dict[Any, Any], tree: yaml.Node) -> list[tuple[tuple[Any, ...], str]]:
    """What the topology's fields cannot say alone: a node listed twice, a peer that is no region.

    A node written twice (in one region or in two) was asked twice and
    counted twice: ``status`` listed it twice, ``plan`` doubled what it holds
    and its capacity. A region cannot be its own peer: it holds what it
    holds, there is no link to stage over.
    """
    regions = data.get("regions")
    if not isinstance(regions, dict):
        return []  # the model says what is wrong with it
    problems = []
    first: dict[str, tuple[Any, int]] = {}  # host:port → (region, index) where first listed
    for name, region in regions.items():
        if not isinstance(region, dict):
            continue
        nodes = region.get("nodes")
        for index, address in enumerate(nodes if isinstance(nodes, list) else []):
            try:
                target = parse_endpoint(address).target
            except InvalidEndpoint:
                continue  # the field's own check says so
            if target not in first:
                first[target] = (name, index)
                continue
            where, at = first[target]
            line = _line(tree, ("regions", where, "nodes", at))
            problems.append(
                (
                    ("regions", name, "nodes", index),
                    f"node {address!r} is listed twice (first as regions.{where}.nodes.{at}, "
                    f"line {line}): status and plan would count it, its capacity and what it "
                    "holds twice; remove one",
                )
            )
        peers = region.get("peers")
        for peer in peers if isinstance(peers, dict) else []:
            if peer == name:
                why = (
                    f"region {name} is listed as its own peer; a region holds what it holds, "
                    "with no link to stage over: remove it from its peers"
                )
            elif peer not in regions:
                close = difflib.get_close_matches(str(peer), [str(r) for r in regions], n=1)
                hint = f"did you mean {close[0]!r}?" if close else "add the region or remove it"
                why = (
                    f"peer {peer!r} is not a region of the file "
                    f"({', '.join(map(str, regions))}): {hint}"
                )
            else:
                continue
            problems.append((("regions", name, "peers", peer), why))
    return problems


def load_topology(path: str | os.PathLike[str] | None = None) -> Topology:
    """Read and validate the topology file."""
    found = find_topology(path)
    topology: Topology = _load_with_tree(found, Topology, "topology", _topology_problems)[0]
    # A relative registry path (plain or file://) is relative to the file that names
    # it, as in any config file, not to wherever a command happens to run.
    prefix = "file://" if topology.registry.startswith("file://") else ""
    path = topology.registry.removeprefix(prefix)
    if "://" not in path and not os.path.isabs(path):
        topology.registry = prefix + str((found.parent / path).resolve())
    return topology


def _job_problems(
    data: dict[Any, Any], tree: yaml.Node, topology: Topology | None
) -> list[tuple[tuple[Any, ...], str]]:
    """What the jobs' fields cannot say alone: a name used twice, a region not in ``topology``.

    Read from the file as written, so they are reported beside the field
    errors of any job, not only once every field is right.
    """
    jobs = data.get("jobs")
    if not isinstance(jobs, list):
        return []  # the model says what is wrong with it
    problems = []
    seen: dict[str, int] = {}
    for index, job in enumerate(jobs):
        if not isinstance(job, dict):
            continue
        name, region = job.get("name"), job.get("region")
        if isinstance(name, str) and name in seen:
            line = _line(tree, ("jobs", seen[name], "name"))
            problems.append(
                (
                    ("jobs", index, "name"),
                    f"job name {name!r} appears twice; names must be unique (the first is "
                    f"jobs.{seen[name]}, line {line})",
                )
            )
        elif isinstance(name, str):
            seen[name] = index
        if topology is not None and isinstance(region, str) and region not in topology.regions:
            who = f"job {name!r}" if isinstance(name, str) else "the job"
            problems.append(
                (
                    ("jobs", index, "region"),
                    f"{who} runs in region {region!r}, which the topology does not have "
                    f"({', '.join(sorted(topology.regions))})",
                )
            )
    return problems


def load_schedule(path: str | os.PathLike[str], topology: Topology | None = None) -> Schedule:
    """Read and validate a schedule; with a topology, regions must exist in it."""
    schedule, _ = _load_with_tree(
        Path(path), Schedule, "schedule", lambda data, tree: _job_problems(data, tree, topology)
    )
    return schedule  # type: ignore[no-any-return]


def nodes_nearest_first(
    config: str | os.PathLike[str], region: str | None
) -> tuple[list[str], list[str]]:
    """(every node, the region's own nodes) of a topology file, for a reader in ``region``.

    The region's nodes come first, then the other regions' in file order; with
    no region, every node in file order. Read with :func:`load_topology`, the
    loader the CLI uses, so a malformed file fails with the same message (file,
    line, field).
    """
    topology = load_topology(config)
    regions = topology.regions
    if region is None:
        return [node for r in regions.values() for node in r.nodes], []
    if region not in regions:
        raise InvalidEndpoint(
            f"region {region!r} is unknown: {config} has regions {', '.join(sorted(regions))}"
        )
    own = list(regions[region].nodes)
    return own + [node for name, r in regions.items() if name != region for node in r.nodes], own
