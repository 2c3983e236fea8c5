"""Volumes: copy-on-write subtrees (a missing volume takes its descendants' rows with it, a parent
with children is never moved to destroying) and orphaned volumes."""

from __future__ import annotations

import pytest

from gcworker.errors import Conflict
from tests.conftest import created, states


def volume(plane, worker: str, handle: str, *, parent=None, container=None) -> None:
    plane.scheduler.create_volume(worker, handle, parent=parent, container=container)
    plane.scheduler.volume_created(handle)


def confirm_missing_after_grace(plane, w, advance, **reported) -> None:
    w.report(**reported)
    advance(minutes=5)
    w.heartbeat()
    w.report(**reported)


def test_volumes_a_missing_parents_deletion_takes_its_descendants_rows_rule4(
    plane, make_worker, advance
):
    w = make_worker()
    volume(plane, "w1", "root")
    volume(plane, "w1", "child", parent="root")
    volume(plane, "w1", "grandchild", parent="child")
    volume(plane, "w1", "sibling", parent="root")
    volume(plane, "w1", "other")
    # Only the root is missing; the worker still lists its copy-on-write descendants.
    kept = ["child", "grandchild", "sibling", "other"]
    confirm_missing_after_grace(plane, w, advance, volumes=kept)

    plane.collect()

    assert states(plane, "volume") == {"other": ("created", False)}
    reasons = {e["subject"]: e["reason"] for e in plane.events() if e["action"] == "delete"}
    assert set(reasons) == {"root", "child", "grandchild", "sibling"}
    assert "missing for at least" in reasons["root"]
    assert all(
        reasons[h] == "descendant of a missing volume" for h in ("child", "grandchild", "sibling")
    )
    # What the worker still holds comes back as unknown and is removed (rule 8).
    w.report(volumes=kept)
    assert states(plane, "volume") == {
        "other": ("created", False),
        "child": ("destroying", False),
        "grandchild": ("destroying", False),
        "sibling": ("destroying", False),
    }


def test_volumes_a_missing_parent_and_its_missing_child_are_each_deleted_once_rule4_rule13(
    plane, make_worker, advance
):
    w = make_worker()
    volume(plane, "w1", "root")
    volume(plane, "w1", "child", parent="root")
    volume(plane, "w1", "grandchild", parent="child")
    volume(plane, "w1", "other")
    confirm_missing_after_grace(plane, w, advance, volumes=["grandchild", "other"])

    summary = plane.collect()

    assert states(plane, "volume") == {"other": ("created", False)}
    assert summary.counts == {"volumes deleted": 3}
    deleted = [(e["subject"], e["reason"]) for e in plane.events() if e["action"] == "delete"]
    assert sorted(handle for handle, _ in deleted) == ["child", "grandchild", "root"]
    reasons = dict(deleted)
    assert "missing for at least" in reasons["root"]
    assert "missing for at least" in reasons["child"]
    assert reasons["grandchild"] == "descendant of a missing volume"


def test_volumes_a_missing_child_is_deleted_without_its_parent_rule4(plane, make_worker, advance):
    w = make_worker()
    volume(plane, "w1", "root")
    volume(plane, "w1", "child", parent="root")
    confirm_missing_after_grace(plane, w, advance, volumes=["root"])

    plane.collect()

    assert states(plane, "volume") == {"root": ("created", False)}


def test_volumes_a_parent_with_children_is_never_moved_to_destroying_by_the_scheduler(
    plane, make_worker
):
    w = make_worker()
    volume(plane, "w1", "root")
    volume(plane, "w1", "child", parent="root")

    with pytest.raises(Conflict, match="child volumes"):
        plane.scheduler.destroy_volume("root")

    assert states(plane, "volume") == {"root": ("created", False), "child": ("created", False)}
    plane.scheduler.destroy_volume("child")
    with pytest.raises(Conflict, match="child volumes"):  # a destroying child is still a child
        plane.scheduler.destroy_volume("root")
    w.report(volumes=["root"])  # the child is confirmed destroyed (rule 9): its row is gone
    plane.scheduler.destroy_volume("root")
    assert states(plane, "volume") == {"root": ("destroying", False)}


