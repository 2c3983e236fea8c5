"""Workers: heartbeat expiry, ephemeral workers, landing, retiring, pruning (by an operator and by
the stalled-worker timeout)."""

from __future__ import annotations

import pytest

from gcworker.control_plane import ControlPlane
from gcworker.errors import Conflict, NotFound
from gcworker.rules import HeartbeatOutcome
from gcworker.settings import load_settings
from tests.conftest import created, states


def worker_states(plane) -> dict[str, str]:
    return {w["name"]: w["state"] for w in plane.workers()}


def test_workers_a_heartbeat_registers_a_running_worker(plane, make_worker):
    w = make_worker(heartbeat=False)

    assert w.heartbeat().outcome is HeartbeatOutcome.REGISTERED
    assert w.heartbeat().outcome is HeartbeatOutcome.EXTENDED

    [row] = plane.workers()
    assert (row["name"], row["state"], row["ephemeral"], row["incarnation"]) == (
        "w1",
        "running",
        False,
        1,
    )


def test_workers_an_expired_heartbeat_stalls_a_durable_worker_and_keeps_its_rows(
    plane, make_worker, advance
):
    w = make_worker()
    alive = make_worker("alive")
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")
    advance(seconds=50)
    plane.collect()
    assert worker_states(plane)["w1"] == "running"  # the TTL (2 x 30s) has not passed

    advance(seconds=11)
    alive.heartbeat()
    plane.collect()

    assert worker_states(plane) == {"alive": "running", "w1": "stalled"}
    assert states(plane) == {"c1": ("created", False)}
    assert states(plane, "volume") == {"v1": ("created", False)}
    [event] = plane.events()
    assert (event["action"], event["subject"], event["reason"]) == (
        "stall",
        "w1",
        "heartbeat expired",
    )
    assert w.heartbeat().outcome is HeartbeatOutcome.RESUMED
    assert worker_states(plane)["w1"] == "running"


def test_workers_a_heartbeat_may_carry_its_own_ttl(plane, make_worker, advance):
    make_worker(heartbeat=False).heartbeat(ttl_seconds=600)
    advance(minutes=9)

    plane.collect()

    assert worker_states(plane) == {"w1": "running"}


def test_workers_an_ephemeral_worker_whose_heartbeat_expired_is_deleted_with_its_rows(
    plane, make_worker, advance
):
    make_worker("eph", ephemeral=True)
    keeper = make_worker("durable")
    created(plane, "eph", "c1", "c2")
    created(plane, "eph", "v1", kind="volume")
    created(plane, "durable", "c9")
    advance(minutes=2)
    keeper.heartbeat()

    plane.collect()

    assert worker_states(plane) == {"durable": "running"}
    assert states(plane) == {"c9": ("created", False)}
    assert states(plane, "volume") == {}
    event, *rows = plane.events()
    assert (event["action"], event["kind"], event["subject"]) == ("delete", "worker", "eph")
    assert "ephemeral" in event["reason"] and "2 containers and 1 volumes" in event["reason"]
    # Rule 13: every row that went with the worker, by handle.
    assert sorted((e["action"], e["kind"], e["subject"], e["worker_name"]) for e in rows) == [
        ("delete", "container", "c1", "eph"),
        ("delete", "container", "c2", "eph"),
        ("delete", "volume", "v1", "eph"),
    ]
    assert {e["reason"] for e in rows} == {
        "deleted with worker eph: ephemeral worker's heartbeat expired"
    }


def test_workers_an_ephemeral_worker_never_stalls(plane, make_worker, advance):
    make_worker("eph", ephemeral=True)
    advance(minutes=2)

    plane.collect()

    assert "stalled" not in worker_states(plane).values()
    assert [e["action"] for e in plane.events()] == ["delete"]


