"""Hostile messages never crash a task: each is rejected with a reason, dead-lettered (bounded in
what is stored), logged in a bounded line, and changes nothing; `gcworker dead-letters` prints
no control character raw. Through `pipeline.receive` on both backends, and through real Celery
for the tasks' calls."""

from __future__ import annotations

import json
import logging
import sys
import unicodedata

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from gcworker import pipeline
from gcworker.codec import Rejected, decode
from gcworker.logs import KeyValueFormatter
from gcworker.reconcile import HeartbeatResult, ReportResult
from gcworker.settings import load_settings
from tests.conftest import created, states
from tests.pipeline_support import Pipeline, wait_for
from tests.test_cli import gcworker, ok

MAX_LOG_LINE = 4096


def heartbeat(**fields) -> dict:
    return {
        "payload": json.dumps(
            {"type": "heartbeat", "worker": "w1", "incarnation": 1, "seq": 5, **fields}
        )
    }


def report(**fields) -> dict:
    message = {"type": "report", "worker": "w1", "incarnation": 1, "seq": 5}
    return {"payload": json.dumps({**message, "containers": [], "volumes": [], **fields})}


HOSTILE = {
    "worker name over 64 characters": (heartbeat(worker="w" * 65), "worker"),
    "NUL escaped in the worker name": (heartbeat(worker="w1\u0000"), "worker"),
    "NUL escaped in the type": (heartbeat(type="heartbeat\u0000"), "type"),
    "NUL escaped in a field's name": (report(**{"x\u0000": 1}), "x"),
    "raw NUL byte in the payload": (
        {"payload": '{"type":"heartbeat","worker":"w1\x00","incarnation":1,"seq":5}'},
        "malformed JSON",
    ),
    "lone surrogate escaped": (
        {"payload": '{"type":"heartbeat","worker":"w1\\ud800","incarnation":1,"seq":5}'},
        "worker",
    ),
    "lone surrogate raw": (
        {"payload": '{"type":"heartbeat","worker":"w1\ud800","incarnation":1,"seq":5}'},
        "not UTF-8",
    ),
    "deeply nested JSON": ({"payload": "[" * 100_000 + "]" * 100_000}, "nested"),
    "deeply nested field": (report(containers=json.loads("[" * 500 + "]" * 500)), "containers"),
    "seq at 2^63": (heartbeat(seq=2**63), "seq"),
    "incarnation at 2^64": (heartbeat(incarnation=2**64), "incarnation"),
    "naive clock": (heartbeat(clock="2024-11-29T17:07:22"), "clock"),
    "naive after": (report(after="2024-11-29T17:07:22"), "after"),
    "clock in year 1 at +14:00": (heartbeat(clock="0001-01-01T00:00:00+14:00"), "clock"),
    "clock in year 9999 at -14:00": (heartbeat(clock="9999-12-31T23:59:59-14:00"), "clock"),
    "after in year 9999 at -14:00": (report(after="9999-12-31T23:59:59-14:00"), "after"),
}


@pytest.fixture
def settings(database_url):
    return load_settings(database_url=database_url, allow_unsigned=True)


@pytest.fixture
def running_plane(plane):
    """A control plane whose w1 is running with c1: a hostile message must leave it so."""
    assert pipeline.receive(plane, heartbeat(seq=1), task="heartbeat").outcome == "registered"
    created(plane, "w1", "c1")
    return plane


