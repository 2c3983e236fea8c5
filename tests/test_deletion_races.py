"""Races between deletions and the messages that keep rows alive, from the second hostile
review of issue 9: a heartbeat committing while the worker collector chooses whom to delete, an
ephemeral restart whose new incarnation made containers before its first heartbeat was applied,
a report clearing a mark while a deletion batch waits for the worker's lock."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import create_engine, text

from gcworker.rules import HeartbeatOutcome
from tests.conftest import created, states
from tests.pipeline_support import wait_for


def _lock_waiters(admin) -> int:
    with admin.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        ).scalar_one()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as error:  # noqa: BLE001 - reported by the test
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.backends("postgresql")
@pytest.mark.parametrize("ephemeral", [False, True], ids=["stalled-timeout", "ephemeral-expiry"])
def test_worker_collector_never_deletes_a_worker_whose_heartbeat_committed_before_its_lock(
    database_url, db, plane, make_worker, advance, ephemeral
):
    """The worker collector picks the workers to delete with a plain SELECT (expired heartbeat,
    or stalled past the timeout) and then `WorkerRepository.delete` locks them by NAME ONLY:
    it never checks again, under the lock, that they still qualify. A heartbeat that commits
    between the two (it resumes the stalled worker, or extends the ephemeral one's expiry) is
    answered RESUMED / EXTENDED, and then the worker is deleted with every row of it, although
    its containers still exist; its tombstone then rejects every later message of this live
    incarnation (rule 16), and when it restarts, its containers are unknown (rule 8)."""
    from gcworker.control_plane import ControlPlane
    from gcworker.settings import load_settings

    plane = ControlPlane(load_settings(database_url=database_url, stalled_worker_timeout="1h"), db)
    worker = make_worker("w1", ephemeral=ephemeral)
    worker.plane = plane
    created(plane, "w1", "c1")
    worker.report(["c1"])
    if ephemeral:
        advance(minutes=5)  # the ephemeral worker's heartbeat expired
    else:
        advance(minutes=5)
        plane.collect()  # stalls w1
        assert plane.workers()[0]["state"] == "stalled"
        advance(hours=2)  # past the stalled-worker timeout

    admin = create_engine(database_url, isolation_level="AUTOCOMMIT")
    blocker = create_engine(database_url).connect()
    try:
        # Any transaction holding w1's row a moment (a report being applied, say).
        tx = blocker.begin()
        blocker.execute(text("SELECT 1 FROM workers WHERE name = 'w1' FOR UPDATE"))
        beat, beat_out = _in_thread(worker.heartbeat)  # the live worker heartbeats...
        wait_for(lambda: _lock_waiters(admin) >= 1, timeout=10, what="heartbeat waits")
        gc, gc_out = _in_thread(plane.collect)  # ...while a collection runs
        wait_for(lambda: _lock_waiters(admin) >= 2, timeout=10, what="collector waits")
        tx.rollback()
        beat.join(20)
        gc.join(20)
    finally:
        blocker.close()
        admin.dispose()
    assert "error" not in beat_out and "error" not in gc_out, (beat_out, gc_out)
    outcome = beat_out["value"].outcome
    assert outcome in (HeartbeatOutcome.RESUMED, HeartbeatOutcome.EXTENDED), outcome

    # The heartbeat was accepted: the worker is alive and its container c1 still exists.
    after = {
        "workers": [w["name"] for w in plane.workers()],
        "rows": states(plane),
        "next heartbeat": str(worker.heartbeat().outcome),
    }
    assert after == {
        "workers": ["w1"],
        "rows": {"c1": ("created", False)},
        "next heartbeat": str(HeartbeatOutcome.EXTENDED),
    }


@pytest.mark.backends("postgresql")
def test_missing_collector_never_deletes_a_row_a_report_cleared_while_it_waited_for_the_lock(
    database_url, db, plane, make_worker, advance
):
    """Holds (written as an attack): the collection plans c1's deletion (missing past grace,
    confirmed), then waits for w1's lock behind a report that lists c1 again; the batch's
    DELETE, run after the lock, sees the cleared mark and keeps c1."""
    worker = make_worker("w1")
    created(plane, "w1", "c1", "c2")
    worker.report(["c2"])  # marks c1
    advance(minutes=5)
    worker.heartbeat()
    worker.report(["c2"])  # confirms c1's absence past grace: c1 is deletable now
    admin = create_engine(database_url, isolation_level="AUTOCOMMIT")
    blocker = create_engine(database_url).connect()
    try:
        tx = blocker.begin()
        blocker.execute(text("SELECT 1 FROM workers WHERE name = 'w1' FOR UPDATE"))
        rep, rep_out = _in_thread(lambda: worker.report(["c1", "c2"]))  # c1 is back
        wait_for(lambda: _lock_waiters(admin) >= 1, timeout=10, what="report waits")
        gc, gc_out = _in_thread(plane.collect)
        wait_for(lambda: _lock_waiters(admin) >= 2, timeout=10, what="collector waits")
        tx.rollback()
        rep.join(20)
        gc.join(20)
    finally:
        blocker.close()
        admin.dispose()
    assert "error" not in rep_out and "error" not in gc_out, (rep_out, gc_out)
    assert states(plane) == {"c1": ("created", False), "c2": ("created", False)}


def test_ephemeral_restart_drops_only_the_old_incarnations_rows_not_one_the_new_one_created(
    plane, make_worker
):
    """Rule 7 says an ephemeral worker's OLD incarnation's rows are gone; `_drop_old_incarnation`
    deletes EVERY row of the worker (rows carry no incarnation). A restarted ephemeral worker
    whose first heartbeat waits in the broker (a backlog) still looks running to the scheduler,
    which places c_new on it; the new incarnation creates it. When the heartbeat is applied,
    c_new's row is deleted although its container exists and was asked for; the new
    incarnation's next report then lists c_new as unknown (rule 8): destroying, and the
    reporter removes a container the scheduler just asked for."""
    worker = make_worker("w1", ephemeral=True)
    created(plane, "w1", "c_old")
    worker.report(["c_old"])
    # The host restarts: incarnation 2 starts, its first heartbeat is still in the broker while
    # the scheduler, seeing w1 running, creates c_new there and the new incarnation makes it.
    created(plane, "w1", "c_new")
    assert worker.restart().outcome == HeartbeatOutcome.NEW_INCARNATION  # the heartbeat arrives
    worker.report(["c_new"])  # incarnation 2 lists what it holds: c_new
    assert states(plane) == {"c_new": ("created", False)}
    assert plane.destroying_handles("w1") == {"container": [], "volume": []}
