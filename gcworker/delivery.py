"""How a reporter's messages reach the control plane, and what it hears back.

A `Channel` sends heartbeats, reports and compact unchanged reports, each wrapped in its signed
envelope (`gcworker.codec`), and gives the reporter its `Feedback`: the handles the control
plane holds as `destroying` for the worker, and whether it asked for a full report (after a
compact report it could not confirm). In embedded mode (no broker) `InProcessChannel` has each
envelope checked and applied at once through the same code a reconciler task runs; with a
broker, `gcworker.broker.BrokerChannel` publishes to Redis/Celery and reads the feedback the
reconciler leaves there (`gcworker.handoff`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from gcworker.answers import DestroyList, Stamp
from gcworker.codec import Message, encode
from gcworker.messages import UnchangedReport
from gcworker.rules import ReportOutcome
from gcworker.settings import Settings


@dataclass
class Feedback:
    """What the control plane answered (`gcworker.answers`), authentic; whether it is current
    is for the reporter to judge."""

    stamp: Stamp | None = None
    destroy_list: DestroyList | None = None
    full_report_wanted: bool = False

    @property
    def as_of(self) -> datetime | None:
        """The stamp's control-plane time (None: no stamp)."""
        return None if self.stamp is None else datetime.fromtimestamp(self.stamp.as_of / 1e6, UTC)

    @property
    def destroying(self) -> dict[str, list[str]]:
        """The destroy list's handles by kind (empty without one)."""
        if self.destroy_list is None:
            return {"container": [], "volume": []}
        return self.destroy_list.by_kind()


class Channel(Protocol):
    def send(self, message: Message) -> None: ...

    def feedback(self, worker: str) -> Feedback: ...


class InProcessChannel:
    def __init__(self, plane, *, private_key=None):
        self.plane = plane
        self.private_key = private_key
        self._full_report_wanted: set[str] = set()

    def send(self, message: Message) -> None:
        from gcworker import pipeline  # the same code (and metrics) as the reconciler's tasks

        task = "heartbeat" if message.type == "heartbeat" else "report"
        result = pipeline.receive(self.plane, encode(message, self.private_key), task=task)
        if isinstance(message, UnchangedReport):
            if getattr(result, "outcome", None) is ReportOutcome.FULL_REPORT_NEEDED:
                self._full_report_wanted.add(message.worker)
        elif message.type == "report":
            self._full_report_wanted.discard(message.worker)

    def feedback(self, worker: str) -> Feedback:
        """Read from the database itself: nothing between it and the reporter to distrust. The
        stamp answers the worker's newest message the control plane applied."""
        from gcworker.handoff import take_snapshot

        wanted = worker in self._full_report_wanted
        self._full_report_wanted.discard(worker)
        snapshot = take_snapshot(self.plane.db, worker)
        if snapshot is None:
            return Feedback(full_report_wanted=wanted)
        return Feedback(snapshot.head.stamp(snapshot.seq), snapshot.destroy_list(), wanted)


def load_key(settings: Settings):
    """The private key named by GCWORKER_KEY_FILE (or --key-file), or None."""
    if settings.key_file is None:
        return None
    from gcworker.signing import load_private_key

    return load_private_key(settings.key_file)


def open_channel(settings: Settings) -> Channel:
    private_key = load_key(settings)
    if settings.embedded:
        from gcworker.control_plane import ControlPlane

        return InProcessChannel(ControlPlane(settings), private_key=private_key)
    from gcworker.broker import BrokerChannel

    return BrokerChannel(settings, private_key=private_key)
