"""`gcworker demo`: a simulated fleet on short intervals, scripted trouble, and a verdict.

Everything runs on this host with no servers (embedded mode): a SQLite database of its own in a
temporary folder, migrated at start; a `dir` runtime per worker under that folder; one reporter
per worker sending its heartbeats and reports through the in-process channel; a scheduler that
creates and destroys containers and volumes (some with a parent volume or an owning container),
recording each in the database first, then creating it in the runtime, then marking it created;
and the collector every GC interval. Then the trouble, at fixed points of the run:

- one worker's runtime restarts and loses all its state (its reporter comes back with a new
  incarnation; its directories are wiped);
- one worker is cut off (no heartbeats, no reports, the scheduler cannot reach it) for longer
  than the heartbeat TTL plus the grace period, then comes back;
- one ephemeral worker vanishes (its host and directories are gone);
- one container is stuck in creating: recorded, never created on its worker.

While it runs, the database and the runtimes' directories are read together every tick, under the
lock that every change to a directory takes, so that both are seen at the same instant. A row that
disappears from the database between two such snapshots while its handle sat in its worker's
directory at both is a row wrongly deleted; so is a deletion in the audit log made while the
handle's directory existed. When the run ends, the scheduler stops and the system settles (final
reports and collections) until the database and the directories agree, or a deadline passes. The
verdict holds when they agree and no row was wrongly deleted.

With a broker URL the same run goes through Redis and real Celery processes, started here as
children (a reconciler and beat, stopped by their process ids at the end): reporters publish
signed messages (a key per worker, registered at start), learn what to remove from the
reconciler's hand-off in Redis, and beat triggers the collections. Queues and keys live under a
broker namespace of this run alone, removed at the end.

With `runtime="docker[:URL]"` the workers' "directories" are a real engine's containers and
volumes (gcworker.demo_engine): a runtime restart removes that worker's objects behind
gcworker's back, and everything the run made is removed from the engine at the end.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from gcworker.db.audit import expand
from gcworker.db.tables import audit_events, containers, volumes, workers
from gcworker.delivery import InProcessChannel
from gcworker.demo_engine import Engine, EngineRuntime
from gcworker.errors import GcworkerError
from gcworker.runtimes import KINDS, RuntimeError_
from gcworker.runtimes.dir import DirRuntime
from gcworker.runtimes.docker import ENGINE_ERRORS, WORKER_LABEL, short
from gcworker.settings import ENV_PREFIX

Key = tuple[str, str]  # (kind, handle)


# Settings --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    workers: int = 5
    duration: float = 30.0
    seed: int | None = None
    report_interval: float = 0.5
    heartbeat_interval: float = 0.5
    heartbeat_ttl: float = 2.5
    grace: float = 1.5
    creating_timeout: float = 3.0
    gc_interval: float = 1.0
    tick: float = 0.2
    scheduler_step: float = 0.12
    settle_timeout: float = 20.0
    broker_url: str = ""  # empty: embedded mode
    startup_timeout: float = 60.0
    # `dir` (a folder per worker) or `docker[:URL]` (one engine, a label per worker)
    runtime: str = "dir"

    MIN_WORKERS = 4
    MIN_DURATION = 12.0

    def settings_overrides(self, database_url: str, namespace: str = "gcworker-demo") -> dict:
        """The settings the demo runs with; they pass the checks of rule 14 like any others."""
        return {
            "database_url": database_url,
            "broker_url": self.broker_url,
            "broker_namespace": namespace,
            "report_interval": f"{self.report_interval}s",
            "heartbeat_interval": f"{self.heartbeat_interval}s",
            "heartbeat_ttl": f"{self.heartbeat_ttl}s",
            "missing_grace_period": f"{self.grace}s",
            "creating_timeout": f"{self.creating_timeout}s",
            "gc_interval": f"{self.gc_interval}s",
            "stalled_worker_timeout": "0",
            "dry_run": False,
        }

    @property
    def cut_off_for(self) -> float:
        """Long enough to be stalled by the collector and stay stalled past the grace period."""
        return self.heartbeat_ttl + self.gc_interval + 2 * self.grace

    def script(self, names: list[str]) -> list[Trouble]:
        """The scripted trouble: when, to whom, what."""
        d = self.duration
        stall_at = min(0.4 * d, d - self.cut_off_for - 1.0)
        return sorted(
            [
                Trouble(0.10 * d, names[0], "stuck"),
                Trouble(0.30 * d, names[1], "restart"),
                Trouble(stall_at, names[2], "cut_off"),
                Trouble(stall_at + self.cut_off_for, names[2], "reconnect"),
                Trouble(0.65 * d, names[-1], "vanish"),
            ],
            key=lambda t: t.at,
        )


@dataclass(frozen=True)
class Trouble:
    at: float
    worker: str
    what: str


# Snapshots and the verdict (pure functions) ---------------------------------------------------


@dataclass(frozen=True)
class Row:
    worker: str
    state: str
    missing: bool = False


@dataclass(frozen=True)
class WorkerRow:
    state: str
    incarnation: int
    ephemeral: bool = False


@dataclass
class Snapshot:
    """The database and every runtime's directories, read at one instant."""

    at: float  # seconds since the demo started
    rows: dict[Key, Row]
    disk: dict[Key, str]  # (kind, handle) -> the worker whose directory holds it
    workers: dict[str, WorkerRow]


