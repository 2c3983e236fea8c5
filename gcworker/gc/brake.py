"""The safety brake (rule 12): runs first in every collection and decides whether the collector
is in disruption mode.

The collector enters disruption mode when one collection would stall more than
`brake_stalled_fraction` of the running workers (and at least `brake_min_workers`), or when the
control plane can see that it is itself behind (the `self_check` it is given returns a reason:
heartbeats waiting in the broker longer than the TTL, no reconciler alive). In disruption mode
it stalls no one and deletes nothing. Leaving it restarts every heartbeat expiry and clears
every mark, so that absence must be seen afresh.
"""

from __future__ import annotations

import logging

from gcworker.broker_health import is_start_up
from gcworker.db.audit import AuditEntry
from gcworker.db.disruption import DisruptionRepository
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext

log = logging.getLogger(__name__)


def brake_reason(
    would_stall: int, running: int, *, fraction: float, min_workers: int
) -> str | None:
    """Why the brake must hold, or None: too many workers' heartbeats expired at once."""
    if would_stall >= min_workers and would_stall > fraction * running:
        return (
            f"{would_stall} of {running} running workers' heartbeats expired at once "
            f"(more than {fraction:.0%}): the trouble is likely not theirs"
        )
    return None


def _phase(reason: str) -> tuple[int, str]:
    """How the brake's phase is said: the start-up phase at INFO, as itself (every deploy goes
    through it); a disruption as a WARNING."""
    if is_start_up(reason):
        return logging.INFO, "start-up protection"
    return logging.WARNING, "disruption mode"


class SafetyBrake:
    name = "brake"

    def run(self, ctx: CollectionContext) -> None:
        workers = WorkerRepository(ctx.db)
        disruption = DisruptionRepository(ctx.db)
        with ctx.step() as step:
            current = disruption.current(step.conn, lock=True)
            expired = workers.expired_heartbeats(step.conn, step.now, states=("running",))
            running = workers.count_in_states(step.conn, ("running",))
            reason = brake_reason(
                len(expired),
                running,
                fraction=ctx.settings.brake_stalled_fraction,
                min_workers=ctx.settings.brake_min_workers,
            )
            if reason is None and ctx.self_check is not None:
                reason = ctx.self_check()
            ctx.disrupted = reason is not None
            ctx.disruption_reason = reason
            if reason is not None:
                level, phase = _phase(reason)
                log.log(
                    level, f"{phase}: stalling no one, deleting nothing", extra={"reason": reason}
                )
                if current is None:
                    disruption.enter(step.conn, step.now, reason)
                    ctx.record(
                        step, [AuditEntry("enter_disruption", "control_plane", "collector", reason)]
                    )
            elif current is not None:
                disruption.leave(step.conn)
                workers.restart_every_clock(step.conn, step.now, ctx.settings.heartbeat_ttl)
                cleared = sum(
                    repo.clear_every_mark(step.conn)
                    for repo in (ContainerRepository(ctx.db), VolumeRepository(ctx.db))
                )
                message = (
                    f"recovered from disruption ({current.reason}) that began "
                    f"{current.since.isoformat()}; every heartbeat expiry restarted and "
                    f"{cleared} marks cleared"
                )
                level, phase = _phase(current.reason)
                log.log(level, f"{phase} left", extra={"reason": message})
                ctx.record(
                    step, [AuditEntry("leave_disruption", "control_plane", "collector", message)]
                )
