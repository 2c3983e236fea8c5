"""The destroying hand-off: how a reporter learns, in broker mode, which of its worker's handles
the control plane holds as `destroying` (so that the worker removes them, rules 8-10).

The reporter cannot read the database, and the reconciler cannot reach the worker; they meet in
Redis. After applying each heartbeat or report, the reconciler task leaves there its answers,
sealed with the control plane's key (`gcworker.answers`): a *stamp* (its clock, the worker's
incarnation and generation, the message answered) and a *snapshot* of the worker's destroying
handles (the destroy list); the reporter reads them after each report it sends.

Keys (N is `GCWORKER_BROKER_NAMESPACE`, W the worker's name; `{W}` is a Redis Cluster hash tag,
so one worker's keys share a slot and one script can replace them together):

    N:destroying:{W}:list           the sealed destroy list
    N:destroying:{W}:version        its version (below), as an integer
    N:destroying:{W}:generation     the worker's generation (`workers.generation`) it was read at
    N:destroying:{W}:stamp          the sealed stamp
    N:destroying:{W}:stamp-version  its version

Writing (`publish_snapshot`, run by the report and heartbeat tasks after their transaction):

1. One read-only statement (no lock, no transaction of its own to commit) reads the worker's
   `generation`, which every change to the worker or to its rows bumps, and the control plane's
   clock at the statement's start: the statement reads in a snapshot taken after that instant,
   so the generation it sees includes every transaction committed before it.
2. If the stored snapshot was read at that same generation, nothing it lists can have changed
   since: one Lua script only moves its version forward to this clock (`refresh`), if the stored
   version is older and its generation still that one. This is the steady state, and it reads no
   handle at all.
3. Otherwise (another generation, no snapshot stored, or it expired) one short transaction locks
   the worker's row, exactly as a report does, reads the clock, the generation and the worker's
   `destroying` handles, at most `SNAPSHOT_LIMIT` per kind (the reporter removes only a few per
   report anyway); one Lua script replaces the four keys if, and only if, its version is higher
   than the stored one (`publish`).

A snapshot's version is a control plane time such that the snapshot reflects everything committed
before it: for a full snapshot, the clock read under the worker's row lock (snapshots read one
at a time in lock order, so a later one has a higher version); for a refresh, the start of the
statement that read the generation, which is the generation the stored handles were read at, so
nothing they list changed between their reading and that instant. The scripts only ever store a
higher version, and a refresh only over handles of the same generation: two reconcilers that
finish out of order cannot put an older snapshot over a newer one, nor a newer version on
handles that changed since; each replacement is atomic, so a reader never sees half of a
snapshot. Every key
expires after `key_ttl` (ten report intervals, at least ten minutes), counted again at each
refresh: a worker that stops reporting leaves nothing behind, and its reporter then simply
removes nothing.

The stamp must keep moving while nothing changes: the reporter dates its next report from it
(`Feedback.as_of`, the `after` of a report, rule 4), so a stamp stuck at the last change would
hold back every confirmation of an absence. A refresh stores a new stamp at every answer.

Reading (`feedback`, by `gcworker.broker.BrokerChannel`): the stamp, the list and the full-report
request in one MULTI; each answer is kept only if the control plane sealed it for this worker.
What the reporter then believes of them (current stamp, list of the same generation, handles held
at every listing since the one the stamp answers) is `gcworker.reporter`'s to judge: anyone who
can write to Redis can write these keys, and handles may be reused once their row is gone. A
change made between reports (the scheduler destroying a container, the collector failing a stuck
one) reaches the reporter with the answer that follows the worker's next message.

The other answer: "send a full report". When a compact unchanged report cannot be confirmed
(unknown digest, or the worker's rows changed since), the report task sets

    N:destroying:{W}:full-report  "1", with the same expiry

and the reporter reads and deletes it together with the answers (`feedback`), so that its next
report is a full one. Setting it twice is harmless; losing it (expiry) only delays the full
report until the reporter's own bound (`full_report_every`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import bindparam, func, select

from gcworker import metrics
from gcworker.answers import DestroyList, Stamp, Untrusted, seal, unseal
from gcworker.db.database import Database, prepared_form
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.keys import active_key_select, active_key_statement
from gcworker.db.oneshot import execute_one
from gcworker.db.tables import workers
from gcworker.db.workers import WorkerRepository
from gcworker.delivery import Feedback

log = logging.getLogger(__name__)

SNAPSHOT_LIMIT = 1000
MIN_KEY_TTL = timedelta(minutes=10)

# KEYS: list, version, generation, stamp, stamp version.
# ARGV: version, ttl, generation, sealed list, sealed stamp.
_REPLACE_IF_NEWER = """
local ttl = tonumber(ARGV[2])
local stamp_version = redis.call('GET', KEYS[5])
if not stamp_version or tonumber(stamp_version) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[4], ARGV[5], 'EX', ttl)
  redis.call('SET', KEYS[5], ARGV[1], 'EX', ttl)
