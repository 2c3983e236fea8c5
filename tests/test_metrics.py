"""Metrics an operator can alert on: every known label value present at 0 from the start (so
that `rate()` works before the first event), heartbeats by outcome, the last collection's time,
the build, the backlog by kind and state; the reporter exports reporter series only."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from importlib.metadata import version

import pytest
from prometheus_client import generate_latest

from gcworker import metrics, pipeline
from gcworker.broker import publish
from gcworker.messages import Heartbeat
from gcworker.runtimes.dir import DirRuntime
from tasks.config import make_app
from tasks.routing import COLLECT_TASK
from tests.conftest import FakeWorker, created
from tests.pipeline_support import GCWORKER, Pipeline, free_port, wait_for


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in an exposition text, or None when it is absent."""
    shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
    series = re.escape(f"{name}{{{shown}}}" if labels else name)
    found = re.search(rf"^{series} (\S+)$", text, re.M)
    return None if found is None else float(found.group(1))


def control_plane_text() -> str:
    return generate_latest(metrics.registry()).decode()


def test_every_known_label_value_of_the_control_plane_is_exported_from_the_start():
    text = control_plane_text()

    for outcome in metrics.HEARTBEAT_OUTCOMES:
        assert sample(text, "gcworker_heartbeats_total", outcome=outcome) is not None, outcome
    for outcome in metrics.REPORT_OUTCOMES:
        assert sample(text, "gcworker_reports_total", outcome=outcome) is not None, outcome
    for task in ("heartbeat", "report", "collect"):
        assert sample(text, "gcworker_messages_rejected_total", task=task) is not None
    assert sample(text, "gcworker_build_info", version=version("gcworker")) == 1
    assert sample(text, "gcworker_last_collection_timestamp_seconds") is not None
    for kind in metrics.KINDS:
        for state in metrics.BACKLOG_STATES:
            assert sample(text, "gcworker_backlog_rows", kind=kind, state=state) is not None
    assert "gcworker_reporter_" not in text  # the control plane exports no reporter series


def test_heartbeats_are_counted_by_outcome(plane):
    def count(outcome: str) -> float:
        return sample(control_plane_text(), "gcworker_heartbeats_total", outcome=outcome)

    worker = FakeWorker(plane, "w1")
    before = {o: count(o) for o in ("registered", "extended", "stale")}

    pipeline.apply(plane, worker.heartbeat_message(seq=5))
    pipeline.apply(plane, worker.heartbeat_message(seq=6))
    pipeline.apply(plane, worker.heartbeat_message(seq=6))

    after = {o: count(o) for o in before}
    assert {o: after[o] - before[o] for o in before} == {
        "registered": 1,
        "extended": 1,
        "stale": 1,
    }


def test_a_collection_sets_its_time_and_the_backlog_by_kind_and_state(plane, make_worker, db):
    make_worker("w1")
    plane.scheduler.create_container("w1", "c-creating")
    created(plane, "w1", "c-destroying", "c-created")
    plane.scheduler.destroy_container("c-destroying")
    plane.scheduler.create_volume("w1", "v-failed")
    plane.scheduler.fail_volume("v-failed")  # the collection moves it on to destroying
    before = time.time()

    pipeline.run_collection(plane)

    text = control_plane_text()
    assert sample(text, "gcworker_last_collection_timestamp_seconds") >= before - 1
    backlog = {
        (kind, state): sample(text, "gcworker_backlog_rows", kind=kind, state=state)
        for kind in metrics.KINDS
        for state in metrics.BACKLOG_STATES
    }
    assert backlog == {
        ("container", "creating"): 1,
        ("container", "failed"): 0,
        ("container", "destroying"): 1,
        ("volume", "creating"): 0,
        ("volume", "failed"): 0,
        ("volume", "destroying"): 1,
    }
    oldest = sample(text, "gcworker_backlog_oldest_seconds", kind="container", state="creating")
    assert oldest is not None and oldest >= 0
    assert sample(text, "gcworker_backlog_oldest_seconds", kind="volume", state="creating") == 0


def test_the_reporter_exports_its_own_series_only_each_present_from_the_start(tmp_path):
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GCWORKER_", "PROMETHEUS_"))}
    # A broker that does not answer: nothing is sent, every send fails, the reporter goes on.
    env.update(
        GCWORKER_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0",
        GCWORKER_ALLOW_UNSIGNED="true",
        GCWORKER_HEARTBEAT_INTERVAL="30s",
    )
    reporter = subprocess.Popen(
        [GCWORKER, "reporter", "--worker", "w1", "--runtime", f"dir:{runtime.root}"]
        + ["--metrics-port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def scraped() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return r.read().decode()
            except OSError:
                assert reporter.poll() is None, "the reporter exited"
                return None

        text = wait_for(scraped, timeout=30, what="the reporter's /metrics")
    finally:
        os.kill(reporter.pid, signal.SIGTERM)
        try:
            reporter.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(reporter.pid, signal.SIGKILL)
            reporter.wait()

    names = set(re.findall(r"^(gcworker_\w+?)(?:\{| )", text, re.M))
    assert names and all(n.startswith("gcworker_reporter_") for n in names), names
    for kind in ("heartbeat", "report", "unchanged"):
        assert sample(text, "gcworker_reporter_send_failures_total", type=kind) is not None
        assert sample(text, "gcworker_reporter_messages_sent_total", type=kind) is not None
    for kind in metrics.KINDS:
        assert sample(text, "gcworker_reporter_handles_removed_total", kind=kind) is not None
    assert sample(text, "gcworker_reporter_listing_failures_total") is not None
    assert "process_cpu_seconds_total" in text


@pytest.mark.backends("postgresql")
def test_a_reporter_sends_no_task_sent_events(database_url, tmp_path):
    """Flower turns each task-sent event into a label value of its sender's host and process:
    one per reporter process. Beat's sends (one task per GC interval) still say so."""
    pipeline = Pipeline(database_url, tmp_path)
    events = pipeline.redis.pubsub()
    events.psubscribe(f"{pipeline.namespace}:*celeryev/task.sent")  # this test's alone
    wait_for(lambda: events.get_message(timeout=1), timeout=10, what="the subscription")
    try:
        pipeline.channel.send(Heartbeat(worker="w1", incarnation=1, seq=1))  # a reporter's send
        beat = make_app(pipeline.settings)  # as beat sends: with task-sent events
        publish(beat, COLLECT_TASK, "collect", None, "control")
        beat.close()
        seen = wait_for(
            lambda: events.get_message(timeout=1), timeout=10, what="beat's task-sent event"
        )
    finally:
        events.close()
        pipeline.close()

    event = json.loads(json.loads(seen["data"])["body"])
    assert (event["type"], event["args"]) == ("task-sent", "control"), "the reporter's came first"
