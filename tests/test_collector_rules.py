"""What the collector does: rule 4 (delete after grace, confirmed), rule 5 (coming back restarts
the clock), rule 10 (stuck creating) and rule 13 (every change audited with its reason)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from gcworker.control_plane import ControlPlane
from gcworker.db.inventory import ContainerRepository, Deletion
from gcworker.db.tables import audit_events
from gcworker.gc.context import CollectionContext
from gcworker.gc.missing import MissingRowCollector, batches, worker_batches
from gcworker.rules import HeartbeatOutcome
from gcworker.settings import load_settings
from tests.conftest import FakeWorker, created, states


def worker_state(plane, name: str = "w1") -> str | None:
    return {w["name"]: w["state"] for w in plane.workers()}.get(name)


def snapshot(plane) -> dict[tuple[str, str], tuple]:
    """(kind, subject) -> what the collector may change about it."""
    shot = {("worker", w["name"]): (w["state"],) for w in plane.workers()}
    for kind, rows in (("container", plane.containers()), ("volume", plane.volumes())):
        for r in rows:
            shot[(kind, r["handle"])] = (r["state"], r["missing_since"])
    return shot


# Rule 4: delete after grace, confirmed ----------------------------------------------------


@pytest.mark.parametrize("kind", ["container", "volume"])
def test_rule4_a_missing_row_is_deleted_after_grace_once_a_later_report_confirms(
    plane, make_worker, advance, kind
):
    w = make_worker()
    created(plane, "w1", "gone", "kept", kind=kind)
    field = "containers" if kind == "container" else "volumes"
    w.report(**{field: ["kept"]})

    advance(minutes=5)
    w.heartbeat()
    w.report(**{field: ["kept"]})
    plane.collect()

    assert states(plane, kind) == {"kept": ("created", False)}


def test_rule4_nothing_is_deleted_before_the_grace_period(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()

    for _ in range(4):
        advance(minutes=1)
        w.heartbeat()
        w.report()
        plane.collect()

    assert states(plane) == {"c1": ("created", True)}


def test_rule4_silence_is_never_evidence(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()

    for _ in range(10):  # heartbeats, but no report, for twice the grace period
        advance(minutes=1)
        w.heartbeat()
        plane.collect()

    assert states(plane) == {"c1": ("created", True)}
    w.report()  # now a report received after missing_since + grace confirms the absence
    plane.collect()
    assert states(plane) == {}


def test_rule4_a_report_received_before_missing_since_plus_grace_does_not_confirm(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=4)
    w.heartbeat()
    w.report()  # lacks c1, but only 4 of the 5 minutes have passed
    advance(minutes=2)
    w.heartbeat()

    plane.collect()  # c1 has been missing for 6 minutes, yet no report confirms it

    assert states(plane) == {"c1": ("created", True)}


def test_rule4_a_row_reported_again_within_grace_is_not_deleted(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=3)
    w.heartbeat()
    w.report(containers=["c1"])
    advance(minutes=3)
    w.heartbeat()
    w.report(containers=["c1"])

    plane.collect()

    assert states(plane) == {"c1": ("created", False)}


def test_rule4_a_stalled_workers_missing_rows_are_not_deleted(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=5)
    w.report()  # confirms, but the heartbeat has expired meanwhile

    plane.collect()

    assert worker_state(plane) == "stalled"
    assert states(plane) == {"c1": ("created", True)}


def test_rule4_only_the_rows_missing_long_enough_are_deleted(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "early", "late")
    w.report(containers=["late"])
    advance(minutes=3)
    w.heartbeat()
    w.report()  # marks "late" three minutes after "early"
    advance(minutes=2)
    w.heartbeat()
    w.report()

    plane.collect()

    assert states(plane) == {"late": ("created", True)}


# Rule 5: coming back restarts the clock ---------------------------------------------------


def test_rule5_coming_back_clears_the_workers_marks(plane, make_worker, advance):
    w = make_worker()
    other = make_worker("other")
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")
    created(plane, "other", "c9")
    w.report()
    other.report()
    advance(minutes=2)
    plane.collect()
    assert worker_state(plane) == "stalled"

    result = w.heartbeat()

    assert result.outcome is HeartbeatOutcome.RESUMED
    assert result.marks_cleared == 2
    assert states(plane)["c1"] == ("created", False)
    assert states(plane, "volume") == {"v1": ("created", False)}
    assert states(plane)["c9"] == ("created", True)  # another worker's marks are its own


def test_rule5_coming_back_restarts_the_clock(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()  # c1 missing since t0
    advance(minutes=10)
    plane.collect()
    assert worker_state(plane) == "stalled"

    w.heartbeat()  # back at t0 + 10m: absence must be seen afresh
    w.report()  # missing since t0 + 10m
    plane.collect()
    advance(minutes=4)
    w.heartbeat()
    w.report()
    plane.collect()
    assert states(plane) == {"c1": ("created", True)}

    advance(minutes=1)
    w.heartbeat()
    w.report()
    plane.collect()
    assert states(plane) == {}


# Rule 10: stuck creating ------------------------------------------------------------------


def test_rule10_stuck_creating_row_becomes_failed_then_destroying(plane, make_worker, advance):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.create_volume("w1", "v1")
    advance(minutes=59)
    w.heartbeat()
    plane.collect()
    assert states(plane) == {"c1": ("creating", False)}

    advance(minutes=2)
    w.heartbeat()
    plane.collect()

    assert states(plane) == {"c1": ("destroying", False)}
    assert states(plane, "volume") == {"v1": ("destroying", False)}
    actions = {(e["action"], e["kind"], e["subject"]) for e in plane.events()}
    assert actions == {
        ("fail", "container", "c1"),
        ("destroy", "container", "c1"),
        ("fail", "volume", "v1"),
        ("destroy", "volume", "v1"),
    }
    assert plane.destroying_handles("w1") == {"container": ["c1"], "volume": ["v1"]}
    w.report()  # the worker never had them: rule 9 finishes the job
    assert states(plane) == {} and states(plane, "volume") == {}


def test_rule10_the_creating_timeout_counts_from_creation_not_from_the_last_report(
    plane, make_worker, advance
):
    w = make_worker()
    plane.scheduler.create_container("w1", "c1")
    for _ in range(3):
        advance(minutes=25)
        w.heartbeat()
        w.report(containers=["c1"])

    plane.collect()

    assert states(plane) == {"c1": ("destroying", False)}


def test_rule10_a_failed_row_goes_to_destroying(plane, make_worker):
    make_worker()
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.fail_container("c1")
    assert states(plane) == {"c1": ("failed", False)}

    plane.collect()

    assert states(plane) == {"c1": ("destroying", False)}
    [event] = plane.events()
    assert (event["action"], event["subject"], event["reason"]) == ("destroy", "c1", "failed")


def test_rule10_the_creating_timeout_is_a_setting(settings, db, make_worker, advance):
    quick_settings = load_settings(database_url=settings.database_url, creating_timeout="2m")
    quick = ControlPlane(quick_settings, db)
    make_worker()
    quick.scheduler.create_container("w1", "c1")
    advance(minutes=3)

    quick.collect()

    assert states(quick) == {"c1": ("destroying", False)}


# Rule 13: audit ---------------------------------------------------------------------------


def test_rule13_audit_records_every_collector_change_with_its_reason(plane, make_worker, advance):
    e = make_worker("e")  # keeps heartbeating and reporting
    make_worker("a")  # durable, stops heartbeating: stalls
    make_worker("b", ephemeral=True)  # ephemeral, stops heartbeating: deleted
    make_worker("c")  # retiring, stops heartbeating: deleted
    make_worker("d")  # landing: lands
    created(plane, "b", "b-c1")
    plane.fleet.retire("c")
    plane.fleet.land("d")
    created(plane, "e", "missing", "owner")
    plane.scheduler.create_volume("e", "orphan", container="owner")
    plane.scheduler.volume_created("orphan")
    plane.scheduler.create_container("e", "stuck")
    e.report(containers=["owner"], volumes=["orphan"])  # "missing" is marked
    plane.scheduler.destroy_container("owner")
    e.report(volumes=["orphan"])  # "owner" is confirmed destroyed: "orphan" is orphaned
    advance(minutes=61)
    e.heartbeat()
    e.report(volumes=["orphan"])  # confirms that "missing" is still missing
    before = snapshot(plane)
    audited_before = len(plane.events())

    summary = plane.collect()

    after = snapshot(plane)
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    all_events = plane.events()
    events = all_events[: len(all_events) - audited_before]  # newest first
    audited = {(ev["kind"], ev["subject"]) for ev in events}
    assert changed == audited
    assert {(ev["action"], ev["kind"], ev["subject"]) for ev in events} == {
        ("stall", "worker", "a"),
        ("delete", "worker", "b"),
        ("delete", "container", "b-c1"),  # went with its worker
        ("delete", "worker", "c"),
        ("land", "worker", "d"),
        ("fail", "container", "stuck"),
        ("destroy", "container", "stuck"),
        ("destroy", "volume", "orphan"),
        ("delete", "container", "missing"),
    }
    assert all(ev["actor"] == "collector" and ev["reason"] for ev in events)
    assert all(not ev["dry_run"] for ev in events)
    reasons = {ev["subject"]: ev["reason"] for ev in events}
    assert "heartbeat expired" in reasons["a"]
    assert "1 containers" in reasons["b"]
    assert "orphaned" in reasons["orphan"]
    assert "missing for at least" in reasons["missing"]
    assert sum(summary.counts.values()) == len(events)


def test_rule13_a_dry_run_changes_nothing_and_audits_what_it_would_do(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1")
    w.report()
    advance(minutes=5)
    w.heartbeat()
    w.report()
    before = snapshot(plane)

    summary = plane.collect(dry_run=True)

    assert snapshot(plane) == before
    [event] = plane.events()
    assert (event["action"], event["subject"], event["dry_run"]) == ("delete", "c1", True)
    assert summary.dry_run and sum(summary.counts.values()) == 1

    plane.collect()
    assert states(plane) == {}


def test_rule13_events_are_listed_newest_first(plane, make_worker, advance):
    make_worker("a")
    make_worker("b")
    plane.fleet.land("b")
    advance(minutes=2)
    plane.collect()  # b lands, a stalls
    advance(minutes=1)
    plane.fleet.prune("a")

    events = plane.events()

    assert [ev["at"] for ev in events] == sorted((ev["at"] for ev in events), reverse=True)
    assert (events[0]["action"], events[0]["subject"], events[0]["actor"]) == (
        "delete",
        "a",
        "operator",
    )


def test_rule13_a_batch_of_deletions_is_one_audit_row_per_worker_and_reason_with_every_handle(
    settings, db, advance
):
    plane = ControlPlane(load_settings(database_url=settings.database_url, delete_batch_size=3), db)
    workers = {"a": FakeWorker(plane, "a"), "b": FakeWorker(plane, "b")}
    gone = {"a": ["a1", "a2", "a3", "a4"], "b": ["b1", "b2"]}
    for name, worker in workers.items():
        worker.heartbeat()
        created(plane, name, *gone[name])
        worker.report()
    advance(minutes=5)
    for worker in workers.values():
        worker.heartbeat()
        worker.report()

    summary = plane.collect()

    assert states(plane) == {}
    assert summary.counts == {"containers deleted": 6}
    with db.transaction() as conn:
        rows = conn.execute(select(audit_events).order_by(audit_events.c.id)).all()
    # Batches of 3: a (4 rows) in two batches of its own, oldest marks first, then b's two.
    assert sorted((r.worker_name, r.subject, sorted(r.subjects)) for r in rows) == [
        ("a", None, ["a1", "a2", "a3"]),
        ("a", None, ["a4"]),
        ("b", None, ["b1", "b2"]),
    ]
    events = plane.events()
    assert sorted((ev["worker_name"], ev["subject"]) for ev in events) == [
        (name, handle) for name in ("a", "b") for handle in gone[name]
    ]
    assert all(ev["action"] == "delete" and "missing for at least" in ev["reason"] for ev in events)


def test_rule13_the_newest_events_are_cut_at_the_limit_even_inside_a_batch(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1", "c2", "c3")
    w.report()
    advance(minutes=5)
    w.heartbeat()
    w.report()
    plane.collect()

    assert [ev["subject"] for ev in plane.events(limit=2)] == ["c1", "c2"]
    assert [ev["subject"] for ev in plane.events()] == ["c1", "c2", "c3"]


def test_rule13_a_dry_run_audits_a_batch_as_the_deletion_would(plane, make_worker, advance):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    w.report()
    advance(minutes=5)
    w.heartbeat()
    w.report()

    plane.collect(dry_run=True)

    assert states(plane) == {"c1": ("created", True), "c2": ("created", True)}
    assert [(ev["subject"], ev["dry_run"]) for ev in plane.events()] == [
        ("c1", True),
        ("c2", True),
    ]


def test_rule4_batches_hold_at_most_the_batch_size_and_split_a_worker_where_needed():
    groups = [("a", [1, 2, 3, 4]), ("b", [5, 6]), ("c", [7])]

    assert batches(groups, 3) == [[("a", [1, 2, 3])], [("a", [4]), ("b", [5, 6])], [("c", [7])]]
    assert batches(groups, 10) == [groups]
    assert batches([], 3) == []


def test_rule4_whole_workers_are_batched_by_their_counts_and_a_larger_worker_split_alone():
    counts = [("a", 2), ("b", 1), ("c", 7), ("d", 3), ("e", 1)]

    assert worker_batches(counts, 3) == [
        [("a", None), ("b", None)],
        [("c", 3)],
        [("c", 3)],
        [("c", 3)],
        [("d", None)],
        [("e", None)],
    ]
    assert worker_batches(counts, 20) == [[(w, None) for w, _ in counts]]
    assert worker_batches([], 3) == []


def test_rule4_a_worker_with_more_candidates_than_a_batch_loses_its_oldest_marks_first(
    settings, db, advance
):
    plane = ControlPlane(load_settings(database_url=settings.database_url, delete_batch_size=2), db)
    w = FakeWorker(plane, "w1")
    w.heartbeat()
    created(plane, "w1", "new1", "old1", "old2", "kept")
    w.report(containers=["new1", "kept"])  # old1, old2 marked first
    advance(seconds=30)
    w.report(containers=["kept"])  # new1 marked later
    advance(minutes=6)
    w.heartbeat()
    w.report(containers=["kept"])

    summary = plane.collect()

    assert states(plane) == {"kept": ("created", False)}
    assert summary.counts == {"containers deleted": 3}
    with db.transaction() as conn:
        rows = conn.execute(select(audit_events).order_by(audit_events.c.id)).all()
    assert [sorted(r.subjects) for r in rows] == [["old1", "old2"], ["new1"]]


def test_rule4_a_batch_never_deletes_a_row_marked_after_the_plans_cutoff(
    plane, db, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "early", "late")
    w.report(containers=["late"])
    advance(seconds=30)
    w.report()
    advance(minutes=6)
    w.heartbeat()
    w.report()
    marks = {c["handle"]: c["missing_since"] for c in plane.containers()}
    assert marks["early"] < marks["late"]

    # Both qualify under the lock now, but the plan counted the worker's rows up to `early`.
    with db.engine.connect() as conn:
        ctx = CollectionContext(db, plane.settings, conn)
        MissingRowCollector._delete_batch(
            ctx, ContainerRepository(db), [Deletion("w1", marks["early"])]
        )

    assert states(plane) == {"late": ("created", True)}
    assert [ev["subject"] for ev in plane.events() if ev["action"] == "delete"] == ["early"]
