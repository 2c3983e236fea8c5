"""`gcworker up`, as a real process: embedded (the collector every GC interval, in-process) and
with a broker (a reconciler and beat as child processes, all stopped together on SIGTERM)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request

import pytest

from gcworker.messages import Heartbeat
from tests.pipeline_support import GCWORKER, Pipeline, free_port, wait_for

pytestmark = pytest.mark.timeout(120)
COMPLETED = r'gcworker_collections_total\{outcome="completed"\} (\S+)'
REGISTERED = r'^gcworker_heartbeats_total\{outcome="registered"\} (\S+)$'


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_embedded_collects_every_interval_and_stops_on_sigterm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    env["GCWORKER_DATABASE_URL"] = f"sqlite:///{tmp_path / 'gcworker.db'}"
    subprocess.run([GCWORKER, "migrate"], env=env, check=True, capture_output=True)
    port = free_port()
    out = tmp_path / "up.log"
    with open(out, "wb") as log:
        up = subprocess.Popen(
            [GCWORKER, "--gc-interval", "0.2s", "up", "--metrics-port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: out.read_text().count("collection: ") >= 3,
            timeout=20,
            what="three collections",
            details=out.read_text,
        )
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        completed = re.search(COMPLETED.encode(), body)
        assert completed and float(completed.group(1)) >= 3
        os.kill(up.pid, signal.SIGTERM)
        assert up.wait(timeout=10) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert "gcworker up: stopped" in out.read_text()


@pytest.mark.backends("postgresql")
def test_up_with_a_broker_runs_reconciler_and_beat_and_stops_them_all(
    database_url, db, plane, tmp_path
):
    pipeline = Pipeline(database_url, tmp_path, gc_interval="1s")
    port = free_port()
    try:
        up = pipeline.start("up", "up", "up", "--metrics-port", str(port), "--concurrency", "1")
        children = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", up.log())]
        assert len(children) == 2, up.log()
        pipeline.send(Heartbeat(worker="w1", incarnation=1, seq=1))
        wait_for(
            lambda: plane.workers(),
            timeout=30,
            what="the heartbeat applied by up's reconciler",
            details=pipeline.logs,
        )
        metrics_url = f"http://127.0.0.1:{port}/metrics"

        def scraped():
            body = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
            collections = re.search(COMPLETED, body)
            heartbeats = re.search(REGISTERED, body, re.M)
            return (
                collections
                and float(collections.group(1)) >= 1
                and heartbeats
                and float(heartbeats.group(1)) == 1
            )

        wait_for(
            scraped,
            timeout=30,
            what="/metrics to show the heartbeat and a scheduled collection",
            details=pipeline.logs,
        )
        assert pipeline.stop(up, timeout=40) == 0, up.log()
        assert all(_gone(pid) for pid in children), up.log()
        assert "gcworker up: stopped" in up.log()
    finally:
        pipeline.close()
