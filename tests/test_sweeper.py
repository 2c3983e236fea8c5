"""The sweeper on its own, over a `dir` runtime: a removal that fails or outlives its timeout is
logged and counted, never raised, and its handle may be submitted again. (Bounded parallelism
is tested against a real engine in test_runtime_docker.py.)"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from gcworker import metrics
from gcworker.runtimes import RuntimeError_
from gcworker.runtimes.dir import DirRuntime
from gcworker.settings import SettingsError, load_settings
from gcworker.sweeper import Sweeper
from tests.pipeline_support import wait_for


class SlowRuntime(DirRuntime):
    """Removals of handles in `blocked` wait for `release`; those in `broken` fail."""

    def __init__(self, root):
        super().__init__(str(root))
        self.blocked: set[str] = set()
        self.broken: set[str] = set()
        self.release = threading.Event()
        self.started: list[str] = []

    def destroy(self, kind: str, handle: str) -> None:
        self.started.append(handle)
        if handle in self.broken:
            raise RuntimeError_(f"cannot remove {handle}: device busy")
        if handle in self.blocked:
            self.release.wait(timeout=60)
        super().destroy(kind, handle)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def runtime(tmp_path):
    runtime = SlowRuntime(tmp_path / "runtime")
    yield runtime
    runtime.release.set()


def failures(kind: str, reason: str) -> float:
    return metrics.SWEEP_FAILURES.labels(kind, reason)._value.get()


def logged(caplog, message: str) -> list[str]:
    """The handles of the log records with this message."""
    return [r.handle for r in caplog.records if r.getMessage().startswith(message)]


def test_a_failed_removal_is_logged_and_counted_not_raised(runtime, caplog):
    runtime.create("container", "bad")
    runtime.create("container", "good")
    runtime.broken.add("bad")
    before = failures("container", "error")
    sweeper = Sweeper(runtime)
    try:
        sweeper.submit("container", "bad")
        sweeper.submit("container", "good")
        wait_for(lambda: not sweeper.in_flight(), timeout=30, what="both removals to end")
        sweeper.submit("container", "bad")  # a later round tries again
        wait_for(lambda: not sweeper.in_flight(), timeout=30, what="the retry to end")
    finally:
        sweeper.close()

    assert runtime.inventory().containers == ["bad"]
    assert runtime.started.count("bad") == 2
    assert failures("container", "error") == before + 2
    assert logged(caplog, "removal failed") == ["bad", "bad"]


def test_a_removal_past_its_timeout_frees_its_handle_for_a_later_round(runtime, caplog):
    clock = Clock()
    runtime.create("volume", "stuck")
    runtime.blocked.add("stuck")
    before = failures("volume", "timeout")
    sweeper = Sweeper(runtime, volumes_in_flight=2, timeout=timedelta(minutes=5), clock=clock)
    try:
        sweeper.submit("volume", "stuck")
        wait_for(lambda: runtime.started == ["stuck"], timeout=30, what="the removal to start")
        clock.now += 299
        sweeper.submit("volume", "stuck")  # still within its timeout: not twice
        assert sweeper.in_flight() == {("volume", "stuck")}
        clock.now += 1
        assert sweeper.in_flight() == set()  # timed out: free to be submitted again
        assert failures("volume", "timeout") == before + 1
        assert logged(caplog, "removal timed out") == ["stuck"]

        sweeper.submit("volume", "stuck")
        wait_for(lambda: runtime.started == ["stuck"] * 2, timeout=30, what="a second removal")
        runtime.release.set()
        wait_for(lambda: not sweeper.in_flight(), timeout=30, what="the removals to end")
    finally:
        sweeper.close()

    assert runtime.inventory().volumes == []


def test_sweep_settings_are_read_and_checked():
    settings = load_settings(
        sweep_containers_in_flight="7", sweep_volumes_in_flight="2", destroy_timeout="90s"
    )
    assert (settings.sweep_containers_in_flight, settings.sweep_volumes_in_flight) == (7, 2)
    assert settings.destroy_timeout == timedelta(seconds=90)
    assert load_settings().destroy_timeout == timedelta(minutes=5)
    with pytest.raises(SettingsError, match="GCWORKER_DESTROY_TIMEOUT=0s"):
        load_settings(destroy_timeout="0s")
    with pytest.raises(SettingsError, match="GCWORKER_SWEEP_VOLUMES_IN_FLIGHT=0"):
        load_settings(sweep_volumes_in_flight="0")
