"""Rule 12, the control plane's own half: the brake holds while the broker shows that the
control plane is behind (heartbeats waiting longer than the TTL or for a retry, no reconciler
alive, a broker that just restarted or cannot be read), on real Redis, with a namespace per
test; and the collect task of a real reconciler asks."""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta

import pytest
import redis

from gcworker import metrics, pipeline
from gcworker.broker import BrokerChannel
from gcworker.broker_health import BrokerHealth, BrokerSelfCheck, BrokerStatus, LeaseKeeper
from gcworker.db.tables import workers
from gcworker.messages import Heartbeat
from gcworker.settings import load_settings
from tasks.routing import COLLECT_TASK
from tests.conftest import FakeWorker
from tests.pipeline_support import REDIS_URL, Pipeline, free_port, wait_for

TTL = {"heartbeat_interval": "0.5s", "heartbeat_ttl": "1s", "brake_min_workers": 100}


@pytest.fixture
def broker_settings(database_url):
    namespace = "gcwtest-" + uuid.uuid4().hex[:12]
    settings = load_settings(
        database_url=database_url, broker_url=REDIS_URL, broker_namespace=namespace, **TTL
    )
    yield settings
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def settings(broker_settings):  # the plane and the database use the broker settings too
    return broker_settings


@pytest.fixture
def health(broker_settings):
    health = BrokerHealth.from_settings(broker_settings)
    yield health
    health.close()


class Renewing:
    """A reconciler's lease, renewed on its period from a thread, as a consumer would."""

    def __init__(self, settings, node="r@test"):
        self.keeper = LeaseKeeper.for_node(settings, node, ["heartbeats", "reports"])
        self.stop = threading.Event()
        self.keeper.renew(reset=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.keeper.every):
            self.keeper.renew()

    def close(self, release=True):
        self.stop.set()
        self.thread.join(5)
        if release:
            self.keeper.release()
        self.keeper.close()


@pytest.fixture
def lease(broker_settings):
    renewing = Renewing(broker_settings)
    yield renewing
    renewing.close()


def one_of_four_expired(plane):
    """Four running workers, w4's heartbeat expired a minute ago, the others' in an hour; the
    stalled-fraction brake is out of the way (`brake_min_workers`), so only the self-check can
    keep w4 from being stalled."""
    for i in range(1, 5):
        FakeWorker(plane, f"w{i}").heartbeat(ttl_seconds=3600)
    with plane.db.transaction() as conn:
        conn.execute(
            workers.update()
            .where(workers.c.name == "w4")
            .values(heartbeat_expires_at=plane.db.now(conn) - timedelta(minutes=1))
        )


def worker_states(plane):
    return {w["name"]: w["state"] for w in plane.workers()}


def actions(plane):
    """The audit, oldest first."""
    return [(e["action"], e["subject"], e["reason"]) for e in reversed(plane.events())]


def up_for_a_ttl(health):
    wait_for(
        lambda: health.status().reconcilers_up_for >= health.heartbeat_ttl.total_seconds(),
        timeout=10,
        what="the lease to be held for a whole TTL",
    )


# The reasons -----------------------------------------------------------------------------------


def status(**fields) -> BrokerStatus:
    values = {
        "heartbeat_ttl": 60.0,
        "reconcilers": 2,
        "reconcilers_up_for": 600.0,
        "waiting": 0,
        "waited": None,
        "retrying": 0,
        "broker_uptime": 86400.0,
        **fields,
    }
    return BrokerStatus(**values)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, None),
        ({"waiting": 40, "waited": 59.9}, None),
        ({"broker_uptime": None}, None),
        ({"reconcilers": 0}, "no reconciler is alive to process heartbeats"),
        ({"broker_uptime": 12.0}, "the broker restarted 12s ago"),
        ({"waiting": 40, "waited": 75.0}, "heartbeats have waited in the broker for at least 75s"),
        ({"retrying": 3}, "3 heartbeats wait for a retry"),
        ({"reconcilers_up_for": 10.0}, "the reconcilers processing heartbeats have been up"),
    ],
)
def test_each_sign_of_being_behind_is_a_reason(fields, reason):
    found = status(**fields).reason()
    if reason is None:
        assert found is None
    else:
        assert found is not None and found.startswith(reason), found


# No reconciler alive ----------------------------------------------------------------------------