end
local current = redis.call('GET', KEYS[2])
if current and tonumber(current) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[4], 'EX', ttl)
redis.call('SET', KEYS[2], ARGV[1], 'EX', ttl)
redis.call('SET', KEYS[3], ARGV[3], 'EX', ttl)
return 1
"""

# KEYS: as above. ARGV: version, ttl, generation, sealed stamp.
# 1: moved forward; 0: a stamp as new or newer is there already; -1: no list stored, or one of
# another generation (a full snapshot is needed).
_REFRESH_IF_SAME_GENERATION = """
local current = redis.call('GET', KEYS[5])
if current and tonumber(current) >= tonumber(ARGV[1]) then
  return 0
end
if not redis.call('GET', KEYS[2]) or redis.call('GET', KEYS[3]) ~= ARGV[3] then
  return -1
end
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[4], ARGV[4], 'EX', ttl)
redis.call('SET', KEYS[5], ARGV[1], 'EX', ttl)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return 1
"""

REFRESHED, NEWER_STORED, FULL_NEEDED = 1, 0, -1
LIST_AND_STAMP_KEYS = ("list", "version", "generation", "stamp", "stamp-version")


@dataclass(frozen=True)
class Head:
    """The worker's generation and incarnation, and the control plane's clock at the start of
    the statement that read them (so every transaction committed before that instant is
    included): what a refresh, and a stamp, need."""

    worker: str
    version: int
    generation: int
    incarnation: int

    def stamp(self, seq: int) -> Stamp:
        """The stamp answering the worker's message `seq` (`gcworker.answers`)."""
        return Stamp(
            worker=self.worker,
            incarnation=self.incarnation,
            generation=self.generation,
            as_of=self.version,
            seq=seq,
        )


@dataclass(frozen=True)
class Snapshot:
    """The worker's destroying handles, read under its row lock at `head`."""

    head: Head
    handles: dict[str, list[str]] = field(default_factory=dict)
    seq: int = 0  # the worker's newest message applied when it was read

    @property
    def worker(self) -> str:
        return self.head.worker

    @property
    def version(self) -> int:
        return self.head.version

    def destroy_list(self) -> DestroyList:
        return DestroyList(
            worker=self.head.worker,
            incarnation=self.head.incarnation,
            generation=self.head.generation,
            as_of=self.head.version,
            containers=self.handles.get("container", []),
            volumes=self.handles.get("volume", []),
        )


def version_of(now: datetime) -> int:
    return int(now.timestamp() * 1_000_000)


def read_head(db: Database, worker: str) -> Head | None:
    """`Head` of the worker, in one statement (its own transaction); None for an unknown one."""
    if not db.is_postgresql:  # embedded mode: SQLite, one writer at a time
        with db.transaction() as conn:
            view = WorkerRepository(db).lock(conn, worker)
            now = db.now(conn)
        return None if view is None else _head(view, now)
    row = execute_one(db, _head_statement(), {"p_name": worker}, prepared="gcworker_head")
    if row is None:
        return None
    return Head(worker, version_of(db.clock(row.clock_now)), row.generation, row.incarnation)


def _head(view, now: datetime) -> Head:
    return Head(view.name, version_of(now), view.generation, view.incarnation)


@functools.cache
def _head_statement():
    # statement_timestamp(): set before the statement takes its snapshot. No lock: a lock would
    # give the statement a transaction id and a commit that waits for the disk.
    return select(
        workers.c.generation, workers.c.incarnation, func.statement_timestamp().label("clock_now")
    ).where(workers.c.name == bindparam("p_name"))


