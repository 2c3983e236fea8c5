"""Issue 9, findings 1, 2 and 4: what a worker may believe, and what a late report may prove.

- Rule 4: a report confirms an absence only when it carries a control-plane date from before
  it was built; a real reporter's reports that waited in the broker, undated, delete nothing.
- Rule 15: the reporter removes only what a current answer signed by the control plane names,
  only valid handles, only what its runtime holds; anyone who can write to Redis can write the
  answers' keys, and that must move nothing.
- Fail closed: a listing that cannot be trusted sends no report; a stray entry never stops one.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from gcworker.answers import DestroyList, Stamp, seal
from gcworker.broker import BrokerChannel
from gcworker.control_plane import ControlPlane
from gcworker.handoff import DestroyingBoard, Head, Snapshot
from gcworker.reporter import Reporter
from gcworker.runtimes import RuntimeError_
from gcworker.runtimes.dir import DirRuntime
from gcworker.signing import generate_private_key, public_key_text, sign, write_private_key
from tests.conftest import created, states
from tests.pipeline_support import GCWORKER, Pipeline, wait_for

INCARNATION = 7


# Rule 4: late reports from a real reporter ---------------------------------------------------


@pytest.mark.backends("postgresql")
def test_rule4_late_undated_reports_of_a_real_reporter_never_delete_a_live_container(
    database_url, db, tmp_path, advance
):
    """The reproduction of finding 1: a reporter with no date yet (no reconciler answered it),
    its messages held in Redis; c10 is created after they were built; the first marks it, the
    second arrives past the grace period. c10 must survive the collection."""
    pipe = Pipeline(database_url, tmp_path, report_interval="0.5s", heartbeat_interval="0.5s")
    plane = ControlPlane(pipe.settings, db)
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    try:
        reporter = pipe.start_reporter("w1", runtime.root)  # no reconciler runs
        wait_for(
            lambda: pipe.queue_length("reports") >= 2 and pipe.queue_length("heartbeats") >= 2,
            timeout=30,
            what="two reports and two heartbeats waiting in Redis",
            details=pipe.logs,
        )
        pipe.stop(reporter)
        heartbeats, reports = pipe.take_queued("heartbeats"), pipe.take_queued("reports")

        plane.receive(heartbeats[0])  # the broker delivers the first heartbeat: w1 registered
        plane.scheduler.create_container("w1", "c10")
        runtime.create("container", "c10")  # the worker makes c10, after the reports were built
        plane.scheduler.container_created("c10")
        plane.receive(reports[0])  # built before c10: marks it
        assert states(plane) == {"c10": ("created", True)}
        advance(minutes=6)
        plane.receive(heartbeats[-1])
        plane.receive(reports[1])  # arrives past the grace period, still built before c10
        plane.collect()
    finally:
        pipe.close()

    assert states(plane) == {"c10": ("created", True)}
    assert (runtime.root / "containers" / "c10").is_dir()


@pytest.mark.backends("postgresql")
def test_rule4_the_answer_to_a_first_heartbeat_dates_the_first_report(database_url, db, tmp_path):
    pipe = Pipeline(database_url, tmp_path)
    plane = ControlPlane(pipe.settings, db)
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    channel = BrokerChannel(pipe.settings)
    reporter = Reporter("w1", runtime, channel, heartbeat_interval=30, report_interval=30)
    stamp_key = f"{pipe.namespace}:destroying:{{w1}}:stamp"
    try:
        pipe.start_reconciler("r1")
        reporter.heartbeat()
        wait_for(lambda: pipe.redis.exists(stamp_key), timeout=30, what="the heartbeat's answer")
        assert reporter.report()

        def applied():
            row = next((w for w in plane.workers() if w["name"] == "w1"), None)
            return row if row and row["last_report_seq"] == reporter._last_seq else None

        row = wait_for(applied, timeout=30, what="the first report applied", details=pipe.logs)
    finally:
        channel.close()
        pipe.close()
    assert row["last_report_at"] is not None  # moved only by a dated report (rule 4)
    assert row["last_report_at"] <= plane.now()


# Rule 15: answers written into Redis by anyone ------------------------------------------------


class WorkerHost:
    """A reporter of worker w3 on a broker channel (real Redis; no reconciler), with a runtime
    holding c1, and a victim directory outside the runtime."""

    def __init__(self, tmp_path, **reporter_options):
        self.pipe = Pipeline(
            f"sqlite:///{tmp_path / 'unused.db'}", tmp_path, allow_unsigned="false"
        )
        self.runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
        self.runtime.create("container", "c1")
        self.victim = tmp_path / "victim"
        self.victim.mkdir()
        self.channel = BrokerChannel(self.pipe.settings)
        self.reporter = Reporter(
            "w3",
            self.runtime,
            self.channel,
            heartbeat_interval=30,
            report_interval=30,
            incarnation=INCARNATION,
            **reporter_options,
        )
        self.genuine = DestroyingBoard(
            self.pipe.redis, self.pipe.namespace, signing_key=self.pipe.control_plane_key
        )

    def held(self) -> list[str]:
        return self.runtime.inventory().containers

    def last_report(self) -> dict:
        envelope = self.pipe.take_queued("reports")[-1]
        return json.loads(envelope["payload"])

    def close(self) -> None:
        self.channel.close()
        self.pipe.close()


@pytest.fixture
def host(tmp_path):
    worker_host = WorkerHost(tmp_path)
    yield worker_host
    worker_host.close()


def answer(board: DestroyingBoard, seq: int, *handles: str, incarnation=INCARNATION, version=0):
    """Publish a snapshot naming `handles`, with its stamp answering message `seq`."""
    head = Head("w3", version or int(time.time() * 1e6), 5, incarnation)
    board.publish(Snapshot(head, {"container": list(handles), "volume": []}), seq)


def test_rule15_unsigned_answers_written_into_redis_remove_nothing(host):
    host.reporter.heartbeat()
    seq = host.reporter._last_seq
    forger = DestroyingBoard(host.pipe.redis, host.pipe.namespace)  # no key: unsigned
    answer(forger, seq, "c1")
    # The sets the hand-off used before answers were signed, and a version in the year 2286.
    base = f"{host.pipe.namespace}:destroying:{{w3}}"
    host.pipe.redis.sadd(f"{base}:container", "../../victim", str(host.victim))
    host.pipe.redis.set(f"{base}:version", 9999999999999999)

    assert host.reporter.report()

    assert host.held() == ["c1"] and host.victim.is_dir()
    assert "after" not in host.last_report()  # undated: nothing it sent vouches for a date


def test_rule15_answers_signed_with_another_key_remove_nothing(host):
    host.reporter.heartbeat()
    forger = DestroyingBoard(
        host.pipe.redis, host.pipe.namespace, signing_key=generate_private_key()
    )
    answer(forger, host.reporter._last_seq, "c1")

    assert host.reporter.report()

    assert host.held() == ["c1"]
    assert "after" not in host.last_report()


def test_rule15_a_genuine_current_answer_removes_the_handle_and_dates_the_reports(host):
    host.reporter.heartbeat()
    answer(host.genuine, host.reporter._last_seq, "c1", "c-not-held")
    assert host.reporter.report()  # the answer predates every listing: nothing removed yet
    assert host.held() == ["c1"]
    assert host.last_report()["after"]  # dated from the stamp, read before the listing

    answer(host.genuine, host.reporter._last_seq, "c1", "c-not-held")  # answers that report
    assert host.reporter.report()

    assert host.held() == []


def test_rule15_a_signed_list_naming_paths_is_refused_whole(host):
    host.reporter.heartbeat()
    key, now = host.pipe.control_plane_key, int(time.time() * 1e6)
    stamp = Stamp(
        worker="w3", incarnation=INCARNATION, generation=5, as_of=now, seq=host.reporter._last_seq
    )
    # The control plane never lists such names; even signed, the list is no valid answer.
    listed = DestroyList(worker="w3", incarnation=INCARNATION, generation=5, as_of=now)
    payload = json.dumps(
        {**listed.model_dump(), "containers": ["c1", "../../victim", str(host.victim)]}
    )
    forged = {"payload": payload, "signature": sign(key, payload.encode())}
    base = f"{host.pipe.namespace}:destroying:{{w3}}"
    host.pipe.redis.set(f"{base}:list", json.dumps(forged))
    host.pipe.redis.set(f"{base}:stamp", seal(stamp, key))

    host.reporter.report()

    assert host.held() == ["c1"] and host.victim.is_dir()


@pytest.mark.parametrize(
    "case", ["other_incarnation", "future_message", "other_worker", "other_generation"]
)
def test_rule15_a_genuine_answer_that_is_not_current_removes_nothing(host, case):
    host.reporter.heartbeat()
    seq = host.reporter._last_seq
    if case == "other_incarnation":  # replayed from the worker's previous life
        answer(host.genuine, seq, "c1", incarnation=INCARNATION - 1)
    elif case == "future_message":
        answer(host.genuine, seq + 10**12, "c1")
    elif case == "other_worker":  # another worker's genuine answer, copied under w3's keys
        other = DestroyingBoard(
            host.pipe.redis, "elsewhere", signing_key=host.pipe.control_plane_key
        )
        head = Head("w9", int(time.time() * 1e6), 5, INCARNATION)
        other.publish(Snapshot(head, {"container": ["c1"], "volume": []}), seq)
        for name in ("list", "stamp"):
            value = host.pipe.redis.get(f"elsewhere:destroying:{{w9}}:{name}")
            host.pipe.redis.set(f"{host.pipe.namespace}:destroying:{{w3}}:{name}", value)
        host.pipe.redis.delete(*host.pipe.redis.keys("elsewhere:*"))
    else:  # a current stamp, and a genuine list read at another generation (replayed)
        answer(host.genuine, seq, "c1")
        stamp = Head("w3", int(time.time() * 1e6) + 1000, 6, INCARNATION).stamp(seq)
        sealed = seal(stamp, host.pipe.control_plane_key)
        host.pipe.redis.set(f"{host.pipe.namespace}:destroying:{{w3}}:stamp", sealed)

    host.reporter.report()

    assert host.held() == ["c1"]


def test_rule15_a_replayed_genuine_answer_never_removes_a_new_container_of_a_reused_handle(host):
    """From the hostile review: anyone who can write to Redis keeps a genuine stamp and destroy
    list naming c1 while c1 is destroying, and writes them back after c1 was removed, its row
    deleted and a new c1 made (same worker, same incarnation, within answer_max_age)."""
    base = f"{host.pipe.namespace}:destroying:{{w3}}"
    host.reporter.heartbeat()
    host.reporter.report()
    answer(host.genuine, host.reporter._last_seq, "c1")  # genuine: c1 is destroying
    captured = {k: host.pipe.redis.get(f"{base}:{k}") for k in ("stamp", "list")}
    host.reporter.report()  # the answer covers a listing that held c1: removed
    assert host.held() == []

    answer(host.genuine, host.reporter._last_seq)  # genuine, newer: nothing to destroy
    host.reporter.report()
    host.runtime.create("container", "c1")  # c1's row deleted, a new c1 made: a reused handle
    host.reporter.report()
    for key, value in captured.items():  # the replay
        host.pipe.redis.set(f"{base}:{key}", value)
    host.reporter.report()
    host.reporter.report()

    assert host.held() == ["c1"]


def test_rule4_a_first_report_is_never_dated_after_its_listing(host):
    """From the hostile review: the answer to the first heartbeat lands while the runtime is
    being listed; the report built from that listing must not carry that answer's time."""
    listed_at: list[int] = []
    board = host.genuine

    class SlowListing(DirRuntime):
        def inventory(self):
            inventory = super().inventory()
            listed_at.append(int(time.time() * 1e6))
            answer(board, host.reporter._last_seq, version=listed_at[0] + 1)
            return inventory

    host.reporter.runtime = SlowListing(str(host.runtime.root))
    host.reporter.heartbeat()

    assert host.reporter.report()

    assert "after" not in host.last_report()


