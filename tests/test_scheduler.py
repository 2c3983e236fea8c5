"""The scheduler's side: creating -> created -> destroying, creating -> failed -> destroying, and
every impossible request refused with a clear message, changing nothing."""

from __future__ import annotations

import pytest

from gcworker.errors import Conflict, GcworkerError, NotFound
from tests.conftest import created, states


def test_scheduler_lifecycle_creating_created_destroying(plane, make_worker):
    make_worker()
    plane.scheduler.create_container("w1", "c1")
    assert states(plane) == {"c1": ("creating", False)}
    plane.scheduler.container_created("c1")
    assert states(plane) == {"c1": ("created", False)}
    plane.scheduler.destroy_container("c1")
    assert states(plane) == {"c1": ("destroying", False)}


def test_scheduler_destroying_a_marked_row_drops_its_mark(plane, make_worker):
    w = make_worker()
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")
    w.report()  # both marked missing

    plane.scheduler.destroy_container("c1")
    plane.scheduler.destroy_volume("v1")

    assert states(plane) == {"c1": ("destroying", False)}
    assert states(plane, "volume") == {"v1": ("destroying", False)}


@pytest.mark.parametrize(
    ("setup", "request_", "error", "message"),
    [
        ("none", lambda s: s.container_created("nope"), NotFound, "unknown container 'nope'"),
        ("none", lambda s: s.destroy_volume("nope"), NotFound, "unknown volume 'nope'"),
        ("none", lambda s: s.create_container("ghost", "c2"), NotFound, "unknown worker 'ghost'"),
        ("none", lambda s: s.create_container("w1", "c1"), Conflict, "already exists"),
        ("none", lambda s: s.create_volume("w1", "v2", parent="nope"), NotFound, "parent"),
        ("none", lambda s: s.create_volume("w1", "v2", container="nope"), NotFound, "container"),
        ("none", lambda s: s.create_container("w1", "bad handle!"), GcworkerError, "invalid"),
        ("destroying", lambda s: s.container_created("c1"), Conflict, "is destroying"),
        ("destroying", lambda s: s.destroy_container("c1"), Conflict, "is destroying"),
        ("destroying", lambda s: s.fail_container("c1"), Conflict, "is destroying"),
        ("none", lambda s: s.container_created("c1"), Conflict, "is created"),
        ("none", lambda s: s.fail_container("c1"), Conflict, "is created"),
        ("creating", lambda s: s.destroy_container("c1"), Conflict, "is creating"),
    ],
)
def test_scheduler_an_impossible_request_is_refused_and_changes_nothing(
    plane, make_worker, setup, request_, error, message
):
    make_worker()
    if setup == "creating":
        plane.scheduler.create_container("w1", "c1")
    else:
        created(plane, "w1", "c1")
    if setup == "destroying":
        plane.scheduler.destroy_container("c1")
    created(plane, "w1", "v1", kind="volume")
    before = (states(plane), states(plane, "volume"), plane.workers())

    with pytest.raises(error, match=message):
        request_(plane.scheduler)

    assert (states(plane), states(plane, "volume"), plane.workers()) == before


def test_scheduler_a_handle_is_unique_across_workers(plane, make_worker):
    make_worker("w1")
    make_worker("w2")
    created(plane, "w1", "c1")

    with pytest.raises(Conflict, match="on worker 'w1'"):
        plane.scheduler.create_container("w2", "c1")


def test_scheduler_new_rows_go_to_running_workers_only(plane, make_worker, advance):
    make_worker()
    advance(minutes=2)
    plane.collect()

    with pytest.raises(Conflict, match="stalled"):
        plane.scheduler.create_container("w1", "c1")

    assert states(plane) == {}