@dataclass(frozen=True)
class WrongDeletion:
    kind: str
    handle: str
    worker: str
    how: str

    def line(self) -> str:
        return f"{self.kind} {self.handle} of {self.worker}: {self.how}"


def wrong_deletions(before: Snapshot, after: Snapshot) -> list[WrongDeletion]:
    """Rows that left the database between two snapshots while their handle sat in their
    worker's directory at both (a directory is made once and removed once, so it was there
    throughout, when the row was deleted too)."""
    found = []
    for key, row in before.rows.items():
        if key in after.rows:
            continue
        if before.disk.get(key) == row.worker and after.disk.get(key) == row.worker:
            found.append(
                WrongDeletion(
                    *key,
                    row.worker,
                    f"row deleted between {before.at:.1f}s and {after.at:.1f}s while "
                    "its directory existed",
                )
            )
    return found


def audited_wrong_deletions(
    audit: Iterable[dict], on_disk: Callable[[Key, float], str | None]
) -> list[WrongDeletion]:
    """Deletions in the audit log made while the handle's directory existed.

    `on_disk(key, t)` names the worker whose directory held `key` at wall-clock time `t`, or None.
    """
    found = []
    for event in audit:
        if event["action"] != "delete" or event["kind"] not in KINDS:
            continue
        key = (event["kind"], event["subject"])
        holder = on_disk(key, event["at"].timestamp())
        if holder is not None:
            found.append(
                WrongDeletion(
                    *key,
                    event["worker_name"] or holder,
                    f"deleted by the {event['actor']} ({event['reason']}) while its directory "
                    f"existed on {holder}",
                )
            )
    return found


def disagreements(snapshot: Snapshot, live: Iterable[str]) -> list[str]:
    """Where the database and the workers' directories differ; empty when they agree.

    They agree when every live worker is running, no other worker is left in the database, every
    row is `created`, unmarked and in its worker's directory, and every directory has its row.
    """
    live = set(live)
    problems = []
    for name, worker in sorted(snapshot.workers.items()):
        if name not in live:
            problems.append(
                f"worker {name}: still in the database ({worker.state}), but it is gone"
            )
        elif worker.state != "running":
            problems.append(f"worker {name}: {worker.state} in the database, but it is running")
    for name in sorted(live - set(snapshot.workers)):
        problems.append(f"worker {name}: running, but not in the database")
    for (kind, handle), row in sorted(snapshot.rows.items()):
        holder = snapshot.disk.get((kind, handle))
        if holder != row.worker:
            where = f"it is on {holder}" if holder else "no worker has it"
            problems.append(
                f"{kind} {handle}: {row.state} on {row.worker} in the database, {where}"
            )
        elif row.state != "created":
            problems.append(f"{kind} {handle}: on {row.worker}, but {row.state} in the database")
        elif row.missing:
            problems.append(f"{kind} {handle}: on {row.worker}, but marked missing")
    for (kind, handle), holder in sorted(snapshot.disk.items()):
        if (kind, handle) not in snapshot.rows:
            problems.append(f"{kind} {handle}: on {holder}, but not in the database")
    return problems


@dataclass
class Verdict:
    disagreements: list[str]
    wrongly_deleted: list[WrongDeletion]
    errors: list[str] = field(default_factory=list)
    containers: int = 0
    volumes: int = 0
    workers: int = 0
    settled_after: float | None = None

    @property
    def ok(self) -> bool:
        return not (self.disagreements or self.wrongly_deleted or self.errors)

    def lines(self) -> list[str]:
        lines = []
        if not self.disagreements:
            settled = (
                f", settled {self.settled_after:.1f}s after the scheduler stopped"
                if self.settled_after is not None
                else ""
            )
            lines.append(
                f"verdict: database and workers agree ({self.containers} containers, "
                f"{self.volumes} volumes on {self.workers} workers{settled})"
            )
        else:
            lines.append(
                f"verdict: database and workers DISAGREE ({len(self.disagreements)} differences)"
            )
            lines += [f"  - {problem}" for problem in self.disagreements[:30]]
            if len(self.disagreements) > 30:
                lines.append(f"  ... and {len(self.disagreements) - 30} more")
        lines.append(f"rows wrongly deleted: {len(self.wrongly_deleted)}")
        lines += [f"  - {wrong.line()}" for wrong in self.wrongly_deleted[:30]]
        if self.errors:
            lines.append(f"errors during the run: {len(self.errors)}")
            lines += [f"  - {error}" for error in self.errors[:10]]
        return lines


def unique_wrong_deletions(found: Iterable[WrongDeletion]) -> list[WrongDeletion]:
    """One entry per row (both checks may catch the same one)."""
    seen: dict[Key, WrongDeletion] = {}
    for wrong in found:
        seen.setdefault((wrong.kind, wrong.handle), wrong)
    return list(seen.values())


# The runtimes --------------------------------------------------------------------------------


