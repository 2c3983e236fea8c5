"""Health endpoints, served beside `/metrics` on the metrics port of `up`, `reconciler` and
`reporter`, for systemd, compose, Kubernetes or a load balancer:

- `/healthz`: the process is alive (it answers): 200.
- `/readyz`: what the process needs answers: 200 when every check passes, else 503. The body
  (JSON) names each check and what failed. The control plane's checks: the database answers,
  its schema is the newest, and the broker (if any) answers. The reporter's: its runtime's
  last listing succeeded, and the broker answers (embedded: the database, where its events go).

Each check runs in a thread of its own, bounded by `CHECK_SECONDS`: a server that hangs makes
the process not ready, never the probe hang; a check still running since an earlier probe is
not started again (it answers "still running"), so probes cannot pile threads up.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from gcworker.logs import bounded

Check = Callable[[], None]  # returns if all is well; raises, saying what is wrong, if not
CHECK_SECONDS = 5.0
ERROR_CHARS = 300


class Checks:
    def __init__(self, checks: dict[str, Check]):
        self.checks = checks
        self._running: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def run(self) -> tuple[bool, dict[str, str]]:
        """Every check at once; (all passed, check -> "ok" or what failed)."""
        results: dict[str, str] = {}
        started = {}
        with self._lock:
            for name, check in self.checks.items():
                if name in self._running and self._running[name].is_alive():
                    results[name] = (
                        f"still running since an earlier probe (over {CHECK_SECONDS:g}s)"
                    )
                    continue
                thread = threading.Thread(target=self._one, args=(name, check, results))
                thread.daemon = True
                self._running[name] = started[name] = thread
                thread.start()
        for name, thread in started.items():
            thread.join(CHECK_SECONDS)
            if thread.is_alive():
                results.setdefault(name, f"no answer within {CHECK_SECONDS:g}s")
        results = {name: results.get(name, "no answer") for name in self.checks}
        return all(r == "ok" for r in results.values()), results

    @staticmethod
    def _one(name: str, check: Check, results: dict[str, str]) -> None:
        try:
            check()
        except Exception as error:  # noqa: BLE001 - any failure means: not ready, and why
            lines = str(error).strip().splitlines() or [type(error).__name__]
            results[name] = bounded(lines[0], ERROR_CHARS)
        else:
            results[name] = "ok"


def database_checks(database_url: str) -> dict[str, Check]:
    from sqlalchemy import text

    from gcworker.db.database import Database
    from gcworker.db.migrate import require_current

    db = Database.from_url(database_url)

    def database() -> None:
        with db.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    return {"database": database, "schema": lambda: require_current(db.engine)}


def broker_check(broker_url: str) -> Check:
    import redis

    client = redis.Redis.from_url(
        broker_url, socket_timeout=CHECK_SECONDS, socket_connect_timeout=CHECK_SECONDS
    )
    return client.ping


def control_plane_checks(settings) -> Checks:
    checks = database_checks(settings.database_url)
    if not settings.embedded:
        checks["broker"] = broker_check(settings.broker_url)
    return Checks(checks)


def reporter_checks(settings, listed: Check) -> Checks:
    """`listed` raises while the runtime's last listing failed (or none was made yet)."""
    if settings.embedded:
        return Checks({"runtime": listed, **database_checks(settings.database_url)})
    return Checks({"runtime": listed, "broker": broker_check(settings.broker_url)})


def wsgi_app(metrics_app, checks: Checks | None):
    """`/healthz` and `/readyz` (every check, or none), and `metrics_app` for anything else."""

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _json(start_response, 200, {"alive": True})
        if path == "/readyz":
            ready, results = checks.run() if checks is not None else (True, {})
            return _json(start_response, 200 if ready else 503, {"ready": ready, "checks": results})
        return metrics_app(environ, start_response)

    return app


def _json(start_response, status: int, body: dict) -> list[bytes]:
    text = {200: "200 OK", 503: "503 Service Unavailable"}[status]
    start_response(text, [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
    return [json.dumps(body).encode() + b"\n"]
