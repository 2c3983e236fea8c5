"""The reporter: one per worker host. It heartbeats every heartbeat-interval, reports the
runtime's inventory every report-interval, and after each report removes, a few at a time, the
handles the control plane holds as destroying. A listing that fails sends no report (never an
empty one).

A report is compact when nothing changed: if the inventory's digest equals that of the last full
report sent, the reporter sends only the digest (`UnchangedReport`), unless `full_report_every`
reports have passed since the last full one or the control plane asked for a full report (it
does when it cannot confirm a digest, e.g. after its own rows of the worker changed).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from gcworker.delivery import Channel
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.rules import report_digest
from gcworker.runtimes import Runtime, RuntimeError_

log = logging.getLogger(__name__)

DESTROY_PER_REPORT = 50
FULL_REPORT_EVERY = 10


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
        full_report_every: int = FULL_REPORT_EVERY,
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
        self.full_report_every = full_report_every
        self._last_seq = 0
        self._last_full_digest: str | None = None
        self._compact_since_full = 0
        self._full_report_wanted = False
        self._heard_at: datetime | None = None  # the newest feedback's control-plane time

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
        if self._heard_at is None:  # date the first report too (rule 4 confirmations)
            self._take_feedback()
        digest = report_digest(inventory.containers, inventory.volumes)
        fields = {
            "after": self._heard_at,
            "worker": self.worker,
            "incarnation": self.incarnation,
            "seq": self._next_seq(),
            "clock": datetime.now(UTC),
        }
        if self._may_send_compact(digest):
            self.channel.send(UnchangedReport(**fields, digest=digest))
            self._compact_since_full += 1
        else:
            self.channel.send(
                Report(**fields, containers=inventory.containers, volumes=inventory.volumes)
            )
            self._last_full_digest, self._compact_since_full = digest, 0
            self._full_report_wanted = False
        log.info(
            "report sent",
            extra={
                "worker": self.worker,
                "compact": self._compact_since_full > 0,
                "containers": len(inventory.containers),
                "volumes": len(inventory.volumes),
            },
        )
        self._act_on_feedback()
        return True

    def _may_send_compact(self, digest: str) -> bool:
        return (
            digest == self._last_full_digest
            and self._compact_since_full + 1 < self.full_report_every
            and not self._full_report_wanted
        )

    def _take_feedback(self):
        """Read the control plane's answer; the reports built from now on date from its time."""
        feedback = self.channel.feedback(self.worker)
        self._full_report_wanted |= feedback.full_report_wanted
        if feedback.as_of is not None:
            self._heard_at = max(self._heard_at or feedback.as_of, feedback.as_of)
        return feedback

    def _act_on_feedback(self) -> int:
        """Remove up to `destroy_per_report` handles the control plane holds as destroying, and
        note whether it asked for a full report. Returns how many handles were removed."""
        feedback = self._take_feedback()
        removed = 0
        for kind, handles in feedback.destroying.items():
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
