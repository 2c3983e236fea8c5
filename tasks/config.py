"""The Celery configuration, built from gcworker's settings: shared by the reconciler's app
(`tasks.app`) and by the publishers (`gcworker.broker.BrokerChannel`), so both agree on the
broker, the key prefix, the queues and the serializer."""

from __future__ import annotations

from celery import Celery
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


def make_app(settings: Settings, *, main: bool = False) -> Celery:
    """A Celery app configured from `settings`; `main` is the one whose tasks run here."""
    app = Celery(
        "gcworker",
        set_as_current=main,
        include=["tasks.reconcile"] if main else [],
    )
    app.conf.update(celery_config(settings))
    return app
