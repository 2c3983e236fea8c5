"""What one report does to its worker's rows: rules 1, 2, 3, 6, 7 (reports), 8 and 9, and the
control plane's clock."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import event

from gcworker.rules import HeartbeatOutcome, ReportOutcome
from tests.conftest import created, states
from tests.rowwrites import install_row_write_counter


@pytest.fixture
def rows_written(db):
    return install_row_write_counter(db)


def missing_since(plane, handle: str, kind: str = "container"):
    rows = plane.containers() if kind == "container" else plane.volumes()
    return {r["handle"]: r["missing_since"] for r in rows}[handle]


def worker_row(plane, name: str = "w1") -> dict:
    return {w["name"]: w for w in plane.workers()}[name]


def stall(plane, advance, *workers):
    """Let the heartbeats of `workers` expire and have the collector notice."""
    advance(minutes=2)
    for w in workers:
        w.heartbeat()  # ... except these, which stay running
    plane.collect()


# Rule 1: mark -----------------------------------------------------------------------------


def test_rule1_mark_marks_created_rows_the_report_lacks(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", "v2", kind="volume")

    result = w.report(containers=["c1"], volumes=["v2"])

    assert result.outcome is ReportOutcome.ACCEPTED
    assert result.marked == {"container": 1, "volume": 1}
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}
    assert states(plane, "volume") == {"v1": ("created", True), "v2": ("created", False)}


def test_rule1_mark_never_marks_a_creating_row(plane, make_worker):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.create_volume("w1", "v1")

    w.report()
    w.report()

    assert states(plane) == {"c1": ("creating", False)}
    assert states(plane, "volume") == {"v1": ("creating", False)}


def test_rule1_mark_never_marks_a_destroying_or_failed_row(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    plane.scheduler.destroy_container("c1")
    plane.scheduler.create_container("w1", "c2")
    plane.scheduler.fail_container("c2")

    w.report(containers=["c1", "c2"])
    w.report(containers=["c2"])  # c1 is gone for good (rule 9); c2 is failed, never marked

    assert states(plane) == {"c2": ("failed", False)}


def test_rule1_mark_keeps_the_first_missing_since(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    first = missing_since(plane, "c1")

    advance(minutes=1)
    w.heartbeat()
    result = w.report()

    assert sum(result.marked.values()) == 0
    assert missing_since(plane, "c1") == first


def test_rule1_mark_touches_only_the_reporting_workers_rows(plane, make_worker):
    w1 = make_worker("w1")
    make_worker("w2")
    created(plane, "w1", "c1")
    created(plane, "w2", "c2")

    w1.report(containers=["c1"])

    assert states(plane) == {"c1": ("created", False), "c2": ("created", False)}


def test_rule1_mark_time_is_the_control_planes_clock_not_the_workers(plane, db, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    with db.transaction() as conn:
        before = db.now(conn)

    w.report(clock=datetime(2001, 1, 1, tzinfo=UTC))

    with db.transaction() as conn:
        after = db.now(conn)
    assert before <= missing_since(plane, "c1") <= after


# Rule 2: only while running ---------------------------------------------------------------


def test_rule2_only_while_running_a_stalled_workers_report_marks_nothing(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1")
    stall(plane, advance)
    assert worker_row(plane)["state"] == "stalled"

    result = w.report()

    assert result.outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert states(plane) == {"c1": ("created", False)}


def test_rule2_only_while_running_an_unknown_workers_report_changes_nothing(plane, make_worker):
    w = make_worker("ghost", heartbeat=False)

    result = w.report(containers=["c1"], volumes=["v1"])

    assert result.outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert plane.workers() == []
    assert states(plane) == {} and states(plane, "volume") == {}


def test_rule2_only_while_running_a_landing_or_landed_workers_report_marks_nothing(
    plane, make_worker
):
    w = make_worker()
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")
    plane.fleet.land("w1")

    assert w.report(containers=[]).outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert states(plane) == {"c1": ("created", False)}
    assert states(plane, "volume") == {"v1": ("created", False)}

    plane.scheduler.destroy_container("c1")
    plane.collect()
    assert worker_row(plane)["state"] == "landed"

    assert w.report(containers=["c1"]).outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert states(plane, "volume") == {"v1": ("created", False)}


def test_rule2_a_report_numbered_below_the_registering_heartbeat_marks_nothing(plane, make_worker):
    w = make_worker(heartbeat=False)
    w.heartbeat(seq=10)
    created(plane, "w1", "c1")

    late = w.report(seq=5)  # sent before the heartbeat that began the running period

    assert late.outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert states(plane) == {"c1": ("created", False)}

    assert w.report(seq=11).outcome is ReportOutcome.ACCEPTED
    assert states(plane) == {"c1": ("created", True)}


def test_rule2_a_report_sent_before_the_resuming_heartbeat_marks_nothing(
    plane, make_worker, advance
):
    w = make_worker(heartbeat=False)
    w.heartbeat(seq=1)
    created(plane, "w1", "c1")
    w.report(containers=["c1"], seq=2)
    stall(plane, advance)

    assert w.heartbeat(seq=20).outcome is HeartbeatOutcome.RESUMED
    late = w.report(seq=15)  # numbered below the heartbeat that began this running period

    assert late.outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert states(plane) == {"c1": ("created", False)}

    assert w.report(seq=21).outcome is ReportOutcome.ACCEPTED
    assert states(plane) == {"c1": ("created", True)}


# Rule 3: clear ----------------------------------------------------------------------------


def test_rule3_clear_a_reported_handle_clears_its_mark(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")
    w.report()
    assert states(plane) == {"c1": ("created", True)}

    result = w.report(containers=["c1"], volumes=["v1"])

    assert result.cleared == {"container": 1, "volume": 1}
    assert states(plane) == {"c1": ("created", False)}
    assert states(plane, "volume") == {"v1": ("created", False)}


def test_rule3_clear_writes_only_the_marked_rows(plane, make_worker, rows_written):
    w = make_worker()
    created(plane, "w1", "c1", "c2", "c3")
    w.report(containers=["c1", "c2"])
    before = rows_written()

    w.report(containers=["c1", "c2", "c3"])

    assert rows_written() - before == 1  # c3's mark, and nothing of c1 and c2


def test_rule3_a_report_that_matches_the_database_writes_no_container_or_volume_row(
    plane, make_worker, rows_written
):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", kind="volume")
    plane.scheduler.create_volume("w1", "v2", parent="v1")  # creating: may or may not be there
    plane.scheduler.create_container("w1", "c3")
    created(plane, "w1", "c4")
    plane.scheduler.destroy_container("c4")  # not yet removed by the worker
    before = rows_written()

    for _ in range(3):  # the first after the scheduler's changes, then the unchanged fast path
        result = w.report(containers=["c1", "c2", "c4"], volumes=["v1"])
        assert result.outcome is ReportOutcome.ACCEPTED

    assert rows_written() - before == 0
    # The counter does count: a report that lacks one handle writes exactly that row.
    w.report(containers=["c2", "c4"], volumes=["v1"])
    assert rows_written() - before == 1


def test_rule3_a_matching_report_costs_the_same_statements_whatever_the_number_of_handles(
    plane, db, make_worker
):
    statements: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    def cost_of_matching_report(worker, handles) -> int:
        created(plane, worker.name, *handles)
        worker.report(containers=handles)  # the first report after the scheduler's changes
        statements.clear()
        event.listen(db.engine, "before_cursor_execute", count)
        try:
            worker.report(containers=handles)
        finally:
            event.remove(db.engine, "before_cursor_execute", count)
        return len(statements)

    small = cost_of_matching_report(make_worker("small"), [f"s{i}" for i in range(2)])
    large = cost_of_matching_report(make_worker("large"), [f"l{i}" for i in range(60)])

    assert small == large


# Rule 6: stale and duplicate reports ------------------------------------------------------


def test_rule6_a_duplicate_report_changes_nothing(plane, make_worker, advance, rows_written):
    w = make_worker(heartbeat=False)
    w.heartbeat(seq=1)
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1", "c2"], seq=10)
    worker_before = worker_row(plane)
    before = rows_written()
    advance(minutes=1)

    again = w.report(containers=["c1"], seq=10)  # same number, and it would mark c2

    assert again.outcome is ReportOutcome.STALE
    assert states(plane) == {"c1": ("created", False), "c2": ("created", False)}
    assert rows_written() == before
    assert worker_row(plane) == worker_before


def test_rule6_an_older_report_changes_nothing(plane, make_worker, rows_written):
    w = make_worker(heartbeat=False)
    w.heartbeat(seq=1)
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"], seq=10)  # marks c2
    before = rows_written()

    older = w.report(containers=["c1", "c2"], volumes=["v9"], seq=9)  # would clear c2, add v9

    assert older.outcome is ReportOutcome.STALE
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}
    assert states(plane, "volume") == {}
    assert rows_written() == before
    assert worker_row(plane)["last_report_seq"] == 10


def test_rule6_a_stale_heartbeat_does_not_resume_a_stalled_worker(plane, make_worker, advance):
    w = make_worker(heartbeat=False)
    w.heartbeat(seq=5)
    created(plane, "w1", "c1")
    w.report(seq=6)  # marks c1
    stall(plane, advance)

    for seq in (5, 4):
        assert w.heartbeat(seq=seq).outcome is HeartbeatOutcome.STALE

    assert worker_row(plane)["state"] == "stalled"
    assert states(plane) == {"c1": ("created", True)}


# Rule 7: new incarnation (reports and heartbeats) -----------------------------------------


def test_rule7_new_incarnation_an_older_incarnation_is_rejected(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    w.restart()

    old_heartbeat = w.heartbeat_message(seq=100).model_copy(update={"incarnation": 1})
    old_report = w.report_message(seq=101).model_copy(update={"incarnation": 1})

    assert plane.reconciler.heartbeat(old_heartbeat).outcome is HeartbeatOutcome.REJECTED
    assert plane.reconciler.report(old_report).outcome is ReportOutcome.REJECTED
    assert worker_row(plane)["incarnation"] == 2
    assert states(plane) == {"c1": ("created", False)}


def test_rule7_new_incarnation_a_report_before_its_first_heartbeat_changes_nothing(
    plane, make_worker
):
    w = make_worker()
    created(plane, "w1", "c1")
    w.incarnation = 2  # restarted, but its first heartbeat has not arrived yet

    result = w.report(volumes=["v1"])

    assert result.outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert worker_row(plane)["incarnation"] == 1
    assert states(plane) == {"c1": ("created", False)}
    assert states(plane, "volume") == {}


def test_rule7_new_incarnation_of_a_durable_worker_keeps_its_rows_under_normal_rules(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1", "c2")

    result = w.restart()

    assert result.outcome is HeartbeatOutcome.NEW_INCARNATION
    assert result.rows_dropped == 0
    assert states(plane) == {"c1": ("created", False), "c2": ("created", False)}
    # The new incarnation counts from 1 again; its reports are accepted and mark as usual.
    assert w.report(containers=["c2"]).outcome is ReportOutcome.ACCEPTED
    assert states(plane) == {"c1": ("created", True), "c2": ("created", False)}
    advance(minutes=5)
    w.heartbeat()
    w.report(containers=["c2"])
    plane.collect()
    assert states(plane) == {"c2": ("created", False)}


def test_rule7_new_incarnation_of_an_ephemeral_worker_drops_the_old_rows_at_once(
    plane, make_worker
):
    w = make_worker(ephemeral=True)
    make_worker("other", ephemeral=True)
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", kind="volume")
    created(plane, "other", "c9")

    result = w.restart()

    assert result.outcome is HeartbeatOutcome.NEW_INCARNATION
    assert result.rows_dropped == 3
    assert states(plane) == {"c9": ("created", False)}
    assert states(plane, "volume") == {}
    assert worker_row(plane)["state"] == "running"
    event_, *rows = plane.events()
    assert (event_["action"], event_["kind"], event_["subject"]) == ("drop_rows", "worker", "w1")
    assert "incarnation 1 -> 2" in event_["reason"]
    # Rule 13: every row of the old incarnation, by handle.
    assert sorted((e["action"], e["kind"], e["subject"]) for e in rows) == [
        ("delete", "container", "c1"),
        ("delete", "container", "c2"),
        ("delete", "volume", "v1"),
    ]
    assert all("incarnation 1 -> 2" in e["reason"] for e in rows)


# Rule 8: unknown handles ------------------------------------------------------------------


def test_rule8_unknown_handles_are_recorded_as_destroying(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")

    result = w.report(containers=["c1", "c-stray"], volumes=["v-stray"])

    assert result.unknown == {"container": 1, "volume": 1}
    assert states(plane) == {"c1": ("created", False), "c-stray": ("destroying", False)}
    assert states(plane, "volume") == {"v-stray": ("destroying", False)}
    assert plane.destroying_handles("w1") == {"container": ["c-stray"], "volume": ["v-stray"]}


def test_rule8_a_handle_another_worker_holds_is_left_alone(plane, make_worker):
    make_worker("w1")
    w2 = make_worker("w2")
    created(plane, "w1", "c1")

    w2.report(containers=["c1"])

    [row] = plane.containers()
    assert (row["worker"], row["state"]) == ("w1", "created")


def test_rule8_and_rule9_database_and_worker_converge_both_ways(plane, make_worker):
    w = make_worker()
    w.report(containers=["stray"])
    assert plane.destroying_handles("w1")["container"] == ["stray"]

    w.report(containers=["stray"])  # the worker has not removed it yet
    assert states(plane) == {"stray": ("destroying", False)}

    w.report(containers=[])  # the worker removed it
    assert states(plane) == {}
    assert plane.destroying_handles("w1") == {"container": [], "volume": []}


# Rule 9: confirmed destroyed --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["container", "volume"])
def test_rule9_confirmed_destroyed_row_is_deleted_once_the_worker_no_longer_reports_it(
    plane, make_worker, kind
):
    w = make_worker()
    created(plane, "w1", "h1", "h2", kind=kind)
    destroy = plane.scheduler.destroy_container if kind == "container" else None
    destroy = destroy or plane.scheduler.destroy_volume
    destroy("h1")
    reported = {"containers" if kind == "container" else "volumes": ["h1", "h2"]}

    w.report(**reported)
    assert states(plane, kind) == {"h1": ("destroying", False), "h2": ("created", False)}

    reported[next(iter(reported))] = ["h2"]
    result = w.report(**reported)

    assert result.destroyed[kind] == 1
    assert states(plane, kind) == {"h2": ("created", False)}
