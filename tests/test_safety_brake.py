"""Rule 12: the safety brake, the deletion cap and dry runs."""

from __future__ import annotations

import pytest

from gcworker.gc.brake import brake_reason
from gcworker.gc.collection import collect
from gcworker.settings import load_settings
from tests.conftest import created, states


def _fleet(make_worker, plane, n=5):
    workers = [make_worker(f"w{i}") for i in range(n)]
    for w in workers:
        created(plane, w.name, f"{w.name}-c1")
        w.report(containers=[f"{w.name}-c1"])
    return workers


def _worker_states(plane):
    return {w["name"]: w["state"] for w in plane.workers()}


def test_rule12_brake_holds_when_four_of_five_workers_stop_heartbeating(
    plane, make_worker, advance
):
    workers = _fleet(make_worker, plane)
    # Every worker lost its container while the control plane was behind: marked now.
    for w in workers:
        w.report()
    advance(minutes=6)  # past every heartbeat TTL and the grace period
    workers[0].heartbeat()
    workers[0].report()

    summary = plane.collect()

    assert summary.counts == {"disruption mode entered": 1}
    assert set(_worker_states(plane).values()) == {"running"}
    assert len(states(plane)) == 5
    (entry,) = [e for e in plane.events() if e["action"] == "enter_disruption"]
    assert "4 of 5 running workers' heartbeats expired at once" in entry["reason"]


def test_rule12_after_recovery_nothing_is_deleted_before_a_fresh_grace_and_report(
    plane, make_worker, advance
):
    workers = _fleet(make_worker, plane)
    for w in workers:
        w.report()  # all five containers marked missing
    advance(minutes=6)
    workers[0].heartbeat()
    plane.collect()  # brake: disruption mode

    for w in workers:  # heartbeats resume, and reports confirm the absence
        w.heartbeat()
        w.report()
    summary = plane.collect()
    assert summary.counts == {"disruption mode left": 1}
    assert all(not marked for _, marked in states(plane).values())
    assert "marks cleared" in plane.events()[0]["reason"]

    for w in workers:  # absence seen afresh: marked again, but the grace starts now
        w.report()
    advance(minutes=4)
    for w in workers:
        w.heartbeat()
        w.report()
    plane.collect()
    assert len(states(plane)) == 5

    advance(minutes=1)
    for w in workers:
        w.heartbeat()
        w.report()
    plane.collect()
    assert states(plane) == {}


def test_rule12_brake_needs_at_least_the_minimum_number_of_workers(plane, make_worker, advance):
    workers = _fleet(make_worker, plane, n=2)
    advance(minutes=2)
    plane.collect()
    assert _worker_states(plane) == {w.name: "stalled" for w in workers}


def test_rule12_a_self_check_reason_holds_the_brake(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=6)
    w.heartbeat()
    w.report()

    summary = collect(plane.db, plane.settings, self_check=lambda: "no reconciler alive")
    assert summary.counts == {"disruption mode entered": 1}
    assert states(plane) == {"c1": ("created", True)}


@pytest.mark.parametrize(
    ("would_stall", "running", "held"),
    [(4, 5, True), (3, 5, True), (2, 5, False), (3, 6, False), (2, 2, False), (3, 3, True)],
)
def test_rule12_brake_reason_threshold(would_stall, running, held):
    reason = brake_reason(would_stall, running, fraction=0.5, min_workers=3)
    assert (reason is not None) == held


def test_rule12_deletions_per_collection_are_capped_oldest_first(
    database_url, db, make_worker, advance
):
    from gcworker.control_plane import ControlPlane

    plane = ControlPlane(load_settings(database_url=database_url, max_deletes_per_collection=2), db)
    w = make_worker()
    created(plane, "w1", "old1", "old2", "new1")
    w.report(containers=["new1"])  # old1, old2 marked first
    advance(seconds=30)
    w.report()  # new1 marked later
    advance(minutes=6)
    w.heartbeat()
    w.report()

    plane.collect()
    assert states(plane) == {"new1": ("created", True)}
    plane.collect()
    assert states(plane) == {}


def test_rule12_dry_run_audits_what_would_be_deleted_and_deletes_nothing(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=6)
    w.heartbeat()
    w.report()

    summary = plane.collect(dry_run=True)

    assert summary.counts == {"containers deleted": 1}
    assert states(plane) == {"c1": ("created", True)}
    (entry,) = plane.events()
    assert (entry["action"], entry["subject"], entry["dry_run"]) == ("delete", "c1", True)