def test_workers_landing_lands_once_no_container_is_active(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    plane.scheduler.create_container("w1", "c2")
    created(plane, "w1", "v1", kind="volume")  # volumes do not hold a landing worker back
    plane.fleet.land("w1")

    plane.collect()
    assert worker_states(plane) == {"w1": "landing"}

    plane.scheduler.destroy_container("c1")
    plane.collect()
    assert worker_states(plane) == {"w1": "landing"}  # c2 is still being created

    plane.scheduler.fail_container("c2")
    w.heartbeat()
    plane.collect()
    assert worker_states(plane) == {"w1": "landed"}
    assert ("land", "w1") in {(e["action"], e["subject"]) for e in plane.events()}


def test_workers_a_landing_worker_that_stops_heartbeating_lands(plane, make_worker, advance):
    make_worker()
    created(plane, "w1", "c1")
    plane.fleet.land("w1")
    advance(minutes=2)

    plane.collect()

    assert worker_states(plane) == {"w1": "landed"}
    assert states(plane) == {"c1": ("created", False)}


def test_workers_landing_is_refused_unless_running(plane, make_worker, advance):
    make_worker()
    advance(minutes=2)
    plane.collect()

    with pytest.raises(Conflict, match="stalled"):
        plane.fleet.land("w1")

    assert worker_states(plane) == {"w1": "stalled"}


def test_workers_a_retiring_worker_is_deleted_with_its_rows_once_it_stops_heartbeating(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1")
    plane.fleet.retire("w1")
    advance(seconds=50)
    w.heartbeat()
    advance(seconds=50)

    plane.collect()
    assert worker_states(plane) == {"w1": "retiring"}  # still heartbeating

    advance(minutes=1)
    plane.collect()

    assert worker_states(plane) == {}
    assert states(plane) == {}
    event = plane.events()[0]
    assert (event["action"], event["subject"], event["actor"]) == ("delete", "w1", "collector")
    assert "retiring" in event["reason"]


def test_workers_retire_and_land_are_audited_as_operator_actions(plane, make_worker):
    make_worker("a")
    make_worker("b")

    plane.fleet.land("a")
    plane.fleet.retire("b")

    assert {(e["actor"], e["action"], e["subject"]) for e in plane.events()} == {
        ("operator", "land", "a"),
        ("operator", "retire", "b"),
    }


def test_workers_prune_refuses_a_running_worker(plane, make_worker):
    make_worker()
    created(plane, "w1", "c1")

    with pytest.raises(Conflict, match="running"):
        plane.fleet.prune("w1")

    assert worker_states(plane) == {"w1": "running"}
    assert states(plane) == {"c1": ("created", False)}
    assert plane.events() == []


def test_workers_prune_deletes_a_stalled_worker_with_its_rows(plane, make_worker, advance):
    make_worker()
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", kind="volume")
    advance(minutes=2)
    plane.collect()

    counts = plane.fleet.prune("w1")

    assert counts == {"containers": 2, "volumes": 1}
    assert worker_states(plane) == {}
    assert states(plane) == {} and states(plane, "volume") == {}
    event = plane.events()[0]
    assert (event["actor"], event["action"], event["subject"]) == ("operator", "delete", "w1")


def test_workers_prune_an_unknown_worker_is_refused(plane):
    with pytest.raises(NotFound, match="ghost"):
        plane.fleet.prune("ghost")


def test_workers_the_stalled_worker_timeout_prunes_long_stalled_workers(
    settings, db, make_worker, advance
):
    plane = ControlPlane(
        load_settings(database_url=settings.database_url, stalled_worker_timeout="30m"), db
    )
    make_worker()
    created(plane, "w1", "c1")
    advance(minutes=2)
    plane.collect()
    advance(minutes=29)
    plane.collect()
    assert worker_states(plane) == {"w1": "stalled"}

    advance(minutes=2)
    plane.collect()

    assert worker_states(plane) == {}
    assert states(plane) == {}
    assert "stalled-worker timeout" in plane.events()[0]["reason"]


def test_workers_a_stalled_worker_timeout_of_zero_never_prunes(plane, make_worker, advance):
    make_worker()
    advance(minutes=2)
    plane.collect()
    advance(days=30)

    plane.collect()

    assert worker_states(plane) == {"w1": "stalled"}
