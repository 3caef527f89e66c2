"""``edgecache controller``: run a schedule's plan continuously, on time."""

from __future__ import annotations

import math
import os
import signal
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import (
    ConfigOption,
    ExitCode,
    LogLevel,
    LogLevelOption,
    Options,
    TokenOption,
    configure_logging,
    exit_with,
    reporting,
)
from edgecache.clients.cli.render import console, err_console, error

if TYPE_CHECKING:
    from edgecache.cache.planner import Plan
    from edgecache.clients.controller import Controller


@app.command()
def controller(
    schedule: Annotated[
        Path,
        typer.Option(
            "--schedule", envvar="EDGECACHE_SCHEDULE", help="Schedule file (re-read every round)."
        ),
    ],
    config: ConfigOption = None,
    interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between planning rounds.")
    ] = 30.0,
    metrics_listen: Annotated[
        str | None,
        typer.Option(envvar="EDGECACHE_CONTROLLER_METRICS_LISTEN", help="Prometheus HOST:PORT."),
    ] = None,
    lease_ttl: Annotated[
        # controller.MIN_LEASE_TTL (not imported: the controller loads only when it runs)
        float,
        typer.Option(
            min=2.0,
            help="Seconds the lease lasts without renewal (at least 2: a renewal and a call).",
        ),
    ] = 30.0,
    at: Annotated[
        str | None,
        typer.Option(help="Start the clock at this time (ISO 8601 with zone): rehearse a day."),
    ] = None,
    speed: Annotated[
        float, typer.Option(min=0.001, help="Simulated seconds per second (with --at).")
    ] = 1.0,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            help="With --at: act on the topology's live nodes and save the real record at "
            "the simulated time (refused without it).",
        ),
    ] = False,
    once: Annotated[
        bool,
        typer.Option(
            "--once",
            help="Rounds until one starts no task (a task due once another ended runs "
            "too); wait for the tasks; exit.",
        ),
    ] = False,
    keep_records: Annotated[
        float,
        typer.Option(
            "--keep-records",
            metavar="HOURS",
            help="Hours the record keeps a job and its tasks after the job ends (plan --status).",
        ),
    ] = 24.0,
    token_file: TokenOption = None,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Run the schedule: pin, evict and stage each task when its planned start comes.

    Every round re-plans from the nodes' live status, so a dead node or a
    vanished version is planned around. Only one controller acts at a time
    (a lease in the registry); others stand by and take over when it lapses.
    Plan against reality: `edgecache plan SCHEDULE --status` and the
    edgecache_controller_* metrics. A running controller logs what fails (a
    node down, a pin, eviction or stage that failed) and tries again next
    round (a failed stage after a backoff); a schedule edit that does not
    validate is logged once and the last good schedule runs on. A node that
    does not answer is logged when it goes down and when it is back, and is
    not called until it answers; a round's calls end inside the lease.

    The task gauges count live tasks only: one the plan no longer has stops
    counting once its jobs have started (a late task, then, too). The record
    (<registry>/_controller/state.json, read by plan --status: missed, and
    why) keeps tasks and jobs for --keep-records hours (24) after their jobs
    end, then drops them (at once when the jobs leave the schedule).

    Rehearsal: --at TIME [--speed N] runs the rounds on a simulated clock.
    It acts on the topology's nodes and saves the record in its registry as
    if it were that time, so it is refused (exit 2) unless --yes is given:
    rehearse against a topology of its own, not the live one.

    Stopping: SIGTERM or Ctrl-C ends the round, stops the staging tasks
    (whole shards are kept) and gives the lease up; a second one stops at
    once (the next controller resumes the tasks when the lease lapses).
    Exit codes: 0 stopped by SIGTERM, or --once done with every action
    carried out; 1 failed: with --once, another controller holds the lease,
    or something the round did failed (each failure listed on stderr); 2 bad
    input (a schedule or topology that does not validate, a registry on a local
    path that does not exist: a controller creates none; with --once, a peer the
    plan copies from that refused the staging node for its configuration, said
    as "peer refused:"); 3 with --once, a job
    cannot be met (listed on stderr, as plan does; a version the round staged
    whole after all is said as "there now" instead); 130 interrupted by Ctrl-C,
    --once included (run it again to resume); 143 a second SIGTERM.
    """
    import prometheus_client

    from edgecache.clients.channels import credentials_refused_in
    from edgecache.clients.cli.staging import (
        parse_at,
        report_infeasible,
        report_there_now,
        there_now,
    )
    from edgecache.clients.controller import Controller, SimulatedClock
    from edgecache.clients.topology import load_schedule

    configure_logging(log_level)
    prometheus_client.disable_created_metrics()  # its own process: no `_created` per counter
    options = Options(config, token_file)
    with reporting():
        start = parse_at(at)
        if start is None and speed != 1.0:
            raise ValueError("--speed needs --at (the time the simulated clock starts)")
        if start is not None and not yes:
            raise ValueError(_AT_REFUSED.format(at=at))
        clock = SimulatedClock(start, speed) if start else (lambda: datetime.now(UTC))
        running = Controller(
            options.config,
            schedule,
            token=options.token,
            clock=clock,
            lease_ttl=lease_ttl,
            record_retention=record_retention(keep_records),
            standby=not once,
            retry_failed_now=once,  # a run that skips a failing task cannot say it is done
        )
    received: list[int] = []  # the stop signals so far

    def on_signal(signum: int, _frame: object) -> None:
        """The first SIGTERM or Ctrl-C stops cleanly; a second one stops at once.

        A clean stop lets the round end (its calls are bounded by the lease)
        and the tasks stop, saves the record and gives the lease up. Stopping
        at once skips all that: staging commits whole shards, so the next
        controller finishes the tasks, once this one's lease lapses.
        """
        if received:
            err_console.print(
                "stopped at once: a staging task in flight loses only the shard it was "
                "on, and the lease is held until it lapses (--lease-ttl "
                f"{lease_ttl:g} s); run the controller again to resume the tasks",
                highlight=False,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)
        received.append(signum)
        if signum == signal.SIGINT:
            err_console.print("stopping (Ctrl-C again to stop at once)", highlight=False)
        running.stop.set()

    try:
        if once:
            # Bad input is said before anything is announced: "running bad.yaml once" on
            # stdout, then its error, read as a round that ran. (A controller that keeps
            # running waits for the file to validate, rereading it every round.)
            with reporting():
                load_schedule(schedule, running.topology)
        if metrics_listen:
            with reporting():
                bound = _serve_metrics(running, metrics_listen, interval)
            console.print(f"metrics on {bound}")
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)
        every = "once" if once else f"every {interval:g} s"
        console.print(f"controller {running.holder} running {schedule} {every}")
        if once:
            with reporting():
                acted_on = running.tick()
                if acted_on is None:  # another controller holds the lease
                    error(_lease_held(running))
                    raise exit_with(ExitCode.FAILED)
            running.wait_idle()
            first = acted_on  # what it called late: "there now" if the run staged it whole
            failures, refusals = list(running.failures), list(running.peer_refusals)
            # A task due once the round's own tasks ended (the next one on the same link, a
            # peer region's copy of what was just staged) was left for a next run, which
            # exited 0 as if the plan were carried out: rounds follow until one starts no
            # task, or one fails (a failure is retried by a controller that keeps running,
            # with a backoff; here it is said and the run exits).
            rounds = 1
            while not failures and not received and rounds < _ONCE_ROUNDS:
                started = running.started
                with reporting():
                    again = running.tick()
                if again is None:  # another controller took the lease meanwhile
                    break
                running.wait_idle()
                acted_on, rounds = again, rounds + 1
                failures += running.failures
                refusals += [r for r in running.peer_refusals if r not in refusals]
                if running.started == started:
                    break
            later = _not_due(acted_on, running.clock())
            if later:
                console.print(f"not due yet: {later} (run the controller again then)")
            # What cannot be met, as warm says it (an unreachable region is a failure of
            # the round, said below); a failure (1) outranks it (3). What the round staged
            # whole after all is said as such, and does not count.
            there = there_now(first, running.held_whole())
            cannot = report_infeasible(acted_on, there)  # what the last round still cannot meet
            if running.last_schedule is not None:
                report_there_now(there, running.last_schedule)
            for failure in failures:
                error(failure)
            if failures and not received:
                # Every failure a node refusing this token (the read one, where Pin and
                # Evict need the admin's): bad input, as warm and evict exit for it.
                refused = all(map(credentials_refused_in, failures))
                raise exit_with(ExitCode.BAD_INPUT if refused else ExitCode.FAILED)
            for refusal in refusals:
                err_console.print(f"[red]peer refused:[/red] {refusal}", soft_wrap=True)
            if refusals and not received:
                raise exit_with(ExitCode.BAD_INPUT)  # a setting to fix, as warm exits for it
            if cannot and not received:
                raise exit_with(ExitCode.CANNOT_BE_MET)
        else:
            running.run(interval)
    finally:
        running.close()
        running.metrics.shutdown()
    if received and received[0] == signal.SIGINT:
        err_console.print("interrupted; run the same command again to resume", highlight=False)
        raise typer.Exit(ExitCode.INTERRUPTED)


_AT_REFUSED = (
    "--at {at} runs the controller as if it were that time against the live nodes of the "
    "topology: it would pin, unpin, evict and stage there on the simulated clock and save "
    "simulated times in the real record (<registry>/_controller/state.json). Rehearse on a "
    "topology of its own (its own nodes and registry) and pass --yes to go ahead; to see "
    "what the plan would be then without acting, run edgecache plan SCHEDULE --at {at}"
)


_ONCE_ROUNDS = 50  # rounds of one --once run at most: each started a task, so work moves on


def _not_due(plan: Plan, now: datetime) -> str:
    """The plan's tasks that start after ``now``, as ``region name@N at time`` (the first few)."""
    later = sorted(
        (task.start, region, task.spec)
        for region, region_plan in plan.regions.items()
        for task in region_plan.tasks
        if task.start > now
    )
    said = [f"{region} {spec} at {start:%Y-%m-%d %H:%M:%S}Z" for start, region, spec in later[:3]]
    return ", ".join(said) + (f" and {len(later) - 3} more" if len(later) > 3 else "")


