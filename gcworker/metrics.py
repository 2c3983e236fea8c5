"""Prometheus metrics of the control plane and of the reporter.

Multiprocess: a Celery reconciler applies events in its pool's child processes, so every value
is written where the process that serves `/metrics` can read it. That is prometheus-client's
multiprocess mode, chosen by `PROMETHEUS_MULTIPROC_DIR` *before this module is imported*: the
commands that start Celery processes (`gcworker reconciler`, `gcworker up`) set it to a fresh
folder first, and the process that serves `/metrics` reads every process's file through a
`MultiProcessCollector` (`serve`). Without the variable (the reporter, embedded `up`), values
live in the process and `serve` exposes the default registry.

The gauges of the database's state (`gcworker_workers`, `gcworker_missing_rows`) are refreshed
after each collection by the process that ran it; in multiprocess mode the most recent value wins.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
)

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
KINDS = ("container", "volume")
REPORT_OUTCOMES = ("accepted", "stale", "rejected", "worker_not_running", "full_report_needed")
COLLECTION_OUTCOMES = ("completed", "skipped", "failed")
HEARTBEAT_OUTCOMES = ("registered", "extended", "resumed", "new_incarnation", "stale", "rejected")
BACKLOG_STATES = ("creating", "failed", "destroying")
MESSAGE_TYPES = ("heartbeat", "report", "unchanged")
REPORTER_PREFIX = "gcworker_reporter_"
# The reporter's own registry: its /metrics shows its series (and its process's), none of the
# control plane's, whatever modules it imported.
REPORTER_REGISTRY = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REPORTER_REGISTRY.register(_collector)
WORKER_STATES = ("running", "stalled", "landing", "landed", "retiring")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_COLLECTION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

# Control plane: events ---------------------------------------------------------------------

REPORTS = Counter("gcworker_reports", "Reports received, by outcome.", ["outcome"])
HEARTBEATS = Counter(
    "gcworker_heartbeats", "Heartbeats received, by outcome (rejected: on arrival).", ["outcome"]
)
MESSAGES_REJECTED = Counter(
    "gcworker_messages_rejected",
    "Messages rejected on arrival (malformed, unsigned, wrongly signed...), by task.",
    ["task"],
)
REPORT_RECONCILE_SECONDS = Histogram(
    "gcworker_report_reconcile_seconds",
    "Time to decode, check and apply one report, commit included.",
    buckets=_LATENCY_BUCKETS,
)
REPORT_LAG_SECONDS = Histogram(
    "gcworker_report_lag_seconds",
    "Control plane's clock at application minus the worker's clock at sending (for lag only).",
    buckets=_LAG_BUCKETS,
)
ROWS_MARKED_MISSING = Counter(
    "gcworker_rows_marked_missing", "Rows marked missing by reports (rule 1).", ["kind"]
)
ROWS_CLEARED = Counter(
    "gcworker_rows_cleared", "Missing marks cleared by reports (rule 3).", ["kind"]
)
ROWS_DELETED = Counter(
    "gcworker_rows_deleted",
    "Rows deleted: missing past the grace period (collector, rule 4) or confirmed destroyed "
    "(reconciler, rule 9); workers deleted by the collector have kind=worker.",
    ["kind", "reason"],
)
UNKNOWN_HANDLES = Counter(
    "gcworker_unknown_handles",
    "Handles reported with no row, recorded as destroying (rule 8).",
    ["kind"],
)

# Control plane: collections ----------------------------------------------------------------

COLLECTION_SECONDS = Histogram(
    "gcworker_collection_seconds", "Duration of completed collections.", buckets=_COLLECTION_BUCKETS
)
COLLECTIONS = Counter(
    "gcworker_collections",
    "Collections, by outcome (skipped: another collection held the fence).",
    ["outcome"],
)
WORKERS = Gauge(
    "gcworker_workers",
    "Workers by state, as of the last collection.",
    ["state"],
    multiprocess_mode="mostrecent",
)
MISSING_ROWS = Gauge(
    "gcworker_missing_rows",
    "Rows marked missing, as of the last collection.",
    ["kind"],
    multiprocess_mode="mostrecent",
)

DISRUPTION = Gauge(
    "gcworker_disruption",
    "1 while the collector is in disruption mode (rule 12: stalling no one, deleting nothing), "
    "as of the last collection; else 0. The start-up phase is not counted: gcworker_starting_up.",
    multiprocess_mode="mostrecent",
)
STARTING_UP = Gauge(
    "gcworker_starting_up",
    "1 while the collector holds for the reconcilers' start-up (up for less than a heartbeat "
    "TTL: stalling no one, deleting nothing, as in disruption mode), as of the last collection.",
    multiprocess_mode="mostrecent",
)

LAST_COLLECTION = Gauge(
    "gcworker_last_collection_timestamp_seconds",
    "When the last completed collection finished (Unix time; 0: none yet).",
    multiprocess_mode="max",
)
BACKLOG_ROWS = Gauge(
    "gcworker_backlog_rows",
    "Rows waiting in creating, failed or destroying, by kind and state, as of the last collection.",
    ["kind", "state"],
    multiprocess_mode="mostrecent",
)
BACKLOG_OLDEST_SECONDS = Gauge(
    "gcworker_backlog_oldest_seconds",
    "How long the oldest row has been in that state (0: none), as of the last collection.",
    ["kind", "state"],
    multiprocess_mode="mostrecent",
)
BUILD_INFO = Gauge(
    "gcworker_build_info",
    "1, labelled with gcworker's version.",
    ["version"],
    multiprocess_mode="max",
)

# Control plane: the broker, as the last collection saw it (gcworker.broker_health) ----------

HEARTBEAT_RECONCILERS = Gauge(
    "gcworker_heartbeat_reconcilers",
    "Reconcilers holding a live lease on the heartbeats queue.",
    multiprocess_mode="mostrecent",
)
HEARTBEATS_WAITING = Gauge(
    "gcworker_heartbeats_waiting",
    "Heartbeats waiting in the broker's heartbeats queue.",
    multiprocess_mode="mostrecent",
)
HEARTBEAT_WAIT_SECONDS = Gauge(
    "gcworker_heartbeat_wait_seconds",
    "A heartbeat still in the queue has waited at least this long (0: none seen waiting).",
    multiprocess_mode="mostrecent",
)
HEARTBEATS_RETRYING = Gauge(
    "gcworker_heartbeats_retrying",
    "Heartbeats waiting for a retry (the database refused them).",
    multiprocess_mode="mostrecent",
)

# Reporter ----------------------------------------------------------------------------------

REPORTER_SENT = Counter(
    "gcworker_reporter_messages_sent",
    "Messages the reporter published, by type.",
    ["type"],
    registry=REPORTER_REGISTRY,
)
REPORTER_SEND_FAILURES = Counter(
    "gcworker_reporter_send_failures",
    "Messages the reporter could not publish (broker unreachable...), by type.",
    ["type"],
    registry=REPORTER_REGISTRY,
)
REPORTER_LISTING_FAILURES = Counter(
    "gcworker_reporter_listing_failures",
    "Runtime listings that failed (no report was sent).",
    registry=REPORTER_REGISTRY,
)
REPORTER_HANDLES = Gauge(
    "gcworker_reporter_handles",
    "Handles the runtime held at the last listing.",
    ["kind"],
    registry=REPORTER_REGISTRY,
)
REPORTER_REMOVED = Counter(
    "gcworker_reporter_handles_removed",
    "Handles the reporter removed because the control plane holds them as destroying.",
    ["kind"],
    registry=REPORTER_REGISTRY,
)
REPORTER_ANSWERS_IGNORED = Counter(
    "gcworker_reporter_answers_ignored",
    "Control-plane answers (stamp, destroy list) the reporter ignored, by answer and reason "
    "(untrusted: unsigned or forged; stale, future, other_incarnation: not current; "
    "other_generation: a list awaiting its newer version).",
    ["answer", "reason"],
    registry=REPORTER_REGISTRY,
)
REPORTER_HANDLES_SKIPPED = Counter(
    "gcworker_reporter_handles_skipped",
    "Entries the reporter skipped: listed by the runtime but no valid handle (never reported), "
    "or named for removal but invalid or not held by the runtime (never removed).",
    ["why"],
    registry=REPORTER_REGISTRY,
)
SWEEP_FAILURES = Counter(
    "gcworker_reporter_sweep_failures",
    "Removals of destroying handles that failed or timed out (retried on a later round).",
    ["kind", "reason"],
    registry=REPORTER_REGISTRY,
)

for _outcome in REPORT_OUTCOMES:
    REPORTS.labels(_outcome)
for _outcome in COLLECTION_OUTCOMES:
    COLLECTIONS.labels(_outcome)
for _kind in KINDS:
    ROWS_MARKED_MISSING.labels(_kind)
    ROWS_CLEARED.labels(_kind)
    UNKNOWN_HANDLES.labels(_kind)
    ROWS_DELETED.labels(_kind, "missing")
    ROWS_DELETED.labels(_kind, "confirmed_destroyed")
    MISSING_ROWS.labels(_kind)
    REPORTER_HANDLES.labels(_kind)
    REPORTER_REMOVED.labels(_kind)
    for _reason in ("error", "timeout"):
        SWEEP_FAILURES.labels(_kind, _reason)
    for _state in BACKLOG_STATES:
        BACKLOG_ROWS.labels(_kind, _state)
        BACKLOG_OLDEST_SECONDS.labels(_kind, _state)
for _task in ("heartbeat", "report", "collect"):
    MESSAGES_REJECTED.labels(_task)
for _outcome in HEARTBEAT_OUTCOMES:
    HEARTBEATS.labels(_outcome)
for _state in WORKER_STATES:
    WORKERS.labels(_state)
for _type in MESSAGE_TYPES:
    REPORTER_SENT.labels(_type)
    REPORTER_SEND_FAILURES.labels(_type)
for _answer in ("stamp", "destroylist"):
    for _reason in ("untrusted", "stale", "future", "other_incarnation", "other_generation"):
        REPORTER_ANSWERS_IGNORED.labels(_answer, _reason)
for _why in ("invalid_listed", "invalid_named", "not_held"):
    REPORTER_HANDLES_SKIPPED.labels(_why)
try:
    BUILD_INFO.labels(version("gcworker")).set(1)
except PackageNotFoundError:  # run from a checkout that was never installed
    BUILD_INFO.labels("unknown").set(1)


def multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class _ControlPlaneSeries:
    """Every process's values (multiprocess mode) but the reporter's: in that mode each series a
    process merely declares is written to its files, the reporter's included."""

    def __init__(self, collector):
        self.collector = collector

    def collect(self):
        return (m for m in self.collector.collect() if not m.name.startswith(REPORTER_PREFIX))


