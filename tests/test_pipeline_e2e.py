"""End to end through real Redis and real Celery worker processes (never eager mode), on
PostgreSQL: reporters reach the database, reconcilers tolerate duplicates, reordering and
SIGKILL, heartbeats overtake a backlog of reports, one collection at a time under two beats,
and destroying handles leave the runtime and then the database."""

from __future__ import annotations

import itertools
import random
import re
import time
import uuid

import pytest
from sqlalchemy import text

from gcworker.control_plane import ControlPlane
from gcworker.db.database import Database
from gcworker.db.migrate import upgrade
from gcworker.messages import Heartbeat, Report
from gcworker.runtimes.dir import DirRuntime
from gcworker.settings import load_settings
from tasks.routing import COLLECT_TASK
from tests.conftest import PG_ADMIN_URL
from tests.pipeline_support import Pipeline, wait_for, wait_until_blocked_by

pytestmark = [pytest.mark.backends("postgresql"), pytest.mark.timeout(120)]

FAST_REPORTER = {"heartbeat_interval": "0.3s", "report_interval": "0.5s"}


@pytest.fixture
def pipeline(database_url, db, tmp_path):
    pipe = Pipeline(database_url, tmp_path)
    yield pipe
    pipe.close()


def worker_row(plane: ControlPlane, name: str) -> dict | None:
    return next((w for w in plane.workers() if w["name"] == name), None)


def rows(plane: ControlPlane) -> dict[tuple[str, str], tuple[str, str, bool]]:
    """(kind, handle) -> (worker, state, marked missing) for every container and volume."""
    found = {}
    for kind, listing in (("container", plane.containers()), ("volume", plane.volumes())):
        for r in listing:
            found[(kind, r["handle"])] = (r["worker"], r["state"], r["missing_since"] is not None)
    return found


def create_on(plane: ControlPlane, runtime: DirRuntime | None, worker: str, kind: str, handle):
    """The scheduler records the row, the worker creates it, the scheduler marks it created."""
    scheduler = plane.scheduler
    if kind == "container":
        scheduler.create_container(worker, handle)
    else:
        scheduler.create_volume(worker, handle)
    if runtime is not None:
        runtime.create(kind, handle)
    (scheduler.container_created if kind == "container" else scheduler.volume_created)(handle)


# A reporter reaches the database -------------------------------------------------------------


def test_reporter_with_dir_runtime_reaches_the_database(pipeline, plane, tmp_path):
    pipeline.start_reconciler("r1", concurrency=2)
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    reporter = pipeline.start_reporter("w1", runtime.root, **FAST_REPORTER)

    wait_for(
        lambda: (w := worker_row(plane, "w1")) and w["state"] == "running" and w["last_report_at"],
        timeout=20,
        what="w1 registered by its first heartbeat and its first report applied",
        details=pipeline.logs,
    )
    create_on(plane, runtime, "w1", "container", "c1")
    create_on(plane, runtime, "w1", "volume", "v1")
    create_on(plane, None, "w1", "container", "c-lost")  # recorded, but never on the worker

    expected = {
        ("container", "c1"): ("w1", "created", False),
        ("volume", "v1"): ("w1", "created", False),
        ("container", "c-lost"): ("w1", "created", True),  # marked missing by a later report
    }
    wait_for(
        lambda: rows(plane) == expected,
        timeout=20,
        what="the reporter's reports to mark c-lost and leave c1 and v1 alone",
        details=lambda: f"{rows(plane)}\n{pipeline.logs()}",
    )
    assert pipeline.stop(reporter, timeout=10) == 0, reporter.log()
    assert "reporter stopped" in reporter.log()


# Destroying: from the runtime, then from the database ----------------------------------------


