"""The collection fence (rule 11): at most one collection runs at any moment.

On PostgreSQL, a session-level advisory lock taken by the very connection that makes the
collection's changes: if that collector stalls, it still holds the lock, and if it dies, the
server ends its session and the lock with it, so a successor never runs beside it. So that a
collector whose process is stopped or hangs, or whose host dies, does not hold the fence until
TCP gives up (hours), the fenced session gets limits scaled on the GC interval
(`session_limits`): the server ends it once it waits for a lock, sits idle (in a transaction or
not) or runs one statement for too long, or once its host stops answering keepalives. A
collector cut off so finds its connection gone at its next statement: it writes nothing more.
On SQLite (one host), an exclusive `flock` on a file beside the database, which the kernel
releases when the process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Connection, func, select, text

COLLECTION_LOCK_KEY = 0x6763_776F  # "gcwo"; the second key is the schema's, see _lock_keys
# The least patience a fenced session gets, whatever the GC interval: a batch may wait for a
# report's lock, and a loaded server may be slow.
MIN_PATIENCE = timedelta(seconds=5)
_memory_lock = threading.Lock()


def session_limits(gc_interval: timedelta, server_version: tuple[int, ...]) -> dict[str, str]:
    """The settings of a fenced session (PostgreSQL `server_version`, e.g. (15, 4)). With the
    patience `max(gc_interval, MIN_PATIENCE)`, a collector stopped or hung anywhere loses the
    fence within about two patiences (a lock wait ends in an error after one, and the aborted
    transaction then sits idle for another; a long statement takes four), and one whose host
    dies within about two as well (keepalives), so that collections resume within a few GC
    intervals. A healthy collection runs short statements back to back, nowhere near them."""
    patience = max(gc_interval, MIN_PATIENCE)
    ms = int(patience.total_seconds() * 1000)
    seconds = max(1, ms // 1000)
    limits = {
        "lock_timeout": f"{ms}ms",
        "statement_timeout": f"{4 * ms}ms",  # the planning statement over the cap reads much
        "idle_in_transaction_session_timeout": f"{ms}ms",
        # The server sees a dead client host through keepalives: probes after `seconds` idle.
        "tcp_keepalives_idle": str(seconds),
        "tcp_keepalives_interval": str(max(1, seconds // 3)),
        "tcp_keepalives_count": "3",
    }
    if server_version >= (14,):
        # Stopped between two steps (no transaction open), still holding the session's lock;
        # and a client gone while a statement runs.
        limits["idle_session_timeout"] = f"{ms}ms"
        limits["client_connection_check_interval"] = f"{ms}ms"
    return limits


@contextlib.contextmanager
def collection_fence(conn: Connection, gc_interval: timedelta | None = None) -> Iterator[bool]:
    """Yields True while holding the fence, False when another collection holds it. On
    PostgreSQL, with `gc_interval` (a collection; not a probe that only looks whether the
    fence is free), the session holding it gets `session_limits` until it lets it go."""
    if conn.dialect.name == "postgresql":
        with _advisory_lock(conn, gc_interval) as held:
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
def _advisory_lock(conn: Connection, gc_interval: timedelta | None) -> Iterator[bool]:
    held = conn.execute(select(func.pg_try_advisory_lock(*_lock_keys()))).scalar_one()
    limits = {}
    if held and gc_interval is not None:
        limits = session_limits(gc_interval, conn.dialect.server_version_info)
        conn.execute(
            select(*(func.set_config(name, value, False) for name, value in limits.items()))
        )
    conn.commit()
    try:
        yield held
    finally:
        # An invalidated connection lost its session, and the lock with it: nothing to let go
        # (and no new session to open for it).
        if held and not conn.invalidated:
            if conn.in_transaction():
                conn.rollback()
            conn.execute(select(func.pg_advisory_unlock(*_lock_keys())))
            # The connection goes back to the pool: it serves others without the limits.
            for name in limits:
                conn.execute(text(f"RESET {name}"))
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
