"""The worker collector: heartbeat expiry and the worker lifecycle.

Running workers whose heartbeat expired stall (ephemeral ones are deleted, rows and all);
retiring workers that stopped heartbeating are deleted; landing workers land; stalled workers
past the stalled-worker timeout are pruned.
"""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext, Step


class WorkerCollector:
    name = "workers"

    def run(self, ctx: CollectionContext) -> None:
        repo = WorkerRepository(ctx.db)
        with ctx.step() as step:
            expired = repo.expired_heartbeats(
                step.conn, step.now, states=("running",), ephemeral=False
            )
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
                (
                    AuditEntry("stall", "worker", name, "heartbeat expired", worker=name)
                    for name in stalled
                ),
            )
            self._delete(
                ctx,
                step,
                repo,
                repo.expired_heartbeats(
                    step.conn,
                    step.now,
                    states=("running", "stalled"),
                    ephemeral=True,
                ),
                "ephemeral worker's heartbeat expired",
            )
            self._delete(
                ctx,
                step,
                repo,
                repo.expired_heartbeats(
                    step.conn,
                    step.now,
                    states=("retiring",),
                ),
                "retiring worker stopped heartbeating",
            )
            landing = set(repo.expired_heartbeats(step.conn, step.now, states=("landing",)))
            landing |= set(repo.landing_without_active_containers(step.conn))
            landed = repo.set_state(
                step.conn, landing, state="landed", from_states=("landing",), now=step.now
            )
            ctx.record(
                step,
                (
                    AuditEntry(
                        "land",
                        "worker",
                        name,
                        "landing worker has no active containers or stopped heartbeating",
                        worker=name,
                    )
                    for name in landed
                ),
            )
            timeout = ctx.settings.stalled_worker_timeout
            if timeout.total_seconds() > 0:
                self._delete(
                    ctx,
                    step,
                    repo,
                    repo.stalled_since_before(
                        step.conn,
                        step.now - timeout,
                    ),
                    f"stalled for longer than the stalled-worker timeout ({timeout})",
                )

    @staticmethod
    def _delete(
        ctx: CollectionContext, step: Step, repo: WorkerRepository, names, reason: str
    ) -> None:
        counts = {name: repo.row_counts(step.conn, name) for name in names}
        deleted = repo.delete(step.conn, names)
        ctx.record(
            step,
            (
                AuditEntry(
                    "delete",
                    "worker",
                    name,
                    f"{reason}; {counts[name]['containers']} containers and "
                    f"{counts[name]['volumes']} volumes deleted with it",
                    worker=name,
                )
                for name in deleted
            ),
        )