def test_destroying_handles_leave_the_runtime_then_the_database(pipeline, plane, tmp_path):
    pipeline.start_reconciler("r1", concurrency=2)
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    runtime.create("container", "unknown-1")  # on the worker, never recorded (rule 8)
    pipeline.start_reporter("w1", runtime.root, **FAST_REPORTER)
    wait_for(
        lambda: (w := worker_row(plane, "w1")) and w["state"] == "running",
        timeout=20,
        what="w1 registered",
        details=pipeline.logs,
    )
    for kind, handle in (("container", "c1"), ("container", "c2"), ("volume", "v1")):
        create_on(plane, runtime, "w1", kind, handle)
    plane.scheduler.destroy_container("c1")
    plane.scheduler.destroy_volume("v1")

    targets = {("container", "c1"), ("volume", "v1"), ("container", "unknown-1")}
    left_runtime: dict = {}
    left_database: dict = {}

    def done():
        now = time.monotonic()
        # The database first, then the runtime: a handle leaves the runtime before its row, so
        # a row deleted between the two reads is then also seen gone from the runtime (read the
        # other way round, such a deletion would look like the wrong order).
        in_db = rows(plane)
        inventory = runtime.inventory()
        on_disk = set(inventory.containers) | set(inventory.volumes)
        for kind, handle in targets:
            if handle not in on_disk:
                left_runtime.setdefault(handle, now)
            if (kind, handle) not in in_db:
                left_database.setdefault(handle, now)
        return len(left_database) == len(targets) and len(left_runtime) == len(targets)

    wait_for(
        done,
        timeout=30,
        what="c1, v1 and unknown-1 to leave the runtime and the database",
        details=lambda: f"{rows(plane)}\n{runtime.inventory()}\n{pipeline.logs()}",
    )
    for handle in ("c1", "v1"):
        assert left_runtime[handle] <= left_database[handle], (handle, left_runtime, left_database)
    assert rows(plane) == {("container", "c2"): ("w1", "created", False)}
    assert runtime.inventory().containers == ["c2"]


# Duplicated and reordered deliveries, two reconcilers ------------------------------------------


def _scenario(seed: int):
    """Setup (applied in order to both databases) and the events to deliver."""
    rng = random.Random(seed)
    names = ["w1", "w2", "w3"]
    events = []
    for name in names:
        known_c = [f"c-{name}-{i}" for i in range(10)]
        known_v = [f"v-{name}-{i}" for i in range(4)]
        seq = itertools.count(2)
        for _ in range(14):
            if rng.random() < 0.25:
                events.append(Heartbeat(worker=name, incarnation=1, seq=next(seq)))
                continue
            containers = [h for h in known_c if rng.random() < 0.7]
            # Undated reports (rule 4) confirm no destruction (rule 9): the stray containers the
            # worker holds (rule 8) are in every report, so the order cannot tell.
            containers += [f"u-{name}-{i}" for i in range(3)]
            volumes = [h for h in known_v if rng.random() < 0.7]
            events.append(
                Report(
                    worker=name,
                    incarnation=1,
                    seq=next(seq),
                    containers=containers,
                    volumes=volumes,
                )
            )
    return names, events


def _setup(plane: ControlPlane, names):
    for name in names:
        plane.apply(Heartbeat(worker=name, incarnation=1, seq=1))
        for i in range(10):
            create_on(plane, None, name, "container", f"c-{name}-{i}")
        for i in range(4):
            create_on(plane, None, name, "volume", f"v-{name}-{i}")
        plane.scheduler.destroy_container(f"c-{name}-8")
        plane.scheduler.destroy_container(f"c-{name}-9")


def _database_state(plane: ControlPlane):
    workers = {
        w["name"]: (
            w["state"],
            w["incarnation"],
            w["last_heartbeat_seq"],
            w["last_report_seq"],
            w["running_since_seq"],
        )
        for w in plane.workers()
    }
    return workers, rows(plane)


