"""The running system: `gcworker reporter`, `reconciler`, `beat` and `up`.

- `reporter` runs on a worker host: heartbeats and reports of a runtime's inventory, and removal
  of what the control plane destroys. Embedded mode applies its events in-process; with
  `GCWORKER_BROKER_URL` it publishes them to Redis.
- `reconciler` is a Celery worker of `tasks.app` (heartbeats, reports, collections); `beat` is
  Celery beat with the redbeat scheduler (collections every GC interval, one beat active).
- `up` runs the control plane on one host: embedded, the collector every GC interval; with a
  broker, a reconciler, beat and optionally Flower as child processes, stopped together.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime

import click

from gcworker.errors import GcworkerError

log = logging.getLogger(__name__)

DEFAULT_UP_METRICS_PORT = 9180
EXIT_CHILD_FAILED = 1


def _fail(message: str, code: int = 1):
    click.echo(f"gcworker: {message}", err=True)
    sys.exit(code)


def _log_level() -> str:
    return logging.getLevelName(logging.getLogger().level)


def _celery_logging(settings) -> dict:
    """A Celery process's logging options: this process's level, no banner in JSON."""
    return {"log_level": _log_level(), "quiet": settings.log_format == "json"}


def _stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C): the command winds down and exits 0."""
    stop = threading.Event()

    def handler(signum, _frame):
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _require_broker(settings, command: str) -> None:
    if settings.embedded:
        _fail(
            f"`gcworker {command}` needs a broker: set GCWORKER_BROKER_URL (e.g. "
            "redis://127.0.0.1:6379/0); without one, run `gcworker up` (embedded mode)",
            2,
        )


def _require_control_plane_key(settings, role: str) -> None:
    """Rule 15: the key that signs (reconciler) or verifies (reporter) the control plane's
    answers to workers, checked at start; a reconciler's private key is loaded once here."""
    from gcworker.settings import SettingsError

    try:
        settings.require_control_plane_key(role)
        if role != "reporter":
            settings.control_plane_signing_key()
    except (SettingsError, GcworkerError) as error:
        _fail(str(error), 2)


# Reporter ------------------------------------------------------------------------------------


class MeteredChannel:
    """A channel that counts what it sends and never lets a broker hiccup kill the reporter:
    a message that cannot be published is logged, counted and dropped (the next heartbeat or
    report carries the news; rule 6 makes the order irrelevant)."""

    def __init__(self, channel):
        self.channel = channel

    def send(self, message) -> None:
        from gcworker import metrics

        try:
            self.channel.send(message)
        except Exception as error:  # noqa: BLE001 - keep reporting whatever the broker does
            metrics.REPORTER_SEND_FAILURES.labels(message.type).inc()
            log.warning(
                "send failed: message dropped, the next one carries the news",
                extra={"worker": message.worker, "type": message.type, "error": str(error)},
            )
            return
        metrics.REPORTER_SENT.labels(message.type).inc()

    def feedback(self, worker: str):
        from gcworker.delivery import Feedback

        try:
            return self.channel.feedback(worker)
        except Exception as error:  # noqa: BLE001 - nothing is removed this time
            log.warning(
                "cannot read the control plane's feedback: nothing removed this time",
                extra={"worker": worker, "error": str(error)},
            )
            return Feedback()

    def close(self) -> None:
        close = getattr(self.channel, "close", None)
        if close is not None:
            close()
        plane = getattr(self.channel, "plane", None)
        if plane is not None:
            plane.close()


class MeteredRuntime:
    """A runtime that counts listings and removals."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.listing_error: str | None = "no listing yet"

    def listed(self) -> None:
        """The reporter's readiness check: raises while the last listing failed."""
        if self.listing_error is not None:
            raise RuntimeError(f"the runtime's last listing failed: {self.listing_error}")

    def inventory(self):
        from gcworker import metrics
        from gcworker.runtimes import RuntimeError_

        try:
            inventory = self.runtime.inventory()
        except RuntimeError_ as error:
            metrics.REPORTER_LISTING_FAILURES.inc()
            self.listing_error = str(error)
            raise
        self.listing_error = None
        metrics.REPORTER_HANDLES.labels("container").set(len(inventory.containers))
        metrics.REPORTER_HANDLES.labels("volume").set(len(inventory.volumes))
        return inventory

    def create(self, kind: str, handle: str) -> None:
        self.runtime.create(kind, handle)

    def destroy(self, kind: str, handle: str) -> None:
        """A removal: the reporter's sweeper, which is given the runtime itself, counts it."""
        self.runtime.destroy(kind, handle)