class KeyAndHead:
    """The decoder's `public_key_of` for a report task: the worker's active key and its `Head`,
    in one statement (PostgreSQL; elsewhere the key alone), which `prefetch` sends as soon as
    the message names its worker, so that its round trip runs while the message is validated,
    on the process's `KeyReader` (an asynchronous connection: no thread); without one, the key
    is read when it is asked for.

    The key is the one active when the statement runs, after the message arrived: as exact as
    `ControlPlane.public_key_of`. The head is read before the report is applied, so it says
    nothing of what the report itself changes; it serves to refresh the stored snapshot, which
    is exact on its own terms whatever happens next: the refresh applies only over handles read
    at that generation, and its version, the statement's start, is earlier than the report (the
    snapshot's `as_of` still moves at every report)."""

    def __init__(self, db: Database, reader: KeyReader | None = None):
        self.db = db
        self.reader = reader
        self.head: Head | None = None
        self._prefetched: str | None = None  # the worker whose key the reader was sent for

    def prefetch(self, worker: str) -> None:
        if self.reader is None or not self.db.is_postgresql or len(worker) > 200:
            return
        try:
            self.reader.send(worker)
        except Exception as error:  # noqa: BLE001 - read again the ordinary way
            self.reader.broken(error)
            return
        self._prefetched = worker

    def __call__(self, worker: str) -> str | None:
        prefetched, self._prefetched = self._prefetched, None
        answer = self._received(worker) if prefetched == worker else None
        if answer is None:
            answer = self._read(worker)
        key, self.head = answer
        return key

    def _received(self, worker: str) -> tuple[str | None, Head | None] | None:
        try:
            row = self.reader.receive()
        except Exception as error:  # noqa: BLE001 - read again the ordinary way
            self.reader.broken(error)
            return None
        return self._answer(worker, row)

    def _read(self, worker: str) -> tuple[str | None, Head | None]:
        if not self.db.is_postgresql:
            with self.db.transaction() as conn:
                return conn.execute(active_key_statement(), {"p_worker": worker}).scalar(), None
        row = execute_one(
            self.db, _key_and_head_statement(), {"p_name": worker}, prepared="gcworker_key_head"
        )
        return self._answer(worker, row)

    def _answer(self, worker: str, row) -> tuple[str | None, Head | None]:
        public_key, generation, incarnation, clock_now = row
        if generation is None:
            return public_key, None
        head = Head(worker, version_of(self.db.clock(clock_now)), generation, incarnation)
        return public_key, head


class KeyReader:
    """A psycopg2 asynchronous connection of this process for the key-and-head statement: `send`
    returns once the statement is sent, `receive` waits for its row. One statement at a time; a
    row nobody asked for (its message was rejected first) is read and dropped by the next send.
    A broken connection is closed, reopened at the next send, and meanwhile the statement runs
    the ordinary way."""

    TIMEOUT_S = 30.0

    def __init__(self, db: Database):
        self.db = db
        self._conn = None
        self._cursor = None
        self._pid: int | None = None
        self._pending = False

    def send(self, worker: str) -> None:
        if self._conn is None or self._pid != os.getpid():
            self._open()
        if self._pending:
            self.receive()
        self._cursor.execute("EXECUTE gcworker_key_head_async(%s)", (worker,))
        self._pending = True

    def receive(self):
        self._wait()
        self._pending = False
        return self._cursor.fetchone()

    def broken(self, error: Exception) -> None:
        log.warning(
            "key reader connection dropped: reading the ordinary way until it reopens",
            extra={"error": f"{type(error).__name__}: {error}"},
        )
        self.close()

    def close(self) -> None:
        conn, self._conn, self._cursor, self._pending = self._conn, None, None, False
        if conn is not None and self._pid == os.getpid():
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - closing a broken connection
                pass

    def _open(self) -> None:
        import psycopg2

        self._conn = None  # a connection inherited through fork is the parent's: never used
        engine = self.db.engine
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        conn = psycopg2.connect(*args, **kwargs, async_=1)
        self._conn, self._pid, self._pending = conn, os.getpid(), False
        self._wait()
        self._cursor = conn.cursor()
        self._cursor.execute(
            "PREPARE gcworker_key_head_async " + prepared_form(_key_and_head_statement())[0]
        )
        self._wait()

    def _wait(self) -> None:
        import select

        import psycopg2.extensions as ext

        deadline = time.monotonic() + self.TIMEOUT_S
        while True:
            state = self._conn.poll()
            if state == ext.POLL_OK:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the database")
            if state == ext.POLL_READ:
                select.select([self._conn.fileno()], [], [], left)
            elif state == ext.POLL_WRITE:
                select.select([], [self._conn.fileno()], [], left)


@functools.cache
def _key_and_head_statement():
    key = active_key_select(bindparam("p_name"))
    generation = select(workers.c.generation).where(workers.c.name == bindparam("p_name"))
    incarnation = select(workers.c.incarnation).where(workers.c.name == bindparam("p_name"))
    return select(
        key.scalar_subquery().label("public_key"),
        generation.scalar_subquery().label("generation"),
        incarnation.scalar_subquery().label("incarnation"),
        func.statement_timestamp().label("clock_now"),
    )