@pytest.fixture
def reference_plane(pg_admin_engine):
    """A second, empty PostgreSQL schema for the in-order reference run."""
    schema = "t_" + uuid.uuid4().hex[:16]
    with pg_admin_engine.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    url = f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    db = Database.from_url(url)
    upgrade(db.engine)
    yield ControlPlane(load_settings(database_url=url), db)
    db.dispose()
    with pg_admin_engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def test_two_reconcilers_with_duplicates_and_reordering_match_in_order(
    pipeline, plane, reference_plane
):
    names, events = _scenario(seed=3)
    _setup(reference_plane, names)
    _setup(plane, names)
    for message in events:  # the reference: each event once, in order
        reference_plane.apply(message)

    first = pipeline.start_reconciler("r1", concurrency=2, wait=False)
    second = pipeline.start_reconciler("r2", concurrency=2, wait=False)
    pipeline.wait_ready(first)
    pipeline.wait_ready(second)
    rng = random.Random(7)
    deliveries = [m for m in events for _ in range(rng.choice((1, 2, 3)))]
    rng.shuffle(deliveries)
    assert len(deliveries) > len(events)
    for message in deliveries:
        pipeline.send(message)

    wait_for(
        lambda: pipeline.in_flight() == 0,
        timeout=60,
        what=f"{len(deliveries)} deliveries to be applied and acknowledged",
        details=pipeline.logs,
    )
    assert _database_state(plane) == _database_state(reference_plane)
    for proc in (first, second):  # both took part
        assert re.search(r"Task gcworker\.report\[\S+\] succeeded", proc.log()), proc.name


# SIGKILL mid-report ---------------------------------------------------------------------------


def test_reconciler_killed_mid_report_loses_no_report(pipeline, plane, db):
    first = pipeline.start_reconciler("r1", broker_visibility_timeout="3s")
    pipeline.send(Heartbeat(worker="w1", incarnation=1, seq=1))
    wait_for(lambda: worker_row(plane, "w1"), timeout=20, what="w1 registered")
    for i in range(5):
        create_on(plane, None, "w1", "container", f"c{i}")
    for i in range(3):
        create_on(plane, None, "w1", "volume", f"v{i}")

    # Hold v0's row: the report marks containers first, then blocks marking v0 - mid-report.
    with db.engine.connect() as blocker:
        blocker_pid = blocker.execute(text("SELECT pg_backend_pid()")).scalar_one()
        blocker.execute(text("SELECT id FROM volumes WHERE handle = 'v0' FOR UPDATE"))
        pipeline.send(
            Report(
                worker="w1",
                incarnation=1,
                seq=2,
                containers=["c0", "c1", "u1"],
                volumes=["v1", "v2"],
            )
        )
        wait_until_blocked_by(
            db.engine,
            blocker_pid,
            what="the report to block mid-transaction",
            details=pipeline.logs,
        )
        second = pipeline.start_reconciler("r2", broker_visibility_timeout="3s")
        pipeline.kill(first)  # SIGKILL the reconciler and its pool process
        blocker.rollback()

    expected = {
        ("container", "c0"): ("w1", "created", False),
        ("container", "c1"): ("w1", "created", False),
        ("container", "c2"): ("w1", "created", True),
        ("container", "c3"): ("w1", "created", True),
        ("container", "c4"): ("w1", "created", True),
        ("container", "u1"): ("w1", "destroying", False),
        ("volume", "v0"): ("w1", "created", True),
        ("volume", "v1"): ("w1", "created", False),
        ("volume", "v2"): ("w1", "created", False),
    }
    wait_for(
        lambda: worker_row(plane, "w1")["last_report_seq"] == 2 and rows(plane) == expected,
        timeout=40,
        what="the killed reconciler's report to be redelivered and applied in full",
        details=lambda: f"{rows(plane)}\n{pipeline.logs()}",
    )
    assert "report applied" in second.log()
    wait_for(lambda: pipeline.in_flight() == 0, timeout=10, what="the report to be acknowledged")


# Heartbeats overtake a backlog of large reports -----------------------------------------------


def test_heartbeats_are_applied_promptly_behind_a_backlog_of_large_reports(pipeline, plane):
    pipeline.start_reconciler("r1", concurrency=2)
    reporters = [f"big{i}" for i in range(4)]
    for name in [*reporters, "hb"]:
        pipeline.send(Heartbeat(worker=name, incarnation=1, seq=1))
    wait_for(lambda: len(plane.workers()) == 5, timeout=20, what="five workers registered")

    handles = 8000
    for i in range(40):  # each report a fresh set: every one is a full diff with writes
        pipeline.send(
            Report(
                worker=reporters[i % 4],
                incarnation=1,
                seq=2 + i // 4,
                containers=[f"r{i}-{j}" for j in range(handles)],
                volumes=[],
            )
        )
    wait_for(
        lambda: any(worker_row(plane, n)["last_report_seq"] for n in reporters),
        timeout=30,
        what="the first large report to be applied",
    )
    started = time.monotonic()
    pipeline.send(Heartbeat(worker="hb", incarnation=1, seq=2))
    wait_for(
        lambda: worker_row(plane, "hb")["last_heartbeat_seq"] == 2,
        timeout=20,
        what="the heartbeat behind the backlog",
        interval=0.02,
    )
    latency = time.monotonic() - started
    backlog = pipeline.queue_length("reports")
    print(f"heartbeat applied after {latency:.2f}s with {backlog} large reports still waiting")
    assert backlog >= 10, f"the backlog drained too fast to show anything ({backlog} left)"
    assert latency < 3.0, f"heartbeat waited {latency:.2f}s behind {backlog} reports"


