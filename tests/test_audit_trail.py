"""Rule 13: every row that appears or disappears is in the audit log with its handle and reason,
whoever made the change: the reconciler's unknown handles (rule 8) and confirmed destructions
(rule 9), and the rows deleted with a worker (pruned, or by an ephemeral restart). One audit row
per report, kind and reason holds the handles; a report that changes nothing writes none."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from gcworker.db.tables import audit_events
from gcworker.reconcile import REASONS
from tests.conftest import created, recorded_statements, states


def audit_rows(db) -> list[tuple]:
    """(actor, action, kind, worker, reason, handles) of every audit row, oldest first."""
    with db.transaction() as conn:
        rows = conn.execute(select(audit_events).order_by(audit_events.c.id)).all()
    return [
        (r.actor, r.action, r.kind, r.worker_name, r.reason, sorted(r.subjects or [r.subject]))
        for r in rows
    ]


def test_audit_unknown_handles_recorded_as_destroying_rule8(plane, db, make_worker):
    w = make_worker("w1")
    make_worker("w2")
    created(plane, "w2", "theirs")

    w.report(containers=["u1", "u2", "theirs"], volumes=["uv"])

    assert audit_rows(db) == [
        ("reconciler", "record_unknown", "container", "w1", REASONS["unknown"], ["u1", "u2"]),
        ("reconciler", "record_unknown", "volume", "w1", REASONS["unknown"], ["uv"]),
    ]  # "theirs" belongs to w2: no row was recorded for it, so none is audited


def test_audit_destroying_rows_confirmed_destroyed_rule9(plane, db, make_worker):
    w = make_worker("w1")
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", kind="volume")
    plane.scheduler.destroy_container("c1")
    plane.scheduler.destroy_container("c2")
    plane.scheduler.destroy_volume("v1")

    w.report()

    assert states(plane) == {} and states(plane, "volume") == {}
    assert audit_rows(db) == [
        ("reconciler", "delete", "container", "w1", REASONS["destroyed"], ["c1", "c2"]),
        ("reconciler", "delete", "volume", "w1", REASONS["destroyed"], ["v1"]),
    ]


def test_audit_a_report_that_changes_nothing_writes_no_audit_row(plane, db, make_worker):
    w = make_worker("w1")
    created(plane, "w1", "c1")
    w.report(containers=["c1", "u1"])
    before = audit_rows(db)

    w.report(containers=["c1", "u1"])  # the fast path
    w.report(containers=["u1", "c1"])  # another order: the whole diff, no change

    assert audit_rows(db) == before


def test_audit_every_row_pruned_with_its_worker(plane, db, make_worker):
    make_worker("w1")
    created(plane, "w1", "c1", "c2")
    created(plane, "w1", "v1", kind="volume")
    plane.fleet.land("w1")

    plane.fleet.prune("w1")

    reason = "deleted with worker w1: pruned by an operator (landing)"
    assert audit_rows(db)[1:] == [
        ("operator", "delete", "container", "w1", reason, ["c1", "c2"]),
        ("operator", "delete", "volume", "w1", reason, ["v1"]),
        (
            "operator",
            "delete",
            "worker",
            "w1",
            "pruned by an operator (landing); 2 containers and 1 volumes deleted with it",
            ["w1"],
        ),
    ]
    assert plane.events()[0]["subject"] == "w1"  # the worker's deletion, newest


@pytest.mark.backends("postgresql")
def test_audit_the_reconcilers_changes_are_audited_by_the_statement_that_makes_them(
    plane, db, make_worker
):
    w = make_worker("w1")
    created(plane, "w1", "c1")
    plane.scheduler.destroy_container("c1")

    with recorded_statements(db, lambda s: "audit_events" in s) as audited:
        w.report(containers=["u1"])

    assert states(plane) == {"u1": ("destroying", False)}
    assert len(audited) == 2
    assert all(s.lstrip().startswith("WITH changed AS") for s in audited), audited


def test_audit_a_child_volume_deleted_with_its_worker_is_audited_too(plane, db, make_worker):
    """SQLite's cascade deletes a child with its parent, unseen by RETURNING: still audited."""
    w = make_worker("e1", ephemeral=True)
    created(plane, "e1", "parent", kind="volume")
    plane.scheduler.create_volume("e1", "child", parent="parent")
    plane.scheduler.volume_created("child")
    w.report([], ["parent", "child"])  # dated: the old incarnation held both then

    w.restart()  # rule 7: the old incarnation's rows go

    assert states(plane, "volume") == {}
    [rows] = [r for r in audit_rows(db) if r[2] == "volume"]
    assert rows[1:3] == ("delete", "volume") and rows[5] == ["child", "parent"]
