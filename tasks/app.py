"""The Celery application of the control plane: `celery -A tasks.app worker|beat|flower`.

Settings come from the same `GCWORKER_*` environment as every gcworker command (rule 14: a bad
value stops the process with one line naming it). The broker is `GCWORKER_BROKER_URL` (Redis);
every Redis key the pipeline uses is prefixed with `GCWORKER_BROKER_NAMESPACE` + ":".

Delivery guarantees:

- JSON only, in and out; no result backend (tasks return nothing anyone waits for).
- A report is acknowledged only after its transaction commits (`task_acks_late`), a pool
  process that dies mid-task gives its message back at once (`task_reject_on_worker_lost`), and
  each process reserves one message at a time (`worker_prefetch_multiplier = 1`), so a
  reconciler killed with SIGKILL loses nothing: what it held unacknowledged goes back to the
  queue after `GCWORKER_BROKER_VISIBILITY_TIMEOUT`. A redelivered message is harmless: the
  database accepts only a higher sequence number (rule 6).
- A message the decoder rejects is acknowledged after its dead-letter entry is written and
  logged: never redelivered forever, never crashing the reconciler.

Each reconciler holds a lease in Redis on every queue it consumes, renewed from its consumer's
event loop (`HeartbeatLease` below, `gcworker.broker_health`): the collector's safety brake holds
while no reconciler is alive to process heartbeats (rule 12).

`gcworker reconciler` and `gcworker beat` run this app with the right options; `gcworker up`
starts both (and Flower) as child processes.
"""

from __future__ import annotations

import logging
import os
import shutil

from celery import bootsteps, signals

from gcworker.settings import Settings, SettingsError, load_settings
from tasks import kombu_fixes
from tasks.config import make_app

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "GCWORKER_METRICS_PORT"
METRICS_DIR_TEMPORARY_ENV = "GCWORKER_METRICS_DIR_TEMPORARY"


class _WithoutTaskArguments(logging.Filter):
    """Celery attaches each task's arguments to its log records (`data`): a report's complete
    handle lists. Keep them out of the logs; the message says which task it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("data", None)
        return True


def _settings_or_exit() -> Settings:
    try:
        return load_settings()
    except SettingsError as error:
        raise SystemExit(f"gcworker: {error}") from None


def _configure_logging(level: str, log_format: str) -> None:
    from gcworker import logs

    logs.configure(level, log_format if log_format in logs.FORMATS else "text")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_WithoutTaskArguments())


if not logging.getLogger().handlers:
    # Before the settings, whose warnings must come out formatted. Flower never sends
    # setup_logging: its lines (and Tornado's) get this handler, which keeps Tornado from adding
    # its own; Flower's --logging sets the level. A worker or beat configures again, at its
    # --loglevel. (A bad GCWORKER_LOG_FORMAT is reported by the settings, just below.)
    _configure_logging("WARNING", os.environ.get("GCWORKER_LOG_FORMAT", "text"))
settings = _settings_or_exit()
app = make_app(settings, main=True)

# A Redis restart must not stop a reconciler: see tasks/kombu_fixes.py.
kombu_fixes.apply()


# Process lifecycle ---------------------------------------------------------------------------


@signals.setup_logging.connect
def _setup_logging(loglevel=None, **_):
    level = logging.getLevelName(loglevel) if isinstance(loglevel, int) else loglevel
    _configure_logging(level or "WARNING", settings.log_format)


def _require_broker() -> None:
    if not settings.broker_url:
        raise SystemExit(
            "gcworker: GCWORKER_BROKER_URL is not set: the reconciler and beat need a broker "
            "(e.g. redis://127.0.0.1:6379/0); without one, use `gcworker up` (embedded mode)"
        )


@signals.worker_init.connect
def _worker_init(**_):
    """In the reconciler's main process, before its pool starts: check, then serve metrics."""
    _require_broker()
    from gcworker.db.database import Database
    from gcworker.db.migrate import require_current
    from gcworker.errors import GcworkerError

    db = Database.from_url(settings.database_url)
    try:
        require_current(db.engine)
    except GcworkerError as error:
        raise SystemExit(f"gcworker: {error}") from None
    finally:
        db.dispose()
    port = os.environ.get(METRICS_PORT_ENV)
    if port:
        from gcworker import metrics

        if not metrics.multiprocess():
            log.warning(
                "PROMETHEUS_MULTIPROC_DIR is not set: /metrics shows this process only, not the "
                "pool processes that apply events (start with `gcworker reconciler`)"
            )
        from gcworker.health import control_plane_checks

        metrics.serve(int(port), checks=control_plane_checks(settings))


class HeartbeatLease(bootsteps.StartStopStep):
    """The reconciler's leases on the queues it consumes (`gcworker.broker_health.LeaseKeeper`).

    A consumer step: started once the task consumer is, renewed by the consumer's own timer (so
    a reconciler whose event loop is stuck stops renewing), stopped when the consumer loses its
    broker connection (the lease lapses; the reconnected consumer starts it afresh), and given
    back when the reconciler stops."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.keeper = None
        self.timer_entry = None

    def start(self, c):
        from gcworker.broker_health import LeaseKeeper

        if self.keeper is None:
            queues = list(c.app.amqp.queues.consume_from or ())
            self.keeper = LeaseKeeper.for_node(settings, c.hostname, queues)
        self.keeper.renew(reset=True)
        self.timer_entry = c.timer.call_repeatedly(self.keeper.every, self.keeper.renew)

    def stop(self, c):
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    def shutdown(self, c):
        self.stop(c)
        if self.keeper is not None:
            self.keeper.release()
            self.keeper.close()
            self.keeper = None


app.steps["consumer"].add(HeartbeatLease)


@signals.worker_process_shutdown.connect
def _pool_process_exited(pid=None, **_):
    from gcworker import metrics

    metrics.process_exited(pid or os.getpid())


@signals.worker_shutdown.connect
def _worker_shutdown(**_):
    temporary = os.environ.get(METRICS_DIR_TEMPORARY_ENV)
    if temporary and temporary == os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(temporary, ignore_errors=True)


@signals.beat_init.connect
def _beat_init(**_):
    _require_broker()