class DiskHistory:
    """When each handle's directory was made and removed (wall clock), for the audit check."""

    def __init__(self):
        self._made: dict[Key, tuple[str, float]] = {}
        self._removed: dict[Key, float] = {}

    def made(self, key: Key, worker: str) -> None:
        self._made.setdefault(key, (worker, time.time()))

    def removed(self, key: Key) -> None:
        if key in self._made:
            self._removed.setdefault(key, time.time())

    def holder_at(self, key: Key, t: float) -> str | None:
        """The worker whose directory surely held `key` at `t` (made before, removed after)."""
        if key not in self._made:
            return None
        worker, made = self._made[key]
        removed = self._removed.get(key)
        return worker if made < t and (removed is None or t < removed) else None


class SimulatedRuntime:
    """A `dir` runtime that can be unreachable, that knows volumes need their parent, and that
    records its changes. Every change to a directory holds `lock`, the lock snapshots take."""

    def __init__(self, worker: str, root: Path, lock: threading.Lock, history: DiskHistory):
        self.worker = worker
        self.root = root
        self.dir = DirRuntime(str(root))
        self.lock = lock
        self.history = history
        self.reachable = True
        self.dir.declare_empty()

    def inventory(self):
        if not self.reachable:
            raise RuntimeError_(f"{self.worker}: runtime unreachable")
        return self.dir.inventory()

    def create(self, kind: str, handle: str, *, parent: str | None = None) -> None:
        with self.lock:
            if not self.reachable:
                raise RuntimeError_(f"{self.worker}: runtime unreachable")
            if parent is not None and not (self.root / "volumes" / parent).is_dir():
                raise RuntimeError_(f"{self.worker}: parent volume {parent} not found")
            self.dir.create(kind, handle)
            self.history.made((kind, handle), self.worker)

    def destroy(self, kind: str, handle: str) -> None:
        with self.lock:
            self.history.removed((kind, handle))
            self.dir.destroy(kind, handle)

    def wipe(self) -> Counter:
        """The runtime lost its state: every directory is gone. Returns what was lost."""
        with self.lock:
            lost = Counter()
            for key in self.listing():
                self.history.removed(key)
                lost[key[0]] += 1
            for kind in KINDS:
                shutil.rmtree(self.root / f"{kind}s", ignore_errors=True)
            self.dir.declare_empty()
            return lost

    def vanish(self) -> None:
        with self.lock:
            self.reachable = False
            for key in self.listing():
                self.history.removed(key)
            shutil.rmtree(self.root, ignore_errors=True)

    def listing(self) -> list[Key]:
        """What the directories hold now (read straight from disk)."""
        found = []
        for kind in KINDS:
            folder = self.root / f"{kind}s"
            if folder.is_dir():
                found += [(kind, entry.name) for entry in os.scandir(folder) if entry.is_dir()]
        return found


# The simulation ------------------------------------------------------------------------------


class ReporterThread:
    """One worker's reporter running in a thread; stopped and started by the script."""

    def __init__(self, reporter, on_error: Callable[[str], None]):
        self.reporter = reporter
        self.on_error = on_error
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.stop_event = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"reporter-{self.reporter.worker}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        stop = self.stop_event
        while not stop.is_set():
            try:
                self.reporter.run(stop)
            except Exception as error:  # a reporter that dies would look like a stall
                self.on_error(f"reporter of {self.reporter.worker}: {error!r}")
                stop.wait(self.reporter.report_interval)

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=30)


@dataclass
class SimWorker:
    name: str
    ephemeral: bool
    runtime: SimulatedRuntime | EngineRuntime
    reporter: ReporterThread | None = None
    incarnations: list[int] = field(default_factory=list)
    gone: bool = False
    note: str = ""
    key: object = None  # broker mode: the worker's Ed25519 private key