def test_rule15_a_replayed_stamp_of_a_message_sent_long_ago_is_stale(tmp_path):
    host = WorkerHost(tmp_path, answer_max_age=0.05)
    try:
        host.reporter.heartbeat()
        answer(host.genuine, host.reporter._last_seq, "c1")
        time.sleep(0.1)  # the message it answers is now older than answer_max_age

        host.reporter.report()

        assert host.held() == ["c1"]
        assert "after" not in host.last_report()
    finally:
        host.close()


def test_rule15_the_dir_runtime_refuses_names_that_leave_its_root(tmp_path):
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    victim = tmp_path / "victim"
    victim.mkdir()
    (runtime.root / "containers" / "link").symlink_to(victim)
    for name in ("../../victim", str(victim), "..", "link"):
        with pytest.raises(RuntimeError_):
            runtime.destroy("container", name)
    assert victim.is_dir()


# Fail closed on the worker side -----------------------------------------------------------------


def run_reporter(tmp_path, runtime: str, *extra: str, key_file=None, **env):
    import os
    import subprocess

    environment = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    environment["GCWORKER_DATABASE_URL"] = f"sqlite:///{tmp_path / 'gcworker.db'}"
    if key_file is not None:
        environment["GCWORKER_KEY_FILE"] = str(key_file)
    environment.update({f"GCWORKER_{k.upper()}": v for k, v in env.items()})
    return subprocess.run(
        [GCWORKER, "reporter", "--worker", "w1", "--runtime", runtime, "--once", *extra],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def embedded_plane(tmp_path):
    """The embedded control plane the reporter processes apply their messages to, and w1's key."""
    from gcworker.db.database import Database
    from gcworker.db.migrate import upgrade
    from gcworker.settings import load_settings

    settings = load_settings(database_url=f"sqlite:///{tmp_path / 'gcworker.db'}")
    db = Database.from_url(settings.database_url)
    upgrade(db.engine)
    plane = ControlPlane(settings, db)
    key = generate_private_key()
    write_private_key(key, tmp_path / "w1.key")
    plane.register_key("w1", public_key_text(key))
    yield plane
    db.dispose()


@pytest.mark.parametrize(
    "root", ["missing", "file", "empty mount point", "containers gone", "containers unmounted"]
)
def test_fail_closed_a_runtime_root_that_cannot_be_trusted_sends_no_report(
    tmp_path, embedded_plane, root
):
    path = tmp_path / "runtime"
    if root == "file":
        path.write_text("")
    elif root == "empty mount point":
        path.mkdir()
    elif root != "missing":
        DirRuntime(str(path)).create("volume", "v1")
        shutil.rmtree(path / "containers")
        if root == "containers unmounted":  # the mount point is there, empty: no marker
            (path / "containers").mkdir()
    embedded_plane.scheduler  # noqa: B018 - the plane exists: a report would reach it
    result = run_reporter(tmp_path, f"dir:{path}", key_file=tmp_path / "w1.key")

    assert result.returncode == 1
    assert "listing failed: no report sent" in result.stderr
    assert "no report sent (the listing failed" in result.stderr
    assert [w["last_report_seq"] for w in embedded_plane.workers()] == [None]


def test_fail_closed_an_entry_that_is_no_handle_is_skipped_and_the_report_goes_out(
    tmp_path, embedded_plane
):
    runtime = DirRuntime(str(tmp_path / "runtime"))
    runtime.create("container", "c1")
    (runtime.root / "containers" / "lost+found").mkdir()

    result = run_reporter(tmp_path, f"dir:{runtime.root}", key_file=tmp_path / "w1.key")

    assert result.returncode == 0, result.stderr
    assert "runtime entry is no valid handle: skipped" in result.stderr
    assert "Traceback" not in result.stderr
    assert states(embedded_plane) == {"c1": ("destroying", False)}  # reported, unknown: rule 8


def test_fail_closed_reporter_once_exits_non_zero_when_its_messages_are_rejected(
    tmp_path, embedded_plane
):
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()

    unsigned = run_reporter(tmp_path, f"dir:{runtime.root}", "--once-timeout", "1s")

    assert unsigned.returncode == 1
    assert "was not acknowledged" in unsigned.stderr
    assert embedded_plane.workers() == []
    assert [d["reason"] for d in embedded_plane.dead_letters()][0].startswith("unsigned message")


def test_fail_closed_a_failing_removal_is_logged_and_tried_again(plane, tmp_path):
    class FlakyRuntime(DirRuntime):
        failures = 1

        def destroy(self, kind, handle):
            if self.failures:
                self.failures -= 1
                raise RuntimeError_("device busy")
            super().destroy(kind, handle)

    from gcworker.delivery import InProcessChannel

    runtime = FlakyRuntime(str(tmp_path / "runtime"))
    runtime.create("container", "stray")  # unknown to the control plane: destroying (rule 8)
    key = generate_private_key()
    plane.register_key("w1", public_key_text(key))
    channel = InProcessChannel(plane, private_key=key)
    reporter = Reporter("w1", runtime, channel, heartbeat_interval=30, report_interval=30)
    reporter.heartbeat()

    assert reporter.report()  # the removal fails: logged, the reporter goes on
    assert runtime.inventory().containers == ["stray"]
    assert reporter.report()  # tried again
    assert runtime.inventory().containers == []


def test_fail_closed_a_containers_folder_gone_for_a_while_loses_nothing(plane, advance, tmp_path):
    """From the hostile review: `containers/` renamed away (or its disk not mounted) while
    `volumes/` is there: no report at all, so nothing is marked, deleted, or later removed."""
    from gcworker.delivery import InProcessChannel

    runtime = DirRuntime(str(tmp_path / "runtime"))
    runtime.create("volume", "v1")
    key = generate_private_key()
    plane.register_key("w1", public_key_text(key))
    reporter = Reporter(
        "w1",
        runtime,
        InProcessChannel(plane, private_key=key),
        heartbeat_interval=30,
        report_interval=30,
    )
    reporter.heartbeat()
    created(plane, "w1", "c1")
    created(plane, "w1", "v1", kind="volume")
    runtime.create("container", "c1")
    (runtime.root / "containers" / "c1" / "data").write_text("precious")
    reporter.report()
    assert states(plane) == {"c1": ("created", False)}

    folder = runtime.root / "containers"
    folder.rename(runtime.root / "elsewhere")
    folder.mkdir()  # what an unmounted disk's mount point looks like
    for _ in range(3):
        advance(minutes=6)
        reporter.heartbeat()
        assert not reporter.report()
    plane.collect()
    folder.rmdir()
    (runtime.root / "elsewhere").rename(folder)
    for _ in range(2):
        reporter.heartbeat()
        assert reporter.report()

    assert (folder / "c1" / "data").is_file()
    assert states(plane) == {"c1": ("created", False)}