def registry() -> CollectorRegistry:
    """What the control plane's `/metrics` shows: every process's values in multiprocess mode,
    else this one's; never the reporter's series (`REPORTER_REGISTRY`)."""
    if not multiprocess():
        return REGISTRY
    from prometheus_client import multiprocess as mp

    combined = CollectorRegistry()
    combined.register(_ControlPlaneSeries(mp.MultiProcessCollector(None)))
    return combined


def serve(
    port: int,
    address: str = "0.0.0.0",
    *,
    registry_: CollectorRegistry | None = None,
    checks=None,
):
    """Serve `/metrics` (the control plane's series, unless `registry_` says otherwise), and
    `/healthz` and `/readyz` (`checks`: `gcworker.health.Checks`) on `port`, from a background
    thread; returns the server."""
    from gcworker import health

    chosen = registry() if registry_ is None else registry_
    app = health.wsgi_app(make_wsgi_app(chosen), checks)
    server = make_server(address, port, app, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info(
        "metrics served",
        extra={"port": port, "multiprocess": multiprocess(), "paths": "/metrics /healthz /readyz"},
    )
    return server


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process up at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """Every scrape and probe would be a line on stderr."""


def process_exited(pid: int) -> None:
    """Drop a dead pool process's live gauges (multiprocess mode only)."""
    if multiprocess():
        from prometheus_client import multiprocess as mp

        mp.mark_process_dead(pid)


def count_counts(counter: Counter, counts: dict[str, int], *extra_labels: str) -> None:
    for kind, n in counts.items():
        if n:
            counter.labels(kind, *extra_labels).inc(n)


def set_states(gauge: Gauge, counts: dict[str, int], labels: Iterable[str]) -> None:
    for label in labels:
        gauge.labels(label).set(counts.get(label, 0))
