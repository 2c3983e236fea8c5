"""Rule 4 with a broker between worker and control plane: reports can wait in a queue.

A report that lacks a handle proves its absence only from when the report was built, not from
when it arrived. Reporters date their reports with the control plane's time of the newest answer
they had read (`after`); a report built before a container was created can then neither confirm
its absence, however late it arrives, nor (with the seed's T1..T10 race) get it deleted.
"""

from __future__ import annotations

from datetime import timedelta

from tests.conftest import created, states


def feedback_time(plane, worker="w1"):
    return plane.destroying_handles_as_of(worker)[0]


def test_rule4_a_delayed_report_built_before_a_creation_confirms_nothing(
    plane, make_worker, advance
):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    built_at = feedback_time(plane)
    # Two reports built now, before the worker has created c1, stay in the broker.
    early, earlier_still = w.report_message(after=built_at), w.report_message(after=built_at)
    plane.scheduler.container_created("c1")  # the worker created c1; the scheduler says so

    plane.reconciler.report(early)  # arrives late: c1 lacks from it, so it is marked
    assert states(plane) == {"c1": ("created", True)}
    advance(minutes=6)
    w.heartbeat()
    plane.reconciler.report(earlier_still)  # arrives past the grace: still built before c1
    plane.collect()

    assert states(plane) == {"c1": ("created", True)}
    w.report(containers=["c1"], after=feedback_time(plane))  # a report built now has c1
    assert states(plane) == {"c1": ("created", False)}


def test_rule4_a_dated_report_built_after_the_grace_confirms(plane, make_worker, advance):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.container_created("c1")
    w.report(after=feedback_time(plane))  # c1 lost: marked
    advance(minutes=5)
    w.heartbeat()
    w.report(after=feedback_time(plane))

    plane.collect()

    assert states(plane) == {}


def test_rule4_a_dated_report_never_moves_an_earlier_confirmation_back(plane, make_worker, advance):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.container_created("c1")
    stale_time = feedback_time(plane)
    w.report(after=stale_time)
    advance(minutes=5)
    w.heartbeat()
    w.report(after=feedback_time(plane))  # confirms
    w.report(after=stale_time)  # an old date later: the confirmation stands

    plane.collect()

    assert states(plane) == {}


def test_rule9_a_delayed_report_built_before_a_creation_confirms_no_destruction(plane, make_worker):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    early = w.report_message(after=feedback_time(plane))  # built before c1 exists: lacks it
    plane.scheduler.container_created("c1")
    plane.scheduler.destroy_container("c1")  # c1 is still on the worker until it removes it

    plane.reconciler.report(early)

    assert states(plane) == {"c1": ("destroying", False)}
    w.report(after=feedback_time(plane))  # built after the worker removed it
    assert states(plane) == {}


def test_rule4_an_undated_report_confirms_no_absence_however_late(plane, make_worker, advance):
    """Issue 9.1: a reporter with no date yet (new, silent for long, Redis lost its keys)."""
    w = make_worker()
    early = w.report_message(after=None)  # built before c10 exists, held by the broker
    late = w.report_message(after=None)
    created(plane, "w1", "c10")

    plane.reconciler.report(early)  # c10 lacks from it: marked
    advance(minutes=6)
    w.heartbeat()
    plane.reconciler.report(late)  # past the grace, undated: it cannot prove it is recent
    plane.collect()

    assert states(plane) == {"c10": ("created", True)}
    w.report(containers=["c10"])  # a dated report that lists it clears the mark
    assert states(plane) == {"c10": ("created", False)}


def test_rule9_an_undated_report_confirms_no_destruction(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    plane.scheduler.destroy_container("c1")

    plane.reconciler.report(w.report_message(after=None))

    assert states(plane) == {"c1": ("destroying", False)}
    w.report()  # dated: built after the worker removed it
    assert states(plane) == {}


def test_rule4_a_report_dated_after_its_arrival_is_rejected(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()  # c1 marked
    future = feedback_time(plane) + timedelta(days=1)
    advance(minutes=6)
    w.heartbeat()
    before = plane.workers()

    result = w.report(after=future)
    plane.collect()

    assert result.outcome == "rejected" and "after its arrival" in result.reason
    assert plane.workers() == before
    assert states(plane) == {"c1": ("created", True)}