def test_no_reconciler_alive_holds_the_brake_until_one_is_up_for_a_ttl(
    plane, health, broker_settings
):
    one_of_four_expired(plane)
    check = BrokerSelfCheck(health)

    summary = pipeline.run_collection(plane, self_check=check)
    assert summary.disrupted
    assert summary.disruption_reason.startswith("no reconciler is alive to process heartbeats")
    assert metrics.DISRUPTION._value.get() == 1
    assert set(worker_states(plane).values()) == {"running"}, "the brake stalled someone"
    assert [a for a, *_ in actions(plane)] == ["enter_disruption"]
    assert "no reconciler is alive" in actions(plane)[0][2]

    renewing = Renewing(broker_settings)
    try:
        assert check().startswith("the reconcilers processing heartbeats have been up for only")
        assert pipeline.run_collection(plane, self_check=check).disrupted
        up_for_a_ttl(health)
        summary = pipeline.run_collection(plane, self_check=check)
    finally:
        renewing.close()
    assert not summary.disrupted
    assert metrics.DISRUPTION._value.get() == 0
    assert [a for a, *_ in actions(plane)] == ["enter_disruption", "leave_disruption"]
    # Leaving restarted every clock: w4's heartbeat expiry starts afresh, nobody stalled.
    assert set(worker_states(plane).values()) == {"running"}


def test_a_lease_lapses_when_its_reconciler_stops_renewing(health, broker_settings):
    renewing = Renewing(broker_settings)
    assert health.status().reconcilers == 1
    renewing.close(release=False)  # as if killed: nothing given back
    wait_for(
        lambda: health.status().reconcilers == 0,
        timeout=5,
        what="the lease to lapse",
    )
    keeper = LeaseKeeper.for_node(broker_settings, "r@test", ["heartbeats"])
    keeper.renew()
    assert health.status().reconcilers_up_for < 0.5, "a lapsed lease must start afresh"
    keeper.release()
    keeper.close()
    assert health.status().reconcilers == 0


# A backlog of heartbeats --------------------------------------------------------------------------


def test_a_backlog_older_than_the_ttl_holds_the_brake(plane, health, lease, broker_settings):
    up_for_a_ttl(health)
    channel = BrokerChannel(broker_settings)
    try:
        for seq in range(1, 4):  # nobody consumes: they wait in the queue
            channel.send(Heartbeat(worker="w9", incarnation=1, seq=seq))
    finally:
        channel.close()
    check = BrokerSelfCheck(health)
    assert check() is None, "a backlog seen for the first time has not waited a TTL yet"
    one_of_four_expired(plane)

    wait_for(lambda: (health.status().waited or 0) >= 1.0, timeout=10, what="a TTL of waiting")
    summary = pipeline.run_collection(plane, self_check=check)
    assert summary.disrupted
    assert summary.disruption_reason.startswith("heartbeats have waited in the broker"), (
        summary.disruption_reason
    )
    assert "3 waiting" in summary.disruption_reason
    assert set(worker_states(plane).values()) == {"running"}, "the brake stalled someone"
    assert metrics.HEARTBEATS_WAITING._value.get() == 3
    assert metrics.HEARTBEAT_WAIT_SECONDS._value.get() >= 1.0

    health.redis.delete(health.queue_key)  # the reconcilers caught up
    summary = pipeline.run_collection(plane, self_check=check)
    assert not summary.disrupted
    assert [a for a, *_ in actions(plane)] == ["enter_disruption", "leave_disruption"]
    assert set(worker_states(plane).values()) == {"running"}


@pytest.mark.backends("sqlite")
def test_a_queue_that_moves_is_no_backlog_and_the_records_stay_few(health, lease, broker_settings):
    """Heartbeats that keep arriving and leaving are never taken for a backlog, however long it
    goes on; each look keeps only a handful of records."""
    client = health.redis
    up_for_a_ttl(health)
    for i in range(30):
        client.lpush(health.queue_key, f"message-{i}")
        if i >= 2:
            client.rpop(health.queue_key)  # each one leaves after two looks, well within a TTL
        status = health.status()
        assert status.waited is None or status.waited < 1.0, (i, status)
        threading.Event().wait(0.05)
    assert client.llen(health.records_key) <= 12
    # And one that stays is recognised a TTL after it was first seen, not earlier.
    client.delete(health.queue_key)
    client.lpush(health.queue_key, "stuck")
    assert health.status().waited is None
    wait_for(lambda: health.status().waited, timeout=5, what="the stuck message's wait")
    assert health.status().waited >= 1.0


# Heartbeats waiting for a retry -----------------------------------------------------------------


@pytest.mark.backends("sqlite")
def test_heartbeats_waiting_for_a_retry_hold_the_brake(health, lease):
    up_for_a_ttl(health)
    check = BrokerSelfCheck(health)
    assert check() is None
    health.mark_retrying("task-1")
    health.mark_retrying("task-2")
    assert check().startswith("2 heartbeats wait for a retry")
    health.unmark_retrying("task-1")
    health.unmark_retrying("task-2")
    assert check() is None