# Two beats, two collectors, one collection at a time -----------------------------------------

FENCE = re.compile(
    r"collection finished outcome=\"completed\".* fenced_from=([\d.]+) fenced_until=([\d.]+)"
)


def test_two_beats_and_two_collectors_never_run_two_collections_at_once(pipeline, plane):
    for name in ("w1", "w2", "w3"):  # something to look at in every collection
        plane.apply(Heartbeat(worker=name, incarnation=1, seq=1))
        for i in range(30):
            create_on(plane, None, name, "container", f"{name}-c{i}")
    settings = {"gc_interval": "1s"}
    started = [
        pipeline.start_reconciler("c1", concurrency=2, queues="collect", wait=False, **settings),
        pipeline.start_reconciler("c2", concurrency=2, queues="collect", wait=False, **settings),
        pipeline.start_beat("b1", wait=False, **settings),
        pipeline.start_beat("b2", wait=False, **settings),
    ]
    for proc in started:
        pipeline.wait_ready(proc)
    collectors, beats = started[:2], started[2:]
    for _ in range(3):  # bursts on top of the schedule: four pool processes race for the fence
        for _ in range(12):
            pipeline.send_task(COLLECT_TASK, "collect")
        time.sleep(0.3)

    def fenced():
        return sorted((float(a), float(b)) for p in collectors for a, b in FENCE.findall(p.log()))

    def skipped():
        return sum(p.log().count('collection finished outcome="skipped"') for p in collectors)

    wait_for(
        lambda: len(fenced()) >= 10 and skipped() >= 1,
        timeout=40,
        what="ten completed collections and at least one skipped",
        details=pipeline.logs,
    )
    intervals = fenced()
    print(f"{len(intervals)} collections completed, {skipped()} skipped (fence taken)")
    for (_, end), (start, _) in itertools.pairwise(intervals):
        assert end <= start, f"two collections held the fence at once: {intervals}"
    senders = [b.name for b in beats if "Sending due task gcworker-collect" in b.log()]
    assert len(senders) == 1, f"beats that sent triggers: {senders}\n{pipeline.logs()}"
    assert all(p.log().count("collection finished") for p in collectors)


# Invalid messages: logged, dead-lettered, acknowledged -----------------------------------------


def test_invalid_messages_are_logged_and_dropped_never_redelivered(pipeline, plane):
    reconciler = pipeline.start_reconciler("r1", allow_unsigned="false")
    app = pipeline.channel.app
    app.send_task("gcworker.report", args=[{"payload": "{not json"}], queue="reports")
    app.send_task("gcworker.report", args=["a bare string"], queue="reports")
    app.send_task("gcworker.heartbeat", args=[], queue="heartbeats")  # wrong arity
    pipeline.send(Heartbeat(worker="w1", incarnation=1, seq=1))  # unsigned: refused here
    wait_for(
        lambda: pipeline.in_flight() == 0 and len(plane.dead_letters()) == 4,
        timeout=20,
        what="every message acknowledged and dead-lettered",
        details=pipeline.logs,
    )
    reasons = sorted(d["reason"].split(":")[0] for d in plane.dead_letters())
    assert reasons == [
        "malformed JSON",
        "malformed envelope",
        "malformed task call",
        "unsigned message (set GCWORKER_ALLOW_UNSIGNED=true to accept them)",
    ], reasons
    assert plane.workers() == []
    assert reconciler.alive()
    assert reconciler.log().count("message rejected") == 4
