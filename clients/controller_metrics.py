"""Prometheus metrics of the controller: plan against reality.

Names follow Prometheus conventions (``_total`` counters, base units). The
questions they answer: is staging keeping up with the schedule (tasks by
state, late ones), did any job start without its data, how far off were the
plan's predictions, and where did the bytes come from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["NODE_LABELS", "ControllerMetrics"]

# The labels of the per-node series. ``node`` is the node id the node reports in its
# Status, the ``node`` of its own metrics (edgecache_cache_*, edgecache_read_*), so the
# two join; ``address`` is the node's address in the topology. A node not heard from
# since the record began is named by its address in both.
NODE_LABELS = ("region", "node", "address")


class ControllerMetrics:
    """The controller's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._http: ThreadingHTTPServer | None = None
        r = self.registry
        self.tasks = Gauge(
            "edgecache_controller_tasks",
            "Live staging tasks by state, each task in one state only: late (ready after, "
            "or not ready at, its deadline, whatever else it is), else pending, running, "
            "done or failed; a task stops counting once the plan no longer has it and its "
            "jobs have started",
            ["state"],
            registry=r,
        )
        self.jobs_unready_at_start = Counter(
            "edgecache_controller_jobs_unready_at_start_total",
            "Jobs whose data was not complete in their region when they started (a job no "
            "controller round saw before its start is not counted: that is not known)",
            registry=r,
        )
        # The third verdict at a start, beside complete (not counted) and unready: a job no
        # round saw before it started (the controller restarted late, the schedule was edited
        # late). Without it such a job left no trace in any metric.
        self.jobs_unknown_at_start = Counter(
            "edgecache_controller_jobs_unknown_at_start_total",
            "Jobs no controller round saw before their start (the controller started late, "
            "or the schedule gained the job late): whether their data was complete then is "
            "unknown, and they are not counted as unready",
            registry=r,
        )
        # A job the plan cannot meet was only a log line until its start (then counted in
        # jobs_unready_at_start): an alert can fire hours before, while there is time to act.
        self.jobs_infeasible = Gauge(
            "edgecache_controller_jobs_infeasible",
            "Jobs not yet started that the last round's plan cannot meet (a version not "
            "published, a region too small, a link too slow for the start), and running ones "
            "no round saw before their start that it cannot meet; plan --status says why",
            registry=r,
        )
        staged = Counter(
            "edgecache_controller_staged_bytes_total",
            "Bytes staged by the controller's tasks, by source (origin: source bytes; "
            "peer: stored bytes)",
            ["source"],
            registry=r,
        )
        self.staged_bytes = {source: staged.labels(source=source) for source in ("origin", "peer")}
        self.ready_delay = Histogram(
            "edgecache_controller_ready_delay_seconds",
            "Actual minus predicted ready time of finished tasks (negative: early)",
            buckets=(-3600, -600, -60, -10, 0, 10, 60, 300, 600, 1800, 3600, 14400),
            registry=r,
        )
        self.evictions = Counter(
            "edgecache_controller_evictions_total", "Evictions carried out", registry=r
        )
        self.evictions_refused = Counter(
            "edgecache_controller_evictions_refused_total",
            "Planned evictions refused because a job reads (or is about to read) the version",
            registry=r,
        )
        self.evictions_failed = Counter(
            "edgecache_controller_evictions_failed_total",
            "Planned evictions a node failed or could not be asked (down); the next round "
            "tries again while the plan still has them",
            registry=r,
        )
        self.pin_failures = Counter(
            "edgecache_controller_pin_failures_total",
            "Pins, and releases of pins the plan no longer keeps, that a node failed; each "
            "round's attempt counts, and the next round tries again",
            registry=r,
        )
        self.task_failures = Counter(
            "edgecache_controller_task_failures_total",
            "Staging runs that failed (each is retried with backoff while the plan needs it)",
            registry=r,
        )
        self.peer_refusals = Counter(
            "edgecache_controller_peer_refusals_total",
            "Staging runs whose version came from origin because the peers the plan chose "
            "refused the staging node for its configuration (a peer token, TLS): origin "
            "egress paid until that setting is fixed",
            ["region"],
            registry=r,
        )
        self.schedule_valid = Gauge(
            "edgecache_controller_schedule_valid",
            "1 when the schedule file validated at the last round; 0 while a broken edit "
            "leaves the controller running on the last good schedule",
            registry=r,
        )
        self.ticks = Counter(
            "edgecache_controller_ticks_total",
            "Rounds: planning rounds while leading, lease checks while standing by",
            registry=r,
        )
        self.tick_errors = Counter(
            "edgecache_controller_tick_errors_total", "Rounds that failed", registry=r
        )
        self.last_tick = Gauge(
            "edgecache_controller_last_tick_timestamp_seconds",
            "When the last round finished (unix time)",
            registry=r,
        )
        self.node_rtt = Gauge(
            "edgecache_controller_node_rtt_seconds",
            "Round trip from the controller to each node (median of health checks, each "
            "round); no series while the node is down",
            NODE_LABELS,
            registry=r,
        )
        self.node_up = Gauge(
            "edgecache_controller_node_up",
            "1 when the node answered the controller's last round, else 0 (node: its node "
            "id, as in its own metrics; address: the topology's)",
            NODE_LABELS,
            registry=r,
        )
        self.leader = Gauge(
            "edgecache_controller_leader",
            "1 while this controller holds the lease and acts, 0 while it stands by",
            registry=r,
        )

    def serve(self, host: str, port: int, healthy: Callable[[], str | None]) -> int:
        """Serve ``/metrics`` and ``/healthz``; returns the bound port.

        ``healthy()`` returns None when the controller is alive, else why not
        (for a liveness probe: a planning loop that stopped turning is not
        seen by a scrape, which a separate thread answers).
        """
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.startswith("/healthz"):
                    problem = healthy()
                    body = (problem or "ok").encode() + b"\n"
                    self.send_response(503 if problem else 200)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                else:
                    body = generate_latest(registry)
                    self.send_response(200)
                    self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass  # scrapes every few seconds would flood the log

        self._http = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._http.serve_forever, name="metrics", daemon=True).start()
        return int(self._http.server_address[1])

    def shutdown(self) -> None:
        """Stop the ``/metrics`` server, if started."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