@click.command()
@click.option("--worker", required=True, help="The worker's name.")
@click.option(
    "--runtime",
    "runtime_spec",
    required=True,
    metavar="KIND:ARG",
    help="Where the inventory comes from: dir:PATH, or docker[:URL][?worker=NAME] (Docker/Podman).",
)
@click.option("--ephemeral", is_flag=True, help="The worker's rows die with it (no stalling).")
@click.option(
    "--once",
    is_flag=True,
    help="One heartbeat and one report, then exit: 0 when the control plane acknowledged the "
    "report, 1 when the listing failed or the report was rejected or not acknowledged in time.",
)
@click.option(
    "--once-timeout",
    default="30s",
    show_default=True,
    metavar="DURATION",
    help="With --once and a broker: how long to wait for the control plane's answer.",
)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="Serve /metrics.")
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The worker's private key, to sign with. Env: GCWORKER_KEY_FILE.",
)
@click.pass_obj
def reporter(obj, worker, runtime_spec, ephemeral, once, once_timeout, metrics_port, key_file):
    """Heartbeat and report WORKER's inventory, and remove what the control plane destroys.

    A new incarnation at each start; a heartbeat every heartbeat-interval and a complete report
    every report-interval; after each report, up to a few of the handles the control plane holds
    as destroying are removed from the runtime. A listing that fails sends no report. SIGTERM
    or Ctrl-C stops it after the current step.
    """
    from gcworker.delivery import open_channel
    from gcworker.messages import check_worker_name
    from gcworker.reporter import Reporter
    from gcworker.runtimes import load_runtime
    from gcworker.settings import parse_duration
    from gcworker.sweeper import Sweeper

    if key_file is not None:
        obj.overrides["key_file"] = key_file
    settings = obj.settings
    _require_control_plane_key(settings, "reporter")
    check_worker_name(worker)
    try:
        once_timeout = parse_duration(once_timeout).total_seconds()
    except ValueError as error:
        _fail(f"--once-timeout: {error}", 2)
    engine = load_runtime(runtime_spec)
    runtime = MeteredRuntime(engine)
    sweeper = Sweeper(
        engine,
        containers_in_flight=settings.sweep_containers_in_flight,
        volumes_in_flight=settings.sweep_volumes_in_flight,
        timeout=settings.destroy_timeout,
    )
    stop = _stop_on_signals()
    if metrics_port:
        from gcworker import metrics
        from gcworker.health import reporter_checks

        checks = reporter_checks(settings, runtime.listed)
        metrics.serve(metrics_port, registry_=metrics.REPORTER_REGISTRY, checks=checks)
    channel = MeteredChannel(open_channel(settings))
    agent = Reporter(
        worker,
        runtime,
        channel,
        heartbeat_interval=settings.heartbeat_interval.total_seconds(),
        report_interval=settings.report_interval.total_seconds(),
        ephemeral=ephemeral,
        sweeper=sweeper,
    )
    log.info(
        "reporter started",
        extra={
            "worker": worker,
            "incarnation": agent.incarnation,
            "runtime": runtime_spec,
            "mode": "embedded" if settings.embedded else "broker",
        },
    )
    try:
        sent = agent.run(stop, once=once)
        if once:
            _finish_once(agent, sent, stop, once_timeout)
    finally:
        sweeper.close()
        channel.close()
    log.info("reporter stopped", extra={"worker": worker})


