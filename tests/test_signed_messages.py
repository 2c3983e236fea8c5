"""Signed messages and hostile input: the envelope decoder, forged reports, dead letters."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcworker.codec import Rejected, decode, encode
from gcworker.control_plane import ControlPlane
from gcworker.messages import Heartbeat, Report
from gcworker.settings import load_settings
from gcworker.signing import generate_private_key, public_key_text
from tests.conftest import created, states

W1_KEY = generate_private_key()
W2_KEY = generate_private_key()
KEYS = {"w1": public_key_text(W1_KEY), "w2": public_key_text(W2_KEY)}


def report(worker="w1", seq=10, containers=("c1",), volumes=()):
    return Report(
        worker=worker, incarnation=1, seq=seq, containers=list(containers), volumes=list(volumes)
    )


def test_a_signed_message_decodes_to_itself():
    message = report()
    assert decode(encode(message, W1_KEY), KEYS.get) == message


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
        assert isinstance(message, Heartbeat | Report)


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
