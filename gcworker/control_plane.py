"""The control plane as one object built from settings: what the CLI, the Celery tasks and the
demo call. It opens the database and wires the reconciler, the scheduler, the fleet actions, the
collector and the listings to it."""

from __future__ import annotations

import logging
from datetime import datetime

from gcworker.codec import Rejected, decode
from gcworker.db.audit import AuditRepository
from gcworker.db.database import Database
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.keys import DeadLetterRepository, KeyRepository, active_key_statement
from gcworker.db.migrate import require_current
from gcworker.db.oneshot import execute_one
from gcworker.db.workers import WorkerRepository
from gcworker.fleet import Fleet
from gcworker.gc.collection import CollectionSummary, collect
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.reconcile import HeartbeatResult, Reconciler, ReportResult
from gcworker.scheduler import Scheduler
from gcworker.settings import Settings

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(
        self, settings: Settings, db: Database | None = None, *, check_schema: bool = True
    ):
        self.settings = settings
        self.db = db or Database.from_url(settings.database_url)
        if check_schema:
            require_current(self.db.engine)
        self.reconciler = Reconciler(self.db, settings.heartbeat_ttl)
        self.scheduler = Scheduler(self.db)
        self.fleet = Fleet(self.db)

    def receive(self, envelope, hooks=None) -> HeartbeatResult | ReportResult | Rejected:
        """Decode, check and apply one message as it arrived; a rejected one (unreadable,
        unsigned, forged, or a replay the rules refuse) changes nothing but the dead-letter list.

        `hooks` (`gcworker.handoff.ReportHandoff`) may replace the key lookup and follow the
        message: `hooks.public_key_of(worker)` instead of `self.public_key_of` (it must read the
        active key as exactly), `hooks.claimed(worker)` with the worker a message names as soon
        as it is read (before it is validated or verified: to start reading its key), and
        `hooks.checked(message)` once the message is known authentic, before it is applied."""
        try:
            message = decode(
                envelope,
                hooks.public_key_of if hooks is not None else self.public_key_of,
                allow_unsigned=self.settings.allow_unsigned,
                max_bytes=self.settings.max_message_bytes,
                claimed=hooks.claimed if hooks is not None else None,
            )
        except Rejected as rejected:
            self.dead_letter(rejected)
            return rejected
        if hooks is not None:
            hooks.checked(message)
        result = self.apply(message)
        if result.outcome == "rejected":
            # Authentic but refused (an older incarnation, a deleted worker's: a replay).
            self.dead_letter(Rejected(result.reason, message.worker, envelope["payload"]))
        return result

    def apply(self, message: Heartbeat | Report | UnchangedReport):
        """Apply one checked message through the reconciler."""
        if isinstance(message, Heartbeat):
            return self.reconciler.heartbeat(message)
        if isinstance(message, UnchangedReport):
            return self.reconciler.unchanged(message)
        return self.reconciler.report(message)

    def public_key_of(self, worker: str) -> str | None:
        """The worker's active key, read from the database for every message, so that a key
        revoked (or replaced) verifies nothing from the moment the revocation commits: no cache
        could know of a revocation made elsewhere (another host, SQL) any sooner. One statement,
        its own transaction (`execute_one`): one round trip."""
        row = execute_one(
            self.db, active_key_statement(), {"p_worker": worker}, prepared="gcworker_active_key"
        )
        return None if row is None else row.public_key

    def dead_letter(self, rejected: Rejected) -> None:
        log.warning(
            "message rejected", extra={"worker": rejected.worker, "reason": rejected.reason}
        )
        with self.db.transaction() as conn:
            DeadLetterRepository().add(
                conn,
                now=self.db.now(conn),
                worker=rejected.worker,
                reason=rejected.reason,
                payload=rejected.payload,
                keep=self.settings.dead_letter_limit,
            )

    def dead_letters(self, limit: int | None = None) -> list[dict]:
        with self.db.transaction() as conn:
            return DeadLetterRepository().list(conn, limit)

    def register_key(self, worker: str, public_key: str, *, replace: bool = False) -> None:
        with self.db.transaction() as conn:
            KeyRepository().register(conn, worker, public_key, self.db.now(conn), replace=replace)

    def revoke_key(self, worker: str) -> None:
        with self.db.transaction() as conn:
            KeyRepository().revoke(conn, worker, self.db.now(conn))

    def keys(self) -> list[dict]:
        with self.db.transaction() as conn:
            return KeyRepository().list(conn)

    def collect(self, *, dry_run: bool = False) -> CollectionSummary:
        return collect(self.db, self.settings, dry_run=dry_run)

    def workers(self) -> list[dict]:
        with self.db.transaction() as conn:
            return WorkerRepository(self.db).list(conn)

    def containers(self, worker: str | None = None) -> list[dict]:
        with self.db.transaction() as conn:
            return ContainerRepository(self.db).list(conn, worker)

    def volumes(self, worker: str | None = None) -> list[dict]:
        with self.db.transaction() as conn:
            return VolumeRepository(self.db).list(conn, worker)

    def now(self) -> datetime:
        """The control plane's clock (the database's)."""
        with self.db.transaction() as conn:
            return self.db.now(conn)

    def destroying_handles(self, worker: str) -> dict[str, list[str]]:
        """What `worker` should remove: its rows in `destroying`, by kind."""
        return self.destroying_handles_as_of(worker)[1]

    def destroying_handles_as_of(self, worker: str) -> tuple[datetime, dict[str, list[str]]]:
        """The control plane's time, and what `worker` should remove as of then."""
        with self.db.transaction() as conn:
            now = self.db.now(conn)
            return now, {
                repo.kind: repo.handles_in_state(conn, worker, "destroying")
                for repo in (ContainerRepository(self.db), VolumeRepository(self.db))
            }

    def events(self, limit: int | None = None, *, worker=None, age=None, actions=()) -> list[dict]:
        """The audit, newest first: of `worker`, of the last `age` (a timedelta, by the control
        plane's clock), of `actions` only, when given."""
        with self.db.transaction() as conn:
            since = None if age is None else self.db.now(conn) - age
            return AuditRepository().list(
                conn, limit, worker=worker, since=since, actions=tuple(actions)
            )

    def worker(self, name: str) -> dict:
        """The worker named `name`; UnknownWorker (a NotFound) if there is none."""
        from gcworker.db.workers import UnknownWorker
        from gcworker.errors import NotFound

        with self.db.transaction() as conn:
            try:
                return WorkerRepository(self.db).get(conn, name)
            except UnknownWorker as error:
                raise NotFound(str(error)) from None

    def close(self) -> None:
        self.db.dispose()
