"""The pipeline part of `gcworker bench`: reports through Redis and real Celery worker processes.

A Celery worker of the control plane's own app (`tasks.app`, the `reports` queue, the configured
options: JSON, late acknowledgement, one message reserved per process) is started as a child
process on the benchmark's scratch schema and a Redis namespace of its own, with the no-op task
of `gcworker.bench_noop` loaded beside the report task. For each payload size N, the same signed
report envelopes of N handles are published as fast as one process can (as a reporter publishes
them: `gcworker.broker.publish`, with its one-line `argsrepr`), once to the no-op task
and once to the report task (steady full reports of a fleet of workers, each already known to
the control plane), alternately, twice; the rate is messages / (first publish to the queue
drained and every message acknowledged). Also measured: the bytes a report and a compact report
take on the broker (the stored Celery message, headers and body included).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from typing import Any

NOOP_TASK = "gcworker.bench.noop"  # gcworker.bench_noop; not imported here (it loads tasks.app)
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
PIPELINE_WORKERS = 8
CONCURRENCY = 2
ROUNDS = 2
DRAIN_TIMEOUT_S = 120.0


class PipelineUnavailable(Exception):
    pass


def messages_for(handles: int, quick: bool) -> int:
    if quick:
        return 20
    return 600 if handles <= 2_000 else 150


def bench_pipeline(bench, options, progress) -> dict[str, Any]:
    """Returns {"measured": False, "reason": ...} when Redis, Celery or `tasks/` is missing."""
    try:
        return _bench_pipeline(bench, options, progress)
    except PipelineUnavailable as why:
        return {"measured": False, "reason": str(why)}


def _bench_pipeline(bench, options, progress) -> dict[str, Any]:
    try:
        import redis

        from gcworker.broker import publish as publish_envelope
        from gcworker.broker import summary
        from gcworker.codec import encode
        from gcworker.db.keys import KeyRepository
        from gcworker.processes import Supervisor, reconciler_argv
        from gcworker.settings import load_settings
        from gcworker.signing import generate_private_key, public_key_text
        from tasks.config import make_app
        from tasks.routing import QUEUES, REPORT_TASK
    except ImportError as error:
        raise PipelineUnavailable(f"the pipeline code is missing ({error})") from None

    broker_url = os.environ.get("GCWORKER_BROKER_URL") or DEFAULT_BROKER_URL
    client = redis.Redis.from_url(broker_url)
    try:
        client.ping()
    except redis.RedisError as error:
        raise PipelineUnavailable(f"no Redis answers at {broker_url} ({error})") from None
    namespace = "gcbench-" + uuid.uuid4().hex[:12]
    settings = load_settings(
        database_url=bench.url, broker_url=broker_url, broker_namespace=namespace
    )
    app = make_app(settings)
    queue_key, unacked_key = f"{namespace}:{QUEUES.reports}", f"{namespace}:unacked"
    supervisor = Supervisor()
    log = tempfile.NamedTemporaryFile(prefix="gcbench-celery-", suffix=".log", delete=False)
    result: dict[str, Any] = {
        "measured": True,
        "broker": _redacted(broker_url),
        "celery_processes": CONCURRENCY,
        "fleet_workers": PIPELINE_WORKERS,
        "sizes": {},
    }
    try:
        # Sizes on the broker, measured before any consumer runs: publish, read back, delete.
        key = generate_private_key()
        sizes = {}
        for n in options.pipeline_sizes:
            player = _Player("size-probe")
            containers = [str(uuid.uuid4()) for _ in range(n // 2)]
            volumes = [str(uuid.uuid4()) for _ in range(n - n // 2)]
            message = player.report(containers, volumes)
            full = (encode(message, key), summary(message))
            sizes[n] = _stored_bytes(app, client, REPORT_TASK, queue_key, full)
        from gcworker.rules import report_digest

        message = _Player("size-probe").unchanged(report_digest([], []))
        compact = (encode(message, key), summary(message))
        result["compact_envelope_bytes"] = len(_json(compact[0]))
        result["compact_broker_bytes"] = _stored_bytes(app, client, REPORT_TASK, queue_key, compact)

        env = dict(os.environ)
        env.update(
            GCWORKER_DATABASE_URL=bench.url,
            GCWORKER_BROKER_URL=broker_url,
            GCWORKER_BROKER_NAMESPACE=namespace,
            GCWORKER_ALLOW_UNSIGNED="false",
        )
        env.pop("GCWORKER_METRICS_PORT", None)
        argv = reconciler_argv(
            queues=("reports",), concurrency=CONCURRENCY, node_name=f"{namespace}@bench"
        ) + ["--include", "gcworker.bench_noop"]
        progress(f"pipeline: starting a Celery worker ({CONCURRENCY} processes)")
        child = supervisor.start("bench-reconciler", argv, env, stdout=log, stderr=log)

        def drained(expected_seq: dict[str, int] | None = None) -> None:
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            quiet = 0
            while True:
                if child.process.poll() is not None:
                    raise PipelineUnavailable(
                        f"the Celery worker exited ({child.process.returncode}); see {log.name}"
                    )
                busy = client.llen(queue_key) or client.hlen(unacked_key)
                if not busy and expected_seq is not None:
                    busy = not _seqs_reached(bench, expected_seq)
                quiet = 0 if busy else quiet + 1
                if quiet >= 2:
                    return
                if time.monotonic() > deadline:
                    raise PipelineUnavailable(f"the queue did not drain in {DRAIN_TIMEOUT_S:g}s")
                time.sleep(0.002)

        def publish(task: str, envelopes: list) -> float:
            started = time.perf_counter()
            for envelope, line in envelopes:
                publish_envelope(app, task, QUEUES.reports, envelope, line)
            return started

        for n in options.pipeline_sizes:
            count = messages_for(n, options.quick)
            progress(f"pipeline: N={n:,}, {count} messages per round, no-op vs report task")
            players = bench.fleet(PIPELINE_WORKERS, n // 2, n - n // 2)
            keys = {}
            with bench.db.transaction() as conn:
                now = bench.db.now(conn)
                for player in players:
                    keys[player.name] = generate_private_key()
                    KeyRepository().register(
                        conn, player.name, public_key_text(keys[player.name]), now, replace=True
                    )
            lists = {p.name: bench.handles(p.name) for p in players}
            for player in players:  # the full report the steady ones are compared with
                bench.reconciler.report(player.report(*lists[player.name]))

            def envelopes(count=count, players=players, lists=lists, keys=keys):
                out, last = [], {}
                for i in range(count):
                    player = players[i % len(players)]
                    message = player.report(*lists[player.name])
                    last[player.name] = message.seq
                    out.append((encode(message, keys[player.name]), summary(message)))
                return out, last

            warm, last = envelopes(count=2 * len(players))
            publish(NOOP_TASK, warm[:4])
            drained()
            publish(REPORT_TASK, warm)
            drained(last)
            noop_rates, report_rates = [], []
            for _ in range(1 if options.quick else ROUNDS):
                batch, last = envelopes()
                started = publish(NOOP_TASK, batch)
                drained()
                noop_rates.append(count / (time.perf_counter() - started))
                started = publish(REPORT_TASK, batch)
                drained(last)
                report_rates.append(count / (time.perf_counter() - started))
            result["sizes"][str(n)] = {
                "messages_per_round": count,
                "noop_per_s": round(max(noop_rates), 1),
                "reports_per_s": round(max(report_rates), 1),
                "noop_rounds_per_s": [round(r, 1) for r in noop_rates],
                "report_rounds_per_s": [round(r, 1) for r in report_rates],
                "broker_bytes_per_report": sizes[n],
                "envelope_bytes": len(_json(batch[0][0])),
            }
    finally:
        supervisor.stop(grace=20)
        _delete_namespace(client, namespace)
        app.close()
        client.close()
        log.close()
    os.unlink(log.name)
    return result


class _Player:
    """A worker that only builds messages (for the size probes)."""

    def __init__(self, name: str):
        from gcworker.bench import BenchWorker

        self._worker = BenchWorker(None, name)

    def report(self, containers, volumes):
        return self._worker.report(containers, volumes)

    def unchanged(self, digest):
        return self._worker.unchanged(digest)


def _json(envelope) -> bytes:
    return json.dumps(envelope).encode()


def _stored_bytes(app, client, task: str, queue_key: str, envelope) -> int:
    """The bytes one message of `envelope` (envelope, summary), published as a reporter publishes
    it (`gcworker.broker.publish`), takes in the Redis list of its queue."""
    from gcworker.broker import publish

    probe_queue = "gcbench-probe"
    publish(app, task, probe_queue, *envelope)
    key = queue_key.rsplit(":", 1)[0] + ":" + probe_queue
    try:
        stored = client.lindex(key, 0)
        if stored is None:
            raise PipelineUnavailable(f"the probe message was not found at {key}")
        return len(stored)
    finally:
        client.delete(key)


def _seqs_reached(bench, expected: dict[str, int]) -> bool:
    rows = bench.sql(
        "SELECT name, last_report_seq FROM workers WHERE name = ANY(:names)", names=list(expected)
    ).all()
    got = {name: seq for name, seq in rows}
    return all((got.get(name) or 0) >= seq for name, seq in expected.items())


def _delete_namespace(client, namespace: str) -> None:
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    # kombu's bindings table and fanout keys may sit under the prefix too; nothing else does.
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL SQLAlchemy cannot parse is shown as is
        return url
