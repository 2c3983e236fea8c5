"""The destroying hand-off (`gcworker.handoff`): a report that changed nothing only moves the
stored snapshot's version forward (no handle read), a change is always published in full, and an
older snapshot or version never replaces a newer one."""

from __future__ import annotations

import pytest

from gcworker.handoff import (
    FULL_NEEDED,
    NEWER_STORED,
    REFRESHED,
    Head,
    KeyAndHead,
    KeyReader,
    Snapshot,
    publish_snapshot,
    read_head,
)
from tests.conftest import created, recorded_statements

SEQ = 1  # the worker's message a hand-off answers


def snapshot(worker, version, handles, generation) -> Snapshot:
    return Snapshot(Head(worker, version, generation, 1), handles)


@pytest.fixture
def inventory_reads(db):
    """The statements run on the database that read containers or volumes."""

    def reads_inventory(statement: str) -> bool:
        lowered = statement.lower()
        return "from containers" in lowered or "from volumes" in lowered

    with recorded_statements(db, reads_inventory) as seen:
        yield seen


def destroying(plane, worker, handle):
    created(plane, worker, handle)
    plane.scheduler.destroy_container(handle)


def test_a_report_that_changed_nothing_moves_the_version_without_reading_handles(
    plane, db, make_worker, board, advance, inventory_reads
):
    worker = make_worker("w1")
    destroying(plane, "w1", "c-gone")
    worker.report(["c-gone"])
    first = publish_snapshot(db, board, "w1", SEQ)
    assert isinstance(first, Snapshot)  # nothing stored yet: read in full
    assert board.feedback("w1").destroying == {"container": ["c-gone"], "volume": []}

    advance(seconds=5)
    assert worker.report(["c-gone"]).fast_path
    inventory_reads.clear()
    refreshed = publish_snapshot(db, board, "w1", SEQ)

    assert isinstance(refreshed, Head)
    assert inventory_reads == []
    feedback = board.feedback("w1")
    assert feedback.destroying == {"container": ["c-gone"], "volume": []}
    assert refreshed.version == board.version("w1") > first.version


def test_the_version_keeps_advancing_with_the_control_planes_clock(
    plane, db, make_worker, board, advance
):
    worker = make_worker("w1")
    worker.report([])
    publish_snapshot(db, board, "w1", SEQ)
    seen = [board.feedback("w1").as_of]
    for _ in range(3):
        advance(minutes=1)
        worker.report([])
        publish_snapshot(db, board, "w1", SEQ)
        seen.append(board.feedback("w1").as_of)
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)
    assert (seen[-1] - seen[0]).total_seconds() >= 180


def test_a_change_since_the_stored_snapshot_is_published_in_full(
    plane, db, make_worker, board, advance
):
    worker = make_worker("w1")
    created(plane, "w1", "c1")
    worker.report(["c1"])
    publish_snapshot(db, board, "w1", SEQ)
    assert board.feedback("w1").destroying["container"] == []

    plane.scheduler.destroy_container("c1")  # between reports: bumps the worker's generation
    advance(seconds=5)
    publish_snapshot(db, board, "w1", SEQ)
    assert board.feedback("w1").destroying["container"] == ["c1"]


def test_an_older_snapshot_never_replaces_a_newer_one(plane, db, make_worker, board):
    make_worker("w1")
    head = read_head(db, "w1")
    newer = snapshot("w1", head.version + 10, {"container": ["new"], "volume": []}, 7)
    older = snapshot("w1", head.version + 5, {"container": ["old"], "volume": []}, 6)
    assert board.publish(newer, SEQ) is True
    assert board.publish(older, SEQ) is False
    assert board.feedback("w1").destroying["container"] == ["new"]
    assert board.version("w1") == newer.version


