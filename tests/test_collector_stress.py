"""The collector under stress (PostgreSQL): a mass loss with stale planner statistics, and the
lock order it shares with reports and the scheduler (the worker, then its rows)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import event, text

from gcworker.settings import load_settings

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
