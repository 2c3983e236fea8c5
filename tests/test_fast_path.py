"""The steady-state fast path: a report identical to the worker's last accepted one, with no
change to the worker or its rows since, skips the diff and writes no container or volume row.
It is taken only when that is correct: a change on either side (the handle list; the
scheduler's or the collector's hand on the worker's rows; the worker's state) forces the diff."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from gcworker.rules import ReportOutcome
from tests.conftest import created, recorded_statements, states
from tests.rowwrites import install_row_write_counter


@pytest.fixture
def rows_written(db):
    return install_row_write_counter(db)


def worker_row(plane, name: str = "w1") -> dict:
    return {w["name"]: w for w in plane.workers()}[name]


@pytest.fixture
def steady(plane, make_worker):
    """w1 holds c1, c2 (created), c3 (creating) and v1 (created), and has reported them once."""
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    plane.scheduler.create_container("w1", "c3")
    created(plane, "w1", "v1", kind="volume")
    first = w.report(containers=["c1", "c2", "c3"], volumes=["v1"])
    assert not first.fast_path  # the first report has nothing to compare with
    return w


def report_again(w, **lists):
    lists.setdefault("containers", ["c1", "c2", "c3"])
    lists.setdefault("volumes", ["v1"])
    return w.report(**lists)


def test_an_identical_report_after_no_change_takes_the_fast_path(plane, steady, rows_written):
    before_rows = rows_written()
    before = worker_row(plane)

    result = report_again(steady)

    assert result.outcome is ReportOutcome.ACCEPTED
    assert result.fast_path
    assert result.rows_written == 0
    assert rows_written() == before_rows  # no container or volume row written
    after = worker_row(plane)
    assert after["last_report_seq"] > before["last_report_seq"]  # rule 6 still advances
    assert after["last_report_at"] >= before["last_report_at"]  # and rule 4 is confirmed
    assert after["generation"] == before["generation"]
    assert after["report_digest"] == before["report_digest"]


def test_the_fast_path_holds_report_after_report_and_across_heartbeats(plane, steady):
    for _ in range(3):
        steady.heartbeat()  # a heartbeat of a running worker changes nothing
        assert report_again(steady).fast_path


def test_a_different_handle_list_forces_the_full_diff(plane, steady, rows_written):
    assert report_again(steady).fast_path
    before_rows = rows_written()

    result = report_again(steady, containers=["c1", "c3"])

    assert not result.fast_path
    assert result.marked == {"container": 1, "volume": 0}
    assert states(plane)["c2"] == ("created", True)
    assert rows_written() == before_rows + 1
    # ... and the new list is the one the next identical report is compared with.
    assert report_again(steady, containers=["c1", "c3"]).fast_path


def test_a_different_volume_list_forces_the_full_diff(plane, steady):
    assert report_again(steady).fast_path

    result = report_again(steady, volumes=["v1", "v9"])

    assert not result.fast_path
    assert result.unknown == {"container": 0, "volume": 1}  # rule 8
    assert states(plane, "volume")["v9"] == ("destroying", False)


def test_a_scheduler_change_creating_to_created_forces_the_full_diff(plane, steady):
    # The worker never got c4 made: its reports do not change, but the database does.
    plane.scheduler.create_container("w1", "c4")
    assert not report_again(steady).fast_path  # the scheduler's hand bumped the generation
    assert report_again(steady).fast_path
    plane.scheduler.container_created("c4")

    result = report_again(steady)

    assert not result.fast_path
    assert result.marked == {"container": 1, "volume": 0}  # rule 1: c4 is missing
    assert states(plane)["c4"] == ("created", True)


def test_the_worker_finishing_creating_with_an_identical_list_is_diffed(plane, steady):
    # c3 was reported while creating; the scheduler records it created, the list stays the same.
    assert report_again(steady).fast_path
    plane.scheduler.container_created("c3")

    result = report_again(steady)

    assert not result.fast_path
    assert result.rows_written == 0  # it is reported: nothing to mark
    assert states(plane)["c3"] == ("created", False)
    assert report_again(steady).fast_path


def test_a_scheduler_destroy_forces_the_full_diff(plane, steady, rows_written):
    # c2 went missing and the list without it is steady; then the scheduler destroys c2.
    report_again(steady, containers=["c1", "c3"])
    assert report_again(steady, containers=["c1", "c3"]).fast_path
    plane.scheduler.destroy_container("c2")
    before_rows = rows_written()

    result = report_again(steady, containers=["c1", "c3"])

    assert not result.fast_path
    assert result.destroyed == {"container": 1, "volume": 0}  # rule 9: confirmed destroyed
    assert "c2" not in states(plane)
    assert rows_written() == before_rows + 1


def test_a_collector_deletion_forces_the_full_diff(plane, steady, advance):
    report_again(steady, containers=["c1", "c3"])  # c2 marked
    advance(minutes=6)
    steady.heartbeat()
    report_again(steady, containers=["c1", "c3"])  # confirms after the grace period
    plane.collect()
    assert "c2" not in states(plane)

    assert not report_again(steady, containers=["c1", "c3"]).fast_path
    assert report_again(steady, containers=["c1", "c3"]).fast_path


def test_a_stall_and_return_forces_the_full_diff_and_marks_afresh(plane, steady, advance):
    report_again(steady, containers=["c1", "c3"])  # c2 marked
    assert states(plane)["c2"] == ("created", True)
    advance(minutes=2)
    plane.collect()  # the heartbeat expired: w1 stalls
    assert worker_row(plane)["state"] == "stalled"
    steady.heartbeat()  # ... and comes back: its marks are cleared (rule 5)
    assert states(plane)["c2"] == ("created", False)

    result = report_again(steady, containers=["c1", "c3"])

    assert not result.fast_path
    assert result.marked == {"container": 1, "volume": 0}  # absence seen afresh
    assert states(plane)["c2"] == ("created", True)


def test_a_worker_that_is_not_running_never_takes_the_fast_path(plane, steady):
    assert report_again(steady).fast_path
    plane.fleet.land("w1")

    result = report_again(steady)

    assert not result.fast_path
    assert result.outcome is ReportOutcome.WORKER_NOT_RUNNING
    assert result.rows_written == 0


def test_a_new_incarnation_never_takes_the_fast_path(plane, steady):
    assert report_again(steady).fast_path
    steady.restart()

    result = report_again(steady)

    assert not result.fast_path
    assert result.outcome is ReportOutcome.ACCEPTED


def test_a_report_listing_no_handle_of_a_kind_needs_no_read_and_applies_rules_1_and_9(
    plane, make_worker, rows_written
):
    # A worker that lost everything: the diff of that kind is set-based, with the same result.
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    plane.scheduler.create_container("w1", "c3")  # creating: never marked
    plane.scheduler.destroy_container("c2")  # destroying: gone once not reported
    created(plane, "w1", "v1", kind="volume")
    before = rows_written()

    result = w.report(containers=[], volumes=["v1"])

    assert not result.fast_path
    assert result.marked == {"container": 1, "volume": 0}
    assert result.destroyed == {"container": 1, "volume": 0}
    assert states(plane) == {"c1": ("created", True), "c3": ("creating", False)}
    assert states(plane, "volume") == {"v1": ("created", False)}
    assert rows_written() == before + 2
    assert w.report(containers=[], volumes=["v1"]).fast_path


@pytest.mark.backends("postgresql")
def test_on_postgresql_the_fast_path_is_one_statement_and_no_transaction_around_it(
    db, plane, steady
):
    report_again(steady)  # prepares the statement on this connection
    message = steady.report_message(["c1", "c2", "c3"], ["v1"])
    begins = []
    event.listen(db.engine, "begin", lambda conn: begins.append(conn))  # a transaction's BEGIN

    with recorded_statements(db) as statements:
        result = plane.reconciler.report(message)

    assert result.fast_path
    assert len(statements) == 1 and statements[0].startswith("EXECUTE")
    assert begins == []


@pytest.mark.backends("postgresql")
def test_a_dead_fast_path_connection_falls_back_to_a_transaction(
    db, plane, steady, pg_admin_engine
):
    assert report_again(steady).fast_path
    with db.autocommit() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    with pg_admin_engine.connect() as admin:
        admin.exec_driver_sql(f"SELECT pg_terminate_backend({pid}, 5000)")
    before = worker_row(plane)

    result = report_again(steady)

    assert result.outcome is ReportOutcome.ACCEPTED and result.fast_path
    assert worker_row(plane)["last_report_seq"] > before["last_report_seq"]
    assert report_again(steady).fast_path  # and the next one finds a new connection