def take_snapshot(db: Database, worker: str, limit: int = SNAPSHOT_LIMIT) -> Snapshot | None:
    """The worker's destroying handles, read under its row lock, versioned by the DB clock;
    None for an unknown worker."""
    with db.transaction() as conn:
        view = WorkerRepository(db).lock(conn, worker)
        if view is None:
            return None
        now = db.now(conn)
        handles = {
            repo.kind: repo.handles_in_state(conn, worker, "destroying", limit)
            for repo in (ContainerRepository(db), VolumeRepository(db))
        }
    seq = max(s for s in (view.last_heartbeat_seq, view.last_report_seq, 0) if s is not None)
    return Snapshot(_head(view, now), handles, seq)


class DestroyingBoard:
    """The Redis side of the hand-off: the reconciler publishes answers sealed with the control
    plane's key (`signing_key`; None: unsigned), the reporter reads them and keeps those that
    `public_key` verifies (or, with `allow_unsigned`, unsigned ones too)."""

    def __init__(
        self,
        redis_client,
        namespace: str,
        key_ttl: timedelta = MIN_KEY_TTL,
        *,
        signing_key: Ed25519PrivateKey | None = None,
        public_key: str | None = None,
        allow_unsigned: bool = False,
    ):
        self.redis = redis_client
        self.namespace = namespace
        self.key_ttl = max(key_ttl, MIN_KEY_TTL)
        self.signing_key = signing_key
        self.public_key = public_key
        self.allow_unsigned = allow_unsigned
        self._replace = redis_client.register_script(_REPLACE_IF_NEWER)
        self._refresh = redis_client.register_script(_REFRESH_IF_SAME_GENERATION)

    @classmethod
    def from_settings(cls, settings, redis_client=None) -> DestroyingBoard:
        import redis

        client = redis_client or redis.Redis.from_url(settings.broker_url, decode_responses=True)
        return cls(
            client,
            settings.broker_namespace,
            10 * settings.report_interval,
            signing_key=settings.control_plane_signing_key(),
            public_key=settings.control_plane_public_key,
            allow_unsigned=settings.allow_unsigned,
        )

    def keys(self, worker: str) -> list[str]:
        """The list, its version and generation, the stamp and its version."""
        base = f"{self.namespace}:destroying:{{{worker}}}"
        return [f"{base}:{name}" for name in LIST_AND_STAMP_KEYS]

    @property
    def _ttl(self) -> int:
        return int(self.key_ttl.total_seconds())

    def publish(self, snapshot: Snapshot, seq: int) -> bool:
        """Store the snapshot unless a newer one is there, and its stamp answering the worker's
        message `seq` unless a newer stamp is there; True if the snapshot was stored."""
        head = snapshot.head
        stored = self._replace(
            keys=self.keys(head.worker),
            args=[
                head.version,
                self._ttl,
                str(head.generation),
                seal(snapshot.destroy_list(), self.signing_key),
                seal(head.stamp(seq), self.signing_key),
            ],
        )
        return bool(stored)

    def refresh(self, head: Head, seq: int) -> int:
        """Stamp `head` (answering the worker's message `seq`) if the stored list was read at
        `head.generation`: `REFRESHED`, `NEWER_STORED` (nothing to do), or `FULL_NEEDED`."""
        return int(
            self._refresh(
                keys=self.keys(head.worker),
                args=[
                    head.version,
                    self._ttl,
                    str(head.generation),
                    seal(head.stamp(seq), self.signing_key),
                ],
            )
        )

    def feedback(self, worker: str) -> Feedback:
        """The worker's newest stamp and destroy list, each kept only if the control plane
        sealed it for this worker (`gcworker.answers`), and whether the control plane asked for
        a full report; reading the request consumes it."""
        list_key, _, _, stamp_key, _ = self.keys(worker)
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(stamp_key)
        pipe.get(list_key)
        pipe.getdel(self.full_report_key(worker))
        stamp, destroy_list, wanted = pipe.execute()
        return Feedback(
            self._unsealed(stamp, Stamp, worker),
            self._unsealed(destroy_list, DestroyList, worker),
            wanted is not None,
        )

    def _unsealed(self, sealed: str | None, kind, worker: str):
        if sealed is None:
            return None
        try:
            return unseal(
                sealed,
                kind,
                worker,
                public_key=self.public_key,
                allow_unsigned=self.allow_unsigned,
            )
        except Untrusted as untrusted:
            metrics.REPORTER_ANSWERS_IGNORED.labels(kind.__name__.lower(), "untrusted").inc()
            log.warning(
                "control plane answer ignored: not trusted",
                extra={"worker": worker, "answer": kind.__name__, "reason": str(untrusted)},
            )
            return None

    def full_report_key(self, worker: str) -> str:
        return f"{self.namespace}:destroying:{{{worker}}}:full-report"

    def want_full_report(self, worker: str) -> None:
        self.redis.set(self.full_report_key(worker), "1", ex=self._ttl)

    def version(self, worker: str) -> int | None:
        """The stored stamp's version (the newest control-plane time the worker can read)."""
        value = self.redis.get(self.keys(worker)[4])
        return int(value) if value is not None else None


