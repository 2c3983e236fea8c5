"""Rule 4 with a broker between worker and control plane: reports can wait in a queue.

A report that lacks a handle proves its absence only from when the report was built, not from
when it arrived. Reporters date their reports with the control plane's time of the newest answer
they had read (`after`); a report built before a container was created can then neither confirm
its absence, however late it arrives, nor (with the seed's T1..T10 race) get it deleted.
"""

from __future__ import annotations

from tests.conftest import states


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
