"""The reporter: one per worker host. It heartbeats every heartbeat-interval, reports the
runtime's complete inventory every report-interval, and after each report removes, a few at a
time, the handles the control plane holds as destroying. A listing that fails sends no report
(never an empty one).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from gcworker.delivery import Channel
from gcworker.messages import Heartbeat, Report
from gcworker.runtimes import Runtime, RuntimeError_

log = logging.getLogger(__name__)

DESTROY_PER_REPORT = 50


class Reporter:
    def __init__(
        self,
        worker: str,
        runtime: Runtime,
        channel: Channel,
        *,
        heartbeat_interval: float,
        report_interval: float,
        ttl_seconds: float | None = None,
        ephemeral: bool = False,
        incarnation: int | None = None,
        destroy_per_report: int = DESTROY_PER_REPORT,
    ):
        self.worker = worker
        self.runtime = runtime
        self.channel = channel
        self.heartbeat_interval = heartbeat_interval
        self.report_interval = report_interval
        self.ttl_seconds = ttl_seconds
        self.ephemeral = ephemeral
        # Taken from the clock at start, so a restarted reporter's incarnation is always higher.
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.destroy_per_report = destroy_per_report
        self._last_seq = 0

    def _next_seq(self) -> int:
        self._last_seq = max(time.time_ns(), self._last_seq + 1)
        return self._last_seq

    def heartbeat(self) -> None:
        self.channel.send(
            Heartbeat(
                worker=self.worker,
                incarnation=self.incarnation,
                seq=self._next_seq(),
                clock=datetime.now(UTC),
                ephemeral=self.ephemeral,
                ttl_seconds=self.ttl_seconds,
            )
        )

    def report(self) -> bool:
        """Send one report and remove what the control plane destroys; False if none was sent."""
        try:
            inventory = self.runtime.inventory()
        except RuntimeError_ as error:
            log.warning(
                "listing failed: no report sent", extra={"worker": self.worker, "error": str(error)}
            )
            return False
        self.channel.send(
            Report(
                worker=self.worker,
                incarnation=self.incarnation,
                seq=self._next_seq(),
                clock=datetime.now(UTC),
                containers=inventory.containers,
                volumes=inventory.volumes,
            )
        )
        log.info(
            "report sent",
            extra={
                "worker": self.worker,
                "containers": len(inventory.containers),
                "volumes": len(inventory.volumes),
            },
        )
        self.remove_destroying()
        return True

    def remove_destroying(self) -> int:
        """Remove up to `destroy_per_report` handles the control plane holds as destroying."""
        removed = 0
        for kind, handles in self.channel.destroying(self.worker).items():
            for handle in handles[: self.destroy_per_report - removed]:
                self.runtime.destroy(kind, handle)
                removed += 1
        if removed:
            log.info("removed destroying handles", extra={"worker": self.worker, "count": removed})
        return removed

    def run(self, stop: threading.Event, *, once: bool = False) -> None:
        """Heartbeat and report on their intervals until `stop` is set (or once, with `once`)."""
        next_heartbeat = next_report = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                self.heartbeat()
                next_heartbeat = now + self.heartbeat_interval
            if now >= next_report:
                self.report()
                next_report = now + self.report_interval
                if once:
                    return
            stop.wait(max(0.0, min(next_heartbeat, next_report) - time.monotonic()))
