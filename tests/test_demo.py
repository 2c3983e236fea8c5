"""`gcworker demo`: the whole command on a fresh directory, the verdict logic on crafted inputs,
and a deliberately wrong deletion caught during a real run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import delete, select

from gcworker.db.tables import containers
from gcworker.demo import (
    Demo,
    DemoConfig,
    DiskHistory,
    Row,
    Snapshot,
    Verdict,
    WorkerRow,
    WrongDeletion,
    audited_wrong_deletions,
    disagreements,
    unique_wrong_deletions,
    wrong_deletions,
)
from tests.conftest import created, states

BROKER_URL = os.environ.get("GCWORKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
C = "container"
V = "volume"


def snap(at, rows=None, disk=None, workers=None) -> Snapshot:
    return Snapshot(
        at=at,
        rows={key: Row(*value) for key, value in (rows or {}).items()},
        disk=dict(disk or {}),
        workers={
            name: WorkerRow(state, 1)
            for name, state in (workers or {"w1": "running", "w2": "running"}).items()
        },
    )


# The whole command ----------------------------------------------------------------------------


def test_demo_command_exits_0_with_the_verdict_on_a_fresh_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    done = subprocess.run(
        [sys.executable, "-m", "gcworker.cli", "demo", "--workers", "4", "--duration", "12"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"^verdict: database and workers agree \(", out, re.M), out
    assert re.search(r"^rows wrongly deleted: 0$", out, re.M), out
    assert "container worker-1:stuck (never created on worker-1): creating -> failed" in out
    assert "rows deleted while it was away: 0" in out
    # Its own temporary folder, removed at the end; nothing left in the working directory.
    folder = re.search(r" in (\S+gcworker-demo-\S+)$", out, re.M).group(1)
    assert not Path(folder).exists()
    assert list(tmp_path.iterdir()) == []


def test_demo_runs_through_redis_and_celery_processes_it_starts_and_stops(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    env["GCWORKER_BROKER_URL"] = BROKER_URL
    argv = [sys.executable, "-m", "gcworker.cli", "demo", "--workers", "4", "--duration", "12"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "through Redis and Celery" in out
    assert re.search(r"^verdict: database and workers agree \(", out, re.M), out
    assert re.search(r"^rows wrongly deleted: 0$", out, re.M), out
    # Its Celery processes are gone, and so are its keys.
    pids = [int(pid) for pid in re.findall(r"(?:reconciler|beat) pid (\d+)", out)]
    assert len(pids) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
    namespace = re.search(r"gcworker-demo-[0-9a-f]{8}", out)
    if namespace:
        import redis

        client = redis.Redis.from_url(BROKER_URL)
        assert list(client.scan_iter(match=f"*{namespace.group(0)}*")) == []


def test_demo_refuses_a_bad_option_with_a_usage_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gcworker.cli", "demo", "--workers", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--workers" in done.stderr


def test_the_demo_settings_pass_the_checks_of_rule_14(tmp_path):
    from gcworker.settings import load_settings

    settings = load_settings(**DemoConfig().settings_overrides(f"sqlite:///{tmp_path}/x.db"))
    assert settings.missing_grace_period >= 2 * settings.report_interval
    assert settings.heartbeat_ttl >= settings.heartbeat_interval
    assert settings.embedded


# Wrong deletions, from snapshots ----------------------------------------------------------------


def test_a_row_deleted_while_its_directory_exists_is_a_wrong_deletion():
    before = snap(1.0, rows={(C, "c1"): ("w1", "created")}, disk={(C, "c1"): "w1"})
    after = snap(1.2, rows={}, disk={(C, "c1"): "w1"})
    [wrong] = wrong_deletions(before, after)
    assert (wrong.kind, wrong.handle, wrong.worker) == (C, "c1", "w1")
    assert "1.0s and 1.2s" in wrong.how


def test_a_row_deleted_after_its_directory_went_is_not():
    gone_first = snap(1.0, rows={(V, "v1"): ("w1", "created", True)}, disk={})
    confirmed = snap(1.2, rows={}, disk={})
    assert wrong_deletions(gone_first, confirmed) == []
    # removed from disk and deleted between the same two snapshots: not provably wrong
    both = snap(1.0, rows={(C, "c1"): ("w1", "destroying")}, disk={(C, "c1"): "w1"})
    assert wrong_deletions(both, snap(1.2)) == []


def test_a_directory_on_another_worker_does_not_count():
    before = snap(1.0, rows={(C, "c1"): ("w1", "created")}, disk={(C, "c1"): "w2"})
    after = snap(1.2, rows={}, disk={(C, "c1"): "w2"})
    assert wrong_deletions(before, after) == []


def test_a_directory_made_after_the_first_snapshot_is_not_proof():
    before = snap(1.0, rows={(C, "c1"): ("w1", "creating")}, disk={})
    after = snap(1.2, rows={}, disk={(C, "c1"): "w1"})
    assert wrong_deletions(before, after) == []


# Wrong deletions, from the audit log ----------------------------------------------------------


def audit(kind, handle, at, action="delete", worker="w1"):
    return {
        "action": action,
        "kind": kind,
        "subject": handle,
        "at": datetime.fromtimestamp(at, UTC),
        "worker_name": worker,
        "actor": "collector",
        "reason": "missing for at least 1.5s, confirmed by a later report",
    }


def test_an_audited_deletion_while_the_directory_existed_is_caught():
    history = DiskHistory()
    history._made[(C, "c1")] = ("w1", 100.0)
    history._made[(C, "c2")] = ("w1", 100.0)
    history._removed[(C, "c2")] = 150.0
    history._made[(V, "v1")] = ("w1", 100.0)
    history._removed[(V, "v1")] = 150.0
    events = [
        audit(C, "c1", 160.0),  # still on disk: wrong
        audit(C, "c2", 160.0),  # removed at 150: right
        audit(V, "v1", 140.0),  # deleted before its directory went: wrong
        audit(C, "c9", 160.0),  # never made by the demo (e.g. a leftover): not counted
        audit(C, "c1", 160.0, action="fail"),  # not a deletion
        audit("worker", "w1", 160.0, worker="w1"),  # workers have no directory
    ]
    wrong = audited_wrong_deletions(events, history.holder_at)
    assert [(w.kind, w.handle) for w in wrong] == [(C, "c1"), (V, "v1")]
    assert "while its directory existed on w1" in wrong[0].how


def test_both_checks_catching_one_row_count_it_once():
    one = WrongDeletion(C, "c1", "w1", "a")
    assert unique_wrong_deletions([one, WrongDeletion(C, "c1", "w1", "b")]) == [one]


# Agreement ------------------------------------------------------------------------------------


def test_database_and_workers_agree_when_every_row_has_its_directory():
    shot = snap(
        5.0,
        rows={(C, "c1"): ("w1", "created"), (V, "v1"): ("w2", "created")},
        disk={(C, "c1"): "w1", (V, "v1"): "w2"},
    )
    assert disagreements(shot, ["w1", "w2"]) == []


def test_every_kind_of_difference_is_named():
    shot = snap(
        5.0,
        rows={
            (C, "no-dir"): ("w1", "created"),
            (C, "marked"): ("w1", "created", True),
            (C, "leaving"): ("w1", "destroying"),
            (V, "elsewhere"): ("w1", "created"),
        },
        disk={
            (C, "marked"): "w1",
            (C, "leaving"): "w1",
            (V, "elsewhere"): "w2",
            (V, "no-row"): "w2",
        },
        workers={"w1": "running", "w2": "stalled", "gone": "running"},
    )
    problems = disagreements(shot, ["w1", "w2", "w3"])
    assert problems == [
        "worker gone: still in the database (running), but it is gone",
        "worker w2: stalled in the database, but it is running",
        "worker w3: running, but not in the database",
        "container leaving: on w1, but destroying in the database",
        "container marked: on w1, but marked missing",
        "container no-dir: created on w1 in the database, no worker has it",
        "volume elsewhere: created on w1 in the database, it is on w2",
        "volume no-row: on w2, but not in the database",
    ]


def test_the_verdict_holds_only_with_agreement_and_no_wrong_deletion():
    good = Verdict([], [], containers=3, volumes=4, workers=2, settled_after=1.5)
    assert good.ok
    assert good.lines() == [
        "verdict: database and workers agree (3 containers, 4 volumes on 2 workers, "
        "settled 1.5s after the scheduler stopped)",
        "rows wrongly deleted: 0",
    ]
    wrong = Verdict([], [WrongDeletion(C, "c1", "w1", "deleted while on disk")])
    assert not wrong.ok
    assert wrong.lines()[1:] == [
        "rows wrongly deleted: 1",
        "  - container c1 of w1: deleted while on disk",
    ]
    differ = Verdict(["volume v1: on w2, but not in the database"], [])
    assert not differ.ok
    assert differ.lines()[0].startswith("verdict: database and workers DISAGREE")
    assert not Verdict([], [], errors=["reporter of w1: boom"]).ok


# A deliberately wrong deletion during a real run ---------------------------------------------


class SabotagedDemo(Demo):
    """Plays a buggy collector: deletes the row of a container that is on its worker's disk."""

    victim: str | None = None

    def _trouble(self, trouble):
        super()._trouble(trouble)
        if trouble.what != "restart" or self.victim is not None:
            return
        with self.disk_lock:  # the container stays on disk while its row goes
            on_disk = {h for kind, h in self.sim["worker-1"].runtime.listing() if kind == C}
            with self.plane.db.transaction() as conn:
                handles = conn.execute(
                    select(containers.c.handle).where(
                        containers.c.worker_name == "worker-1", containers.c.state == "created"
                    )
                ).scalars()
                self.victim = sorted(set(handles) & on_disk)[0]
                conn.execute(delete(containers).where(containers.c.handle == self.victim))


def test_the_demo_catches_a_row_deleted_while_its_container_exists(tmp_path):
    demo = SabotagedDemo(DemoConfig(workers=4, duration=8, seed=7), root=tmp_path)
    verdict = demo.run()
    assert demo.victim is not None
    assert not verdict.ok
    assert ("container", demo.victim) in {(w.kind, w.handle) for w in verdict.wrongly_deleted}
    assert "rows wrongly deleted: 1" in verdict.lines()
    # The leftover directory was recorded as unknown, destroyed and removed: they agree again.
    assert verdict.disagreements == []


# A bug the demo found ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["container", "volume"])
def test_destroying_a_row_marked_missing_drops_the_mark(plane, make_worker, kind):
    """A mark belongs to `created` rows only; moving a marked row to destroying used to break
    the `ck_*_missing_only_created` check."""
    w = make_worker()
    created(plane, "w1", "x", kind=kind)
    w.report()  # x is missing
    assert states(plane, kind)["x"] == ("created", True)
    getattr(plane.scheduler, f"destroy_{kind}")("x")
    assert states(plane, kind)["x"] == ("destroying", False)
