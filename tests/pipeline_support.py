"""Helpers of the pipeline's end-to-end tests: real Redis, real Celery worker processes.

Each test gets its own broker namespace (a Redis key prefix: queues, unacked messages, the beat
schedule and lock, the destroying hand-off), so tests running side by side never see each
other's messages; every key of the namespace is deleted at the end. Processes are started in
their own process groups and stopped by their own ids. Nothing sleeps and hopes: `wait_for`
polls a condition until a deadline.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from gcworker.settings import load_settings
from gcworker.signing import generate_private_key, public_key_text, write_private_key

REDIS_URL = os.environ.get("GCWORKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
GCWORKER = str(Path(sys.executable).with_name("gcworker"))
READY_PATTERNS = {
    "reconciler": re.compile(r"\S+@\S+ ready\."),
    "beat": re.compile(r"beat: Starting"),
    "reporter": re.compile(r"reporter started"),
    "up": re.compile(r"gcworker up \("),
}


def wait_for(condition, *, timeout: float, what: str, interval: float = 0.05, details=None):
    """Poll `condition()` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{details()}" if details else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)


def wait_until_blocked_by(engine, blocker_pid: int, *, what: str, details=None) -> None:
    """Wait until some session waits on a lock held by the session `blocker_pid`."""
    from sqlalchemy import text

    def blocked() -> int:
        # Each look in a transaction of its own: a transaction sees pg_stat_activity as it was
        # at its first look.
        with engine.connect() as probe:
            return probe.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE :blocker = ANY(pg_blocking_pids(pid))"
                ),
                {"blocker": blocker_pid},
            ).scalar_one()

    wait_for(blocked, timeout=20, what=what, details=details)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Proc:
    name: str
    role: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None


class Pipeline:
    def __init__(self, database_url: str, tmp_path: Path, **settings):
        self.namespace = "gcwtest-" + uuid.uuid4().hex[:12]
        self.log_dir = tmp_path / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.control_plane_key = generate_private_key()
        key_file = tmp_path / "control-plane.key"
        write_private_key(self.control_plane_key, key_file)
        self.overrides = {
            "database_url": database_url,
            "broker_url": REDIS_URL,
            "broker_namespace": self.namespace,
            "allow_unsigned": "true",
            "control_plane_key_file": key_file,
            "control_plane_public_key": public_key_text(self.control_plane_key),
            **settings,
        }
        self.settings = load_settings(**self.overrides)
        self.redis = redis.Redis.from_url(self.settings.broker_url, decode_responses=True)
        self.procs: list[Proc] = []
        self._channel = None

    # Processes ---------------------------------------------------------------------------

    def env(self, **extra) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("GCWORKER_") and k != "PROMETHEUS_MULTIPROC_DIR"
        }
        for name, value in {**self.overrides, **extra}.items():
            env[f"GCWORKER_{name.upper()}"] = str(value)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, name: str, role: str, *args: str, wait: bool = True, **settings) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                [GCWORKER, "--log-level", "INFO", *args],
                env=self.env(**settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name, role, popen, log_path)
        self.procs.append(proc)
        if wait:
            self.wait_ready(proc)
        return proc

    def start_reconciler(
        self, name: str, *, concurrency: int = 1, queues: str | None = None, **kw
    ) -> Proc:
        args = ["reconciler", "--concurrency", str(concurrency), "--name", f"{name}@%h"]
        if queues:
            args += ["--queues", queues]
        return self.start(name, "reconciler", *args, **kw)

    def start_beat(self, name: str, **kw) -> Proc:
        return self.start(name, "beat", "beat", **kw)

    def start_reporter(self, worker: str, runtime: Path, *extra: str, **kw) -> Proc:
        return self.start(
            f"reporter-{worker}",
            "reporter",
            "reporter",
            "--worker",
            worker,
            "--runtime",
            f"dir:{runtime}",
            *extra,
            **kw,
        )

    def wait_ready(self, proc: Proc, timeout: float = 30.0) -> None:
        pattern = READY_PATTERNS[proc.role]

        def ready():
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited early:\n{proc.log()[-3000:]}")
            return pattern.search(proc.log())

        wait_for(ready, timeout=timeout, what=f"{proc.name} to be ready", details=proc.log)

    def stop(self, proc: Proc, timeout: float = 20.0) -> int:
        """SIGTERM the process by its id; SIGKILL its group if it does not stop in time."""
        if proc.alive():
            os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            return proc.popen.returncode

    def kill(self, proc: Proc) -> None:
        """SIGKILL the process and its group (a Celery worker with its pool processes)."""
        if proc.alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.popen.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()[-4000:]}" for p in self.procs)

    # Broker ------------------------------------------------------------------------------

    @property
    def channel(self):
        if self._channel is None:
            from gcworker.broker import BrokerChannel

            self._channel = BrokerChannel(self.settings)
        return self._channel

    def send(self, message, times: int = 1) -> None:
        for _ in range(times):
            self.channel.send(message)

    def send_task(self, name: str, queue: str) -> None:
        self.channel.app.send_task(name, queue=queue)

    def key(self, name: str) -> str:
        return f"{self.namespace}:{name}"

    def queue_length(self, queue: str) -> int:
        return self.redis.llen(self.key(queue))

    def take_queued(self, queue: str) -> list:
        """Take every message waiting in `queue` out of Redis, oldest first, as the envelopes
        its tasks would get: the test plays a broker that held them back."""
        key = self.key(queue)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            raw, _ = pipe.execute()
        envelopes = []
        for text in reversed(raw):  # kombu pushes on the left and pops on the right
            message = json.loads(text)
            body = message["body"]
            if message.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body).decode()
            envelopes.append(json.loads(body)[0][0])
        return envelopes

    def in_flight(self) -> int:
        """Messages waiting in any queue or reserved and not yet acknowledged."""
        waiting = sum(self.queue_length(q) for q in ("heartbeats", "reports", "collect"))
        return waiting + self.redis.hlen(self.key("unacked"))

    def close(self) -> None:
        for proc in self.procs:  # all at once: each finishes its running task in parallel
            if proc.alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                self.stop(proc)
            except Exception:  # noqa: BLE001 - stop the others whatever happens
                self.kill(proc)
        if self._channel is not None:
            self._channel.close()
        keys = list(self.redis.scan_iter(match=f"{self.namespace}:*", count=1000))
        if keys:
            self.redis.delete(*keys)
        self.redis.close()