def test_a_refresh_never_moves_a_newer_version_back_nor_extends_another_generation(
    plane, db, make_worker, board
):
    make_worker("w1")
    assert board.refresh(Head("w1", 100, 3, 1), SEQ) == FULL_NEEDED  # nothing stored
    board.publish(snapshot("w1", 200, {"container": ["a"], "volume": []}, 3), SEQ)

    assert board.refresh(Head("w1", 150, 3, 1), SEQ) == NEWER_STORED
    assert board.version("w1") == 200
    assert board.refresh(Head("w1", 300, 4, 1), SEQ) == FULL_NEEDED  # read at another generation
    assert board.version("w1") == 200
    assert board.refresh(Head("w1", 300, 3, 1), SEQ) == REFRESHED
    assert board.version("w1") == 300
    assert board.feedback("w1").destroying["container"] == ["a"]


def test_an_unknown_worker_gets_no_answer(db, board):
    assert publish_snapshot(db, board, "nobody", SEQ) is None
    feedback = board.feedback("nobody")
    assert (feedback.stamp, feedback.destroy_list) == (None, None)


@pytest.fixture
def statements(db):
    """Every statement run on the database."""
    with recorded_statements(db) as seen:
        yield seen


def test_the_key_lookup_reads_the_active_key_and_the_workers_head(plane, db, make_worker):
    make_worker("w1")
    plane.register_key("w1", "a2V5")
    lookup = KeyAndHead(db)
    assert lookup("w1") == "a2V5"
    if db.is_postgresql:
        assert lookup.head.generation == read_head(db, "w1").generation
        assert lookup.head.version <= read_head(db, "w1").version
    plane.revoke_key("w1")
    assert KeyAndHead(db)("w1") is None
    unknown = KeyAndHead(db)
    assert unknown("nobody") is None
    assert unknown.head is None


def test_a_head_read_with_the_key_refreshes_with_no_statement(
    plane, db, make_worker, board, advance, statements
):
    worker = make_worker("w1")
    destroying(plane, "w1", "c-gone")
    worker.report(["c-gone"])
    publish_snapshot(db, board, "w1", SEQ)
    before = board.version("w1")
    advance(seconds=5)
    head = Head("w1", before + 5_000_000, read_head(db, "w1").generation, 1)

    statements.clear()
    assert publish_snapshot(db, board, "w1", SEQ, head) == head
    assert statements == []
    assert board.version("w1") == head.version
    assert board.feedback("w1").destroying["container"] == ["c-gone"]


def test_a_head_of_another_generation_gets_a_full_snapshot(plane, db, make_worker, board, advance):
    worker = make_worker("w1")
    created(plane, "w1", "c1")
    worker.report(["c1"])
    publish_snapshot(db, board, "w1", SEQ)
    stored = read_head(db, "w1")
    plane.scheduler.destroy_container("c1")
    advance(seconds=5)
    head = read_head(db, "w1")  # as a report's key lookup would read it now
    assert head.generation != stored.generation

    published = publish_snapshot(db, board, "w1", SEQ, head)
    assert isinstance(published, Snapshot)
    assert board.feedback("w1").destroying["container"] == ["c1"]


def test_the_report_tasks_hand_off_refreshes_while_the_report_is_applied(
    plane, db, make_worker, board, advance, inventory_reads
):
    """`ReportHandoff`: the key read with the head, the refresh started once the message is
    authentic, nothing more after a fast-path report; a report that changed rows is published
    in full after its commit."""
    from gcworker.codec import encode
    from gcworker.handoff import ReportHandoff
    from gcworker.messages import Report
    from gcworker.signing import generate_private_key, public_key_text

    key = generate_private_key()
    plane.register_key("w1", public_key_text(key))
    worker = make_worker("w1")
    destroying(plane, "w1", "c-gone")

    def send(containers):
        handoff = ReportHandoff(db, board)
        message = Report(
            worker="w1", incarnation=1, seq=worker.next_seq(), containers=containers, volumes=[]
        )
        result = plane.receive(encode(message, key), handoff)
        return result, handoff.finish(result)

    result, published = send(["c-gone"])
    assert isinstance(published, Snapshot)  # nothing stored before
    advance(seconds=5)
    inventory_reads.clear()
    result, published = send(["c-gone"])
    if db.is_postgresql:  # the head is read with the key on PostgreSQL only
        assert result.fast_path and isinstance(published, Head)
        assert inventory_reads == []
    assert board.version("w1") > 0
    assert board.feedback("w1").destroying["container"] == ["c-gone"]

    advance(seconds=5)
    result, published = send(["c-gone", "c-unknown"])  # rule 8: a new destroying row
    assert not result.fast_path
    assert isinstance(published, Snapshot)
    assert sorted(board.feedback("w1").destroying["container"]) == ["c-gone", "c-unknown"]


