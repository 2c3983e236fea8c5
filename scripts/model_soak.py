#!/usr/bin/env python3
"""Soak run of the model-based test (tests/test_model_based.py): many more examples and steps
than CI runs, on PostgreSQL (a schema of its own, dropped at the end) or SQLite (a temporary
file). Prints progress every minute and the run's figures at the end; exits 1 on a failing
example, after printing it (hypothesis shrinks it first).

    python scripts/model_soak.py --examples 2000 --steps 50
    python scripts/model_soak.py --backend sqlite --examples 2000

PostgreSQL is reached at GCWORKER_TEST_PG_URL (default postgresql+psycopg2://root@127.0.0.1/test),
as the tests do.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, text  # noqa: E402

from tests import test_model_based as model  # noqa: E402
from tests.conftest import PG_ADMIN_URL, _pg_schema_url  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=50, help="most steps per example")
    parser.add_argument("--backend", choices=["postgresql", "sqlite"], default="postgresql")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the brake and the fence log warnings by design

    admin = schema = None
    if args.backend == "postgresql":
        admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        schema = "soak_" + uuid.uuid4().hex[:12]
        with admin.connect() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        url = _pg_schema_url(schema)
    else:
        url = f"sqlite:///{tempfile.mkdtemp(prefix='gcworker-soak-')}/gcworker.db"

    started = time.monotonic()
    done = threading.Event()

    def progress():
        while not done.wait(60):
            stats = model.STATS
            print(
                f"  {time.monotonic() - started:6.0f} s: {stats['examples']} examples, "
                f"{stats['steps']} steps",
                flush=True,
            )

    threading.Thread(target=progress, daemon=True).start()
    print(f"model soak on {args.backend}: {args.examples} examples of up to {args.steps} steps")
    failed = False
    try:
        stats = model.run_model(url, examples=args.examples, steps=args.steps)
    except BaseException as error:  # a falsifying example: hypothesis printed it
        failed = True
        stats = model.STATS
        print(f"FAILED: {type(error).__name__}: {error}")
    finally:
        done.set()
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            admin.dispose()
    seconds = time.monotonic() - started
    print(
        f"{'FAILED' if failed else 'passed'}: {stats['examples']} examples, {stats['steps']} "
        f"steps, {seconds:.0f} s ({args.backend})"
    )
    for name, count in sorted(stats.items()):
        if name not in ("examples", "steps", "seconds"):
            print(f"  {count:8d}  {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
