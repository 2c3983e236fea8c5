"""The worker collector: heartbeat expiry and the worker lifecycle.

Running workers whose heartbeat expired stall (ephemeral ones are deleted, rows and all);
retiring workers that stopped heartbeating are deleted; landing workers land; stalled workers
past the stalled-worker timeout are pruned. A deleted worker leaves a tombstone (rule 16), and
every row that goes with it is audited. In disruption mode (rule 12) it stalls and deletes no
one.
"""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext, Step
from gcworker.settings import format_duration


class WorkerCollector:
    name = "workers"

    def run(self, ctx: CollectionContext) -> None:
        repo = WorkerRepository(ctx.db)
        with ctx.step() as step:
            if not ctx.disrupted:
                self._stall_expired(ctx, step, repo)
                self._delete_gone(ctx, step, repo)
            self._land(ctx, step, repo)

    @staticmethod
    def _stall_expired(ctx: CollectionContext, step: Step, repo: WorkerRepository) -> None:
        expiry = {"states": ("running",), "ephemeral": False}
        expired = repo.expired_heartbeats(step.conn, step.now, **expiry)
        stalled = repo.set_state(
            step.conn,
            expired,
            state="stalled",
            from_states=("running",),
            now=step.now,
            still=repo.heartbeat_expired(step.now, **expiry),
            stalled_at=step.now,
        )
        ctx.record(
            step,
            [
                AuditEntry("stall", "worker", name, "heartbeat expired", worker=name)
                for name in stalled
            ],
        )

    def _delete_gone(self, ctx: CollectionContext, step: Step, repo: WorkerRepository) -> None:
        """Each kind of worker to delete is chosen by a condition that is checked again under
        each worker's lock: a heartbeat that committed since keeps its worker."""
        gone = [
            (
                repo.heartbeat_expired(step.now, states=("running", "stalled"), ephemeral=True),
                "ephemeral worker's heartbeat expired",
            ),
            (
                repo.heartbeat_expired(step.now, states=("retiring",)),
                "retiring worker stopped heartbeating",
            ),
        ]
        timeout = ctx.settings.stalled_worker_timeout
        if timeout.total_seconds() > 0:
            gone.append(
                (
                    repo.stalled_before(step.now - timeout),
                    "stalled for longer than the stalled-worker timeout "
                    f"({format_duration(timeout)})",
                )
            )
        for condition, reason in gone:
            names = repo.names_where(step.conn, condition)
            self._delete(ctx, step, repo, names, reason, condition)

    @staticmethod
    def _land(ctx: CollectionContext, step: Step, repo: WorkerRepository) -> None:
        landing = set(repo.expired_heartbeats(step.conn, step.now, states=("landing",)))
        landing |= set(repo.landing_without_active_containers(step.conn))
        landed = repo.set_state(
            step.conn, landing, state="landed", from_states=("landing",), now=step.now
        )
        ctx.record(
            step,
            [
                AuditEntry(
                    "land",
                    "worker",
                    name,
                    "landing worker has no active containers or stopped heartbeating",
                    worker=name,
                )
                for name in landed
            ],
        )

    @staticmethod
    def _delete(
        ctx: CollectionContext, step: Step, repo: WorkerRepository, names, reason: str, still
    ):
        """Delete workers with their rows, leaving their tombstones (rule 16), and audit every
        row that went with them (rule 13)."""
        for deleted in repo.delete(step.conn, names, reason=reason, now=step.now, still=still):
            ctx.record(step, deleted.audit(reason))