# A broker that cannot be read ---------------------------------------------------------------------


@pytest.mark.backends("sqlite")
def test_a_broker_that_cannot_be_read_holds_the_brake(broker_settings):
    nowhere = broker_settings.model_copy(
        update={"broker_url": f"redis://127.0.0.1:{free_port()}/0"}
    )
    check = BrokerSelfCheck.from_settings(nowhere)
    try:
        reason = check()
    finally:
        check.health.close()
    assert reason.startswith("the broker cannot be read (ConnectionError"), reason


# The collect task asks, in a real reconciler ------------------------------------------------------


@pytest.mark.backends("postgresql")
@pytest.mark.timeout(120)
def test_the_collect_task_brakes_while_no_reconciler_processes_heartbeats(
    database_url, db, plane, tmp_path
):
    pipe = Pipeline(database_url, tmp_path, **TTL)
    health = BrokerHealth.from_settings(pipe.settings)
    try:
        one_of_four_expired(plane)
        collector = pipe.start_reconciler("c1", queues="collect")

        def collected(times):
            return lambda: collector.log().count("collection finished") >= times

        pipe.send_task(COLLECT_TASK, "collect")
        wait_for(collected(1), timeout=20, what="a collection", details=pipe.logs)
        assert [a for a, *_ in actions(plane)] == ["enter_disruption"], actions(plane)
        assert "no reconciler is alive to process heartbeats" in actions(plane)[0][2]
        assert worker_states(plane)["w4"] == "running"

        heartbeats = pipe.start_reconciler("h1", queues="heartbeats")
        assert health.status().reconcilers == 1
        up_for_a_ttl(health)
        pipe.send_task(COLLECT_TASK, "collect")
        wait_for(collected(2), timeout=20, what="a second collection", details=pipe.logs)
        assert [a for a, *_ in actions(plane)] == ["enter_disruption", "leave_disruption"]

        pipe.kill(heartbeats)  # SIGKILL: its lease lapses on its own
        wait_for(lambda: health.status().reconcilers == 0, timeout=10, what="the lease to lapse")
        pipe.send_task(COLLECT_TASK, "collect")
        wait_for(collected(3), timeout=20, what="a third collection", details=pipe.logs)
        assert [a for a, *_ in actions(plane)][-1] == "enter_disruption"
        assert collector.log().count('disruption="no reconciler is alive') == 2
        # Leaving restarted every clock to one TTL: by now all four have expired.
        assert set(worker_states(plane).values()) == {"running"}, "the brake stalled someone"
    finally:
        health.close()
        pipe.close()


# Start-up is its own phase ----------------------------------------------------------------------


def brake_records(caplog) -> list:
    return [r for r in caplog.records if r.name == "gcworker.gc.brake"]


def test_start_up_is_protected_but_reported_as_its_own_phase_not_a_disruption(plane, caplog):
    one_of_four_expired(plane)
    starting = status(reconcilers_up_for=10.0).reason()

    with caplog.at_level(logging.INFO, logger="gcworker"):
        summary = pipeline.run_collection(plane, self_check=lambda: starting)

    assert summary.disrupted, "the protection must hold"
    assert set(worker_states(plane).values()) == {"running"}, "the brake stalled someone"
    assert (metrics.DISRUPTION._value.get(), metrics.STARTING_UP._value.get()) == (0, 1)
    (line,) = brake_records(caplog)
    assert (line.levelname, line.getMessage()) == (
        "INFO",
        "start-up protection: stalling no one, deleting nothing",
    )

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gcworker"):
        summary = pipeline.run_collection(plane, self_check=lambda: None)

    assert not summary.disrupted
    assert (metrics.DISRUPTION._value.get(), metrics.STARTING_UP._value.get()) == (0, 0)
    assert [(r.levelname, r.getMessage()) for r in brake_records(caplog)] == [
        ("INFO", "start-up protection left")
    ]


def test_a_real_disruption_is_still_one_and_warns(plane, caplog):
    one_of_four_expired(plane)
    behind = status(reconcilers=0).reason()

    with caplog.at_level(logging.INFO, logger="gcworker"):
        pipeline.run_collection(plane, self_check=lambda: behind)
        assert (metrics.DISRUPTION._value.get(), metrics.STARTING_UP._value.get()) == (1, 0)
        pipeline.run_collection(plane, self_check=lambda: None)

    assert [(r.levelname, r.getMessage()) for r in brake_records(caplog)] == [
        ("WARNING", "disruption mode: stalling no one, deleting nothing"),
        ("WARNING", "disruption mode left"),
    ]
    assert metrics.DISRUPTION._value.get() == 0
