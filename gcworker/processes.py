"""The control plane's processes in broker mode, and a small supervisor to run them together.

`reconciler_argv`, `beat_argv` and `flower_argv` are the command lines of a Celery worker, of
beat (celery-redbeat) and of Flower on the app `tasks.app`; `gcworker reconciler` and
`gcworker beat` exec them, `gcworker up` (and anything else that needs a local control plane)
starts them under a `Supervisor`, which stops them all together, each by its own process id.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gcworker.settings import ENV_PREFIX

log = logging.getLogger(__name__)

CELERY_APP = "tasks.app"
DEFAULT_QUEUES = ("heartbeats", "reports", "collect")
STOP_GRACE_SECONDS = 30.0


def _celery(*args: str, quiet: bool = False) -> list[str]:
    # --quiet: no banner, for a log shipper expecting only log lines (--log-format json).
    return [sys.executable, "-m", "celery", "-A", CELERY_APP, *(["--quiet"] * quiet), *args]


def reconciler_argv(
    *,
    queues=DEFAULT_QUEUES,
    concurrency: int | None = None,
    node_name: str | None = None,
    log_level: str = "WARNING",
    quiet: bool = False,
) -> list[str]:
    from tasks.routing import QUEUES

    argv = _celery(
        "worker",
        "--queues",
        ",".join(QUEUES.named(queues)),
        "--loglevel",
        log_level,
        "--without-gossip",
        "--without-mingle",
        "--optimization",
        "fair",
        quiet=quiet,
    )
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    if node_name:
        argv += ["--hostname", node_name]
    return argv


def beat_argv(*, log_level: str = "WARNING", quiet: bool = False) -> list[str]:
    from tasks.schedule import BEAT_SCHEDULER

    return _celery("beat", "--loglevel", log_level, "--scheduler", BEAT_SCHEDULER, quiet=quiet)


DEFAULT_FLOWER_ADDRESS = "127.0.0.1"


def flower_argv(
    *, port: int = 5555, address: str = DEFAULT_FLOWER_ADDRESS, log_level: str = "WARNING"
) -> list[str]:
    return _celery(
        "flower", f"--port={port}", f"--address={address}", f"--logging={log_level.lower()}"
    )


def flower_environment(settings, env: dict[str, str]) -> dict[str, str]:
    """`env` with Flower's basic auth (Flower reads FLOWER_* options from its environment: the
    credentials never show on a command line); SettingsError without them."""
    from gcworker.settings import SettingsError

    if settings.flower_basic_auth is None:
        raise SettingsError(
            f"{ENV_PREFIX}FLOWER_BASIC_AUTH is not set: Flower shows every task and can revoke "
            f"them, so it needs credentials (user:password; or {ENV_PREFIX}FLOWER_BASIC_AUTH_FILE)"
        )
    return {**env, "FLOWER_BASIC_AUTH": settings.flower_basic_auth.get_secret_value()}


def settings_environment(overrides: dict) -> dict[str, str]:
    """This process's environment with the settings given as flags turned into GCWORKER_* so
    that child processes see the same settings."""
    env = dict(os.environ)
    for name, value in overrides.items():
        if value is not None:
            env[f"{ENV_PREFIX}{name.upper()}"] = str(value)
    return env


def fresh_metrics_dir() -> str:
    """A new, empty folder for prometheus-client's multiprocess files."""
    return tempfile.mkdtemp(prefix="gcworker-metrics-")


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Supervisor:
    """Starts child processes in their own process groups (so a terminal's Ctrl-C reaches only
    the supervisor, which then stops them in order) and stops each by its own id."""

    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str], **popen) -> Child:
        process = subprocess.Popen(argv, env=env, start_new_session=True, **popen)
        child = Child(name, argv, process)
        self.children.append(child)
        log.info("started", extra={"child": name, "pid": process.pid})
        return child

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.process.poll() is not None:
                return child
        return None

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every child (a Celery worker finishes its running tasks), wait up to `grace`
        seconds, then SIGKILL what is left, with its process group."""
        for child in self.children:
            if child.process.poll() is None:
                _signal(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("did not stop in time: killed", extra={"child": child.name})
                # The group's leader is not reaped yet, so its id is still this group's; a Celery
                # worker's pool processes share it and must not outlive it.
                _kill_group(child.pid)
                child.process.wait()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_tree(path: str | Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
