"""The scheduler's side: recording containers and volumes before asking a worker to create them,
and moving them through their lifecycle (`creating -> created -> destroying`, `creating ->
failed -> destroying`). An impossible request raises `GcworkerError` and changes nothing.
"""

from __future__ import annotations

from sqlalchemy import Connection

from gcworker.db.database import Database
from gcworker.db.inventory import ContainerRepository, InventoryRepository, VolumeRepository
from gcworker.db.workers import WorkerRepository
from gcworker.errors import Conflict, NotFound
from gcworker.messages import check_handle

# to_state -> the states a row may leave for it
TRANSITIONS = {
    "created": ("creating",),
    "failed": ("creating",),
    "destroying": ("created", "failed"),
}


class Scheduler:
    def __init__(self, db: Database):
        self.db = db
        self.workers = WorkerRepository(db)
        self.containers = ContainerRepository(db)
        self.volumes = VolumeRepository(db)

    # Containers --------------------------------------------------------------------------

    def create_container(self, worker: str, handle: str) -> None:
        check_handle(handle)
        with self.db.transaction() as conn:
            self._lock_running_worker(conn, worker)
            self._refuse_taken_handle(conn, self.containers, handle)
            self.containers.insert_creating(
                conn, worker=worker, handle=handle, now=self.db.now(conn)
            )

    def container_created(self, handle: str) -> None:
        self._move(self.containers, handle, "created")

    def fail_container(self, handle: str) -> None:
        self._move(self.containers, handle, "failed")

    def destroy_container(self, handle: str) -> None:
        self._move(self.containers, handle, "destroying")

    # Volumes -----------------------------------------------------------------------------

    def create_volume(
        self, worker: str, handle: str, *, parent: str | None = None, container: str | None = None
    ) -> None:
        check_handle(handle)
        with self.db.transaction() as conn:
            self._lock_running_worker(conn, worker)
            self._refuse_taken_handle(conn, self.volumes, handle)
            extra = {}
            if parent is not None:
                parent_row = self._related(conn, self.volumes, parent, worker, "parent volume")
                if parent_row["state"] != "created":
                    raise Conflict(
                        f"parent volume {parent!r} is {parent_row['state']}, not created"
                    )
                extra["parent_id"] = parent_row["id"]
            if container is not None:
                owner = self._related(conn, self.containers, container, worker, "container")
                if owner["state"] not in ("creating", "created"):
                    raise Conflict(f"container {container!r} is {owner['state']}")
                extra.update(container_id=owner["id"], container_owned=True)
            self.volumes.insert_creating(
                conn, worker=worker, handle=handle, now=self.db.now(conn), **extra
            )

    def volume_created(self, handle: str) -> None:
        self._move(self.volumes, handle, "created")

    def fail_volume(self, handle: str) -> None:
        self._move(self.volumes, handle, "failed")

    def destroy_volume(self, handle: str) -> None:
        self._move(self.volumes, handle, "destroying")

    # Shared ------------------------------------------------------------------------------

    def _move(self, repo: InventoryRepository, handle: str, to_state: str) -> None:
        with self.db.transaction() as conn:
            row = repo.find(conn, handle)
            if row is None:
                raise NotFound(f"unknown {repo.kind} {handle!r}")
            # Lock the worker first, as a report does, so the two never interleave.
            self.workers.bump_generation(conn, [row["worker_name"]])
            row = repo.find(conn, handle, lock=True)
            if row is None:
                raise NotFound(f"unknown {repo.kind} {handle!r}")
            allowed = TRANSITIONS[to_state]
            if row["state"] not in allowed:
                raise Conflict(
                    f"{repo.kind} {handle!r} is {row['state']}: it cannot become {to_state} "
                    f"(only from {' or '.join(allowed)})"
                )
            if (
                to_state == "destroying"
                and repo is self.volumes
                and self.volumes.has_children(conn, row["id"])
            ):
                raise Conflict(f"volume {handle!r} has child volumes: destroy them first")
            repo.transition(
                conn, handle, from_states=allowed, to_state=to_state, now=self.db.now(conn)
            )

    def _lock_running_worker(self, conn: Connection, name: str) -> None:
        worker = self.workers.lock(conn, name)
        if worker is None:
            raise NotFound(f"unknown worker {name!r}")
        if worker.state != "running":
            raise Conflict(
                f"worker {name!r} is {worker.state}: new rows go to running workers only"
            )
        self.workers.bump_generation(conn, [name])

    @staticmethod
    def _refuse_taken_handle(conn: Connection, repo: InventoryRepository, handle: str) -> None:
        existing = repo.find(conn, handle)
        if existing is not None:
            raise Conflict(
                f"{repo.kind} handle {handle!r} already exists (on worker "
                f"{existing['worker_name']!r}, {existing['state']})"
            )

    @staticmethod
    def _related(
        conn: Connection, repo: InventoryRepository, handle: str, worker: str, what: str
    ) -> dict:
        row = repo.find(conn, handle)
        if row is None:
            raise NotFound(f"unknown {what} {handle!r}")
        if row["worker_name"] != worker:
            raise Conflict(f"{what} {handle!r} is on worker {row['worker_name']!r}, not {worker!r}")
        return row
