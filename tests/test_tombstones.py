"""Rule 16: deleted workers stay deleted. Pruning, retiring, ephemeral expiry and the
stalled-worker timeout leave a tombstone of the worker's last incarnation, so that its old
messages, replayed, are rejected and dead-lettered with a reason; a genuinely restarted worker
(a higher incarnation, rule 7) registers again. The replay is also played through real Redis and
Celery."""

from __future__ import annotations

import pytest

from gcworker.broker import publish
from gcworker.codec import encode
from gcworker.control_plane import ControlPlane
from gcworker.errors import NotFound
from gcworker.messages import Heartbeat, Report
from gcworker.rules import HeartbeatOutcome, ReportOutcome
from gcworker.settings import load_settings
from gcworker.signing import generate_private_key, public_key_text
from tasks.routing import task_for
from tests.conftest import states
from tests.pipeline_support import Pipeline, wait_for
from tests.test_cli import gcworker, ok

W2_KEY = generate_private_key()


def captured(incarnation: int = 1) -> tuple[dict, dict]:
    """w2's signed heartbeat and report, as an eavesdropper on the broker keeps them."""
    heartbeat = encode(Heartbeat(worker="w2", incarnation=incarnation, seq=1), W2_KEY)
    report = encode(
        Report(worker="w2", incarnation=incarnation, seq=2, containers=["c1"], volumes=["v1"]),
        W2_KEY,
    )
    return heartbeat, report


def signed_plane(database_url, db, **settings) -> ControlPlane:
    plane = ControlPlane(load_settings(database_url=database_url, **settings), db)
    plane.register_key("w2", public_key_text(W2_KEY))
    return plane


def prune(plane, advance):
    plane.fleet.land("w2")
    plane.fleet.prune("w2")


def retire(plane, advance):
    plane.fleet.retire("w2")
    advance(minutes=5)
    plane.collect()


def expire_ephemeral(plane, advance):
    plane.receive(encode(Heartbeat(worker="w2", incarnation=1, seq=3, ephemeral=True), W2_KEY))
    advance(minutes=5)
    plane.collect()


def stalled_timeout(plane, advance):
    advance(minutes=5)
    plane.collect()  # stalls w2
    advance(hours=2)
    plane.collect()  # past the stalled-worker timeout: w2 is deleted


DELETIONS = {
    "pruned": prune,
    "retired": retire,
    "ephemeral expiry": expire_ephemeral,
    "stalled timeout": stalled_timeout,
}


@pytest.mark.parametrize("how", DELETIONS)
def test_tombstones_a_deleted_workers_replayed_messages_are_rejected_and_dead_lettered(
    database_url, db, advance, how
):
    plane = signed_plane(database_url, db, stalled_worker_timeout="1h")
    heartbeat, report = captured()
    plane.receive(heartbeat)
    plane.receive(report)
    assert states(plane) == {"c1": ("destroying", False)}  # rule 8: the worker's unknown handle
    DELETIONS[how](plane, advance)
    assert plane.workers() == []

    replayed = [plane.receive(heartbeat), plane.receive(report)]

    assert [r.outcome for r in replayed] == [HeartbeatOutcome.REJECTED, ReportOutcome.REJECTED]
    assert plane.workers() == []
    assert states(plane) == {} and states(plane, "volume") == {}
    letters = plane.dead_letters()
    assert [d["worker_name"] for d in letters] == ["w2", "w2"]
    for letter in letters:
        assert letter["reason"].startswith("worker w2 was deleted (")
        assert "at incarnation 1: a replay of its old messages" in letter["reason"]


def test_tombstones_an_equal_incarnation_is_a_replay_whatever_its_sequence(
    database_url, db, advance
):
    plane = signed_plane(database_url, db)
    heartbeat, _ = captured()
    plane.receive(heartbeat)
    prune(plane, advance)

    later = plane.receive(encode(Heartbeat(worker="w2", incarnation=1, seq=10**6), W2_KEY))

    assert later.outcome is HeartbeatOutcome.REJECTED
    assert plane.workers() == []


