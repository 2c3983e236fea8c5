"""Signed messages and hostile input: the envelope decoder, forged reports, dead letters."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcworker.codec import Rejected, decode, encode
from gcworker.control_plane import ControlPlane
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.settings import load_settings
from gcworker.signing import generate_private_key, public_key_text, sign
from tests.conftest import created, states

W1_KEY = generate_private_key()
W2_KEY = generate_private_key()
KEYS = {"w1": public_key_text(W1_KEY), "w2": public_key_text(W2_KEY)}


def report(worker="w1", seq=10, containers=("c1",), volumes=()):
    return Report(
        worker=worker, incarnation=1, seq=seq, containers=list(containers), volumes=list(volumes)
    )


DIGEST = "0123456789abcdef0123456789abcdef"


def test_a_signed_message_decodes_to_itself():
    message = report()
    assert decode(encode(message, W1_KEY), KEYS.get) == message


@pytest.mark.parametrize("after", [None, datetime(2024, 11, 29, 17, 7, 21, 998000, tzinfo=UTC)])
def test_a_compact_report_travels_as_an_array_and_decodes_to_itself(after):
    message = UnchangedReport(
        worker="w1", incarnation=3, seq=4, clock=datetime.now(UTC), after=after, digest=DIGEST
    )
    envelope = encode(message, W1_KEY)
    assert json.loads(envelope["payload"])[:5] == [1, "unchanged", "w1", 3, 4]
    assert decode(envelope, KEYS.get) == message


def test_a_compact_report_as_an_object_still_decodes():
    message = UnchangedReport(worker="w1", incarnation=3, seq=4, digest=DIGEST)
    payload = message.model_dump_json()
    envelope = {"payload": payload, "signature": sign(W1_KEY, payload.encode())}
    assert decode(envelope, KEYS.get) == message


def test_the_signature_covers_every_value_of_a_compact_report():
    message = UnchangedReport(worker="w1", incarnation=3, seq=4, digest=DIGEST)
    envelope = encode(message, W1_KEY)
    values = json.loads(envelope["payload"])
    for position, changed in ((3, 4), (4, 5), (7, "f" * 32), (2, "w2")):
        tampered = list(values)
        tampered[position] = changed
        forged = {**envelope, "payload": json.dumps(tampered, separators=(",", ":"))}
        with pytest.raises(Rejected, match="wrong signature"):
            decode(forged, KEYS.get)


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        ("not an object", "malformed envelope"),
        ({"payload": 3}, "malformed envelope"),
        ({"payload": "{}", "extra": 1}, "unknown fields"),
        ({"payload": "{not json"}, "malformed JSON"),
        (
            {"payload": json.dumps({"worker": "w1", "version": 2, "incarnation": 1, "seq": 1})},
            "invalid message",
        ),
        (
            {
                "payload": json.dumps(
                    {
                        "type": "report",
                        "worker": "w1",
                        "incarnation": "x",
                        "seq": 1,
                        "containers": [],
                        "volumes": [],
                    }
                )
            },
            "invalid message",
        ),
        (
            {
                "payload": json.dumps(
                    {
                        "type": "report",
                        "worker": "w1",
                        "incarnation": 1,
                        "seq": 1,
                        "containers": ["a", "a"],
                        "volumes": [],
                    }
                )
            },
            "listed twice",
        ),
        (
            {
                "payload": json.dumps(
                    {
                        "type": "report",
                        "worker": "w1",
                        "incarnation": 1,
                        "seq": 1,
                        "containers": ["bad handle"],
                        "volumes": [],
                    }
                )
            },
            "invalid",
        ),
        (
            {
                "payload": json.dumps(
                    {"type": "heartbeat", "worker": "../etc", "incarnation": 1, "seq": 1}
                )
            },
            "invalid message",
        ),
        # The compact unchanged report's array form (`COMPACT_LAYOUT`).
        ({"payload": "[]"}, "malformed compact message"),
        ({"payload": json.dumps([1, "unchanged", "w1", 1, 1, None, None])}, "malformed compact"),
        (
            {"payload": json.dumps([1, "report", "w1", 1, 1, None, None, DIGEST])},
            "malformed compact",
        ),
        ({"payload": json.dumps([2, "unchanged", "w1", 1, 1, None, None, DIGEST])}, "version"),
        ({"payload": json.dumps([None, "unchanged", "w1", 1, 1, None, None, DIGEST])}, "version"),
        ({"payload": json.dumps([1, "unchanged", None, 1, 1, None, None, DIGEST])}, "worker"),
        ({"payload": json.dumps([1, "unchanged", "w1", -1, 1, None, None, DIGEST])}, "incarnation"),
        ({"payload": json.dumps([1, "unchanged", "w1", 1, 1, "noon", None, DIGEST])}, "clock"),
        ({"payload": json.dumps([1, "unchanged", "w1", 1, 1, None, None, "beef"])}, "digest"),
    ],
)
def test_malformed_input_is_rejected_with_a_reason(envelope, reason):
    with pytest.raises(Rejected, match=reason):
        decode(envelope, KEYS.get, allow_unsigned=True)


def test_oversized_messages_are_rejected():
    envelope = encode(report(containers=[f"c{i}" for i in range(1000)]), W1_KEY)
    with pytest.raises(Rejected, match="oversized"):
        decode(envelope, KEYS.get, max_bytes=2048)


def test_unsigned_messages_are_rejected_unless_allowed():
    envelope = encode(report(), None)
    with pytest.raises(Rejected, match="unsigned"):
        decode(envelope, KEYS.get)
    assert decode(envelope, KEYS.get, allow_unsigned=True) == report()


def test_a_report_signed_with_another_workers_key_is_rejected():
    with pytest.raises(Rejected, match="wrong signature for worker 'w1'"):
        decode(encode(report(worker="w1"), W2_KEY), KEYS.get)


def test_an_unknown_or_revoked_key_verifies_nothing():
    with pytest.raises(Rejected, match="no active key"):
        decode(encode(report(worker="w3"), W1_KEY), KEYS.get)


def test_the_signature_covers_every_field():
    envelope = encode(report(containers=("c1", "c2")), W1_KEY)
    tampered = dict(envelope, payload=envelope["payload"].replace('"c2"', '"c3"'))
    with pytest.raises(Rejected, match="wrong signature"):
        decode(tampered, KEYS.get)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        json_values,
        st.dictionaries(
            st.sampled_from(["payload", "signature"]),
            st.text(max_size=200) | json_values,
            max_size=2,
        ),
        st.builds(
            lambda values: {"payload": json.dumps(values)},
            st.lists(
                st.one_of(
                    json_values,
                    st.sampled_from([1, "unchanged", "w1", DIGEST, "2024-11-29T17:07:21Z"]),
                ),
                min_size=6,
                max_size=9,
            ),
        ),
        st.builds(
            lambda fields: {"payload": json.dumps(fields)},
            st.fixed_dictionaries(
                {},
                optional={
                    "type": st.sampled_from(["report", "heartbeat", "x"]),
                    "version": st.integers(-1, 3),
                    "worker": st.text(max_size=70),
                    "incarnation": json_values,
                    "seq": json_values,
                    "containers": st.lists(st.text(max_size=5), max_size=5),
                    "volumes": json_values,
                    "clock": json_values,
                },
            ),
        ),
    )
)
def test_fuzzed_input_is_either_a_valid_message_or_rejected(envelope):
    try:
        message = decode(envelope, KEYS.get, allow_unsigned=True, max_bytes=10_000)
    except Rejected as rejected:
        assert rejected.reason
    else:
        assert isinstance(message, Heartbeat | Report | UnchangedReport)


@pytest.fixture
def signed_plane(database_url, db) -> ControlPlane:
    plane = ControlPlane(load_settings(database_url=database_url), db)
    plane.register_key("w1", KEYS["w1"])
    plane.register_key("w2", KEYS["w2"])
    return plane


def test_a_forged_report_changes_nothing(signed_plane):
    plane = signed_plane
    plane.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=1), W1_KEY))
    created(plane, "w1", "c1")

    outcome = plane.receive(encode(report(worker="w1", seq=2, containers=()), W2_KEY))

    assert isinstance(outcome, Rejected)
    assert states(plane) == {"c1": ("created", False)}
    (letter,) = plane.dead_letters()
    assert (letter["worker_name"], letter["reason"]) == ("w1", "wrong signature for worker 'w1'")
    genuine = plane.receive(encode(report(worker="w1", seq=3, containers=()), W1_KEY))
    assert genuine.marked == {"container": 1, "volume": 0}


def test_a_revoked_key_is_rejected(signed_plane):
    plane = signed_plane
    plane.revoke_key("w1")
    outcome = plane.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=1), W1_KEY))
    assert isinstance(outcome, Rejected)
    assert plane.workers() == []


def test_a_replayed_older_incarnation_is_rejected(signed_plane):
    plane = signed_plane
    old = encode(Heartbeat(worker="w1", incarnation=1, seq=1), W1_KEY)
    plane.receive(old)
    plane.receive(encode(Heartbeat(worker="w1", incarnation=2, seq=1), W1_KEY))
    assert plane.receive(old).outcome == "rejected"
    assert [w["incarnation"] for w in plane.workers()] == [2]


def test_dead_letters_are_bounded(database_url, db):
    plane = ControlPlane(load_settings(database_url=database_url, dead_letter_limit=3), db)
    for i in range(5):
        plane.receive({"payload": f"garbage {i}"})
    assert [d["excerpt"] for d in plane.dead_letters()] == [f"garbage {i}" for i in (4, 3, 2)]


def test_a_key_revoked_elsewhere_verifies_nothing_from_the_next_message_on(database_url, db):
    """The reconciler asks the database for the active key of every message: a revocation made
    by another process (here another control plane on the same database) applies at once, even
    to a reconciler that has just verified messages with that key."""
    reconciler = ControlPlane(load_settings(database_url=database_url), db)
    operator = ControlPlane(load_settings(database_url=database_url))
    try:
        operator.register_key("w1", KEYS["w1"])
        first = reconciler.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=1), W1_KEY))
        assert first.outcome == "registered"
        operator.revoke_key("w1")
        after = reconciler.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=2), W1_KEY))
        assert isinstance(after, Rejected)
        assert "no active key" in after.reason
    finally:
        operator.close()


def test_a_replaced_key_verifies_nothing_from_the_next_message_on(database_url, db):
    reconciler = ControlPlane(load_settings(database_url=database_url), db)
    reconciler.register_key("w1", KEYS["w1"])
    assert reconciler.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=1), W1_KEY))
    reconciler.register_key("w1", KEYS["w2"], replace=True)  # w2's key is now w1's
    old = reconciler.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=2), W1_KEY))
    assert isinstance(old, Rejected)
    assert old.reason == "wrong signature for worker 'w1'"
    new = reconciler.receive(encode(Heartbeat(worker="w1", incarnation=1, seq=3), W2_KEY))
    assert not isinstance(new, Rejected)
