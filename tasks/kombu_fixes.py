"""A work-around for a kombu bug that kills a reconciler when Redis goes away (tests/test_faults).

When the broker connection breaks, Celery first collects the kombu connection (which detaches
its transport: `transport.client = None`), then closes it. Closing a Redis channel that the
collection could not close (its broadcast queue's clean-up failed with the broker gone) gives
back the messages it held unacknowledged, for which it builds a new Redis client from
`transport.client`: an `AttributeError`, which is no connection error, escapes every
`ignore_errors`, and Celery stops the worker ("Unrecoverable error"). A Redis restart while a
reconciler held a message unacknowledged was enough.

Here a channel whose transport is detached raises a connection error instead, which the
clean-up ignores: the consumer reconnects. The messages it held stay in the broker's unacked
set, and are given back after `GCWORKER_BROKER_VISIBILITY_TIMEOUT` (if the broker kept them),
like those of a reconciler that died; a redelivered message is harmless (rule 6).
"""

from __future__ import annotations

import functools

import redis
from kombu.transport import redis as kombu_redis


def apply() -> None:
    original = kombu_redis.Channel._connparams
    if getattr(original, "gcworker_fix", False):
        return

    @functools.wraps(original)
    def _connparams(self, *args, **kwargs):
        transport = self.connection
        if transport is None or transport.client is None:
            raise redis.exceptions.ConnectionError("the broker connection is already closed")
        return original(self, *args, **kwargs)

    _connparams.gcworker_fix = True
    kombu_redis.Channel._connparams = _connparams
