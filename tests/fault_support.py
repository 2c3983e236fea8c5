"""Helpers of the fault tests: servers of their own, and a collector that pauses mid-batch.

`PrivateRedis` and `PrivatePostgres` are servers started by one test on a loopback port of
their own, stopped and started again by the test, each by its own process id: the shared
servers (Redis on 6379, PostgreSQL on 5432) that other tests use in parallel are never touched.
PostgreSQL refuses to run as root, so the cluster belongs to the `postgres` OS user.

`python -m tests.fault_support pause-collection URL REACHED LOCK N` runs one collection that
stops inside its Nth statement deleting containers (after the statement ran, before the batch's
transaction commits), writes its pid to REACHED and waits for a lock on LOCK that the test
holds, so that the test can kill it there.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from tests.pipeline_support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _stop(popen: subprocess.Popen, signum: int, timeout: float) -> None:
    """Signal the process by its id; SIGKILL it if it has not exited in time."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, signum)
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, signal.SIGKILL)
        popen.wait(timeout=10)


class PrivateRedis:
    """A redis-server of this test alone, without persistence: a restart loses every key."""

    def __init__(self, tmp_path: Path):
        self.port = free_port()
        self.dir = tmp_path / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.popen: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        log = open(self.dir / f"redis-{self.starts}.log", "wb")  # noqa: SIM115 - kept by Popen
        self.popen = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)

        def answers():
            if self.popen.poll() is not None:
                raise AssertionError(f"redis-server exited: {self.log()}")
            try:
                return client.ping()
            except redis.RedisError:
                return False

        try:
            wait_for(answers, timeout=10, what=f"redis-server on port {self.port}")
        finally:
            client.close()

    def stop(self) -> None:
        if self.popen is not None:
            _stop(self.popen, signal.SIGTERM, 10)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        return (self.dir / f"redis-{self.starts}.log").read_text(errors="replace")[-2000:]


def _postgres_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"no PostgreSQL {name} under /usr/lib/postgresql")
    return found[-1]


class PrivatePostgres:
    """A PostgreSQL cluster of this test alone (trust authentication, no durability: tests only).

    The server is run directly (not through pg_ctl), so the test holds the postmaster's process
    id; `stop` is a fast shutdown (SIGINT: every session ends, open transactions roll back).
    """

    def __init__(self):
        # PostgreSQL refuses to run as root: then it runs as the `postgres` OS user.
        self.user = "postgres" if os.geteuid() == 0 else None
        # Not under pytest's tmp_path: that folder is private to root, and the server is not.
        self.dir = Path(tempfile.mkdtemp(prefix="gcworker-pg-"))
        if self.user:
            shutil.chown(self.dir, self.user, self.user)
        self.data = self.dir / "data"
        self.port = free_port()
        self.popen: subprocess.Popen | None = None
        self.starts = 0
        subprocess.run(
            [_postgres_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust"]
            + ["--no-sync", "-E", "UTF8", "--locale=C"],
            user=self.user,
            cwd=self.dir,
            check=True,
            capture_output=True,
        )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self.starts += 1
        log_path = self.dir / f"postgres-{self.starts}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - kept by Popen
        self.popen = subprocess.Popen(
            [_postgres_bin("postgres"), "-D", str(self.data), "-p", str(self.port)]
            + ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}"]
            + ["-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=60"],
            user=self.user,
            cwd=self.dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        wait_for(self.accepting, timeout=20, what=f"PostgreSQL on port {self.port}")

    def accepting(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"postgres exited: {self.log()}")
        result = subprocess.run(
            [_postgres_bin("pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            check=False,
        )
        return result.returncode == 0

    def stop(self) -> None:
        """Fast shutdown, waited for: the port is closed when this returns."""
        if self.popen is not None:
            _stop(self.popen, signal.SIGINT, 20)

    def log(self) -> str:
        return (self.dir / f"postgres-{self.starts}.log").read_text(errors="replace")[-3000:]

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# A collector that pauses inside a batch -------------------------------------------------------


def start_pausing_collector(
    database_url: str, reached: Path, lock: Path, nth: int, log_path: Path, **settings
) -> subprocess.Popen:
    return _start(
        ["-m", "tests.fault_support", "pause-collection"]
        + [database_url, str(reached), str(lock), str(nth)],
        log_path,
        settings,
    )


def start_collector(database_url: str, log_path: Path, **settings) -> subprocess.Popen:
    """`gcworker collect` in a process of its own."""
    return _start(
        ["-m", "gcworker.cli", "collect"], log_path, dict(settings, database_url=database_url)
    )


def _start(args: list[str], log_path: Path, settings: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    for name, value in settings.items():
        env[f"GCWORKER_{name.upper()}"] = str(value)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _pause_collection(database_url: str, reached: str, lock: str, nth: int) -> None:
    from sqlalchemy import event

    from gcworker.db.database import Database
    from gcworker.gc.collection import collect
    from gcworker.settings import load_settings

    settings = load_settings(database_url=database_url)
    db = Database.from_url(database_url)
    seen = 0

    @event.listens_for(db.engine, "after_cursor_execute")
    def _maybe_pause(_conn, _cursor, statement, *_args):
        nonlocal seen
        if "delete from containers" not in " ".join(statement.lower().split()):
            return
        seen += 1
        if seen == nth:
            Path(reached).write_text(str(os.getpid()))
            with open(lock) as held_by_the_test:
                fcntl.flock(held_by_the_test, fcntl.LOCK_EX)  # until killed
            time.sleep(3600)

    summary = collect(db, settings)
    print(summary.line(), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "pause-collection":
        _pause_collection(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        raise SystemExit("usage: python -m tests.fault_support pause-collection URL REACHED LOCK N")