@pytest.mark.parametrize(("envelope", "reason"), HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_message_is_dead_lettered_and_changes_nothing(running_plane, envelope, reason):
    plane = running_plane
    workers_before = plane.workers()

    task = "report" if '"report"' in envelope["payload"] else "heartbeat"
    result = pipeline.receive(plane, envelope, task=task)

    assert isinstance(result, Rejected)
    assert reason in result.reason
    assert plane.workers() == workers_before
    assert states(plane) == {"c1": ("created", False)}
    (letter,) = plane.dead_letters()
    assert reason in letter["reason"]
    for value in (letter["worker_name"] or "", letter["reason"], letter["excerpt"]):
        assert "\x00" not in value
        value.encode("utf-8")  # no lone surrogate


any_text = st.text(st.characters(blacklist_categories=()), max_size=70) | st.sampled_from(
    ["w" * 65, "w1\x00", "w1\ud800", "", "c1"]
)
edge_ints = st.integers() | st.sampled_from([2**63 - 1, 2**63, -1, 2**64, 0])
edge_times = (
    st.sampled_from(
        [
            "0001-01-01T00:00:00+14:00",
            "9999-12-31T23:59:59-14:00",
            "2024-11-29T17:07:22",
            "1969-12-31T23:59:59Z",
            "2199-12-31T23:59:59+00:00",
            "2200-01-01T00:00:00Z",
            "2024-11-29T17:07:22.045137Z",
        ]
    )
    | st.datetimes().map(lambda t: t.isoformat())
    | edge_ints
    | st.floats()
    | any_text
)
known_fields = st.fixed_dictionaries(
    {"type": st.sampled_from(["heartbeat", "report"]) | any_text},
    optional={
        "version": edge_ints,
        "worker": st.just("w1") | any_text,
        "incarnation": edge_ints,
        "seq": edge_ints,
        "clock": edge_times,
        "after": edge_times,
        "ttl_seconds": st.floats() | edge_ints,
        "containers": st.lists(st.just("c1") | any_text, max_size=3),
        "volumes": st.lists(any_text, max_size=2),
    },
)
hostile_fields = st.builds(
    lambda known, unknown: {**unknown, **known},
    known_fields,
    st.dictionaries(any_text, edge_ints, max_size=1),
)


@hypothesis_settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(fields=hostile_fields, ascii_only=st.booleans())
def test_fuzzed_messages_are_applied_or_dead_lettered_never_raised(plane, fields, ascii_only):
    envelope = {"payload": json.dumps(fields, ensure_ascii=ascii_only)}
    letters = len(plane.dead_letters())

    result = pipeline.receive(plane, envelope, task="heartbeat")

    if isinstance(result, Rejected):
        assert len(plane.dead_letters()) == letters + 1
    else:
        assert isinstance(result, HeartbeatResult | ReportResult)


def test_a_10mb_worker_name_is_dead_lettered_bounded_in_a_bounded_log_line(plane, caplog):
    name = "w" * 10_000_000
    envelope = {"payload": json.dumps({"type": "heartbeat", "worker": name, "incarnation": 1})}
    envelope["signature"] = "AAAA"

    with caplog.at_level(logging.WARNING):
        result = pipeline.receive(plane, envelope, task="heartbeat")

    assert isinstance(result, Rejected)
    (letter,) = plane.dead_letters()
    assert len(letter["worker_name"]) <= 64 and letter["worker_name"].startswith("www")
    assert len(letter["excerpt"]) <= 512 and len(letter["reason"]) <= 1024
    lines = [KeyValueFormatter().format(record) for record in caplog.records]
    assert any("message rejected" in line for line in lines)
    assert all(len(line) <= MAX_LOG_LINE for line in lines), [len(line) for line in lines]


def test_log_lines_are_bounded_whatever_their_fields():
    record = logging.makeLogRecord(
        {"msg": "m" * 100_000, "levelname": "WARNING", "worker": "w" * 10_000_000, "n": 10**5000}
    )
    try:
        raise ValueError("x" * 1_000_000)
    except ValueError:
        record.exc_info = sys.exc_info()
    line = KeyValueFormatter().format(record)
    assert len(line) <= MAX_LOG_LINE
    assert "worker=" in line and "ValueError" in line


def test_the_message_size_limit_counts_bytes_not_characters():
    payload = json.dumps({"type": "heartbeat", "worker": "é" * 600}, ensure_ascii=False)
    assert len(payload) < 1000 < len(payload.encode())
    with pytest.raises(Rejected, match="oversized message: 12.. bytes"):
        decode({"payload": payload}, {}.get, allow_unsigned=True, max_bytes=1000)


def printable(text: str) -> bool:
    return all(c == "\n" or unicodedata.category(c)[0] != "C" for c in text)


def test_dead_letters_are_printed_without_raw_control_characters(tmp_path, database_url, plane):
    hostile = "\x1b[31mred\x1b]0;title\x07\r\x08\x9b2J[bold]markup[/bold]\u202e"
    plane.receive({"payload": hostile})
    plane.receive({"payload": "{}", f"x{hostile}": 1})

    table = ok(gcworker(tmp_path, database_url, "dead-letters"))
    raw_json = ok(gcworker(tmp_path, database_url, "dead-letters", "--json"))
    listing = json.loads(raw_json)

    assert printable(table), repr(table)
    assert "[bold]markup[/bold]" in table  # shown as it is, not read as markup
    assert printable(raw_json)
    assert hostile in [letter["excerpt"] for letter in listing]  # the JSON keeps the text


# Tasks get exactly their arguments, through real Celery ----------------------------------------


@pytest.mark.backends("postgresql")
@pytest.mark.timeout(120)
def test_tasks_called_with_other_arguments_are_dead_lettered(database_url, plane, tmp_path):
    pipe = Pipeline(database_url, tmp_path)
    try:
        reconciler = pipe.start_reconciler("r1", queues="heartbeats,reports,collect")
        good = heartbeat(seq=1)
        send = pipe.channel.app.send_task
        send("gcworker.heartbeat", args=[good, "extra"], queue="heartbeats")
        send("gcworker.heartbeat", args=[good], kwargs={"extra": 1}, queue="heartbeats")
        send("gcworker.heartbeat", args=[], queue="heartbeats")
        send("gcworker.report", args=[report(), report()], queue="reports")
        send("gcworker.collect", args=["x" * 100_000], queue="collect")
        send("gcworker.heartbeat", args=[heartbeat(worker="w" * 100_000)], queue="heartbeats")
        send("gcworker.heartbeat", args=[heartbeat(seq=2**63)], queue="heartbeats")

        letters = wait_for(
            lambda: len(found := plane.dead_letters()) == 7 and pipe.in_flight() == 0 and found,
            timeout=60,
            what="seven dead letters",
            details=pipe.logs,
        )
        reasons = sorted(letter["reason"] for letter in letters)
        assert sum("gcworker.heartbeat takes one envelope" in r for r in reasons) == 3, reasons
        assert sum("gcworker.report takes one envelope" in r for r in reasons) == 1, reasons
        assert sum("gcworker.collect takes no arguments" in r for r in reasons) == 1, reasons
        assert plane.workers() == []
        log = reconciler.log()
        assert "Traceback" not in log and "TypeError" not in log, log[-3000:]
        assert max(len(line) for line in log.splitlines()) <= MAX_LOG_LINE
        # The reconciler still works: a right call is applied.
        send("gcworker.heartbeat", args=[good], queue="heartbeats")
        wait_for(lambda: plane.workers(), timeout=30, what="w1 registered", details=pipe.logs)
    finally:
        pipe.close()
