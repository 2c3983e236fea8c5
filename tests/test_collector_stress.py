"""The collector under stress (PostgreSQL): a mass loss with stale planner statistics, the lock
order it shares with reports and the scheduler (the worker, then its rows), and the limits of the
fenced session (a stopped collector losing the fence is `tests/test_faults.py`)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import event, text

from gcworker.db.fence import collection_fence
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.workers import WorkerRepository
from gcworker.settings import load_settings
from tests.conftest import created
from tests.pipeline_support import wait_until_blocked_by

pytestmark = pytest.mark.backends("postgresql")


def plan_nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", ()):
        yield from plan_nodes(child)


@pytest.fixture
def explained_deletes(db):
    """The plans of the collector's DELETE statements on `containers`, each explained on the
    collector's own connection just before it runs (with its parameters, in its transaction,
    with the statistics as they are then)."""
    plans: list[list[dict]] = []

    def explain(conn, _cursor, statement, parameters, *_args):
        if "DELETE FROM containers" in statement:
            cursor = conn.connection.dbapi_connection.cursor()
            try:
                cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
                (plan,) = cursor.fetchone()[0]
            finally:
                cursor.close()
            plans.append(list(plan_nodes(plan["Plan"])))

    event.listen(db.engine, "before_cursor_execute", explain)
    yield plans
    event.remove(db.engine, "before_cursor_execute", explain)


def test_a_mass_loss_marked_after_analyze_is_deleted_by_primary_key_without_a_nested_loop(
    settings, db, plane, make_worker, advance, explained_deletes
):
    """4 workers lose their containers at once, marked after the last ANALYZE (the planner
    believes each worker's marked range empty): each batch of a worker's oldest marks deletes
    its rows by primary key, never by a nested loop over the worker's marked rows (which made
    a batch quadratic in the worker's marks: 274 s for 100k rows)."""
    workers = [make_worker(f"w{i}") for i in range(4)]
    with db.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO containers (handle, worker_name, state, created_at, "
                "state_changed_at) SELECT w.name || '-' || g, w.name, 'created', now(), now() "
                "FROM workers w CROSS JOIN generate_series(1, 1500) g"
            )
        )
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # Statistics from before the loss, and no autovacuum to refresh them meanwhile.
        conn.execute(text("ALTER TABLE containers SET (autovacuum_enabled = false)"))
        conn.execute(text("VACUUM ANALYZE containers"))
    for w in workers:
        w.report()  # every container is missing
    advance(minutes=5)
    for w in workers:
        w.heartbeat()
        w.report()  # confirms the absence

    plane.settings = load_settings(
        database_url=settings.database_url, delete_batch_size=500, max_deletes_per_collection=6000
    )
    summary = plane.collect()

    assert summary.counts == {"containers deleted": 6000}
    assert len(explained_deletes) == 12  # 3 batches of each worker's 500 oldest marks
    for nodes in explained_deletes:
        types = [node["Node Type"] for node in nodes]
        assert "Nested Loop" not in types, types
        # The rows deleted are read by id (the candidates' own scan is aliased `candidate`).
        deleted = [
            n.get("Index Name")
            for n in nodes
            if n.get("Alias") == "containers" and n["Node Type"] != "ModifyTable"
        ]
        assert deleted == ["containers_pkey"], json.dumps(nodes, default=str)[:3000]


# One lock order: the worker, then its rows -------------------------------------------------


def stuck_in_creating(plane, w, advance) -> tuple[str, str, tuple[str, ...], str]:
    """A container left in creating past the timeout; the scheduler then reports it created."""
    plane.scheduler.create_container("w1", "c1")
    advance(hours=2)
    return "container", "c1", ("creating",), "created"


def orphaned(plane, w, advance) -> tuple[str, str, tuple[str, ...], str]:
    """A volume whose owning container's row is gone; the scheduler then destroys it."""
    created(plane, "w1", "owner")
    plane.scheduler.create_volume("w1", "orphan", container="owner")
    plane.scheduler.volume_created("orphan")
    plane.scheduler.destroy_container("owner")
    w.report(volumes=["orphan"])  # "owner" is confirmed destroyed: "orphan" is orphaned
    return "volume", "orphan", ("created",), "destroying"


@pytest.mark.parametrize("arrange", [stuck_in_creating, orphaned])
def test_the_collector_locks_a_worker_before_its_rows_as_the_scheduler_does(
    db, plane, make_worker, advance, arrange
):
    """The scheduler holds worker w1 (as it does before changing one of w1's rows) while a
    collection moves one of w1's rows; once the collection waits, the scheduler changes that
    row. A collector that took the row before the worker closed a lock cycle (PostgreSQL:
    DeadlockDetected); one that takes the worker first just waits, then finds the row moved."""
    w = make_worker("w1")
    kind, handle, from_states, to_state = arrange(plane, w, advance)
    w.heartbeat()  # w1 is running: the worker collector leaves it alone
    repo = (ContainerRepository if kind == "container" else VolumeRepository)(db)

    failures: list[BaseException] = []

    def collect():
        try:
            plane.collect()
        except BaseException as error:  # reported by the assertion below
            failures.append(error)

    with db.engine.connect() as scheduler:
        scheduler.begin()
        assert WorkerRepository(db).lock(scheduler, "w1") is not None
        pid = scheduler.execute(text("SELECT pg_backend_pid()")).scalar_one()
        collection = threading.Thread(target=collect)
        collection.start()
        try:
            wait_until_blocked_by(db.engine, pid, what="the collection to wait for w1")
            moved = repo.transition(
                scheduler, handle, from_states=from_states, to_state=to_state, now=db.now(scheduler)
            )
            scheduler.commit()
        finally:
            collection.join(timeout=60)

    assert not collection.is_alive()
    assert failures == []
    assert moved
    rows = plane.containers() if kind == "container" else plane.volumes()
    assert {r["handle"]: r["state"] for r in rows}[handle] == to_state


# The fence's session ---------------------------------------------------------------------------


def test_the_fenced_session_has_limits_scaled_on_the_gc_interval_and_gives_them_back(db):
    """While a collection holds the fence its session may not wait, idle or run a statement
    for long (a stopped or hung collector loses the fence); the connection then goes back to
    the pool without those limits."""

    def show(conn, name: str) -> str:
        return conn.execute(text(f"SHOW {name}")).scalar_one()

    names = ("lock_timeout", "idle_in_transaction_session_timeout", "tcp_keepalives_idle")
    with db.engine.connect() as conn:
        before = {name: show(conn, name) for name in names}
        with collection_fence(conn, timedelta(seconds=30)) as held:
            assert held
            assert {name: show(conn, name) for name in names} == {
                "lock_timeout": "30s",
                "idle_in_transaction_session_timeout": "30s",
                "tcp_keepalives_idle": "30",
            }
            assert show(conn, "statement_timeout") == "2min"
        assert {name: show(conn, name) for name in names} == before