class Demo:
    """The whole demo; `run()` returns the verdict. `view` gets a `Frame` every tick."""

    def __init__(
        self,
        config: DemoConfig,
        *,
        root: Path,
        view: Callable[[Frame], None] = lambda frame: None,
        say: Callable[[str], None] = lambda line: None,
    ):
        self.config = config
        self.root = root
        self.view = view
        self.say = say
        self.rng = random.Random(config.seed)
        self.disk_lock = threading.Lock()
        self.history = DiskHistory()
        self.stats: Counter = Counter()
        self.stats_lock = threading.Lock()
        self.errors: list[str] = []
        self.events: deque[tuple[float, str]] = deque(maxlen=8)
        self.wrong: list[WrongDeletion] = []
        self.outcomes: list[str] = []
        self.started = time.monotonic()
        self.phase = "starting"
        self.scheduler_stop = threading.Event()
        self.collector_stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.plane = None
        self.sim: dict[str, SimWorker] = {}
        self.counter = 0
        self.stuck_key: Key | None = None
        self.trouble_log: dict[str, dict] = {}
        self._last_audit_id = 0
        self._previous: Snapshot | None = None
        self.supervisor = None  # broker mode: the Celery reconciler and beat
        self.channels: list = []
        self.mode = "embedded (SQLite, events applied in-process)"
        self.engine: Engine | None = None  # docker runtime: the engine every worker shares

    # Set-up --------------------------------------------------------------------------------

    def _open(self) -> None:
        from gcworker.control_plane import ControlPlane
        from gcworker.db.database import Database
        from gcworker.db.migrate import upgrade
        from gcworker.settings import load_settings

        database_url = f"sqlite:///{self.root / 'gcworker.db'}"
        # Broker mode: keys, queues and the beat schedule under a namespace of this run alone.
        self.overrides = self.config.settings_overrides(
            database_url, f"gcworker-demo-{secrets.token_hex(4)}"
        )
        if self.config.broker_url:  # reconcilers sign their answers, reporters verify them
            from gcworker.signing import generate_private_key, public_key_text, write_private_key

            key = generate_private_key()
            write_private_key(key, self.root / "control-plane.key")
            self.overrides["control_plane_key_file"] = self.root / "control-plane.key"
            self.overrides["control_plane_public_key"] = public_key_text(key)
        self.settings = load_settings(**self.overrides)
        db = Database.from_url(self.settings.database_url)
        upgrade(db.engine)
        self.plane = ControlPlane(self.settings, db)

    def _make_keys(self) -> None:
        """Messages are signed in both modes: a key per worker, the public half registered."""
        from gcworker.signing import generate_private_key, public_key_text

        for worker in self.sim.values():
            worker.key = generate_private_key()
            self.plane.register_key(worker.name, public_key_text(worker.key))

    def _channel(self, worker: SimWorker):
        if self.settings.embedded:
            return InProcessChannel(self.plane, private_key=worker.key)
        from gcworker.broker import BrokerChannel

        channel = BrokerChannel(self.settings, private_key=worker.key)
        self.channels.append(channel)
        return channel

    # Broker mode ---------------------------------------------------------------------------

    def _start_control_plane(self) -> None:
        """A Celery reconciler and Celery beat (redbeat), as child processes of this one."""
        from gcworker import processes

        env = processes.settings_environment(self.overrides)
        env.pop(f"{ENV_PREFIX}KEY_FILE", None)
        self._control_plane_log = open(self.root / "control-plane.log", "ab")  # noqa: SIM115
        output = {"stdout": self._control_plane_log, "stderr": subprocess.STDOUT}
        self.supervisor = processes.Supervisor()
        self.supervisor.start("reconciler", processes.reconciler_argv(concurrency=2), env, **output)
        self.supervisor.start("beat", processes.beat_argv(), env, **output)
        pids = ", ".join(f"{c.name} pid {c.pid}" for c in self.supervisor.children)
        self.mode = f"broker {_redacted(self.settings.broker_url)}, Celery {pids}"
        self.say(f"started {pids}; logs in {self.root / 'control-plane.log'}")

    def _wait_until_every_worker_registered(self) -> None:
        """Reporters publish from the start; the control plane is up once it applied the first
        heartbeat of every worker."""
        deadline = time.monotonic() + self.config.startup_timeout
        while True:
            registered = {w["name"] for w in self.plane.workers()}
            if registered >= set(self.sim):
                return
            gone = self.supervisor.exited() if self.supervisor else None
            if gone is not None:
                raise DemoError(
                    f"the {gone.name} exited with code {gone.process.returncode} "
                    f"(see {self.root / 'control-plane.log'})"
                )
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(set(self.sim) - registered))
                raise DemoError(
                    f"the control plane applied no heartbeat of {missing}"
                    f" within {self.config.startup_timeout:g}s "
                    f"(see {self.root / 'control-plane.log'})"
                )
            time.sleep(0.2)

    def _stop_control_plane(self) -> None:
        for channel in self.channels:
            try:
                channel.close()
            except Exception as error:  # closing is best effort
                self.say(f"closing a broker channel: {error!r}")
        self.channels = []
        if self.supervisor is not None:
            self.supervisor.stop(grace=20)
            self.supervisor = None
            self._control_plane_log.close()
            self._forget_namespace()

    def _forget_namespace(self) -> None:
        """Remove this run's keys from Redis (queues, hand-off, beat schedule)."""
        try:
            import redis

            client = redis.Redis.from_url(self.settings.broker_url)
            prefix = self.settings.broker_namespace
            for pattern in (f"{prefix}:*", f"*{prefix}:*"):
                keys = list(client.scan_iter(match=pattern, count=500))
                if keys:
                    client.delete(*keys)
            client.close()
        except Exception as error:  # leaving a few expired-soon keys is harmless
            self.say(f"cleaning the broker namespace: {error!r}")

    def _open_engine(self) -> None:
        kind, _, url = self.config.runtime.partition(":")
        if kind != "docker":
            return
        self.engine = Engine(url or None)
        try:
            self.engine.open()
        except RuntimeError_ as error:
            raise DemoError(str(error)) from None
        self.mode += f", workers on the engine {url or 'DOCKER_HOST'}"
        self.say(f"workers' objects labelled {WORKER_LABEL}={self.engine.run}-<worker>")

    def _make_workers(self) -> None:
        n = self.config.workers
        self._open_engine()
        for i in range(1, n + 1):
            name = f"worker-{i}"
            if self.engine is not None:
                runtime = EngineRuntime(name, self.engine, self.disk_lock, self.history)
            else:
                runtime = SimulatedRuntime(
                    name, self.root / "workers" / name, self.disk_lock, self.history
                )
            self.sim[name] = SimWorker(name, ephemeral=(i == n), runtime=runtime)
        self.sim[f"worker-{n}"].note = "ephemeral"

    def _start_reporter(self, worker: SimWorker, *, new_incarnation: bool = True) -> None:
        from gcworker.reporter import Reporter

        if new_incarnation or worker.reporter is None:
            reporter = Reporter(
                worker.name,
                worker.runtime,
                self._channel(worker),
                heartbeat_interval=self.config.heartbeat_interval,
                report_interval=self.config.report_interval,
                ephemeral=worker.ephemeral,
            )
            worker.incarnations.append(reporter.incarnation)
            worker.reporter = ReporterThread(reporter, self._error)
        worker.reporter.start()

    def _error(self, message: str) -> None:
        self.errors.append(message)
        self._event(f"error: {message}")

    def _event(self, text: str) -> None:
        self.events.append((self.elapsed(), text))
        self.say(f"[{self.elapsed():5.1f}s] {text}")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # Background loops ----------------------------------------------------------------------

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _collector_loop(self) -> None:
        while not self.collector_stop.wait(self.config.gc_interval):
            try:
                self.plane.collect()
            except Exception as error:
                self._error(f"collector: {error!r}")

    def _scheduler_loop(self) -> None:
        while not self.scheduler_stop.wait(self.config.scheduler_step):
            try:
                self._schedule_one()
            except GcworkerError:
                with self.stats_lock:
                    self.stats["refused"] += 1
            except Exception as error:
                self._error(f"scheduler: {error!r}")

    def _next_handle(self, worker: str, prefix: str) -> str:
        self.counter += 1
        return f"{worker}:{prefix}{self.counter:04d}"

    def _schedule_one(self) -> None:
        """One scheduler decision: create or destroy a container or a volume on a running worker."""
        running = [w["name"] for w in self.plane.workers() if w["state"] == "running"]
        if not running:
            return
        name = self.rng.choice(sorted(running))
        worker = self.sim.get(name)
        if worker is None:
            return
        ctrs = [r for r in self.plane.containers(name) if r["state"] == "created"]
        all_vols = self.plane.volumes(name)
        vols = [r for r in all_vols if r["state"] == "created"]
        parents = {r["parent"] for r in all_vols if r["parent"]}
        roll = self.rng.random()
        if len(ctrs) < 3:  # fill up first: something to lose, to stall, to vanish with
            roll *= 0.6
        elif len(ctrs) >= 8:
            roll = 0.6 + 0.4 * roll
        if roll < 0.45:
            self._create_container(worker, vols)
        elif roll < 0.60:
            self._create(worker, "volume", self._next_handle(name, "v"))
        elif roll < 0.85 and ctrs:
            self.plane.scheduler.destroy_container(self.rng.choice(ctrs)["handle"])
            self._count("destroy requests")
        else:
            leaves = [r for r in vols if r["handle"] not in parents and not r["container"]]
            if leaves:
                self.plane.scheduler.destroy_volume(self.rng.choice(leaves)["handle"])
                self._count("destroy requests")

    def _create_container(self, worker: SimWorker, vols: list[dict]) -> None:
        handle = self._next_handle(worker.name, "c")
        if not self._create(worker, "container", handle):
            return
        if self.rng.random() < 0.7:
            bases = [r["handle"] for r in vols if not r["parent"] and not r["container"]]
            parent = self.rng.choice(bases) if bases and self.rng.random() < 0.6 else None
            self._create(
                worker,
                "volume",
                self._next_handle(worker.name, "v"),
                parent=parent,
                container=handle,
            )

    def _create(
        self,
        worker: SimWorker,
        kind: str,
        handle: str,
        *,
        parent: str | None = None,
        container: str | None = None,
    ) -> bool:
        """Record in the database first, then create in the runtime, then mark created; a
        creation the runtime refuses is marked failed (the collector then destroys it)."""
        scheduler = self.plane.scheduler
        if kind == "container":
            scheduler.create_container(worker.name, handle)
        else:
            scheduler.create_volume(worker.name, handle, parent=parent, container=container)
        try:
            worker.runtime.create(kind, handle, parent=parent)
        except RuntimeError_:
            getattr(scheduler, f"fail_{kind}")(handle)
            self._count("creations failed")
            return False
        getattr(scheduler, f"{kind}_created")(handle)
        self._count(f"{kind}s created")
        return True

    def _count(self, what: str) -> None:
        with self.stats_lock:
            self.stats[what] += 1

    # Scripted trouble ----------------------------------------------------------------------

    def _trouble(self, trouble: Trouble) -> None:
        worker = self.sim[trouble.worker]
        log = self.trouble_log.setdefault(trouble.what, {"worker": worker.name})
        log["at"] = self.elapsed()
        if trouble.what == "stuck":
            handle = f"{worker.name}:stuck"
            self.plane.scheduler.create_container(worker.name, handle)
            self.stuck_key = ("container", handle)
            log["states"] = ["creating"]
            worker.note = "container stuck in creating"
            self._event(f"container {handle} recorded as creating, never created on {worker.name}")
        elif trouble.what == "restart":
            worker.reporter.stop()
            worker.runtime.reachable = False
            lost = worker.runtime.wipe()
            log["lost"] = lost
            log["old"] = len(worker.incarnations)
            worker.runtime.reachable = True
            self._start_reporter(worker)
            lost_text = (
                f"{plural(lost['container'], 'container')}, {plural(lost['volume'], 'volume')}"
            )
            worker.note = f"runtime restarted, lost {lost_text}"
            self._event(
                f"{worker.name}'s runtime restarts and loses all its state ({lost_text}); "
                "its reporter comes back with a new incarnation"
            )
        elif trouble.what == "cut_off":
            worker.reporter.stop()
            worker.runtime.reachable = False
            worker.note = "cut off"
            log["holding"] = len(worker.runtime.listing())
            log["deleted"] = 0
            self._event(
                f"{worker.name} is cut off for {self.config.cut_off_for:.1f}s: "
                "no heartbeats, no reports"
            )
        elif trouble.what == "reconnect":
            worker.runtime.reachable = True
            self._start_reporter(worker, new_incarnation=False)
            worker.note = "back after being cut off"
            self.trouble_log["cut_off"]["back"] = self.elapsed()
            self._event(f"{worker.name} comes back (same incarnation)")
        elif trouble.what == "vanish":
            worker.reporter.stop()
            worker.gone = True
            worker.runtime.vanish()
            worker.note = "vanished (ephemeral)"
            self._event(f"{worker.name} (ephemeral) vanishes with its host and directories")

    # Observation ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The database and every directory at one instant: no directory changes while the
        database is read."""
        with self.disk_lock:
            with self.plane.db.transaction() as conn:
                rows = {}
                for kind, table in (("container", containers), ("volume", volumes)):
                    query = select(
                        table.c.handle, table.c.worker_name, table.c.state, table.c.missing_since
                    )
                    for handle, worker, state, missing in conn.execute(query):
                        rows[(kind, handle)] = Row(worker, state, missing is not None)
                fleet = {
                    name: WorkerRow(state, incarnation, bool(ephemeral))
                    for name, state, incarnation, ephemeral in conn.execute(
                        select(
                            workers.c.name,
                            workers.c.state,
                            workers.c.incarnation,
                            workers.c.ephemeral,
                        )
                    )
                }
            disk = {key: w.name for w in self.sim.values() for key in w.runtime.listing()}
        return Snapshot(self.elapsed(), rows, disk, fleet)

    def _observe(self) -> Snapshot:
        snap = self.snapshot()
        before = self._previous
        self._read_audit()
        if before is not None:
            for wrong in wrong_deletions(before, snap):
                self.wrong.append(wrong)
                self._event(f"WRONGLY DELETED: {wrong.line()}")
            self._note_changes(before, snap)
        self._previous = snap
        return snap

    def _note_changes(self, before: Snapshot, after: Snapshot) -> None:
        counts = Counter()
        for key, row in after.rows.items():
            old = before.rows.get(key)
            if old is None:
                counts["unknown"] += row.state == "destroying"
            elif row.missing and not old.missing:
                counts["marked"] += 1
            elif old.missing and not row.missing and row.state == "created":
                counts["cleared"] += 1
        for key, old in before.rows.items():
            if key not in after.rows and old.state == "destroying":
                counts["destroyed"] += 1
        with self.stats_lock:
            self.stats.update(counts)
        for name, worker in after.workers.items():
            old = before.workers.get(name)
            if old is not None and old.state != worker.state:
                self._event(f"control plane: {name} {old.state} -> {worker.state}")
        for name in before.workers:
            if name not in after.workers:  # the audit log says why
                if self.trouble_log.get("vanish", {}).get("worker") == name:
                    self.trouble_log["vanish"]["deleted_at"] = after.at
        cut = self.trouble_log.get("cut_off")
        if cut and "back" not in cut and before.at >= cut["at"]:
            cut["deleted"] += sum(
                1
                for key, row in before.rows.items()
                if row.worker == cut["worker"] and key not in after.rows
            )
            if after.workers.get(cut["worker"], WorkerRow("", 0)).state == "stalled":
                cut.setdefault("stalled_at", after.at)
        if self.stuck_key is not None and self.stuck_key not in after.rows:
            self._stuck_became("deleted")

    def _stuck_became(self, state: str) -> None:
        states = self.trouble_log["stuck"]["states"]
        if states[-1] != "deleted" and states[-1] != state:
            states.append(state)
            self._event(f"control plane: container {self.stuck_key[1]} -> {state}")

    def _read_audit(self) -> None:
        with self.plane.db.transaction() as conn:
            rows = expand(  # one entry per subject: a batch row holds many
                conn.execute(
                    select(audit_events)
                    .where(audit_events.c.id > self._last_audit_id)
                    .order_by(audit_events.c.id)
                )
            )
        if not rows:
            return
        self._last_audit_id = rows[-1]["id"]
        for wrong in audited_wrong_deletions(rows, self.history.holder_at):
            self.wrong.append(wrong)
            self._event(f"WRONGLY DELETED: {wrong.line()}")
        groups = Counter(
            (r["worker_name"], r["action"], r["kind"], r["reason"])
            for r in rows
            if r["kind"] in KINDS
        )
        for (worker, action, kind, reason), n in sorted(groups.items(), key=str):
            with self.stats_lock:
                self.stats[f"collector {action}"] += n
            self._event(f"collector: {action} {plural(n, kind)} of {worker} ({reason})")
        for r in rows:
            if self.stuck_key == (r["kind"], r["subject"]) and r["action"] in ("fail", "destroy"):
                self._stuck_became("failed" if r["action"] == "fail" else "destroying")
            if r["kind"] not in KINDS and r["action"] != "stall":
                self._event(f"collector: {r['action']} {r['kind']} {r['subject']}: {r['reason']}")
        restart = self.trouble_log.get("restart")
        if restart:
            restart["deleted"] = restart.get("deleted", 0) + sum(
                1
                for r in rows
                if r["action"] == "delete"
                and r["kind"] in KINDS
                and r["worker_name"] == restart["worker"]
            )

    def frame(self, snap: Snapshot) -> Frame:
        return Frame(
            elapsed=snap.at,
            phase=self.phase,
            config=self.config,
            snapshot=snap,
            sim=list(self.sim.values()),
            stats=dict(self.stats),
            events=list(self.events),
            wrong=len(self.wrong),
            mode=self.mode,
        )

    # The run -------------------------------------------------------------------------------

    def run(self) -> Verdict:
        self._open()
        try:
            return self._run()
        finally:
            self._shutdown()

    def _run(self) -> Verdict:
        config = self.config
        self._make_workers()
        self._make_keys()
        if not self.settings.embedded:
            self._start_control_plane()
        self.started = time.monotonic()
        for worker in self.sim.values():
            self._start_reporter(worker)
        if self.settings.embedded:
            self._spawn(self._collector_loop, "collector")
        else:  # beat triggers the collections
            self._wait_until_every_worker_registered()
            self.say(f"every worker registered after {self.elapsed():.1f}s")
            self.started = time.monotonic()
        self._spawn(self._scheduler_loop, "scheduler")
        self.phase = "running"
        script = deque(config.script(list(self.sim)))
        next_tick = time.monotonic()
        while self.elapsed() < config.duration:
            while script and script[0].at <= self.elapsed():
                try:
                    self._trouble(script.popleft())
                except Exception as error:
                    self._error(f"script: {error!r}")
            self.view(self.frame(self._observe()))
            next_tick += config.tick
            time.sleep(max(0.0, next_tick - time.monotonic()))
        for trouble in script:  # cannot happen with a valid duration; never leave one out
            self._trouble(trouble)

        self.phase = "settling"
        self.scheduler_stop.set()
        for thread in self.threads:
            if thread.name == "scheduler":
                thread.join(timeout=30)
        self._event("scheduler stops; letting the system settle (final reports and collections)")
        stopped_at = time.monotonic()
        live = [w.name for w in self.sim.values() if not w.gone]
        settled_after = None
        deadline = stopped_at + config.settle_timeout
        # Settled: agreeing for a whole collection and report round (a collection may still
        # move a row, e.g. orphan a volume whose container went, and its worker remove it).
        quiet_for = config.gc_interval + config.report_interval
        while time.monotonic() < deadline:
            snap = self._observe()
            self.view(self.frame(snap))
            now = time.monotonic()
            if disagreements(snap, live):
                settled_after = None
            elif settled_after is None:
                settled_after = now - stopped_at
            elif now - stopped_at - settled_after >= quiet_for:
                break
            time.sleep(config.tick)

        self.phase = "done"
        self.collector_stop.set()
        for worker in self.sim.values():
            if worker.reporter is not None:
                worker.reporter.stop()
        for thread in self.threads:
            thread.join(timeout=30)
        final = self._observe()  # nothing moves any more
        self.view(self.frame(final))
        self.outcomes = self._outcomes(final)
        wrong = unique_wrong_deletions(self.wrong)
        return Verdict(
            disagreements=disagreements(final, live),
            wrongly_deleted=wrong,
            errors=list(self.errors),
            containers=sum(1 for kind, _ in final.rows if kind == "container"),
            volumes=sum(1 for kind, _ in final.rows if kind == "volume"),
            workers=len(final.workers),
            settled_after=settled_after,
        )

    def _outcomes(self, final: Snapshot) -> list[str]:
        """One line per scripted trouble: what the control plane made of it."""
        lines = []
        log = self.trouble_log
        if "restart" in log:
            r = log["restart"]
            lost = r["lost"]
            left = sum(
                1 for row in final.rows.values() if row.worker == r["worker"] and row.missing
            )
            lines.append(
                f"{r['worker']}: runtime restarted at {r['at']:.1f}s, lost "
                f"{plural(lost['container'], 'container')} and {plural(lost['volume'], 'volume')};"
                f" the collector deleted {plural(r.get('deleted', 0), 'row')} once missing past "
                f"the grace period and confirmed by a later report ({left} still marked)"
            )
        if "cut_off" in log:
            c = log["cut_off"]
            stalled = (
                f"stalled by the collector {c['stalled_at'] - c['at']:.1f}s later"
                if "stalled_at" in c
                else "never seen stalled"
            )
            lines.append(
                f"{c['worker']}: cut off at {c['at']:.1f}s for {self.config.cut_off_for:.1f}s "
                f"holding {c['holding']} directories, {stalled}, came back; rows deleted "
                f"while it was away: {c['deleted']}"
            )
        if "vanish" in log:
            v = log["vanish"]
            when = (
                f"deleted with its rows {v['deleted_at'] - v['at']:.1f}s later, when its "
                "heartbeat expired"
                if "deleted_at" in v
                else "still in the database"
            )
            lines.append(f"{v['worker']} (ephemeral): vanished at {v['at']:.1f}s, {when}")
        if "stuck" in log:
            s = log["stuck"]
            lines.append(
                f"container {s['worker']}:stuck (never created on {s['worker']}): "
                + " -> ".join(s["states"])
            )
        return lines

    def _shutdown(self) -> None:
        self.scheduler_stop.set()
        self.collector_stop.set()
        for worker in self.sim.values():
            if worker.reporter is not None:
                worker.reporter.stop()
        for thread in self.threads:
            thread.join(timeout=30)
        self._stop_control_plane()
        if self.plane is not None:
            self.plane.close()
        if self.engine is not None:
            try:
                self.outcomes.append(f"engine: {self.engine.clean()}")
            except ENGINE_ERRORS as error:
                self.outcomes.append(
                    f"engine: could not remove what run {self.engine.run} made: {short(error)}"
                )


# The live view -------------------------------------------------------------------------------


@dataclass
class Frame:
    """What the view shows at one tick."""

    elapsed: float
    phase: str
    config: DemoConfig
    snapshot: Snapshot
    sim: list[SimWorker]
    stats: dict
    events: list[tuple[float, str]]
    wrong: int
    mode: str = "embedded"

    def worker_rows(self) -> list[dict]:
        snap = self.snapshot
        rows = []
        for worker in self.sim:
            db = snap.workers.get(worker.name)
            mine = [(key, row) for key, row in snap.rows.items() if row.worker == worker.name]
            on_disk = Counter(kind for (kind, _), w in snap.disk.items() if w == worker.name)
            in_db = Counter(kind for (kind, _), _row in mine)
            incarnation = "-"
            if db is not None and db.incarnation in worker.incarnations:
                incarnation = str(worker.incarnations.index(db.incarnation) + 1)
            rows.append(
                {
                    "worker": worker.name,
                    "state": db.state if db else "deleted",
                    "incarnation": incarnation,
                    "containers": f"{in_db['container']}/{on_disk['container']}",
                    "volumes": f"{in_db['volume']}/{on_disk['volume']}",
                    "missing": sum(1 for _, row in mine if row.missing),
                    "destroying": sum(1 for _, row in mine if row.state == "destroying"),
                    "other": sum(1 for _, row in mine if row.state in ("creating", "failed")),
                    "note": worker.note,
                }
            )
        return rows

    def totals(self) -> str:
        s = self.stats
        return (
            f"created {s.get('containers created', 0)} containers, "
            f"{s.get('volumes created', 0)} volumes; destroy requests "
            f"{s.get('destroy requests', 0)}; marked missing {s.get('marked', 0)}, cleared "
            f"{s.get('cleared', 0)}; confirmed destroyed {s.get('destroyed', 0)}; collector "
            f"deleted {s.get('collector delete', 0)}; rows wrongly deleted {self.wrong}"
        )

    def plain_line(self) -> str:
        workers = " | ".join(
            f"{r['worker']} {r['state']} c{r['containers']} v{r['volumes']}"
            + (f" m{r['missing']}" if r["missing"] else "")
            for r in self.worker_rows()
        )
        return f"[{self.elapsed:5.1f}s] {self.phase}: {workers} || {self.totals()}"


def render(frame: Frame):
    """The rich renderable for one frame."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c = frame.config
    header = Text.assemble(
        ("gcworker demo", "bold"),
        f"  {c.workers} workers, {frame.mode}  ",
        (f"t={frame.elapsed:4.1f}s/{c.duration:g}s  {frame.phase}", "cyan"),
        "\n",
        (
            f"report {c.report_interval:g}s  heartbeat {c.heartbeat_interval:g}s  TTL "
            f"{c.heartbeat_ttl:g}s  grace {c.grace:g}s  creating timeout "
            f"{c.creating_timeout:g}s  GC {c.gc_interval:g}s",
            "dim",
        ),
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column, width in (
        ("worker", 9),
        ("state", 7),
        ("inc", 3),
        ("ctrs", 5),
        ("vols", 5),
        ("miss", 4),
        ("destr", 5),
        ("cr/fl", 5),
    ):
        table.add_column(column, no_wrap=True, min_width=width)
    table.add_column("trouble", no_wrap=True, overflow="ellipsis")
    style = {"running": "green", "stalled": "yellow"}
    for r in frame.worker_rows():
        table.add_row(
            r["worker"],
            Text(r["state"], style=style.get(r["state"], "red")),
            r["incarnation"],
            r["containers"],
            r["volumes"],
            str(r["missing"] or ""),
            str(r["destroying"] or ""),
            str(r["other"] or ""),
            r["note"],
        )
    totals = Text(frame.totals(), style="red" if frame.wrong else "")
    events = Text("events:", style="bold")
    for t, text in frame.events:
        events.append(f"\n{t:5.1f}s  {text}", style="dim")
    events.no_wrap = True
    events.overflow = "ellipsis"
    legend = Text(
        "ctrs, vols: rows in the database / directories on the worker; miss: marked missing; "
        "destr: destroying; cr/fl: creating or failed; inc: incarnation",
        "dim",
    )
    return Group(header, Text(""), table, legend, Text(""), totals, Text(""), events)


class DemoError(Exception):
    """The demo could not run (not a verdict): e.g. the control plane did not start."""


def _redacted(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def make_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="gcworker-demo-"))