class ReportHandoff:
    """The hand-off of one report task (`tasks.reconcile.reconcile_report`), in as few round
    trips as possible:

    - the report's key is read with the worker's `Head` (`KeyAndHead`, one statement), sent on
      the process's `KeyReader` from the moment the message names its worker, while the message
      is validated;
    - once the report is known authentic, the stored snapshot is refreshed from that head in a
      background thread of this process, while the report is applied: the refresh is exact on
      its own terms whatever the report then does (`KeyAndHead`);
    - after a report that changed nothing (the fast path) and a refresh that applied (or found a
      newer snapshot), that is all; otherwise `publish_snapshot` reads a head after the report
      and refreshes or publishes in full, as for any report.
    """

    def __init__(self, db: Database, board: DestroyingBoard, reader: KeyReader | None = None):
        self.db = db
        self.board = board
        self.lookup = KeyAndHead(db, reader)
        self._refresh: Future | None = None
        self._seq: int | None = None  # the report's, once it is known authentic

    def public_key_of(self, worker: str) -> str | None:
        return self.lookup(worker)

    def claimed(self, worker: str) -> None:
        self.lookup.prefetch(worker)

    def checked(self, message) -> None:
        self._seq = message.seq
        head = self.lookup.head
        if head is not None and head.worker == message.worker and message.type != "heartbeat":
            self._refresh = _background().submit(self.board.refresh, head, message.seq)

    def finish(self, result) -> Snapshot | Head | None:
        """After the report's transaction: the refresh's answer, or a snapshot published."""
        refreshed = FULL_NEEDED
        if self._refresh is not None:
            try:
                refreshed = self._refresh.result()
            except Exception as error:  # noqa: BLE001 - publish_snapshot tries again and logs
                log.debug("early refresh failed", extra={"error": f"{type(error).__name__}"})
            self._refresh = None
        if result.fast_path and refreshed != FULL_NEEDED:
            return self.lookup.head
        return publish_snapshot(self.db, self.board, result.worker, self._seq)


_executor: ThreadPoolExecutor | None = None
_executor_pid: int | None = None


def _background() -> ThreadPoolExecutor:
    """One thread per process (created in the process that uses it: a Celery pool process is
    forked before its first task) for the hand-off's Redis round trips."""
    global _executor, _executor_pid
    if _executor is None or _executor_pid != os.getpid():
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcworker-handoff")
        _executor_pid = os.getpid()
    return _executor


def publish_snapshot(
    db: Database, board: DestroyingBoard, worker: str, seq: int, head: Head | None = None
) -> Snapshot | Head | None:
    """Answer the worker's report `seq`: refresh the worker's stored snapshot with a new stamp
    if nothing changed since it was read, else take and publish a new one (module docstring);
    a failure is logged, never raised (the report itself is committed, and the next report
    publishes a fresh snapshot). `head`, when given, was read along with the report's key
    (`KeyAndHead`), for a report that changed nothing. An unknown worker gets no answer."""
    try:
        head = head or read_head(db, worker)
        if head is None:
            return None
        if board.refresh(head, seq) != FULL_NEEDED:
            return head
        snapshot = take_snapshot(db, worker)
        if snapshot is None:
            return None
        stored = board.publish(snapshot, seq)
    except Exception as error:  # noqa: BLE001 - the hand-off must never fail a committed report
        log.warning(
            "destroying hand-off failed: the reporter learns at the next report",
            extra={"worker": worker, "error": f"{type(error).__name__}: {error}"},
        )
        return None
    log.debug(
        "destroying handles handed off",
        extra={
            "worker": worker,
            "containers": len(snapshot.handles["container"]),
            "volumes": len(snapshot.handles["volume"]),
            "stored": stored,
        },
    )
    return snapshot

