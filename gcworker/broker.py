"""The broker channel: how a reporter (or `gcworker heartbeat|report`) reaches the control plane
when `GCWORKER_BROKER_URL` is set.

`send` wraps the message in its envelope (`gcworker.codec`; signed when `GCWORKER_KEY_FILE` names
the worker's private key) and publishes it as a Celery task message to its queue: heartbeats to
`heartbeats`, reports to `reports` (see `tasks.routing`). `destroying` reads the newest snapshot
of the worker's destroying handles that the reconciler left in Redis (see `gcworker.handoff`).
"""

from __future__ import annotations

from gcworker.codec import encode
from gcworker.handoff import DestroyingBoard
from gcworker.messages import Heartbeat, Report
from gcworker.settings import Settings

PUBLISH_RETRY_POLICY = {
    "max_retries": 3,
    "interval_start": 0.2,
    "interval_step": 0.5,
    "interval_max": 2.0,
}


class BrokerChannel:
    def __init__(self, settings: Settings, *, private_key=None):
        from tasks.config import make_app

        if not settings.broker_url:
            raise ValueError("BrokerChannel needs GCWORKER_BROKER_URL")
        self.settings = settings
        self.app = make_app(settings)
        if private_key is None and settings.key_file is not None:
            from gcworker.signing import load_private_key

            private_key = load_private_key(settings.key_file)
        self.private_key = private_key
        self._board: DestroyingBoard | None = None

    @property
    def board(self) -> DestroyingBoard:
        if self._board is None:
            self._board = DestroyingBoard.from_settings(self.settings)
        return self._board

    def send(self, message: Heartbeat | Report) -> None:
        from tasks.routing import task_for

        task, queue = task_for(message.type)
        self.app.send_task(
            task,
            args=[encode(message, self.private_key)],
            queue=queue,
            retry=True,
            retry_policy=PUBLISH_RETRY_POLICY,
        )

    def destroying(self, worker: str) -> dict[str, list[str]]:
        return self.board.read(worker)

    def close(self) -> None:
        self.app.close()
        if self._board is not None:
            self._board.redis.close()