def test_volumes_an_orphaned_parent_with_children_is_never_moved_to_destroying(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    volume(plane, "w1", "owned", container="c1")
    volume(plane, "w1", "child", parent="owned")
    plane.scheduler.destroy_container("c1")
    w.report(volumes=["owned", "child"])  # c1 confirmed destroyed: "owned" is orphaned

    plane.collect()

    assert states(plane, "volume") == {"owned": ("created", False), "child": ("created", False)}
    assert [e["actor"] for e in plane.events()] == ["reconciler"]  # c1's rule 9, nothing else


def test_volumes_an_orphaned_volume_goes_to_destroying_rule13(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1", "c2")
    volume(plane, "w1", "v-c1", container="c1")
    volume(plane, "w1", "v-c2", container="c2")
    volume(plane, "w1", "v-free")
    plane.scheduler.destroy_container("c1")
    w.report(containers=["c2"], volumes=["v-c1", "v-c2", "v-free"])
    assert states(plane) == {"c2": ("created", False)}

    plane.collect()

    assert states(plane, "volume") == {
        "v-c1": ("destroying", False),
        "v-c2": ("created", False),
        "v-free": ("created", False),
    }
    [event] = [e for e in plane.events() if e["actor"] == "collector"]
    assert (event["action"], event["kind"], event["subject"], event["worker_name"]) == (
        "destroy",
        "volume",
        "v-c1",
        "w1",
    )
    assert "orphaned" in event["reason"]
    assert plane.destroying_handles("w1")["volume"] == ["v-c1"]


def test_volumes_a_volume_orphaned_by_a_missing_containers_deletion_is_destroyed(
    plane, make_worker, advance
):
    w = make_worker()
    created(plane, "w1", "c1")
    volume(plane, "w1", "v1", container="c1")
    confirm_missing_after_grace(plane, w, advance, volumes=["v1"])

    plane.collect()  # c1 deleted (rule 4)
    plane.collect()  # v1 orphaned

    assert states(plane) == {}
    assert states(plane, "volume") == {"v1": ("destroying", False)}


def test_volumes_the_listing_names_parent_and_container(plane, make_worker):
    make_worker()
    created(plane, "w1", "c1")
    volume(plane, "w1", "root", container="c1")
    plane.scheduler.create_volume("w1", "child", parent="root")

    rows = {r["handle"]: r for r in plane.volumes()}

    assert (rows["root"]["parent"], rows["root"]["container"]) == (None, "c1")
    assert (rows["child"]["parent"], rows["child"]["container"]) == ("root", None)


def test_volumes_a_child_needs_a_created_parent_on_the_same_worker(plane, make_worker):
    make_worker("w1")
    make_worker("w2")
    plane.scheduler.create_volume("w1", "creating-parent")
    volume(plane, "w2", "elsewhere")

    with pytest.raises(Conflict, match="not created"):
        plane.scheduler.create_volume("w1", "child", parent="creating-parent")
    with pytest.raises(Conflict, match="w2"):
        plane.scheduler.create_volume("w1", "child", parent="elsewhere")

    assert "child" not in states(plane, "volume")


def test_volumes_an_orphaned_parent_costs_its_worker_no_fast_path_at_collections(
    plane, make_worker
):
    """An orphaned parent with a child stays where it is: the collector that would move it
    locks (and so marks as changed) no worker for it, and the worker's next steady report still
    takes the fast path."""
    w = make_worker()
    created(plane, "w1", "c1")
    volume(plane, "w1", "owned", container="c1")
    volume(plane, "w1", "child", parent="owned")
    plane.scheduler.destroy_container("c1")
    w.report(volumes=["owned", "child"])  # c1 confirmed destroyed: "owned" is orphaned

    plane.collect()
    plane.collect()

    assert w.report(volumes=["owned", "child"]).fast_path
    assert states(plane, "volume") == {"owned": ("created", False), "child": ("created", False)}
