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
        expired = repo.expired_heartbeats(step.conn, step.now, states=("running",), ephemeral=False)
        stalled = repo.set_state(
            step.conn,
            expired,
            state="stalled",
            from_states=("running",),
            now=step.now,
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
        ephemeral = repo.expired_heartbeats(
            step.conn, step.now, states=("running", "stalled"), ephemeral=True
        )
        self._delete(ctx, step, repo, ephemeral, "ephemeral worker's heartbeat expired")
        retiring = repo.expired_heartbeats(step.conn, step.now, states=("retiring",))
        self._delete(ctx, step, repo, retiring, "retiring worker stopped heartbeating")
        timeout = ctx.settings.stalled_worker_timeout
        if timeout.total_seconds() > 0:
            stalled = repo.stalled_since_before(step.conn, step.now - timeout)
            self._delete(
                ctx,
                step,
                repo,
                stalled,
                f"stalled for longer than the stalled-worker timeout ({format_duration(timeout)})",
            )

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
    def _delete(ctx: CollectionContext, step: Step, repo: WorkerRepository, names, reason: str):
        """Delete workers with their rows, leaving their tombstones (rule 16), and audit every
        row that went with them (rule 13)."""
        for deleted in repo.delete(step.conn, names, reason=reason, now=step.now):
            ctx.record(step, deleted.audit(reason))
