"""The control plane as one object built from settings: what the CLI, the Celery tasks and the
demo call. It opens the database and wires the reconciler, the scheduler, the fleet actions, the
collector and the listings to it."""

from __future__ import annotations

from gcworker.db.audit import AuditRepository
from gcworker.db.database import Database
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.migrate import require_current
from gcworker.db.workers import WorkerRepository
from gcworker.fleet import Fleet
from gcworker.gc.collection import CollectionSummary, collect
from gcworker.reconcile import Reconciler
from gcworker.scheduler import Scheduler
from gcworker.settings import Settings


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

    def destroying_handles(self, worker: str) -> dict[str, list[str]]:
        """What `worker` should remove: its rows in `destroying`, by kind."""
        with self.db.transaction() as conn:
            return {
                repo.kind: repo.handles_in_state(conn, worker, "destroying")
                for repo in (ContainerRepository(self.db), VolumeRepository(self.db))
            }

    def events(self, limit: int | None = None) -> list[dict]:
        with self.db.transaction() as conn:
            return AuditRepository().list(conn, limit)

    def close(self) -> None:
        self.db.dispose()
