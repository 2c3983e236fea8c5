"""A churn report in proportion to its change: a reconciler process that applied a worker's last
report knows that worker's rows, and diffs the next report against them without reading them
again, but only while the worker's generation says nothing else changed them. Whatever another
reconciler, the scheduler, the collector or a new registration did in between, the rows are
read again, and every rule decides as on freshly read rows."""

from __future__ import annotations

import pytest

from gcworker.control_plane import ControlPlane
from gcworker.rows_cache import WorkerRowsCache
from gcworker.rules import WorkerRows
from tests.conftest import created, recorded_statements, states


@pytest.fixture
def rows_reads(db):
    """How many times the worker's handles were read (`handles_by_kind`) so far."""

    def reads_handles(statement: str) -> bool:
        return "string_agg" in statement or "group_concat(containers.handle" in statement

    with recorded_statements(db, reads_handles) as reads:
        yield lambda: len(reads)


@pytest.fixture
def fleet_of_four(plane, make_worker):
    """w1 holds c1..c4 (created) and v1, and has reported them all once."""
    w = make_worker()
    created(plane, "w1", "c1", "c2", "c3", "c4")
    created(plane, "w1", "v1", kind="volume")
    w.report(containers=["c1", "c2", "c3", "c4"], volumes=["v1"])
    return w


def test_a_churn_report_after_this_process_applied_the_last_one_reads_no_rows(
    plane, fleet_of_four, rows_reads
):
    before = rows_reads()

    first = fleet_of_four.report(containers=["c1", "c2", "c3"], volumes=["v1"])  # c4 gone
    second = fleet_of_four.report(containers=["c1", "c2", "c4"], volumes=["v1"])  # c4 back, c3 gone

    assert rows_reads() == before
    assert first.marked["container"] == 1 and second.marked["container"] == 1
    assert second.cleared["container"] == 1
    assert states(plane) == {
        "c1": ("created", False),
        "c2": ("created", False),
        "c3": ("created", True),
        "c4": ("created", False),
    }


def test_a_handle_unknown_to_known_rows_is_recorded_destroying_then_deleted(
    plane, fleet_of_four, rows_reads
):
    fleet_of_four.report(containers=["c1", "c2", "c3", "c4", "stray"], volumes=["v1"])
    assert states(plane)["stray"] == ("destroying", False)  # rule 8

    before = rows_reads()
    fleet_of_four.report(containers=["c1", "c2", "c3", "c4"], volumes=["v1"])

    assert rows_reads() == before
    assert "stray" not in states(plane)  # rule 9, on the known rows


def test_rows_another_reconciler_changed_are_read_again(
    settings, db, plane, fleet_of_four, rows_reads
):
    other = ControlPlane(settings, db)  # a second reconciler process
    fleet_of_four.report(containers=["c1", "c2", "c3"], volumes=["v1"])  # this one knows c4 marked
    fleet_of_four.plane = other
    fleet_of_four.report(containers=["c1", "c2", "c3", "c4"], volumes=["v1"])  # c4 cleared there
    fleet_of_four.plane = plane
    before = rows_reads()

    result = fleet_of_four.report(containers=["c1", "c2", "c4"], volumes=["v1"])

    assert rows_reads() == before + 1
    assert result.cleared["container"] == 0  # c4 was no longer marked: nothing to clear
    assert states(plane)["c3"] == ("created", True)
    assert states(plane)["c4"] == ("created", False)


def test_a_scheduler_change_makes_known_rows_stale(plane, fleet_of_four, rows_reads):
    fleet_of_four.report(containers=["c1", "c2", "c3"], volumes=["v1"])
    plane.scheduler.destroy_container("c1")
    before = rows_reads()

    result = fleet_of_four.report(containers=["c2", "c3"], volumes=["v1"])

    assert rows_reads() == before + 1
    assert result.destroyed["container"] == 1  # rule 9 saw c1 destroying
    assert result.marked["container"] == 0
    assert "c1" not in states(plane)


def test_a_worker_registered_again_never_meets_its_old_known_rows(
    plane, fleet_of_four, make_worker, rows_reads
):
    fleet_of_four.report(containers=["c1", "c2", "c3"], volumes=["v1"])
    plane.fleet.retire("w1")
    plane.fleet.prune("w1")  # its rows go with it
    again = make_worker("w1", heartbeat=False)
    again.restart()  # a new incarnation: the pruned one's stays out (rule 16)
    created(plane, "w1", "c9")
    before = rows_reads()

    result = again.report(containers=["c9", "c1"], volumes=[])

    assert rows_reads() == before + 1
    assert result.unknown["container"] == 1  # c1 is no row of the new registration (rule 8)
    assert states(plane) == {"c9": ("created", False), "c1": ("destroying", False)}


def test_a_report_that_lists_no_handle_of_a_kind_leaves_no_known_rows(
    plane, fleet_of_four, rows_reads
):
    fleet_of_four.report(containers=["c1", "c2", "c3", "c4"], volumes=[])  # v1 marked, unread
    before = rows_reads()

    fleet_of_four.report(containers=["c1", "c2", "c3"], volumes=["v1"])

    assert rows_reads() == before + 1
    assert states(plane, "volume")["v1"] == ("created", False)


def test_known_rows_are_bounded_by_handles_least_recently_used_first_out():
    def rows(*handles):
        return {"container": WorkerRows(created=frozenset(handles)), "volume": WorkerRows()}

    cache = WorkerRowsCache(max_handles=4)
    cache.put("w1", 7, rows("a", "b"))
    cache.put("w2", 3, rows("c", "d"))
    assert cache.get("w1", 7) is not None  # w1 now the most recently used
    cache.put("w3", 1, rows("e"))  # 5 handles: w2 goes

    assert cache.get("w2", 3) is None
    assert cache.get("w1", 7) is not None and cache.get("w3", 1) is not None
    assert cache.get("w1", 8) is None  # another generation is another state of the rows
    cache.put("w4", 1, rows("f", "g", "h", "i", "j"))  # larger than the bound: not kept
    assert cache.get("w4", 1) is None
