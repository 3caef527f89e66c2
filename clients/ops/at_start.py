"""The version a started job's ``name`` resolved to, from the registry's publish times.

A job reads one version from its start to its end: its EdgeDataset resolves
``name`` (or ``name@latest``) when it is built. The controller's record and
warm's keep what they resolved for the jobs they saw; a job neither saw (no
controller round ran before its start, warm never ran for it) was resolved to
the newest version when first seen, so a version published while it ran was
staged and pinned for it, the job called "cannot be met", and the version it
reads left unpinned. Each manifest's ``created_at`` says which version was the
newest at the start.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from datetime import UTC, datetime

from edgecache.cache.errors import EdgeCacheError, VersionNotFound
from edgecache.cache.names import parse_spec
from edgecache.cache.registry import Registry
from edgecache.clients.topology import Schedule

__all__ = ["Known", "newest_at_start", "versions_at"]

log = logging.getLogger(__name__)


Known = dict[tuple[str, datetime], tuple[int, bool] | None]  # versions_at's answers so far


def versions_at(
    registry: str, asked: Set[tuple[str, datetime]], known: Known | None = None
) -> dict[tuple[str, datetime], tuple[int, bool]]:
    """(dataset, start) → the newest version published by then, and whether it is the newest.

    Manifests are read newest first, each once, and only as far back as a start
    needs. A dataset without versions, or with none published by a start, has
    no entry. A registry that cannot be read raises its
    :class:`~edgecache.cache.errors.EdgeCacheError`. ``known``: the answers of
    earlier calls in one pass over a schedule (warm's record, then the jobs
    neither record holds), filled here: the registry is read once for them.
    """
    known = {} if known is None else known
    missing = {key for key in asked if key not in known}

    async def read(reg: Registry) -> dict[tuple[str, datetime], tuple[int, bool]]:
        published: dict[str, list[tuple[int, datetime]]] = {}  # newest first, read lazily
        found = {}
        for dataset, start in sorted(missing):
            try:
                numbers = await reg.published(dataset)
            except VersionNotFound:
                continue  # the plan says so
            seen = published.setdefault(dataset, [])
            for index, number in enumerate(reversed(numbers)):
                if index == len(seen):
                    manifest = await reg.manifest(dataset, number)
                    seen.append((number, manifest.created_at.ToDatetime(UTC)))
                if seen[index][1] <= start:
                    found[(dataset, start)] = (number, index == 0)
                    break
        return found

    if missing:
        found = Registry.run(registry, read)
        known.update({key: found.get(key) for key in missing})
    return {key: answer for key in asked if (answer := known[key]) is not None}


def newest_at_start(
    schedule: Schedule, registry: str, now: datetime, known: Known | None = None
) -> Schedule:
    """The schedule with each running job's ``name`` as the version newest at its start.

    Only where a newer version was published after the start: a ``name`` whose
    newest version the job could have read stays as written, as does one with
    no version published before the start (the job waits for the first). A
    registry that cannot be read leaves the schedule as it is, with a warning;
    the plan then says what is wrong with it. ``known``: see :func:`versions_at`.
    """
    asked = {
        (parse_spec(spec).dataset, job.start)
        for job in schedule.jobs
        if job.start <= now < job.end
        for spec in job.datasets
        if parse_spec(spec).version is None
    }
    try:
        at = versions_at(registry, asked, known)
    except EdgeCacheError as exc:
        log.warning("the registry's publish times could not be read (%s): %s", registry, exc)
        return schedule
    found = {key: number for key, (number, newest) in at.items() if not newest}
    if not found:
        return schedule
    jobs = []
    for job in schedule.jobs:
        if job.start <= now < job.end:
            datasets = []
            for spec in job.datasets:
                wanted = parse_spec(spec)
                number = found.get((wanted.dataset, job.start)) if wanted.version is None else None
                datasets.append(spec if number is None else f"{wanted.dataset}@{number}")
            job = job.model_copy(update={"datasets": list(dict.fromkeys(datasets))})
        jobs.append(job)
    return schedule.model_copy(update={"jobs": jobs})
