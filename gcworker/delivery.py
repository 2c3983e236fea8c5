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

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from gcworker.codec import Message, encode
from gcworker.messages import UnchangedReport
from gcworker.rules import ReportOutcome
from gcworker.settings import Settings


@dataclass
class Feedback:
    destroying: dict[str, list[str]] = field(default_factory=dict)  # kind -> handles to remove
    full_report_wanted: bool = False
    # The control plane's time when it wrote this answer (None: it has written none yet).
    as_of: datetime | None = None


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
        wanted = worker in self._full_report_wanted
        self._full_report_wanted.discard(worker)
        as_of, destroying = self.plane.destroying_handles_as_of(worker)
        return Feedback(destroying, wanted, as_of)


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