def _lease_held(running: Controller) -> str:
    """Why ``--once`` did nothing: which controller holds the lease, and what to do."""
    other = running.other_leader
    if other is None:
        return "another controller took the lease mid-round; nothing more was done"
    until = datetime.fromtimestamp(other.expires, UTC).isoformat(timespec="seconds")
    return (
        f"controller {other.holder} holds the lease (until {until} unless it renews it), so "
        "this one did nothing: a controller already runs the schedule. Wait for it (edgecache "
        "plan SCHEDULE --status shows what it does), or stop it (SIGTERM gives the lease up) "
        "and run this again"
    )


KEEP_RECORDS_MAX = 87_600.0  # hours: ten years, well inside what a datetime can reach


def record_retention(hours: float) -> timedelta:
    """``--keep-records``'s hours as a retention; anything but a positive number is bad input.

    Zero or less would drop a job's record as it ends, before ``plan --status``
    could say how it went; NaN or a span past the calendar's end would fail
    every round when added to a job's end.
    """
    if not math.isfinite(hours) or not 0 < hours <= KEEP_RECORDS_MAX:
        raise ValueError(
            f"--keep-records {hours:g} is not a retention: give the hours plan --status "
            f"still shows a job after it ends, above 0 and at most {KEEP_RECORDS_MAX:g} "
            "(ten years), e.g. --keep-records 24 (the default)"
        )
    return timedelta(hours=hours)


def _serve_metrics(running: Controller, listen: str, interval: float) -> str:
    """Serve the controller's metrics on ``--metrics-listen``; its ``HOST:PORT`` as bound.

    An address that is not ``HOST:PORT`` or cannot be bound is bad input naming the
    option (exit 2), as ``serve`` says of its own addresses, not a traceback.
    """
    import errno

    from edgecache.cache.addresses import split_hostport

    try:
        host, port = split_hostport(listen)
    except ValueError:
        raise ValueError(
            f"--metrics-listen {listen!r} is not HOST:PORT (e.g. 0.0.0.0:9090)"
        ) from None
    try:
        bound = running.metrics.serve(host, port, lambda: running.health(interval))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "is in use: another process listens there; choose another address"
        else:
            why = f"cannot be bound ({exc.strerror or exc})"
        raise ValueError(f"--metrics-listen {listen} {why}") from None
    return f"{host}:{bound}"
