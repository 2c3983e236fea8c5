"""The compact unchanged report: a digest instead of the handle list (issue 5), under rule 4."""

from __future__ import annotations

from datetime import timedelta

from gcworker.messages import UnchangedReport
from gcworker.rules import report_digest
from tests.conftest import created, states


def unchanged(worker, containers=(), volumes=(), *, dated=True):
    digest = report_digest(list(containers), list(volumes))
    message = UnchangedReport(
        worker=worker.name,
        incarnation=worker.incarnation,
        seq=worker.next_seq(),
        digest=digest,
        after=worker.plane.now() if dated else None,
    )
    return worker.plane.reconciler.unchanged(message)


def test_compact_report_of_the_last_full_report_confirms_it(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"])

    result = unchanged(w, containers=["c1"])

    assert (result.outcome, result.fast_path, result.rows_written) == ("accepted", True, 0)


def test_compact_report_of_an_unknown_digest_changes_nothing_and_asks_for_a_full_report(
    plane, make_worker
):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report(containers=["c1"])
    before = plane.workers()

    result = unchanged(w, containers=["c1", "c9"])

    assert result.outcome == "full_report_needed"
    assert plane.workers() == before  # not even the sequence number moved
    assert states(plane) == {"c1": ("created", False)}


def test_compact_report_after_a_scheduler_change_asks_for_a_full_report(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report(containers=["c1"])
    plane.scheduler.create_container("w1", "c2")
    plane.scheduler.container_created("c2")  # c2 is not on the worker: it must be marked

    assert unchanged(w, containers=["c1"]).outcome == "full_report_needed"
    w.report(containers=["c1"])
    assert states(plane)["c2"] == ("created", True)


def test_compact_report_from_a_stalled_worker_asks_for_a_full_report(plane, make_worker, advance):
    w = make_worker()
    w.report()
    advance(minutes=2)
    plane.collect()  # w1 stalls

    assert unchanged(w).outcome == "full_report_needed"


def test_rule4_a_compact_report_can_confirm_a_deletion(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"])  # c2 marked
    advance(minutes=5)
    w.heartbeat()
    plane.collect()
    assert "c2" in states(plane)  # no report since missing_since + grace yet

    assert unchanged(w, containers=["c1"]).fast_path
    plane.collect()
    assert states(plane) == {"c1": ("created", False)}


def test_rule6_a_stale_compact_report_changes_nothing(plane, make_worker):
    w = make_worker()
    w.report()
    digest = report_digest([], [])
    stale = UnchangedReport(worker="w1", incarnation=1, seq=1, digest=digest)
    assert plane.reconciler.unchanged(stale).outcome == "stale"


def test_rule4_an_undated_compact_report_confirms_no_deletion(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"])  # c2 marked
    advance(minutes=5)
    w.heartbeat()

    result = unchanged(w, containers=["c1"], dated=False)
    plane.collect()

    assert result.fast_path  # accepted: it may clear, it confirms nothing
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}


def test_rule4_a_compact_report_dated_after_its_arrival_is_rejected(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"])  # c2 marked
    future = plane.now() + timedelta(days=1)
    advance(minutes=5)
    w.heartbeat()
    before = plane.workers()

    digest = report_digest(["c1"], [])
    message = UnchangedReport(
        worker="w1", incarnation=1, seq=w.next_seq(), digest=digest, after=future
    )
    result = plane.reconciler.unchanged(message)
    plane.collect()

    assert (result.outcome, result.fast_path) == ("rejected", False)
    assert "after its arrival" in result.reason
    assert plane.workers() == before
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}