def _finish_once(agent, sent: bool, stop: threading.Event, timeout: float) -> None:
    """`reporter --once`: exit 0 only once the control plane acknowledged the report."""
    if not sent:
        _fail(f"{agent.worker}: no report sent (the listing failed: see the log above)")
    deadline = time.monotonic() + timeout
    while not agent.acknowledged():
        if stop.is_set() or time.monotonic() > deadline:
            _fail(
                f"{agent.worker}: the report was not acknowledged within {timeout:g}s: it was "
                "rejected (see `gcworker dead-letters`) or no reconciler is running"
            )
        stop.wait(0.2)
    click.echo(f"{agent.worker}: report acknowledged by the control plane")


# Reconciler and beat -------------------------------------------------------------------------


def _queues(value: str) -> list[str]:
    from tasks.routing import QUEUES

    roles = [q.strip() for q in value.split(",") if q.strip()]
    try:
        QUEUES.named(roles)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return roles


@click.command()
@click.option(
    "--queues",
    default="heartbeats,reports,collect",
    show_default=True,
    help="Which queues to consume (a host may run one reconciler per queue).",
)
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=None, help="[CPUs]")
@click.option("--name", "node_name", default=None, help="Celery node name, e.g. r1@%h.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="Serve /metrics.")
@click.pass_obj
def reconciler(obj, queues, concurrency, node_name, metrics_port):
    """Run a reconciler: a Celery worker applying heartbeats and reports, and collections.

    Any number may run, on any hosts. This process becomes the Celery worker (same process id).
    """
    from gcworker import processes
    from tasks.app import METRICS_DIR_TEMPORARY_ENV, METRICS_PORT_ENV

    settings = obj.settings
    _require_broker(settings, "reconciler")
    _require_control_plane_key(settings, "reconciler")
    obj.control_plane().close()  # the schema is current, or say so now
    env = processes.settings_environment(obj.overrides)
    if metrics_port:
        env[METRICS_PORT_ENV] = str(metrics_port)
        if not env.get("PROMETHEUS_MULTIPROC_DIR"):
            env["PROMETHEUS_MULTIPROC_DIR"] = processes.fresh_metrics_dir()
            env[METRICS_DIR_TEMPORARY_ENV] = env["PROMETHEUS_MULTIPROC_DIR"]
    argv = processes.reconciler_argv(
        queues=_queues(queues),
        concurrency=concurrency,
        node_name=node_name,
        **_celery_logging(settings),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


@click.command()
@click.option(
    "--check",
    is_flag=True,
    help="Do not run: exit 0 if some beat holds the schedule's lock, else 1 (a health check).",
)
@click.pass_obj
def beat(obj, check):
    """Run Celery beat (redbeat): a collection every GC interval; one beat of many is active.

    This process becomes Celery beat (same process id).
    """
    from gcworker import processes

    _require_broker(obj.settings, "beat")
    if check:
        _check_beat(obj.settings)
    env = processes.settings_environment(obj.overrides)
    argv = processes.beat_argv(**_celery_logging(obj.settings))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


def _check_beat(settings) -> None:
    import redis

    from tasks.schedule import beat_lock_key

    client = redis.Redis.from_url(settings.broker_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        held = client.exists(beat_lock_key(settings))
    finally:
        client.close()
    if not held:
        _fail(f"no beat holds the schedule's lock ({beat_lock_key(settings)})")
    click.echo(f"beat: the schedule's lock is held ({beat_lock_key(settings)})")
    sys.exit(0)


# Up ------------------------------------------------------------------------------------------


@click.command()
@click.option(
    "--flower", is_flag=True, help="Also run Flower (broker mode; GCWORKER_FLOWER_BASIC_AUTH)."
)
@click.option(
    "--flower-port",
    type=click.IntRange(1, 65535),
    default=5555,
    show_default=True,
    help="Flower's port.",
)
@click.option(
    "--flower-address", default="127.0.0.1", show_default=True, help="Where Flower listens."
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_UP_METRICS_PORT,
    show_default=True,
    help="Serve /metrics here; 0: do not.",
)
@click.option(
    "--concurrency", "-c", type=click.IntRange(min=1), default=None, help="Reconciler processes."
)
@click.pass_obj
def up(obj, flower, flower_port, flower_address, metrics_port, concurrency):
    """Run the control plane on this host until Ctrl-C or SIGTERM.

    Embedded (no GCWORKER_BROKER_URL): the collector every GC interval, in this process;
    reporters apply their own events in-process. With a broker: a reconciler, beat and, with
    --flower, Flower, as child processes, all stopped together.
    """
    plane = obj.control_plane()  # the schema is current, or say so now
    if obj.settings.embedded:
        _up_embedded(plane, metrics_port)
    else:
        plane.close()
        _require_control_plane_key(obj.settings, "reconciler")
        flower_at = (flower_address, flower_port) if flower else None
        _up_broker(obj, flower_at, metrics_port, concurrency)


def _up_embedded(plane, metrics_port: int) -> None:
    from sqlalchemy.exc import SQLAlchemyError

    from gcworker import pipeline

    settings = plane.settings
    stop = _stop_on_signals()
    if metrics_port:
        from gcworker import metrics
        from gcworker.health import control_plane_checks

        metrics.serve(metrics_port, checks=control_plane_checks(settings))
    interval = settings.gc_interval.total_seconds()
    click.echo(
        f"gcworker up (embedded, {plane.db.engine.url.render_as_string(hide_password=True)}): "
        f"collecting every {interval:g}s; reporters apply their events in-process"
        + (f"; metrics on :{metrics_port}/metrics" if metrics_port else "")
        + ". Ctrl-C to stop."
    )
    while not stop.is_set():
        try:
            summary = pipeline.run_collection(plane)
            click.echo(f"{datetime.now(UTC):%H:%M:%S} {summary.line()}")
        except (SQLAlchemyError, GcworkerError) as error:
            click.echo(f"{datetime.now(UTC):%H:%M:%S} collection failed: {error}", err=True)
        stop.wait(interval)
    plane.close()
    click.echo("gcworker up: stopped")


def _up_broker(obj, flower_at, metrics_port: int, concurrency) -> None:
    from gcworker import processes
    from gcworker.settings import SettingsError

    env = processes.settings_environment(obj.overrides)
    try:
        flower_env = processes.flower_environment(obj.settings, env) if flower_at else None
    except SettingsError as error:
        _fail(str(error), 2)
    stop = _stop_on_signals()
    metrics_dir = processes.fresh_metrics_dir()
    worker_env = {**env, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    supervisor = processes.Supervisor()
    exit_code = 0
    try:
        supervisor.start(
            "reconciler",
            processes.reconciler_argv(concurrency=concurrency, **_celery_logging(obj.settings)),
            worker_env,
        )
        supervisor.start("beat", processes.beat_argv(**_celery_logging(obj.settings)), env)
        if flower_at:
            address, port = flower_at
            argv = processes.flower_argv(port=port, address=address, log_level=_log_level())
            supervisor.start("flower", argv, flower_env)
        if metrics_port:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
            from gcworker import metrics
            from gcworker.health import control_plane_checks

            metrics.serve(metrics_port, checks=control_plane_checks(obj.settings))
        parts = [f"{c.name} (pid {c.pid})" for c in supervisor.children]
        click.echo(
            f"gcworker up (broker {_redacted(obj.settings.broker_url)}): "
            + ", ".join(parts)
            + (f"; Flower on http://{_host(flower_at[0])}:{flower_at[1]}" if flower_at else "")
            + (f"; metrics on http://127.0.0.1:{metrics_port}/metrics" if metrics_port else "")
            + ". Ctrl-C to stop."
        )
        while not stop.wait(0.5):
            gone = supervisor.exited()
            if gone is not None:
                click.echo(
                    f"gcworker up: {gone.name} exited with code {gone.process.returncode}: "
                    "stopping everything",
                    err=True,
                )
                exit_code = EXIT_CHILD_FAILED
                break
    finally:
        supervisor.stop()
        processes.remove_tree(metrics_dir)
    click.echo("gcworker up: stopped")
    if exit_code:
        sys.exit(exit_code)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _redacted(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)
