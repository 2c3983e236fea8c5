"""The Celery configuration, built from gcworker's settings: shared by the reconciler's app
(`tasks.app`) and by the publishers (`gcworker.broker.BrokerChannel`), so both agree on the
broker, the key prefix, the queues and the serializer.

What a message costs on the broker. A stock Celery task message repeats its arguments in the
headers (`argsrepr`, a repr of a whole report) and carries a dozen empty headers, a reply-to
address for a result backend we do not have, and a body base64-encoded by kombu's Redis
transport (a third larger). Here:

- publishers give each message a one-line `argsrepr` (`gcworker.broker.summary`: what Flower
  shows, e.g. `unchanged w1 seq=12`) and an empty `kwargsrepr`, and `_trim_message` (connected
  to `before_task_publish`) drops the headers, properties and body fields that say nothing:
  those whose value is Celery's own default (`None`, `[None, None]`, `{}`, `0` retries and
  nesting), the root id equal to the task id, the publisher's `origin` (read by no one), the
  reply-to address, the repr copies Celery adds to the properties. The worker reads every one
  of them with that same default (`Request`, the tracer), so the task runs, retries and is
  reported to Flower exactly as before;
- the Redis transport stores the body as the JSON text it is (`body_encoding: None`); a message
  published base64-encoded still decodes (the encoding travels with each message).
"""

from __future__ import annotations

from celery import Celery, signals
from kombu import Exchange, Queue

from gcworker.settings import Settings
from tasks.routing import QUEUES, ROUTES
from tasks.schedule import beat_config

EXCHANGE = Exchange("gcworker", type="direct")


def celery_config(settings: Settings) -> dict:
    visibility = settings.broker_visibility_timeout.total_seconds()
    return {
        "broker_url": settings.broker_url or None,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "global_keyprefix": f"{settings.broker_namespace}:",
            "visibility_timeout": visibility,
            # Look for messages abandoned by a dead reconciler often enough to honour the timeout.
            "unacked_restore_interval": max(1, min(10, int(visibility // 3))),
            "unacked_restore_throttle": 1,
            # The body as JSON text, not base64: see the module's docstring.
            "body_encoding": None,
        },
        "task_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "result_backend": None,
        "task_ignore_result": True,
        "result_expires": None,  # no results, so no daily `celery.backend_cleanup` in the schedule
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_queues": [Queue(name, EXCHANGE, routing_key=name) for name in QUEUES.all],
        "task_default_queue": QUEUES.reports,
        "task_default_exchange": EXCHANGE.name,
        "task_default_routing_key": QUEUES.reports,
        "task_routes": ROUTES,
        # Flower lists tasks from these events.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "worker_disable_rate_limits": True,
        "enable_utc": True,
        "timezone": "UTC",
        **beat_config(settings),
    }


# Headers the worker reads with `.get()` (or tests with `in`), and the value it then assumes.
_DEFAULT_HEADERS = {
    "shadow": None,
    "eta": None,
    "expires": None,
    "group": None,
    "group_index": None,
    "parent_id": None,
    "ignore_result": None,
    "stamped_headers": None,
    "stamps": {},
    "replaced_task_nesting": 0,
    "timelimit": [None, None],
    "kwargsrepr": "",
    "retries": 0,
}
# Publishing options Celery also copies into the properties, where nothing reads them.
_REPR_PROPERTIES = ("argsrepr", "kwargsrepr", "reply_to")
ARGSREPR_MAX = 120


@signals.before_task_publish.connect(weak=False, dispatch_uid="gcworker-trim-message")
def _trim_message(headers=None, properties=None, body=None, **_):
    """Drop what a message of ours need not carry (module docstring); values that say something
    (a retry's count and ETA, an expiry, a time limit) stay."""
    if headers is not None and "task" in headers and "id" in headers:
        for name, default in _DEFAULT_HEADERS.items():
            if name in headers and headers[name] == default and headers[name] is not False:
                del headers[name]
        if headers.get("root_id") == headers["id"]:
            del headers["root_id"]
        # The publishing process's name: not read by the worker, and no evidence of who sent a
        # message (anyone can write any value); the message's worker is in its `argsrepr`.
        headers.pop("origin", None)
        argsrepr = headers.get("argsrepr")
        if isinstance(argsrepr, str) and len(argsrepr) > ARGSREPR_MAX:
            headers["argsrepr"] = argsrepr[: ARGSREPR_MAX - 3] + "..."
    if properties is not None:
        for name in _REPR_PROPERTIES:
            properties.pop(name, None)
    if isinstance(body, tuple) and len(body) == 3 and isinstance(body[2], dict):
        embed = body[2]
        for name in [name for name, value in embed.items() if value is None]:
            del embed[name]


def make_app(settings: Settings, *, main: bool = False) -> Celery:
    """A Celery app configured from `settings`; `main` is the one whose tasks run here."""
    app = Celery(
        "gcworker",
        set_as_current=main,
        include=["tasks.reconcile"] if main else [],
    )
    app.conf.update(celery_config(settings))
    return app