def test_tombstones_a_restarted_worker_registers_again_and_its_old_report_stays_out(
    database_url, db, advance
):
    plane = signed_plane(database_url, db)
    heartbeat, report = captured()
    plane.receive(heartbeat)
    plane.receive(report)
    prune(plane, advance)

    restarted = plane.receive(encode(Heartbeat(worker="w2", incarnation=2, seq=1), W2_KEY))
    replayed = [plane.receive(heartbeat), plane.receive(report)]

    assert restarted.outcome is HeartbeatOutcome.REGISTERED
    assert [r.outcome for r in replayed] == [HeartbeatOutcome.REJECTED, ReportOutcome.REJECTED]
    assert [(w["name"], w["incarnation"]) for w in plane.workers()] == [("w2", 2)]
    assert states(plane) == {} and states(plane, "volume") == {}
    assert len(plane.dead_letters()) == 2


def test_tombstones_a_worker_deleted_again_is_tombstoned_at_its_newest_incarnation(
    database_url, db, advance
):
    plane = signed_plane(database_url, db)
    plane.receive(captured(incarnation=1)[0])
    prune(plane, advance)
    second, _ = captured(incarnation=2)
    plane.receive(second)
    prune(plane, advance)

    assert plane.receive(second).outcome is HeartbeatOutcome.REJECTED
    third = plane.receive(encode(Heartbeat(worker="w2", incarnation=3, seq=1), W2_KEY))
    assert third.outcome is HeartbeatOutcome.REGISTERED


def test_tombstones_prune_may_revoke_the_workers_key(database_url, db, advance):
    plane = signed_plane(database_url, db)
    plane.receive(captured()[0])
    plane.fleet.land("w2")

    plane.fleet.prune("w2", revoke_key=True)

    assert [k["revoked_at"] is not None for k in plane.keys()] == [True]
    restarted = plane.receive(encode(Heartbeat(worker="w2", incarnation=2, seq=1), W2_KEY))
    assert restarted.reason == "no active key for worker 'w2' (unknown or revoked)"
    assert plane.workers() == []


@pytest.mark.backends("sqlite")
def test_tombstones_the_cli_prunes_and_revokes_the_key(tmp_path, database_url, db):
    plane = signed_plane(database_url, db)
    plane.receive(captured()[0])
    plane.fleet.land("w2")

    said = ok(gcworker(tmp_path, database_url, "workers", "prune", "--revoke-key", "w2"))

    assert said.strip() == "worker w2: pruned with 0 containers and 0 volumes, its key revoked"
    assert plane.workers() == [] and plane.keys()[0]["revoked_at"] is not None


def test_tombstones_prune_with_revoke_key_and_no_key_deletes_nothing(plane, make_worker):
    make_worker("w1")
    plane.fleet.land("w1")

    with pytest.raises(NotFound, match="no active key"):
        plane.fleet.prune("w1", revoke_key=True)

    assert [w["name"] for w in plane.workers()] == ["w1"]


@pytest.mark.backends("postgresql")
@pytest.mark.timeout(120)
def test_tombstones_a_pruned_workers_replay_through_redis_and_celery_is_dead_lettered(
    database_url, db, tmp_path
):
    plane = signed_plane(database_url, db)
    pipeline = Pipeline(database_url, tmp_path, allow_unsigned="false")
    try:
        pipeline.start_reconciler("r1")
        heartbeat, report = captured()

        def push():
            for message, envelope in (("heartbeat", heartbeat), ("report", report)):
                task, queue = task_for(message)
                publish(pipeline.channel.app, task, queue, envelope, f"{message} w2 (replayed)")

        push()
        wait_for(
            lambda: states(plane) == {"c1": ("destroying", False)},
            timeout=30,
            what="w2 registered with its rows",
            details=pipeline.logs,
        )
        plane.fleet.land("w2")
        plane.fleet.prune("w2")

        push()
        wait_for(
            lambda: pipeline.in_flight() == 0 and len(plane.dead_letters()) == 2,
            timeout=30,
            what="the replayed heartbeat and report dead-lettered",
            details=pipeline.logs,
        )
        assert plane.workers() == []
        assert states(plane) == {} and states(plane, "volume") == {}
        assert all("was deleted (pruned" in d["reason"] for d in plane.dead_letters())
    finally:
        pipeline.close()
