"""`/healthz` (alive) and `/readyz` (what the process needs answers) on the metrics port of the
reconciler, `up` and the reporter. Servers are stopped only when they are this test's own
(`tests.fault_support`), never the shared ones."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from gcworker import metrics
from gcworker.db.database import Database
from gcworker.db.migrate import upgrade
from gcworker.health import control_plane_checks
from gcworker.runtimes.dir import MARKER, DirRuntime
from gcworker.settings import load_settings
from tests.fault_support import PrivateRedis
from tests.pipeline_support import Pipeline, free_port, wait_for

pytestmark = pytest.mark.timeout(180)


def probe(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=15) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def answering(port: int, path: str):
    """A probe's answer, or None while nothing listens on the port yet."""
    try:
        return probe(port, path)
    except urllib.error.URLError:
        return None


def wait_ready(port: int, ready: bool, details=None) -> dict:
    """Wait for /readyz to say `ready`; returns its checks."""
    found = wait_for(
        lambda: (answer := answering(port, "/readyz")) and (answer[0] == 200) == ready and answer,
        timeout=60,
        what=f"/readyz to say ready={ready}",
        details=details,
    )
    status, body = found
    assert body["ready"] is ready and status == (200 if ready else 503)
    return body["checks"]


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_reconciler_ready_goes_false_when_postgresql_or_redis_stops_and_back(
    private_postgres, private_redis, tmp_path
):
    upgrade(Database.from_url(private_postgres.url).engine)
    pipeline = Pipeline(private_postgres.url, tmp_path, broker_url=private_redis.url)
    port = free_port()
    try:
        reconciler = pipeline.start(
            "reconciler",
            "reconciler",
            "reconciler",
            "--concurrency",
            "1",
            "--metrics-port",
            str(port),
        )
        checks = wait_ready(port, True, reconciler.log)
        assert checks == {"database": "ok", "schema": "ok", "broker": "ok"}

        private_postgres.stop()
        checks = wait_ready(port, False, reconciler.log)
        assert checks["database"] != "ok" and checks["broker"] == "ok"
        assert probe(port, "/healthz") == (200, {"alive": True})  # alive all the same

        private_postgres.start()
        wait_ready(port, True, reconciler.log)

        private_redis.stop()
        checks = wait_ready(port, False, reconciler.log)
        assert checks["broker"] != "ok" and checks["database"] == "ok"
        assert probe(port, "/healthz")[0] == 200
        private_redis.start()
        wait_ready(port, True, reconciler.log)
    finally:
        pipeline.close()


def test_a_database_behind_the_newest_schema_is_not_ready(tmp_path):
    settings = load_settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}")
    port = free_port()
    server = metrics.serve(port, "127.0.0.1", checks=control_plane_checks(settings))
    try:
        checks = wait_ready(port, False)
    finally:
        server.shutdown()
        server.server_close()

    assert checks["database"] == "ok"
    assert "has no gcworker schema" in checks["schema"] and "gcworker migrate" in checks["schema"]


def test_reporter_ready_follows_its_runtime_listing_and_its_broker(private_redis, tmp_path):
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    pipeline = Pipeline("sqlite://", tmp_path, broker_url=private_redis.url, report_interval="0.2s")
    port = free_port()
    try:
        reporter = pipeline.start_reporter(
            "w1", runtime.root, "--metrics-port", str(port), wait=False
        )
        assert wait_ready(port, True, reporter.log) == {"runtime": "ok", "broker": "ok"}

        (runtime.root / "containers" / MARKER).unlink()  # an unmounted disk: listing fails
        checks = wait_ready(port, False, reporter.log)
        assert "last listing failed" in checks["runtime"] and checks["broker"] == "ok"

        DirRuntime(str(runtime.root)).declare_empty()
        wait_ready(port, True, reporter.log)
        private_redis.stop()
        checks = wait_ready(port, False, reporter.log)
        assert checks["broker"] != "ok"
        private_redis.start()
        wait_ready(port, True, reporter.log)
    finally:
        pipeline.close()
