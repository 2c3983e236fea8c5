"""The rules as pure decisions (`gcworker.rules`), without a database: properties of diff_report
(rules 1, 3, 8, 9), and the judgements of rules 2, 4, 5, 6 and 7."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from gcworker.rules import (
    HeartbeatOutcome,
    ReportOutcome,
    StoredRow,
    WorkerView,
    deletion_cutoff,
    diff_report,
    judge_heartbeat,
    judge_report,
    report_digest,
    report_is_unchanged,
    report_may_mark,
)

HANDLES = st.sampled_from([f"h{i}" for i in range(12)])
STATES = st.sampled_from(["creating", "created", "destroying", "failed"])


@st.composite
def stored_rows(draw) -> list[StoredRow]:
    handles = draw(st.lists(HANDLES, unique=True, max_size=10))
    rows = []
    for id_, handle in enumerate(handles):
        state = draw(STATES)
        missing = state == "created" and draw(st.booleans())  # marks live on created rows only
        rows.append(StoredRow(id_, handle, state, missing))
    return rows


REPORTED = st.sets(HANDLES, max_size=12)


@given(stored_rows(), REPORTED, st.booleans())
def test_rule1_mark_never_marks_a_creating_row(rows, reported, may_mark):
    diff = diff_report(rows, reported, may_mark=may_mark)
    by_id = {r.id: r for r in rows}
    assert all(by_id[i].state == "created" for i in diff.to_mark)


@given(stored_rows(), REPORTED, st.booleans())
def test_rule1_mark_never_marks_a_reported_handle_or_an_already_marked_row(
    rows, reported, may_mark
):
    diff = diff_report(rows, reported, may_mark=may_mark)
    by_id = {r.id: r for r in rows}
    assert all(by_id[i].handle not in reported and not by_id[i].missing for i in diff.to_mark)


@given(stored_rows(), REPORTED)
def test_rule1_mark_marks_exactly_the_unmarked_created_rows_the_report_lacks(rows, reported):
    diff = diff_report(rows, reported, may_mark=True)
    expected = {
        r.id for r in rows if r.state == "created" and not r.missing and r.handle not in reported
    }
    assert set(diff.to_mark) == expected


@given(stored_rows(), REPORTED)
def test_rule2_a_report_that_may_not_mark_marks_nothing(rows, reported):
    assert diff_report(rows, reported, may_mark=False).to_mark == []


@given(stored_rows(), REPORTED, st.booleans())
def test_rule3_clear_exactly_the_marked_rows_that_are_reported(rows, reported, may_mark):
    diff = diff_report(rows, reported, may_mark=may_mark)
    assert set(diff.to_clear) == {r.id for r in rows if r.missing and r.handle in reported}


@given(stored_rows(), REPORTED, st.booleans())
def test_rule8_unknown_handles_are_the_reported_minus_the_stored(rows, reported, may_mark):
    diff = diff_report(rows, reported, may_mark=may_mark)
    assert diff.unknown == sorted(reported - {r.handle for r in rows})


@given(stored_rows(), REPORTED, st.booleans())
def test_rule9_confirmed_destroyed_are_the_destroying_rows_not_reported(rows, reported, may_mark):
    diff = diff_report(rows, reported, may_mark=may_mark)
    assert set(diff.confirmed_destroyed) == {
        r.id for r in rows if r.state == "destroying" and r.handle not in reported
    }


@given(stored_rows(), REPORTED, st.booleans())
def test_rule3_a_report_that_matches_the_rows_changes_nothing(rows, extra_creating, may_mark):
    # "Matches": every created row reported, no marks, no destroying row already removed, no
    # unknown handle; creating and failed rows may or may not be listed.
    rows = [r for r in rows if not r.missing]
    reported = {r.handle for r in rows if r.state in ("created", "destroying")}
    reported |= {r.handle for r in rows if r.state in ("creating", "failed")} & extra_creating
    assert not diff_report(rows, reported, may_mark=may_mark).changes_anything


@given(stored_rows(), REPORTED, st.booleans())
def test_rules_1_3_9_each_row_is_touched_by_one_rule_at_most(rows, reported, may_mark):
    diff = diff_report(rows, reported, may_mark=may_mark)
    touched = diff.to_mark + diff.to_clear + diff.confirmed_destroyed
    assert len(touched) == len(set(touched))


def worker(**fields) -> WorkerView:
    base = dict(
        name="w1",
        state="running",
        ephemeral=False,
        incarnation=3,
        last_heartbeat_seq=10,
        last_report_seq=11,
        running_since_seq=10,
    )
    return WorkerView(**(base | fields))


@given(st.integers(min_value=0, max_value=40))
def test_rule6_only_a_higher_sequence_of_the_current_incarnation_is_accepted(seq):
    outcome, _ = judge_report(worker(), 3, seq)
    assert (outcome is ReportOutcome.ACCEPTED) == (seq > 11)
    if seq <= 11:
        assert outcome is ReportOutcome.STALE


def test_rule7_an_older_incarnation_is_rejected_and_a_newer_one_waits_for_its_heartbeat():
    assert judge_report(worker(), 2, 99)[0] is ReportOutcome.REJECTED
    assert judge_report(worker(), 4, 1)[0] is ReportOutcome.WORKER_NOT_RUNNING
    assert judge_heartbeat(worker(), 2, 99).outcome is HeartbeatOutcome.REJECTED


def test_rule7_a_new_incarnation_drops_rows_only_of_an_ephemeral_worker():
    durable = judge_heartbeat(worker(), 4, 1)
    ephemeral = judge_heartbeat(worker(ephemeral=True), 4, 1)
    assert durable.outcome is ephemeral.outcome is HeartbeatOutcome.NEW_INCARNATION
    assert (durable.drops_rows, ephemeral.drops_rows) == (False, True)
    assert durable.starts_running_period and ephemeral.starts_running_period


@given(st.sampled_from(["running", "stalled", "landing", "landed", "retiring"]), st.integers(0, 30))
def test_rule2_only_a_running_workers_report_from_its_running_period_may_mark(state, seq):
    may = report_may_mark(worker(state=state, running_since_seq=10), seq)
    assert may == (state == "running" and seq > 10)


def test_rule2_no_running_period_no_marks():
    assert not report_may_mark(worker(running_since_seq=None), 99)


def test_rule5_a_stalled_worker_coming_back_clears_its_marks_and_starts_a_running_period():
    decision = judge_heartbeat(worker(state="stalled"), 3, 12)
    assert decision.outcome is HeartbeatOutcome.RESUMED
    assert decision.clears_marks and decision.starts_running_period
    assert decision.new_state == "running"
    assert judge_heartbeat(worker(state="stalled"), 3, 10).outcome is HeartbeatOutcome.STALE


NOW = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)
GRACE = timedelta(minutes=5)


def test_rule4_without_a_report_nothing_may_be_deleted():
    assert deletion_cutoff(NOW, None, GRACE) is None


@given(st.integers(0, 3600), st.integers(0, 3600))
def test_rule4_a_row_qualifies_only_when_missing_for_grace_and_a_later_report_confirms(
    marked_ago, report_ago
):
    missing_since = NOW - timedelta(seconds=marked_ago)
    last_report_at = NOW - timedelta(seconds=report_ago)
    cutoff = deletion_cutoff(NOW, last_report_at, GRACE)
    qualifies = missing_since <= cutoff
    assert qualifies == (NOW - missing_since >= GRACE and last_report_at >= missing_since + GRACE)


def test_rule3_the_fast_path_needs_the_same_handles_and_no_change_since():
    digest = report_digest(["c1"], ["v1"])
    assert report_is_unchanged(
        worker(generation=4, report_digest=digest, report_generation=4), digest
    )
    assert not report_is_unchanged(
        worker(generation=5, report_digest=digest, report_generation=4), digest
    )
    assert not report_is_unchanged(
        worker(generation=4, report_digest=digest, report_generation=4),
        report_digest(["c1", "c2"], ["v1"]),
    )
    assert report_digest(["c1"], ["v1"]) != report_digest([], ["c1", "v1"])
