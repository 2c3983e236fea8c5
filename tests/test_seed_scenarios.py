"""Every scenario of the seed discussion (../shared/seed/), played against the control plane."""

from __future__ import annotations

from tests.conftest import created, states


def worker_state(plane, name: str = "w1") -> str:
    return {w["name"]: w["state"] for w in plane.workers()}[name]


def test_seed_worker_restarts_its_runtime_with_different_state_rule1_rule4_rule8_rule9(
    plane, make_worker, advance
):
    """'a worker goes away and comes back with different state': the database converges on what
    the worker really holds, both ways, without deleting anything it still has."""
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", "v2", kind="volume")
    w.report(containers=["c1", "c2"], volumes=["v1", "v2"])

    w.restart()  # the runtime restarted: c1 and v1 are gone, c3 and v3 are leftovers
    w.report(containers=["c2", "c3"], volumes=["v2", "v3"])

    assert states(plane) == {
        "c1": ("created", True),
        "c2": ("created", False),
        "c3": ("destroying", False),
    }
    assert states(plane, "volume") == {
        "v1": ("created", True),
        "v2": ("created", False),
        "v3": ("destroying", False),
    }
    assert plane.destroying_handles("w1") == {"container": ["c3"], "volume": ["v3"]}

    w.report(containers=["c2"], volumes=["v2"])  # the worker removed what it was told to
    advance(minutes=5)
    w.heartbeat()
    w.report(containers=["c2"], volumes=["v2"])
    plane.collect()

    assert states(plane) == {"c2": ("created", False)}
    assert states(plane, "volume") == {"v2": ("created", False)}


def test_seed_creating_then_created_race_of_t1_to_t10_does_not_delete_v1_rule1(
    plane, make_worker, advance
):
    """T2-T4: the control plane records V1 as creating; T5, T7: the worker's reports lack V1
    (it is still being made); T9: V1 is created; T10: the collector runs. V1 must survive."""
    w = make_worker()
    created(plane, "w1", "V2", "V3", kind="volume")
    plane.scheduler.create_volume("w1", "V1")  # T4: V1 is CREATING

    w.report(volumes=["V2", "V3"])  # T5
    assert states(plane, "volume")["V1"] == ("creating", False)  # T6: not missing since T5
    advance(minutes=6)  # longer than the grace period
    w.heartbeat()
    w.report(volumes=["V2", "V3"])  # T7
    assert states(plane, "volume")["V1"] == ("creating", False)  # T8

    plane.scheduler.volume_created("V1")  # T9
    plane.collect()  # T10

    assert states(plane, "volume") == {
        "V1": ("created", False),
        "V2": ("created", False),
        "V3": ("created", False),
    }


def test_seed_a_report_sent_while_v1_was_being_made_starts_its_clock_at_arrival_rule1_rule3(
    plane, make_worker, advance
):
    """The same race, one step further: a report the worker sent before it finished V1 arrives
    after V1 became created. V1 is marked from that moment, not from T5, and the next report
    clears it."""
    w = make_worker()
    plane.scheduler.create_volume("w1", "V1")
    w.report()  # T5
    advance(minutes=6)
    w.heartbeat()
    plane.scheduler.volume_created("V1")  # T9

    w.report()  # in flight since before T9
    plane.collect()
    assert states(plane, "volume") == {"V1": ("created", True)}

    w.report(volumes=["V1"])
    plane.collect()
    assert states(plane, "volume") == {"V1": ("created", False)}


def test_seed_a_worker_stalling_longer_than_grace_does_not_lose_its_rows_rule2_rule4(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", kind="volume")
    w.report(containers=["c1"], volumes=["v1"])  # c2 went missing just before the trouble

    for _ in range(4):  # 20 minutes of silence: four times the grace period
        advance(minutes=5)
        plane.collect()

    assert worker_state(plane) == "stalled"
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}
    assert states(plane, "volume") == {"v1": ("created", False)}

    w.report()  # a stalled worker's report lacking everything marks nothing
    plane.collect()
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}


def test_seed_a_worker_coming_back_after_a_long_stall_does_not_lose_its_rows_at_once_rule5(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report(containers=["c1"])  # c2 missing since before the stall
    advance(minutes=30)
    plane.collect()
    assert worker_state(plane) == "stalled"

    w.heartbeat()  # back
    plane.collect()
    assert worker_state(plane) == "running"
    assert states(plane) == {"c1": ("created", False), "c2": ("created", False)}

    w.report(containers=["c1"])  # its first report after coming back still lacks c2
    plane.collect()
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}

    advance(minutes=5)  # a fresh grace period and a confirming report are needed
    w.heartbeat()
    plane.collect()
    assert states(plane) == {"c1": ("created", False), "c2": ("created", True)}
    w.report(containers=["c1"])
    plane.collect()
    assert states(plane) == {"c1": ("created", False)}


def test_seed_a_container_reported_again_after_being_marked_has_its_mark_cleared_rule3(
    plane, make_worker, advance
):
    """t0: reported; t1: not reported (marked); t2: reported again (mark removed)."""
    w = make_worker()
    created(plane, "w1", "containerA")
    w.report(containers=["containerA"])  # t0
    advance(seconds=30)
    w.heartbeat()
    w.report()  # t1
    assert states(plane) == {"containerA": ("created", True)}

    advance(seconds=30)
    w.heartbeat()
    w.report(containers=["containerA"])  # t2
    assert states(plane) == {"containerA": ("created", False)}

    advance(minutes=10)
    w.heartbeat()
    w.report(containers=["containerA"])
    plane.collect()
    assert states(plane) == {"containerA": ("created", False)}


def test_seed_a_step_stuck_in_creating_for_a_day_is_failed_and_destroyed_rule10(
    plane, make_worker, advance
):
    """The container the worker never made stays in creating forever, unless rule 10 acts."""
    w = make_worker()
    plane.scheduler.create_container("w1", "step")
    for _ in range(3):
        advance(minutes=30)
        w.heartbeat()
        w.report()
        plane.collect()

    assert states(plane) == {}  # failed, then destroying, then confirmed destroyed (rule 9)
    assert [(e["actor"], e["action"], e["subject"]) for e in reversed(plane.events())] == [
        ("collector", "fail", "step"),
        ("collector", "destroy", "step"),
        ("reconciler", "delete", "step"),
    ]


def test_seed_ephemeral_workers_lose_their_rows_with_their_incarnation_rule7(plane, make_worker):
    """'volume-not-found after switching to ephemeral workers': an ephemeral worker that comes
    back is a new worker with nothing; its old rows must not be handed out again."""
    w = make_worker(ephemeral=True)
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")

    w.restart()

    assert states(plane) == {} and states(plane, "volume") == {}
    assert worker_state(plane) == "running"
