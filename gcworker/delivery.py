"""How a reporter's events reach the control plane, and how it learns what to remove.

A `Channel` sends heartbeats and reports and answers which handles the control plane holds as
`destroying` for a worker. In embedded mode (no broker) `InProcessChannel` applies each event at
once through the same code a reconciler task runs and reads the destroying handles from the
database; with a broker, `BrokerChannel` (see `gcworker.broker`) publishes to Redis/Celery.
"""

from __future__ import annotations

from typing import Protocol

from gcworker.messages import Heartbeat, Report
from gcworker.settings import Settings


class Channel(Protocol):
    def send(self, message: Heartbeat | Report) -> None: ...

    def destroying(self, worker: str) -> dict[str, list[str]]:
        """kind ("container"/"volume") -> handles the worker should remove."""
        ...


class InProcessChannel:
    def __init__(self, plane):
        self.plane = plane

    def send(self, message: Heartbeat | Report) -> None:
        from gcworker import pipeline  # the same code (and metrics) as the reconciler's tasks

        pipeline.apply(self.plane, message)

    def destroying(self, worker: str) -> dict[str, list[str]]:
        return self.plane.destroying_handles(worker)


def open_channel(settings: Settings) -> Channel:
    if settings.embedded:
        from gcworker.control_plane import ControlPlane

        return InProcessChannel(ControlPlane(settings))
    from gcworker.broker import BrokerChannel

    return BrokerChannel(settings)


def publish(settings: Settings, message: Heartbeat | Report) -> None:
    """Send one event the way the configured mode does."""
    open_channel(settings).send(message)
