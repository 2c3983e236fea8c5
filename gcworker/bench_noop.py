"""The no-op task `gcworker bench` compares the report task with: same app, same queue, same
options, same payload, and nothing done with it. Loaded only into the benchmark's own Celery
worker (`celery -A tasks.app worker --include gcworker.bench_noop`)."""

from __future__ import annotations

from tasks.app import app

NOOP_TASK = "gcworker.bench.noop"


@app.task(name=NOOP_TASK)
def noop(envelope):
    return None
