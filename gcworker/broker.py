"""The broker channel: how a reporter (or `gcworker heartbeat|report`) reaches the control plane
when `GCWORKER_BROKER_URL` is set.

`send` wraps the message in its envelope (`gcworker.codec`; signed when `GCWORKER_KEY_FILE` names
the worker's private key) and publishes it as a Celery task message to its queue: heartbeats to
`heartbeats`, reports to `reports` (see `tasks.routing`). `feedback` reads the newest snapshot
of the worker's destroying handles that the reconciler left in Redis, and whether it asked for a
full report (see `gcworker.handoff`).

Every message is published by `publish`, with a one-line `argsrepr` (`summary`) instead of
Celery's repr of the whole envelope: that is what Flower shows as the task's arguments, and the
envelope is not carried twice (see `tasks.config` for the rest of what the broker stores).
"""

from __future__ import annotations

from typing import Any

from gcworker.codec import Message, encode
from gcworker.delivery import Feedback, load_key
from gcworker.handoff import DestroyingBoard
from gcworker.settings import Settings

PUBLISH_RETRY_POLICY = {
    "max_retries": 3,
    "interval_start": 0.2,
    "interval_step": 0.5,
    "interval_max": 2.0,
}


def summary(message: Message) -> str:
    """One line naming a message (its task's `argsrepr`, shown by Flower)."""
    text = f"{message.type} {message.worker} seq={message.seq}"
    containers = getattr(message, "containers", None)
    if containers is not None:
        text += f" containers={len(containers)} volumes={len(message.volumes)}"
    return text


def publish(app, task: str, queue: str, envelope: Any, summary: str, **options) -> None:
    """Publish one envelope as a Celery task message of `task` on `queue`."""
    app.send_task(task, args=[envelope], queue=queue, argsrepr=summary, kwargsrepr="", **options)


class BrokerChannel:
    def __init__(self, settings: Settings, *, private_key=None):
        from tasks.config import make_app

        if not settings.broker_url:
            raise ValueError("BrokerChannel needs GCWORKER_BROKER_URL")
        self.settings = settings
        self.app = make_app(settings)
        # No task-sent events: Flower would turn each reporter process into a label value.
        self.app.conf.task_send_sent_event = False
        self.private_key = private_key if private_key is not None else load_key(settings)
        self._board: DestroyingBoard | None = None

    @property
    def board(self) -> DestroyingBoard:
        if self._board is None:
            self._board = DestroyingBoard.from_settings(self.settings)
        return self._board

    def send(self, message: Message) -> None:
        from tasks.routing import task_for

        task, queue = task_for(message.type)
        publish(
            self.app,
            task,
            queue,
            encode(message, self.private_key),
            summary(message),
            retry=True,
            retry_policy=PUBLISH_RETRY_POLICY,
        )

    def feedback(self, worker: str) -> Feedback:
        return self.board.feedback(worker)

    def close(self) -> None:
        self.app.close()
        if self._board is not None:
            self._board.redis.close()