def test_the_key_is_read_ahead_only_for_the_worker_a_signed_message_names(plane, db, make_worker):
    from gcworker.codec import decode, encode
    from gcworker.messages import Heartbeat
    from gcworker.signing import generate_private_key, public_key_text

    key = generate_private_key()
    plane.register_key("w1", public_key_text(key))
    claims: list[str] = []
    message = Heartbeat(worker="w1", incarnation=1, seq=1)
    lookup = KeyAndHead(db)

    def claimed(worker):
        claims.append(worker)
        lookup.prefetch(worker)

    assert decode(encode(message, key), lookup, claimed=claimed) == message
    assert claims == ["w1"]
    decode(encode(message, None), lookup, allow_unsigned=True, claimed=claims.append)
    assert claims == ["w1"]  # an unsigned message has no key to read

    lookup.prefetch("w2")  # read ahead for another name: never used for w1
    assert lookup("w1") == public_key_text(key)
    plane.revoke_key("w1")
    lookup.prefetch("w1")  # read after the revocation committed: nothing verifies
    assert lookup("w1") is None


@pytest.fixture
def reader(db):
    reader = KeyReader(db)
    yield reader
    reader.close()


@pytest.mark.backends("postgresql")
def test_the_key_reader_reads_ahead_without_the_engines(plane, db, make_worker, reader, statements):
    make_worker("w1")
    plane.register_key("w1", "a2V5")
    generation = read_head(db, "w1").generation
    statements.clear()
    lookup = KeyAndHead(db, reader)
    lookup.prefetch("w1")
    assert lookup("w1") == "a2V5"
    assert lookup.head.generation == generation
    assert statements == []  # the asynchronous connection, not the pooled ones


@pytest.mark.backends("postgresql")
def test_an_answer_nobody_read_is_dropped_by_the_next_message(plane, db, make_worker, reader):
    make_worker("w1")
    make_worker("w2")
    plane.register_key("w1", "a2V5MQ==")
    plane.register_key("w2", "a2V5Mg==")
    KeyAndHead(db, reader).prefetch("w1")  # its message is then rejected: never asked for
    lookup = KeyAndHead(db, reader)
    lookup.prefetch("w2")
    assert lookup("w2") == "a2V5Mg=="
    assert lookup.head.worker == "w2"


@pytest.mark.backends("postgresql")
def test_the_key_reader_sees_a_revocation_committed_before_the_message(plane, db, reader):
    plane.register_key("w1", "a2V5")
    lookup = KeyAndHead(db, reader)
    lookup.prefetch("w1")
    assert lookup("w1") == "a2V5"
    plane.revoke_key("w1")
    lookup = KeyAndHead(db, reader)
    lookup.prefetch("w1")
    assert lookup("w1") is None


@pytest.mark.backends("postgresql")
def test_a_broken_key_reader_falls_back_and_reopens(plane, db, reader):
    plane.register_key("w1", "a2V5")
    lookup = KeyAndHead(db, reader)
    lookup.prefetch("w1")
    reader._conn.close()  # the connection dies with an answer pending
    assert lookup("w1") == "a2V5"  # read the ordinary way
    lookup = KeyAndHead(db, reader)
    lookup.prefetch("w1")  # a new connection
    assert lookup("w1") == "a2V5"
    assert reader._conn is not None and not reader._conn.closed
