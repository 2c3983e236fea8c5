"""The sweeper: removes the handles the control plane holds as destroying, off the reporter's
loop, so that a slow or failing removal never delays a heartbeat or a report.

Removals run in one thread pool per kind, which bounds how many are in flight at once
(Concourse: 5 containers, 3 volumes). A handle already in flight is not submitted twice. A
removal that fails, or that is still running past the timeout, is logged with its handle and
counted (`gcworker_reporter_sweep_failures`), never raised: the control plane still lists the
handle, so a later round submits it again. A thread cannot be killed, so a timed-out removal
keeps its pool slot until the runtime's call returns (the docker runtime's API calls have a
timeout of their own); the timeout frees the handle, not the slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

from gcworker import metrics
from gcworker.runtimes import KINDS, Runtime

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Removal:
    deadline: float
    future: Future | None = field(default=None)


class Sweeper:
    def __init__(
        self,
        runtime: Runtime,
        *,
        containers_in_flight: int = 5,
        volumes_in_flight: int = 3,
        timeout: timedelta = timedelta(minutes=5),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.runtime = runtime
        self.timeout = timeout.total_seconds()
        self._clock = clock
        self._pools = {
            "container": ThreadPoolExecutor(containers_in_flight, "gcworker-sweep-container"),
            "volume": ThreadPoolExecutor(volumes_in_flight, "gcworker-sweep-volume"),
        }
        self._lock = threading.Lock()
        self._removals: dict[tuple[str, str], _Removal] = {}

    def submit(self, kind: str, handle: str) -> None:
        """Start removing `handle` unless it is in flight already; returns at once."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
        with self._lock:
            self._expire()
            if (kind, handle) in self._removals:
                return
            removal = _Removal(deadline=self._clock() + self.timeout)
            self._removals[(kind, handle)] = removal
            removal.future = self._pools[kind].submit(self._remove, kind, handle, removal)

    def in_flight(self) -> set[tuple[str, str]]:
        """The (kind, handle) pairs submitted and neither finished nor timed out."""
        with self._lock:
            self._expire()
            return set(self._removals)

    def close(self) -> None:
        """Drop the removals not started yet; those running finish in their threads."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def _expire(self) -> None:
        """Free the handles whose removal outlived the timeout (called with the lock held)."""
        now = self._clock()
        for (kind, handle), removal in list(self._removals.items()):
            if now >= removal.deadline:
                del self._removals[(kind, handle)]
                removal.future.cancel()  # only if it never started
                metrics.SWEEP_FAILURES.labels(kind, "timeout").inc()
                log.warning(
                    "removal timed out: retried on a later round",
                    extra={"kind": kind, "handle": handle, "timeout_seconds": self.timeout},
                )

    def _remove(self, kind: str, handle: str, removal: _Removal) -> None:
        try:
            self.runtime.destroy(kind, handle)
        except Exception as error:  # in a thread, an exception not logged here is lost
            metrics.SWEEP_FAILURES.labels(kind, "error").inc()
            log.warning(
                "removal failed: retried on a later round",
                extra={"kind": kind, "handle": handle, "error": str(error)[:300]},
            )
        else:
            metrics.REPORTER_REMOVED.labels(kind).inc()
            log.info("removed", extra={"kind": kind, "handle": handle, "why": "destroying"})
        with self._lock:
            if self._removals.get((kind, handle)) is removal:
                del self._removals[(kind, handle)]
