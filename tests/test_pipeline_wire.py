"""What a message of ours is on the broker: the stored Redis entry of a compact report is under
1 KB, names its message in one line (what Flower shows), and carries no empty header, no copy of
its arguments and no base64 body; Celery still reads it (the end-to-end tests run tasks)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from gcworker.codec import decode
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.rules import report_digest
from gcworker.signing import generate_private_key, public_key_text
from tests.pipeline_support import Pipeline

KEY = generate_private_key()


@pytest.fixture
def channel(tmp_path):
    pipe = Pipeline(f"sqlite:///{tmp_path}/unused.db", tmp_path)
    pipe.channel.private_key = KEY
    yield pipe
    pipe.close()


def stored(pipe: Pipeline, queue: str) -> bytes:
    (entry,) = pipe.redis.lrange(pipe.key(queue), 0, -1)
    return entry.encode()


def compact(worker: str = "w-0123456789abcdef") -> UnchangedReport:
    return UnchangedReport(
        worker=worker,
        incarnation=1_700_000_000_000_000_000,
        seq=1_700_000_000_123_456_789,
        clock=datetime.now(UTC),
        after=datetime.now(UTC),
        digest=report_digest(["c1"], ["v1"]),
    )


@pytest.mark.parametrize("worker", ["w1", "w" * 64])  # the shortest and longest names
def test_a_compact_report_is_under_1kb_on_the_broker(channel, worker):
    """As a reporter sends it: incarnation and sequence from the clock in nanoseconds, dated."""
    channel.send(compact(worker))
    entry = stored(channel, "reports")
    assert len(entry) < 1024, entry


def test_the_stored_message_names_its_message_and_carries_nothing_empty(channel):
    message = compact("w1")
    channel.send(message)
    entry = json.loads(stored(channel, "reports"))

    headers = entry["headers"]
    assert headers["task"] == "gcworker.report"
    assert headers["argsrepr"] == f"unchanged w1 seq={message.seq}"
    assert "kwargsrepr" not in headers
    assert all(value not in (None, {}, [None, None]) for value in headers.values()), headers
    assert not {"argsrepr", "kwargsrepr", "reply_to"} & set(entry["properties"])
    assert entry["properties"]["correlation_id"] == headers["id"]
    assert entry["properties"]["body_encoding"] is None
    args, kwargs, embed = json.loads(entry["body"])
    assert (kwargs, embed) == ({}, {})
    (envelope,) = args
    assert decode(envelope, lambda worker: public_key_text(KEY)) == message


def test_a_full_report_is_named_by_its_counts(channel):
    message = Report(worker="w1", incarnation=1, seq=2, containers=["c1", "c2"], volumes=["v1"])
    channel.send(message)
    headers = json.loads(stored(channel, "reports"))["headers"]
    assert headers["argsrepr"] == "report w1 seq=2 containers=2 volumes=1"


def test_a_heartbeat_goes_to_its_queue_trimmed_too(channel):
    channel.send(Heartbeat(worker="w1", incarnation=1, seq=3))
    entry = json.loads(stored(channel, "heartbeats"))
    assert entry["headers"]["argsrepr"] == "heartbeat w1 seq=3"
    assert len(json.dumps(entry)) < 1024


def test_what_says_something_stays(channel):
    """A retry's count and ETA, an expiry: kept (only Celery's defaults are dropped)."""
    channel.channel.app.send_task(
        "gcworker.collect", queue="collect", countdown=30, expires=60, retries=2
    )
    headers = json.loads(stored(channel, "collect"))["headers"]
    assert headers["retries"] == 2
    assert headers["eta"] and headers["expires"]
