"""The collection fence (rule 11): at most one collection runs at any moment.

On PostgreSQL, a session-level advisory lock taken by the very connection that makes the
collection's changes: if that collector stalls, it still holds the lock, and if it dies, the
server ends its session and the lock with it, so a successor never runs beside it. On SQLite
(one host), an exclusive `flock` on a file beside the database, which the kernel releases when
the process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Connection, func, select

COLLECTION_LOCK_KEY = 0x6763_776F  # "gcwo"; the second key is the schema's, see _lock_keys
_memory_lock = threading.Lock()


@contextlib.contextmanager
def collection_fence(conn: Connection) -> Iterator[bool]:
    """Yields True while holding the fence, False when another collection holds it."""
    if conn.dialect.name == "postgresql":
        with _advisory_lock(conn) as held:
            yield held
        return
    database = conn.engine.url.database
    if not database or database == ":memory:":
        acquired = _memory_lock.acquire(blocking=False)
        try:
            yield acquired
        finally:
            if acquired:
                _memory_lock.release()
        return
    with _file_lock(Path(database + ".collect.lock")) as held:
        yield held


@contextlib.contextmanager
def _advisory_lock(conn: Connection) -> Iterator[bool]:
    held = conn.execute(select(func.pg_try_advisory_lock(*_lock_keys()))).scalar_one()
    conn.commit()
    try:
        yield held
    finally:
        if held:
            if conn.in_transaction():
                conn.rollback()
            conn.execute(select(func.pg_advisory_unlock(*_lock_keys())))
            conn.commit()


def _lock_keys():
    # Advisory locks are database-wide: one gcworker schema's collections must not fence out
    # another's (several schemas in one PostgreSQL database, as the tests use).
    return COLLECTION_LOCK_KEY, func.hashtext(func.current_schema())


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
