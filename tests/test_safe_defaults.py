"""Safe defaults: Flower listens on 127.0.0.1 and demands credentials; secrets may come from
files (GCWORKER_<NAME>_FILE) and are never echoed; a private key readable by others is said."""

from __future__ import annotations

import base64
import logging
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gcworker.runtimes.dir import DirRuntime
from gcworker.settings import SettingsError, load_settings
from gcworker.signing import generate_private_key, load_private_key, write_private_key
from tests.pipeline_support import GCWORKER, Pipeline, free_port, wait_for

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def listening_addresses(port: int) -> set[str]:
    """The local IPv4 addresses a socket LISTENs on `port` (from /proc/net/tcp)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.backends("postgresql")
def test_flower_listens_on_loopback_and_refuses_requests_without_credentials(
    database_url, tmp_path
):
    pipeline = Pipeline(database_url, tmp_path)
    secret = tmp_path / "flower-auth"
    secret.write_text("admin:s3cret\n")
    port = free_port()
    env = pipeline.env()
    env["GCWORKER_FLOWER_BASIC_AUTH_FILE"] = str(secret)
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115 - kept by Popen
    flower = subprocess.Popen(
        [GCWORKER, "flower", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    try:
        wait_for(
            lambda: listening_addresses(port),
            timeout=60,
            what="Flower to listen",
            details=lambda: (tmp_path / "flower.log").read_text(),
        )
        assert listening_addresses(port) == {"127.0.0.1"}
        url = f"http://127.0.0.1:{port}/api/workers"
        assert get(url) == 401
        assert get(url, "admin:wrong") == 401
        assert get(url, "admin:s3cret") == 200
        assert "s3cret" not in " ".join(open(f"/proc/{flower.pid}/cmdline").read().split("\0"))
    finally:
        os.kill(flower.pid, signal.SIGTERM)
        try:
            flower.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(flower.pid, signal.SIGKILL)
            flower.wait()
        pipeline.close()


@pytest.mark.backends("postgresql")
def test_up_refuses_to_run_flower_without_credentials(database_url, plane, tmp_path):
    pipeline = Pipeline(database_url, tmp_path)
    result = subprocess.run(
        [GCWORKER, "up", "--flower", "--metrics-port", "0"],
        env=pipeline.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    pipeline.close()

    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "GCWORKER_FLOWER_BASIC_AUTH is not set" in lines[-1], result.stderr
    assert "gcworker up (" not in result.stdout  # nothing was started


def test_secrets_are_read_from_files(tmp_path, monkeypatch):
    url_file = tmp_path / "database-url"
    url_file.write_text(f"sqlite:///{tmp_path}/from-file.db\n")
    monkeypatch.setenv("GCWORKER_DATABASE_URL_FILE", str(url_file))
    monkeypatch.setenv("GCWORKER_FLOWER_BASIC_AUTH_FILE", str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match="GCWORKER_FLOWER_BASIC_AUTH_FILE=.*cannot read it"):
        load_settings()

    monkeypatch.delenv("GCWORKER_FLOWER_BASIC_AUTH_FILE")
    assert load_settings().database_url == f"sqlite:///{tmp_path}/from-file.db"

    monkeypatch.setenv("GCWORKER_DATABASE_URL", "sqlite:///elsewhere.db")
    with pytest.raises(SettingsError, match="both GCWORKER_DATABASE_URL and .*_FILE are set"):
        load_settings()


def test_a_bad_secret_is_named_never_shown(monkeypatch):
    monkeypatch.setenv("GCWORKER_FLOWER_BASIC_AUTH", "no-colon-s3cret")
    with pytest.raises(SettingsError, match="GCWORKER_FLOWER_BASIC_AUTH=\\*\\*\\*") as raised:
        load_settings()
    assert "s3cret" not in str(raised.value)


def test_a_private_key_readable_by_others_is_said(tmp_path, caplog):
    path = tmp_path / "w1.key"
    write_private_key(generate_private_key(), path)
    with caplog.at_level(logging.WARNING, logger="gcworker.signing"):
        load_private_key(path)
    assert caplog.records == []  # 0600: nothing to say

    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="gcworker.signing"):
        load_private_key(path)
    (record,) = caplog.records
    assert "readable by others" in record.getMessage() and record.mode == "0o644"


@pytest.mark.backends("postgresql")
def test_the_beat_health_check_follows_the_broker_namespace(database_url, tmp_path):
    pipeline = Pipeline(database_url, tmp_path)
    other = Pipeline(database_url, tmp_path / "other")  # another namespace, no beat

    def check(p: Pipeline) -> subprocess.CompletedProcess:
        return subprocess.run(
            [GCWORKER, "beat", "--check"], env=p.env(), capture_output=True, text=True, timeout=30
        )

    try:
        assert check(pipeline).returncode == 1
        beat = pipeline.start_beat("beat")
        wait_for(lambda: check(pipeline).returncode == 0, timeout=30, what="beat's lock")
        assert check(other).returncode == 1
        pipeline.stop(beat)
        assert check(pipeline).returncode == 1  # given back when beat stops
    finally:
        pipeline.close()
        other.close()


def test_the_reporters_redis_user_can_report_and_nothing_more(tmp_path):
    """deploy/redis/redis.acl.example, on a redis-server of this test: a reporter publishes and
    reads its answers with the `reporter` user, which can drain, read or delete nothing else."""
    import redis

    from tests.fault_support import _stop

    acl = (ROOT / "deploy" / "redis" / "redis.acl.example").read_text()
    acl = acl.replace("CHANGE-ME-control-plane", "cp-pw").replace("CHANGE-ME-reporters", "rep-pw")
    (tmp_path / "redis.acl").write_text(acl)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--aclfile", str(tmp_path / "redis.acl")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    plane_url = f"redis://gcworker:cp-pw@127.0.0.1:{port}/0"
    reporter_url = f"redis://reporter:rep-pw@127.0.0.1:{port}/0"
    control = redis.Redis.from_url(plane_url, socket_connect_timeout=1)
    reporter = redis.Redis.from_url(reporter_url)
    pipeline = None

    def answers():
        try:
            return control.ping()
        except redis.ConnectionError:
            assert server.poll() is None, "redis-server exited"
            return False

    try:
        wait_for(answers, timeout=10, what="redis-server with the ACL file")
        runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
        pipeline = Pipeline(
            "sqlite://", tmp_path, broker_url=plane_url, broker_namespace="gcworker"
        )
        proc = pipeline.start_reporter("w1", runtime.root, broker_url=reporter_url)
        wait_for(
            lambda: control.llen("gcworker:heartbeats") and control.llen("gcworker:reports"),
            timeout=30,
            what="the reporter's heartbeat and report in the queues",
            details=proc.log,
        )
        pipeline.stop(proc)
        assert "failed" not in proc.log() and "NOPERM" not in proc.log(), proc.log()

        for forbidden in (
            lambda: reporter.rpop("gcworker:reports"),  # drain (read) a queue
            lambda: reporter.delete("gcworker:heartbeats"),
            lambda: reporter.getdel("gcworker:destroying:{w2}:list"),  # another's destroy list
            lambda: reporter.set("gcworker:redbeat::lock", "mine"),
            lambda: reporter.lpush("gcworker:collect", "x"),
            reporter.flushall,
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
    finally:
        if pipeline is not None:
            pipeline.close()
        control.close()
        reporter.close()
        _stop(server, signal.SIGTERM, 10)
