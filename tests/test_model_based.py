"""Model-based test (issue 4, point 5): random interleavings of everything a fleet, its broker,
a scheduler and the collector do, applied to the real control plane on a real database, checked
after every step.

The model holds two things:

- **the truth** — three worker hosts (two durable, one ephemeral), each with its runtime (the
  container and volume handles it really holds, volumes with their copy-on-write parent) and its
  reporter: incarnation, sequence counter, and a mode that says how it behaves as time passes
  (healthy; reports lagging behind heartbeats in the broker's report queue; runtime listing
  failing, so heartbeats only; silent). Every message is built from the runtime at one moment
  and may be delivered at once, wait in the broker (delivered later, in order or not), be
  delivered again, or never; anyone with broker access may replay it later, however old. A
  report is dated (`after`) with the control plane's time in the newest answer (stamp) its
  reporter read, which the control plane gives when it receives one of its messages; before
  any (a new incarnation, or answers that stopped reaching it) its reports are undated. The
  broker may also be down for a while.
- **a reference control plane** — DESIGN.md's rules written out plainly (no fast path, no
  generations, no SQL), fed the same messages, scheduler calls and collections. After every step
  the database must equal it: every worker (state, incarnation, sequence numbers, heartbeat
  expiry, last confirming report), every row (worker, state, `missing_since`, parent, owning
  container), disruption mode, and the audit entries written (multiset of actor, action, kind,
  subject, dry run). A compact report may be applied only where the full report with the same
  handles would have changed no row.

Rules (steps) include the scheduler's create / created / fail / destroy, the worker creating
handles, removing destroying ones, losing one handle or its whole runtime (a restart with a new
incarnation; an ephemeral worker always loses it), stray handles, reporters changing mode or
losing the control plane's answers (undated reports), replays of any message sent, a tampered
reporter's report dated after its arrival (rejected), an operator pruning a worker (stalled
first if needed) followed by replays of its old messages (rule 16), time passing in ticks
(heartbeats, reports, broker deliveries and collections as the modes and the broker allow),
collections (single, dry run, three at once from threads, beside a fence holder),
and scenarios the random walk reaches too rarely: the report/creation race of the seed
discussion; a worker partitioned past the TTL whose old report arrives after the heartbeat that
began its new running period (rules 2 and 5); a worker whose listing fails for longer than the
grace period (rule 4, silence is never evidence); a broker outage past the TTL (rule 12). Every
example ends with `everyone_settles`.

Checked after every step, from the database and the truth (not from the reference model):

1. no row whose handle its worker's runtime holds disappears, except by the lifecycle: a
   `destroying` row confirmed destroyed (rule 9), an ephemeral worker's new incarnation (rule 7)
   or its worker deleted; in particular the collector never deletes (nor would delete, in a dry
   run) a held handle's row;
2. no `creating` row is ever marked missing;
3. a row deleted for being missing had been marked for at least the grace period, and a report
   lacking it, dated at or after `missing_since + grace`, was received (as the model saw
   reports: an undated one proves nothing);
4. at most one collection runs at once: concurrent collections from threads do exactly the work
   of as many sequential ones as report "completed" (the others "skipped"; the audit shows
   nothing twice), and while the fence is held every collection is skipped and changes nothing;
5. liveness (`everyone_settles`, at the end of every example): once every reporter is healthy,
   every handle gone from a worker's runtime loses its row after the grace period and a
   confirming report, and every handle it holds has a row (rule 8: the database and the worker
   converge both ways).

Deliberate bounds, each a promise of the design rather than a shortcut:

- The clock is the control plane's (`Database.now`), moved only by the model: it reads a fixed
  origin plus the advances, so that the reference model decides every comparison
  (`expires_at < now`, `missing_since <= now - grace`) exactly. The database is real; only its
  clock source stands still between advances.
- Reports are dated as the reporter dates them (`after`: the control plane's time of the newest
  answer it had read, read as soon as the control plane gives it), so the broker may keep a
  message for up to three grace periods (MAX_DELAY), and a replay may be older still. An
  undated report may mark and clear, never confirm (rule 4): the reference model confirms
  from `after` only, and `test_a_report_delayed_past_the_grace_period_...` below shows the
  case of the seed discussion.
- The brake keeps its defaults (3 workers, 50%): with three workers it holds when all three
  running workers' heartbeats expire at once (a broker outage), so disruption mode and its
  recovery are part of the model. The deletion cap keeps its default, never reached here.
- Landing and retiring workers, signed envelopes and the broker's own self-check are not
  modelled (other tests cover them).

`GCWORKER_MODEL_EXAMPLES` (default 200) and `GCWORKER_MODEL_STEPS` (default 30) set the size of a
run; `scripts/model_soak.py` runs a long one and prints its figures.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, event, select
from sqlalchemy.engine import make_url

from gcworker.control_plane import ControlPlane
from gcworker.db.audit import expand
from gcworker.db.database import Database, create_database_engine
from gcworker.db.disruption import DisruptionRepository
from gcworker.db.fence import collection_fence
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.migrate import upgrade
from gcworker.db.tables import (
    audit_events,
    containers,
    control_plane_state,
    dead_letters,
    volumes,
    worker_keys,
    worker_tombstones,
    workers,
)
from gcworker.errors import Conflict, NotFound
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.rules import report_digest
from gcworker.settings import load_settings

ORIGIN = datetime(2030, 1, 1, tzinfo=UTC)
# Scaled down from DESIGN.md's defaults (grace 5m, report and heartbeat interval 30s, TTL 60s) so
# that a few steps cover a grace period, keeping their order: the TTL is two heartbeat intervals
# as by default, and the grace period two TTLs (two report intervals, the least the settings allow).
TICK = 10  # seconds: the heartbeat interval, and the step in which time passes
TTL = timedelta(seconds=2 * TICK)
GRACE = timedelta(seconds=4 * TICK)
MODEL_SETTINGS = {
    "missing_grace_period": GRACE,
    "report_interval": timedelta(seconds=2 * TICK),  # reports and collections: every other tick
    "gc_interval": timedelta(seconds=2 * TICK),
    "heartbeat_interval": timedelta(seconds=TICK),
    "heartbeat_ttl": TTL,
    "creating_timeout": timedelta(seconds=3 * TICK),
    "stalled_worker_timeout": timedelta(seconds=10 * TICK),
}
# How long the broker keeps a message (a longer wait drops it): three grace periods, so that
# reports arrive later than a grace period after they were built (see the module docstring).
MAX_DELAY = 3 * GRACE
OUTBOX_SIZE = 8
HOSTS = {"w1": False, "w2": False, "e1": True}  # name -> ephemeral
MODES = ("healthy", "reports lag", "no reports", "silent")
KINDS = ("container", "volume")

EXAMPLES = int(os.environ.get("GCWORKER_MODEL_EXAMPLES", "200"))
STEPS = int(os.environ.get("GCWORKER_MODEL_STEPS", "30"))


class ModelClockDatabase(Database):
    """The real database with a clock that moves only when the model advances it: every reading
    of the control plane's time (`now`, `clock` for a time read along with other columns, and
    the time a statement computes itself) is the origin plus the advances."""

    def now(self, connection):
        return ORIGIN + self.offset

    def clock(self, current=None):
        return ORIGIN + self.offset

    def clock_parameters(self):
        return {"p_clock_offset": timedelta(), "p_clock_pinned": ORIGIN + self.offset}


# The truth: worker hosts ------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """A message built from the runtime at `built_at`; `handles` is what a report says is held."""

    built_at: datetime
    message: Heartbeat | Report | UnchangedReport
    handles: dict[str, frozenset[str]] | None = None


@dataclass
class Host:
    name: str
    ephemeral: bool
    incarnation: int = 1
    seq: int = 0
    # How the reporter behaves as time passes: "healthy" (heartbeats and reports delivered at
    # once, then it removes what the control plane destroys), "reports lag" (its reports wait in
    # the broker's report queue, which delivers them late, in any order), "no reports" (its
    # runtime's listing fails: heartbeats only, never an empty report) or "silent" (nothing at
    # all: a partition, a hung process).
    mode: str = "healthy"
    pending: list[Sent] = field(default_factory=list)  # waiting in the broker, not delivered
    # The control plane's time of the newest answer (a stamp, a destroy list) the reporter has
    # read: its reports date from it (`after`, rules 4 and 9); before any, they are undated.
    heard_at: datetime | None = None
    # Whether the control plane's answers reach the reporter (False: Redis lost its keys, they
    # expired, or the reporter cannot trust them): without them its reports stay undated.
    answered: bool = True
    held: dict[str, dict[str, str | None]] = field(
        default_factory=lambda: {"container": {}, "volume": {}}
    )  # kind -> handle -> parent volume (volumes only)
    acked: set[tuple[str, str]] = field(default_factory=set)  # created, the scheduler not yet told
    outbox: list[Sent] = field(default_factory=list)
    # Every message it ever sent (this example): what anyone with broker access may replay.
    history: list[Sent] = field(default_factory=list)
    last_full: dict[str, frozenset[str]] | None = None

    @property
    def silent(self) -> bool:
        return self.mode == "silent"

    def holds(self, kind: str, handle: str) -> bool:
        return handle in self.held[kind]

    def inventory(self) -> dict[str, frozenset[str]]:
        return {kind: frozenset(self.held[kind]) for kind in KINDS}

    def remove(self, kind: str, handle: str) -> None:
        """A handle leaves the runtime; a volume takes its copy-on-write children with it."""
        self.held[kind].pop(handle, None)
        if kind == "volume":
            for child in [h for h, parent in self.held["volume"].items() if parent == handle]:
                self.remove("volume", child)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def heartbeat(self, now: datetime) -> Sent:
        return self._out(
            Sent(
                now,
                Heartbeat(
                    worker=self.name,
                    incarnation=self.incarnation,
                    seq=self.next_seq(),
                    ephemeral=self.ephemeral,
                ),
            )
        )

    def report(
        self, now: datetime, *, compact: bool = False, ahead: timedelta | None = None
    ) -> Sent:
        """A full report of the runtime, or the compact one when nothing changed since the last
        full report (as the reporter sends it), dated with the newest answer it read (undated
        before any). `ahead`: a tampered reporter's, dated that much after `now`."""
        inventory = self.inventory()
        lists = {kind: sorted(inventory[kind]) for kind in KINDS}
        fields = {
            "worker": self.name,
            "incarnation": self.incarnation,
            "seq": self.next_seq(),
            "after": self.heard_at if ahead is None else now + ahead,
        }
        if compact and self.last_full == inventory:
            digest = report_digest(lists["container"], lists["volume"])
            return self._out(Sent(now, UnchangedReport(digest=digest, **fields), inventory))
        self.last_full = inventory
        message = Report(containers=lists["container"], volumes=lists["volume"], **fields)
        return self._out(Sent(now, message, inventory))

    def _out(self, sent: Sent) -> Sent:
        self.outbox = [*self.outbox[-(OUTBOX_SIZE - 1) :], sent]
        self.history.append(sent)
        return sent

    def reads_answer(self, sent: Sent, now: datetime) -> None:
        """The control plane answered `sent` with a stamp of its clock `now`: the reporter
        believes it if it reaches it, names its incarnation and answers a message it sent
        recently (rule 15), and dates the reports it builds from now on with it."""
        recent = any(sent is o for o in self.outbox)
        if self.answered and sent.message.incarnation == self.incarnation and recent:
            self.heard_at = max(self.heard_at or now, now)

    def restart(self, *, lose_runtime: bool) -> None:
        """The reporter restarts with a new, higher incarnation; with `lose_runtime`, the runtime
        comes back empty."""
        self.incarnation += 1
        self.seq = 0
        self.heard_at = None
        self.mode = "healthy"
        self.last_full = None
        if lose_runtime:
            self.held = {"container": {}, "volume": {}}


# The reference control plane --------------------------------------------------------------


@dataclass
class WorkerModel:
    state: str
    ephemeral: bool
    incarnation: int
    last_heartbeat_seq: int | None
    last_report_seq: int | None
    running_since_seq: int | None
    heartbeat_expires_at: datetime
    stalled_at: datetime | None = None
    last_report_at: datetime | None = None

    def view(self) -> tuple:
        return (
            self.state,
            self.ephemeral,
            self.incarnation,
            self.last_heartbeat_seq,
            self.last_report_seq,
            self.running_since_seq,
            self.heartbeat_expires_at,
            self.stalled_at,
            self.last_report_at,
        )


@dataclass
class RowModel:
    kind: str
    handle: str
    worker: str
    state: str
    state_changed_at: datetime
    missing_since: datetime | None = None
    parent: str | None = None
    container: str | None = None
    container_owned: bool = False
    # Model only: when a report that may mark was last received without this handle.
    lacking_seen_at: datetime | None = None
    created_at: datetime | None = None  # None: as state_changed_at, the row's first state

    def __post_init__(self):
        if self.created_at is None:
            self.created_at = self.state_changed_at

    def view(self) -> tuple:
        return (
            self.worker,
            self.state,
            self.missing_since,
            self.state_changed_at,
            self.parent,
            self.container,
        )


Entry = tuple[str, str, str, str, bool]  # actor, action, kind, subject, dry_run


class ControlPlaneModel:
    """DESIGN.md's rules, plainly: what the database must hold after each event."""

    def __init__(self, settings):
        self.settings = settings
        self.workers: dict[str, WorkerModel] = {}
        self.rows: dict[tuple[str, str], RowModel] = {}
        self.disruption = False
        self.graveyard: dict[tuple[str, str], RowModel] = {}
        # Rule 16: a deleted worker's last incarnation; only a higher one registers again.
        self.tombstones: dict[str, int] = {}

    # Rows -----------------------------------------------------------------------------------

    def rows_of(self, worker: str, kind: str | None = None) -> list[RowModel]:
        return [
            r for r in self.rows.values() if r.worker == worker and (kind is None or r.kind == kind)
        ]

    def has_children(self, handle: str) -> bool:
        return any(r.kind == "volume" and r.parent == handle for r in self.rows.values())

    def delete_row(self, key: tuple[str, str]) -> list[str]:
        """Delete a row as the schema does: a volume's children go with it (cascade), a
        container's volumes lose their owner (set null). Returns the volume handles deleted."""
        row = self.rows.pop(key, None)
        if row is None:
            return []
        self.graveyard[key] = row
        gone = []
        if row.kind == "container":
            for volume in self.rows.values():
                if volume.kind == "volume" and volume.container == row.handle:
                    volume.container = None
        else:
            gone.append(row.handle)
            for child in [r for r in self.rows.values() if r.kind == "volume"]:
                if child.parent == row.handle and ("volume", child.handle) in self.rows:
                    gone += self.delete_row(("volume", child.handle))
        return gone

    def delete_rows_of(
        self, name: str, created_no_later_than: datetime | None = None
    ) -> list[RowModel]:
        """Every row of a worker, or those created no later than a time (each audited, rule
        13), as one DELETE of them does."""
        rows = [
            row
            for row in self.rows_of(name)
            if created_no_later_than is None or row.created_at <= created_no_later_than
        ]
        for row in rows:
            self.delete_row((row.kind, row.handle))
        return rows

    def delete_worker(self, name: str) -> list[RowModel]:
        """Delete a worker with its rows, leaving its tombstone (rule 16); returns the rows."""
        rows = self.delete_rows_of(name)
        self.tombstones[name] = self.workers.pop(name).incarnation
        return rows

    def clear_marks(self, worker: str | None = None) -> None:
        for row in self.rows.values():
            if worker is None or row.worker == worker:
                row.missing_since = None

    # Messages ---------------------------------------------------------------------------------

    def heartbeat(self, m: Heartbeat, now: datetime) -> list[Entry]:
        ttl = self.settings.heartbeat_ttl
        w = self.workers.get(m.worker)
        if w is None:
            if m.incarnation <= self.tombstones.get(m.worker, 0):
                return []  # rule 16: a deleted worker's replay (or its own, not restarted)
            self.workers[m.worker] = WorkerModel(
                "running", m.ephemeral, m.incarnation, m.seq, None, m.seq, now + ttl
            )
            return []
        entries = []
        if m.incarnation < w.incarnation:
            return []  # rule 7: an older incarnation is rejected
        if m.incarnation > w.incarnation:  # rule 7: a new incarnation
            # Rule 7: only the rows provably the old incarnation's, created no later than its
            # newest dated report; none without one.
            if w.ephemeral and w.last_report_at is not None:
                for row in self.delete_rows_of(m.worker, w.last_report_at):
                    entries.append(("reconciler", "delete", row.kind, row.handle, False))
                entries.append(("reconciler", "drop_rows", "worker", m.worker, False))
            elif w.state == "stalled":
                self.clear_marks(m.worker)
            w.incarnation = m.incarnation
            w.last_report_seq = None
            w.running_since_seq = m.seq
            w.stalled_at = None
            w.state = "running"
        elif w.last_heartbeat_seq is not None and m.seq <= w.last_heartbeat_seq:
            return []  # rule 6
        elif w.state == "stalled":  # rule 5: coming back restarts the clock
            self.clear_marks(m.worker)
            w.running_since_seq = m.seq
            w.stalled_at = None
            w.state = "running"
        w.last_heartbeat_seq = m.seq
        w.heartbeat_expires_at = now + ttl
        w.ephemeral = m.ephemeral
        return entries

    def judge_report(self, m, now: datetime) -> tuple[WorkerModel | None, bool]:
        """(the worker, may it mark) for a report that is applied; (None, False) otherwise."""
        w = self.workers.get(m.worker)
        if w is None or m.incarnation != w.incarnation:
            return None, False  # unknown, older (rejected) or not yet heartbeated incarnation
        if w.last_report_seq is not None and m.seq <= w.last_report_seq:
            return None, False  # rule 6: stale or duplicate
        if self.dated_ahead(m, now):
            return None, False  # rule 4: rejected
        may_mark = (
            w.state == "running" and w.running_since_seq is not None and m.seq > w.running_since_seq
        )  # rule 2
        return w, may_mark

    @staticmethod
    def dated_ahead(m, now: datetime) -> bool:
        """Rule 4: a report dated after its arrival is rejected (a tampered reporter's)."""
        return m.after is not None and m.after > now

    def diff(
        self,
        worker: str,
        handles: dict[str, frozenset[str]],
        may_mark: bool,
        built_at: datetime | None,
    ) -> dict:
        changes = {"mark": [], "clear": [], "destroyed": [], "unknown": []}
        for kind in KINDS:
            known = set()
            for row in self.rows_of(worker, kind):
                known.add(row.handle)
                present = row.handle in handles[kind]
                if present and row.missing_since is not None:
                    changes["clear"].append(row)  # rule 3
                elif (
                    not present
                    and row.state == "created"
                    and row.missing_since is None
                    and may_mark
                ):
                    changes["mark"].append(row)  # rule 1
                elif (
                    not present
                    and row.state == "destroying"
                    and built_at is not None  # an undated report confirms no destruction
                    and row.state_changed_at <= built_at  # else the report may predate it
                ):
                    changes["destroyed"].append(row)  # rule 9
            for handle in sorted(handles[kind] - known):
                if (kind, handle) not in self.rows:  # another worker's row is left alone
                    changes["unknown"].append((kind, handle))  # rule 8
        return changes

    def report(
        self, m: Report, handles: dict[str, frozenset[str]], now: datetime
    ) -> tuple[list[RowModel], list[Entry]]:
        """Apply a full report; returns the rows it marked missing, and its audit entries."""
        w, may_mark = self.judge_report(m, now)
        if w is None:
            return [], []
        built_at = self.built_at(m, now)
        changes = self.diff(m.worker, handles, may_mark, built_at)
        for row in changes["mark"]:
            row.missing_since = now
        for row in changes["clear"]:
            row.missing_since = None
        entries = []
        for kind, handle in changes["unknown"]:
            self.rows[(kind, handle)] = RowModel(kind, handle, m.worker, "destroying", now)
            entries.append(("reconciler", "record_unknown", kind, handle, False))
        for row in changes["destroyed"]:
            self.delete_row((row.kind, row.handle))
            entries.append(("reconciler", "delete", row.kind, row.handle, False))
        w.last_report_seq = m.seq
        if may_mark:
            self._confirm(w, m.worker, handles, built_at)
        return changes["mark"], entries

    @staticmethod
    def built_at(m, now: datetime) -> datetime | None:
        """From when a report's content provably dates: its `after` (the newest answer its
        reporter had read), never later than its arrival; None for an undated report (rule 4:
        its arrival proves nothing, it may have waited in the broker)."""
        return None if m.after is None else min(now, m.after)

    def _confirm(self, w: WorkerModel, worker: str, handles, built_at: datetime | None) -> None:
        """Rule 4's confirmation: absences are confirmed from the report's date on (an older
        date never moves a confirmation back); an undated report confirms nothing."""
        if built_at is None:
            return
        w.last_report_at = max(w.last_report_at or built_at, built_at)
        for row in self.rows_of(worker):
            if row.handle not in handles[row.kind]:
                row.lacking_seen_at = max(row.lacking_seen_at or built_at, built_at)

    def unchanged(
        self, m: UnchangedReport, handles: dict[str, frozenset[str]], now: datetime, applied: bool
    ) -> None:
        """A compact report may be applied only where the full report with the same handles
        would change no row; applied, it confirms like one. Not applying it is always allowed
        (the worker then sends a full report)."""
        w, may_mark = self.judge_report(m, now)
        if not applied:
            return
        assert w is not None and may_mark, (
            f"a compact report was applied that is stale or may not mark: {m}"
        )
        built_at = self.built_at(m, now)
        changes = self.diff(m.worker, handles, may_mark, built_at)
        assert not any(changes.values()), (
            f"a compact report was applied although the full report would have changed rows: "
            f"{ {k: v for k, v in changes.items() if v} }"
        )
        w.last_report_seq = m.seq
        self._confirm(w, m.worker, handles, built_at)

    # Scheduler --------------------------------------------------------------------------------

    def create(self, kind, worker, handle, now, *, parent=None, container=None):
        """The scheduler records a creating row; returns the error it must raise, or None."""
        w = self.workers.get(worker)
        if w is None:
            return NotFound
        if w.state != "running" or (kind, handle) in self.rows:
            return Conflict
        for other_kind, other, states in (
            ("volume", parent, ("created",)),
            ("container", container, ("creating", "created")),
        ):
            if other is None:
                continue
            row = self.rows.get((other_kind, other))
            if row is None:
                return NotFound
            if row.worker != worker or row.state not in states:
                return Conflict
        self.rows[(kind, handle)] = RowModel(
            kind,
            handle,
            worker,
            "creating",
            now,
            parent=parent,
            container=container,
            container_owned=container is not None,
        )
        return None

    TRANSITIONS = {
        "created": ("creating",),
        "failed": ("creating",),
        "destroying": ("created", "failed"),
    }

    def move(self, kind, handle, to_state, now):
        row = self.rows.get((kind, handle))
        if row is None:
            return NotFound
        if row.state not in self.TRANSITIONS[to_state]:
            return Conflict
        if to_state == "destroying" and kind == "volume" and self.has_children(handle):
            return Conflict
        row.state = to_state
        row.state_changed_at = now
        row.missing_since = None
        return None

    # Collection -------------------------------------------------------------------------------

    def collect(self, now: datetime, *, dry_run: bool = False) -> list[Entry]:
        s = self.settings
        entries: list[Entry] = []

        def audit(action, kind, subject):
            entries.append(("collector", action, kind, subject, dry_run))

        # Rule 12, the brake.
        running = [n for n, w in self.workers.items() if w.state == "running"]
        expired = [n for n in running if self.workers[n].heartbeat_expires_at < now]
        disrupted = len(expired) >= s.brake_min_workers and len(
            expired
        ) > s.brake_stalled_fraction * len(running)
        if disrupted and not self.disruption:
            self.disruption = True
            audit("enter_disruption", "control_plane", "collector")
        elif not disrupted and self.disruption:
            self.disruption = False
            for w in self.workers.values():
                w.heartbeat_expires_at = now + s.heartbeat_ttl
            self.clear_marks()
            audit("leave_disruption", "control_plane", "collector")

        # Workers: stall (durable) or delete (ephemeral) on expiry; prune long-stalled ones.
        if not disrupted:
            for name in sorted(self.workers):
                w = self.workers[name]
                if w.state == "running" and not w.ephemeral and w.heartbeat_expires_at < now:
                    w.state, w.stalled_at = "stalled", now
                    audit("stall", "worker", name)
            for name in sorted(self.workers):
                w = self.workers[name]
                if w.ephemeral and w.state in ("running", "stalled"):
                    if w.heartbeat_expires_at < now:
                        for row in self.delete_worker(name):
                            audit("delete", row.kind, row.handle)
                        audit("delete", "worker", name)
            timeout = s.stalled_worker_timeout
            if timeout > timedelta(0):
                for name in sorted(self.workers):
                    w = self.workers[name]
                    if w.state == "stalled" and w.stalled_at <= now - timeout:
                        for row in self.delete_worker(name):
                            audit("delete", row.kind, row.handle)
                        audit("delete", "worker", name)

        # Rule 10: stuck creating -> failed -> destroying.
        for kind in KINDS:
            for row in self._rows(kind):
                if row.state == "creating" and row.state_changed_at <= now - s.creating_timeout:
                    row.state, row.state_changed_at = "failed", now
                    audit("fail", kind, row.handle)
            for row in self._rows(kind):
                if row.state == "failed" and not (
                    kind == "volume" and self.has_children(row.handle)
                ):
                    row.state, row.state_changed_at = "destroying", now
                    audit("destroy", kind, row.handle)

        # Orphaned volumes: made for a container whose row is gone.
        for row in self._rows("volume"):
            if (
                row.container_owned
                and row.container is None
                and row.state == "created"
                and not self.has_children(row.handle)
            ):
                row.state, row.state_changed_at, row.missing_since = "destroying", now, None
                audit("destroy", "volume", row.handle)

        # Rule 4: missing past the grace period, confirmed by a later report.
        if not disrupted:
            eligible = []
            for row in self.rows.values():
                w = self.workers[row.worker]
                if (
                    w.state == "running"
                    and row.state == "created"
                    and row.missing_since is not None
                    and row.missing_since <= now - s.missing_grace_period
                    and w.last_report_at is not None
                    and row.missing_since <= w.last_report_at - s.missing_grace_period
                ):
                    eligible.append((row.kind, row.handle))
            assert len(eligible) <= s.max_deletes_per_collection
            for kind in KINDS:
                for key in sorted(k for k in eligible if k[0] == kind):
                    if key not in self.rows:
                        continue  # went with an eligible parent: reported as a root below
                    audit("delete", kind, key[1])
                    for handle in self.delete_row(key)[1:]:
                        audit("delete", "volume", handle)
        return entries

    def _rows(self, kind: str) -> list[RowModel]:
        return sorted((r for r in self.rows.values() if r.kind == kind), key=lambda r: r.handle)


# The machine ------------------------------------------------------------------------------


STATS = Counter()


class GcMachine(RuleBasedStateMachine):
    """Bound to one control plane by `run_model` (class attributes `plane` and `db`)."""

    plane: ControlPlane
    db: ModelClockDatabase

    def __init__(self):
        super().__init__()
        self._reset_database()
        self.cp = ControlPlaneModel(self.plane.settings)
        self.hosts = {name: Host(name, ephemeral) for name, ephemeral in HOSTS.items()}
        self.counter = 0
        self.expected: list[Entry] = []
        self.audit_seen = 0
        self.previous = self._snapshot()[0]
        self.steps = -1  # the invariant also runs once before the first step
        self.ticks = 0
        STATS["examples"] += 1

    def _reset_database(self) -> None:
        self.db.offset = timedelta(0)
        with self.db.transaction() as conn:
            for table in (
                volumes,
                containers,
                workers,
                audit_events,
                control_plane_state,
                dead_letters,
                worker_keys,
                worker_tombstones,
            ):
                conn.execute(delete(table))

    @property
    def now(self) -> datetime:
        return ORIGIN + self.db.offset

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def host_of(self, row: RowModel) -> Host:
        return self.hosts[row.worker]

    # Delivering messages ----------------------------------------------------------------------

    def deliver(self, sent: Sent):
        m, now = sent.message, self.now
        if isinstance(m, Heartbeat):
            result = self.plane.reconciler.heartbeat(m)
            self.expected += self.cp.heartbeat(m, now)
        elif isinstance(m, UnchangedReport):
            result = self.plane.reconciler.unchanged(m)
            self.cp.unchanged(m, sent.handles, now, applied=result.fast_path)
        else:
            result = self.plane.reconciler.report(m)
            marked, entries = self.cp.report(m, sent.handles, now)
            self.expected += entries
            STATS["rows marked missing"] += len(marked)
            STATS["rows marked missing while their handle is held (a stale report)"] += sum(
                self.hosts[m.worker].holds(r.kind, r.handle) for r in marked
            )
        self.hosts[m.worker].reads_answer(sent, now)
        delay = "" if now == sent.built_at else ", delayed"
        undated = ", undated" if not isinstance(m, Heartbeat) and m.after is None else ""
        STATS[f"{m.type} {result.outcome}{undated}{delay}"] += 1
        return result

    def heartbeat_now(self, host: Host) -> None:
        self.deliver(host.heartbeat(self.now))

    def report_now(self, host: Host, *, compact: bool = False) -> None:
        result = self.deliver(host.report(self.now, compact=compact))
        if result.outcome == "full_report_needed":
            self.deliver(host.report(self.now))  # the reporter answers with a full report

    def deliverable(self) -> list[tuple[str, int]]:
        return [
            (name, i)
            for name, host in self.hosts.items()
            for i, sent in enumerate(host.outbox)
            if self.now - sent.built_at <= MAX_DELAY
        ]

    def collect_now(self) -> None:
        summary = self.plane.collect()
        assert summary.outcome == "completed"
        self.expected += self.cp.collect(self.now)

    def advance(self, seconds: int) -> None:
        self.db.advance(timedelta(seconds=seconds))

    # Rules: worker hosts and the broker ---------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data):
        for host in self.hosts.values():
            # A third of the reporters start without the control plane's answers: undated.
            host.answered = data.draw(st.integers(0, 2), label=f"{host.name} answered") < 2
            self.heartbeat_now(host)
        for _ in range(data.draw(st.integers(0, 4), label="rows at start")):
            self.create_and_run(
                data.draw(st.sampled_from(sorted(HOSTS)), label="worker"),
                data.draw(st.sampled_from(KINDS), label="kind"),
                data,
            )

    @rule(
        name=st.sampled_from(sorted(HOSTS)),
        what=st.sampled_from(["heartbeat", "report", "compact report"]),
        delivered_now=st.booleans(),
    )
    def reporter_sends(self, name, what, delivered_now):
        """A message built now from the runtime, delivered now or left in the broker (where
        `broker_delivers` may deliver it later, again, or never)."""
        host = self.hosts[name]
        if host.silent:
            return
        if what == "heartbeat":
            sent = host.heartbeat(self.now)
        else:
            sent = host.report(self.now, compact=what == "compact report")
        if not delivered_now:
            host.pending.append(sent)
            return
        result = self.deliver(sent)
        if what != "heartbeat" and result.outcome == "full_report_needed":
            self.deliver(host.report(self.now))

    @precondition(lambda self: self.deliverable())
    @rule(data=st.data(), times=st.integers(1, 2))
    def broker_delivers(self, data, times):
        """Any message the broker still keeps (younger than MAX_DELAY), in any order, possibly
        again."""
        name, i = data.draw(st.sampled_from(self.deliverable()), label="message")
        for _ in range(times):
            self.deliver(self.hosts[name].outbox[i])

    @rule(name=st.sampled_from(sorted(HOSTS)), kind=st.sampled_from(KINDS), data=st.data())
    def report_overtaken_by_the_scheduler(self, name, kind, data):
        """The race of the seed discussion: a report built before a handle was created arrives
        after its row was marked created (and lacks it)."""
        host = self.hosts[name]
        if host.silent:
            return
        sent = host.report(self.now)
        self.create_and_run(name, kind, data)
        self.deliver(sent)

    @rule(name=st.sampled_from(sorted(HOSTS)), mode=st.sampled_from(MODES))
    def reporter_changes(self, name, mode):
        """A reporter turns healthy, finds its reports lagging in the broker, loses its
        runtime's listing or falls silent (see `Host.mode`); it acts so when time passes."""
        self.hosts[name].mode = mode

    @rule(name=st.sampled_from(sorted(HOSTS)), lose_runtime=st.booleans(), announce=st.booleans())
    def restarts(self, name, lose_runtime, announce):
        """A new incarnation; an ephemeral worker always comes back empty. Its first heartbeat
        is delivered now, or waits in the broker."""
        host = self.hosts[name]
        host.restart(lose_runtime=lose_runtime or host.ephemeral)
        sent = host.heartbeat(self.now)
        if announce:
            self.deliver(sent)

    @rule(name=st.sampled_from(sorted(HOSTS)), lost=st.booleans())
    def answers_lost(self, name, lost):
        """The control plane's answers stop reaching a reporter, which has none yet (Redis lost
        its keys, they expired, or it cannot trust them: rule 15): its reports are undated
        until they reach it again (rule 4: they may mark and clear, never confirm), and it
        removes nothing. Or they reach it again."""
        host = self.hosts[name]
        host.answered = not lost
        if lost:
            host.heard_at = None

    @precondition(lambda self: any(h.history for h in self.hosts.values()))
    @rule(data=st.data())
    def replayed(self, data):
        """Anyone with broker access pushes again a message sent earlier, however old (a
        duplicate, a stale sequence, an older incarnation's, a deleted worker's: rules 6, 7,
        16), or one the broker dropped."""
        sent = data.draw(
            st.sampled_from([m for host in self.hosts.values() for m in host.history]),
            label="replayed",
        )
        self.deliver(sent)

    @rule(
        name=st.sampled_from(sorted(HOSTS)),
        compact=st.booleans(),
        seconds=st.integers(1, 2 * TICK),
    )
    def tampered_reporter_dates_ahead(self, name, compact, seconds):
        """A report dated after its arrival (only a tampered reporter sends one) is rejected
        and changes nothing (rule 4), on the fast path too."""
        host = self.hosts[name]
        sent = host.report(self.now, compact=compact, ahead=timedelta(seconds=seconds))
        w = self.cp.workers.get(name)
        fresh = (
            w is not None
            and w.incarnation == host.incarnation
            and (w.last_report_seq is None or host.seq > w.last_report_seq)
        )
        result = self.deliver(sent)
        if fresh:
            assert result.outcome == "rejected", f"a report dated ahead was {result.outcome}"

    @rule(name=st.sampled_from(sorted(HOSTS)), stall_first=st.booleans(), data=st.data())
    def operator_prunes(self, name, stall_first, data):
        """`gcworker workers prune`: a worker that is not running is deleted with its rows,
        leaving a tombstone of its incarnation (rule 16). With `stall_first`, a running worker
        is silent past the TTL first, and the collector stalls it (or deletes an ephemeral one).
        Then anyone with broker access replays some of its old messages: they change nothing;
        the worker comes back only when its reporter restarts (a higher incarnation)."""
        host = self.hosts[name]
        w = self.cp.workers.get(name)
        if stall_first and w is not None and w.state == "running":
            self.quiet(TTL.seconds + 1, but=host)
            self.collect_now()  # its heartbeat has expired: it stalls (or, ephemeral, goes)
            w = self.cp.workers.get(name)
        expected = NotFound if w is None else Conflict if w.state == "running" else None
        try:
            self.plane.fleet.prune(name)
        except (Conflict, NotFound) as error:
            assert type(error) is expected, f"prune {name}: {error!r}, model: {expected}"
        else:
            assert expected is None, f"prune {name} succeeded, model: {expected}"
            for row in self.cp.delete_worker(name):
                self.expected.append(("operator", "delete", row.kind, row.handle, False))
            self.expected.append(("operator", "delete", "worker", name, False))
            STATS["workers pruned"] += 1
        if host.history:
            for sent in data.draw(st.lists(st.sampled_from(host.history), max_size=3)):
                result = self.deliver(sent)
                if isinstance(sent.message, Heartbeat) and name not in self.cp.workers:
                    # Rule 16: only a higher incarnation than the tombstone's registers again.
                    assert result.outcome == "rejected", f"a deleted worker's replay: {result}"

    @precondition(lambda self: any(h.held[k] for h in self.hosts.values() for k in KINDS))
    @rule(data=st.data())
    def handle_vanishes(self, data):
        """One handle disappears from a runtime (deleted on the host, a disk lost)."""
        held = sorted(
            (n, k, handle) for n, h in self.hosts.items() for k in KINDS for handle in h.held[k]
        )
        name, kind, handle = data.draw(st.sampled_from(held), label="handle")
        self.hosts[name].remove(kind, handle)

    @rule(name=st.sampled_from(sorted(HOSTS)), kind=st.sampled_from(KINDS))
    def stray_handle(self, name, kind):
        """The runtime holds something the control plane never recorded (rule 8)."""
        self.hosts[name].held[kind][self.fresh("x")] = None

    # Rules: the scheduler ---------------------------------------------------------------------

    def schedule(self, name, kind, data) -> tuple[str, object]:
        handle = self.fresh("c" if kind == "container" else "v")
        parent = container = None
        if kind == "volume":
            rows = self.cp.rows_of(name)
            parents = sorted(r.handle for r in rows if r.kind == "volume" and r.state == "created")
            owners = sorted(
                r.handle
                for r in rows
                if r.kind == "container" and r.state in ("creating", "created")
            )
            parent = data.draw(st.none() | st.sampled_from(parents) if parents else st.none())
            container = data.draw(st.none() | st.sampled_from(owners) if owners else st.none())
        expected = self.cp.create(kind, name, handle, self.now, parent=parent, container=container)
        try:
            if kind == "container":
                self.plane.scheduler.create_container(name, handle)
            else:
                self.plane.scheduler.create_volume(name, handle, parent=parent, container=container)
        except (Conflict, NotFound) as error:
            assert type(error) is expected, f"create {kind} {handle}: {error!r}, model: {expected}"
        else:
            assert expected is None, f"create {kind} {handle} succeeded, model: {expected}"
        return handle, expected

    def move(self, kind: str, handle: str, to_state: str) -> None:
        expected = self.cp.move(kind, handle, to_state, self.now)
        call = {
            ("container", "created"): self.plane.scheduler.container_created,
            ("container", "failed"): self.plane.scheduler.fail_container,
            ("container", "destroying"): self.plane.scheduler.destroy_container,
            ("volume", "created"): self.plane.scheduler.volume_created,
            ("volume", "failed"): self.plane.scheduler.fail_volume,
            ("volume", "destroying"): self.plane.scheduler.destroy_volume,
        }[(kind, to_state)]
        try:
            call(handle)
        except (Conflict, NotFound) as error:
            assert type(error) is expected, f"{kind} {handle} -> {to_state}: {error!r}"
        else:
            assert expected is None, f"{kind} {handle} -> {to_state} succeeded, model: {expected}"

    def can_create_on_host(self, row: RowModel) -> bool:
        host = self.host_of(row)
        return (
            not host.silent
            and not host.holds(row.kind, row.handle)
            and (row.parent is None or host.holds("volume", row.parent))
        )

    def creatable(self) -> list[tuple[str, str]]:
        return sorted(
            key
            for key, row in self.cp.rows.items()
            if row.state == "creating" and self.can_create_on_host(row)
        )

    @rule(name=st.sampled_from(sorted(HOSTS)), kind=st.sampled_from(KINDS), data=st.data())
    def scheduler_records(self, name, kind, data):
        """A creating row, not created on the worker yet."""
        self.schedule(name, kind, data)

    @precondition(lambda self: self.creatable())
    @rule(data=st.data())
    def worker_creates(self, data):
        kind, handle = data.draw(st.sampled_from(self.creatable()), label="row")
        row = self.cp.rows[(kind, handle)]
        host = self.host_of(row)
        host.held[kind][handle] = row.parent
        host.acked.add((kind, handle))

    @precondition(lambda self: any(h.acked for h in self.hosts.values()))
    @rule(data=st.data())
    def scheduler_marks_created(self, data):
        """The worker said it created the handle (its runtime may have lost it since)."""
        acked = sorted((n, k, h) for n, host in self.hosts.items() for k, h in host.acked)
        name, kind, handle = data.draw(st.sampled_from(acked), label="ack")
        self.hosts[name].acked.discard((kind, handle))
        self.move(kind, handle, "created")

    @rule(name=st.sampled_from(sorted(HOSTS)), kind=st.sampled_from(KINDS), data=st.data())
    def create_and_run(self, name, kind, data):
        """Record, create on the worker and mark created, in a row."""
        handle, error = self.schedule(name, kind, data)
        if error is None:
            row = self.cp.rows[(kind, handle)]
            if self.can_create_on_host(row):
                self.host_of(row).held[kind][handle] = row.parent
                self.move(kind, handle, "created")

    @precondition(
        lambda self: any(
            r.state in ("creating", "created", "failed") for r in self.cp.rows.values()
        )
    )
    @rule(data=st.data())
    def scheduler_ends(self, data):
        """The scheduler destroys a created or failed row, or gives up on a creating one."""
        rows = sorted(
            k for k, r in self.cp.rows.items() if r.state in ("creating", "created", "failed")
        )
        kind, handle = data.draw(st.sampled_from(rows), label="row")
        creating = self.cp.rows[(kind, handle)].state == "creating"
        self.move(kind, handle, "failed" if creating else "destroying")

    @precondition(lambda self: any(not h.silent and h.answered for h in self.hosts.values()))
    @rule(data=st.data())
    def worker_removes_destroying(self, data):
        """The reporter removes what the control plane lists as destroying (some of it)."""
        names = sorted(n for n, h in self.hosts.items() if not h.silent and h.answered)
        host = self.hosts[data.draw(st.sampled_from(names), label="worker")]
        as_of, listed = self.plane.destroying_handles_as_of(host.name)
        host.heard_at = max(host.heard_at or as_of, as_of)
        model = {
            kind: sorted(
                r.handle for r in self.cp.rows_of(host.name, kind) if r.state == "destroying"
            )
            for kind in KINDS
        }
        assert listed == model, f"destroying list of {host.name}: {listed}, model: {model}"
        held = [(k, h) for k in KINDS for h in listed[k] if host.holds(k, h)]
        if held:
            for kind, handle in data.draw(
                st.lists(st.sampled_from(held), min_size=1, unique=True), label="removed"
            ):
                host.remove(kind, handle)

    # Rules: time and the collector --------------------------------------------------------------

    @rule(
        seconds=st.integers(1, 6 * TICK),
        broker_up=st.booleans(),
        collections=st.booleans(),
        data=st.data(),
    )
    def time_passes(self, seconds, broker_up, collections, data):
        self.pass_time(seconds, broker_up=broker_up, collections=collections, data=data)

    @rule(seconds=st.integers(TTL.seconds + 1, TTL.seconds + TICK))
    def broker_outage(self, seconds):
        """The broker is down for longer than the TTL while the collector keeps running: every
        heartbeat waits, so every running worker's expires at once (rule 12's brake holds when
        that is three or more); then the broker delivers again."""
        self.pass_time(seconds, broker_up=False, collections=True, data=None)
        self.pass_time(TICK, broker_up=True, collections=True, data=None)

    @rule()
    def tick(self):
        """The commonest step: one tick of a fleet whose broker delivers and whose collector
        runs. (Having no argument, hypothesis draws it first and most often.)"""
        self.pass_time(TICK, broker_up=True, collections=True, data=None)

    def pass_time(self, seconds: int, *, broker_up: bool, collections: bool, data) -> None:
        """The clock moves in ticks of at most TICK. After each tick every reporter acts as its
        mode says (a heartbeat every tick, a report every other tick); the broker, if up,
        delivers the heartbeats waiting in it (their queue is short) and a few waiting reports,
        in order or not (per-worker order is the database's business, rule 6), while one that is
        down delivers nothing; and the collector runs every other tick, unless it is not running
        at all."""
        while seconds > 0:
            tick = min(seconds, TICK)
            seconds -= tick
            self.advance(tick)
            self.ticks += 1
            for host in self.hosts.values():
                if host.silent:
                    continue
                self.send(host, host.heartbeat(self.now), queued=not broker_up)
                if host.mode == "no reports" or self.ticks % 2:
                    continue
                queued = not broker_up or host.mode == "reports lag"
                result = self.send(host, host.report(self.now, compact=True), queued=queued)
                if result is not None and result.outcome == "full_report_needed":
                    self.deliver(host.report(self.now))
                if not queued and host.answered:  # it removes what the control plane destroys
                    for kind in KINDS:
                        for row in self.cp.rows_of(host.name, kind):
                            if row.state == "destroying":
                                host.remove(kind, row.handle)
            if broker_up:
                self.broker_drains(data)
            if collections and self.ticks % 2:
                self.collect_now()
                # Checked after each collection (deletions happen there), so that no two checks
                # are a grace period apart; the step's end is checked anyway.
                if seconds > 0:
                    self.check()

    @rule(
        name=st.sampled_from(sorted(HOSTS)),
        seconds=st.integers(TTL.seconds + 1, GRACE.seconds),
        lose_a_handle=st.booleans(),
        data=st.data(),
    )
    def worker_partitioned(self, name, seconds, lose_a_handle, data):
        """Rules 2 and 5 in one scenario: a worker (maybe after losing a handle and reporting
        it) is cut off for longer than the TTL with a report still waiting in the broker, while
        the rest of the fleet runs and the collector stalls it; then it comes back with its
        reports lagging behind its heartbeats, so that the report sent before the heartbeat that
        began its new running period arrives after it."""
        host = self.hosts[name]
        if host.silent:
            return
        self.lose_a_handle_and_report(host, lose_a_handle, data)
        host.pending.append(host.report(self.now))
        host.mode = "silent"
        self.pass_time(seconds, broker_up=True, collections=True, data=data)
        host.mode = "reports lag"
        self.pass_time(TICK, broker_up=True, collections=True, data=data)

    @rule(
        name=st.sampled_from(sorted(HOSTS)),
        seconds=st.integers(GRACE.seconds, GRACE.seconds + 2 * TICK),
        lose_a_handle=st.booleans(),
        data=st.data(),
    )
    def listing_fails(self, name, seconds, lose_a_handle, data):
        """Rule 4's "silence is never evidence": a worker (maybe after losing a handle and
        reporting it) can no longer list its runtime, so it heartbeats but sends no report, for
        longer than the grace period, while the collector runs; then its listing works again."""
        host = self.hosts[name]
        if host.silent:
            return
        self.lose_a_handle_and_report(host, lose_a_handle, data)
        mode, host.mode = host.mode, "no reports"
        self.pass_time(seconds, broker_up=True, collections=True, data=data)
        host.mode = mode

    @rule(
        name=st.sampled_from(sorted(n for n, ephemeral in HOSTS.items() if not ephemeral)),
        data=st.data(),
    )
    def worker_stalls_with_a_confirmed_absence(self, name, data):
        """Rule 4's "W is running": a worker loses a handle, and a report confirms the absence
        past the grace period while no collection runs (the collector is down); then it falls
        silent past the TTL before the collector is back. The collection that stalls it deletes
        none of its rows (when it comes back, rule 5 restarts the clock)."""
        host = self.hosts[name]
        if host.silent:
            return
        created = sorted(
            (r.kind, r.handle)
            for r in self.cp.rows_of(name)
            if r.state == "created" and host.holds(r.kind, r.handle)
        )
        if created:
            host.remove(*data.draw(st.sampled_from(created), label="lost"))
            self.report_now(host)
        self.quiet(GRACE.seconds, but=None)
        self.report_now(host)  # dated by the answer to its heartbeat: it confirms
        self.check()  # no two checks a grace period apart (see `pass_time`)
        self.quiet(TTL.seconds + 1, but=host)
        self.collect_now()

    def quiet(self, seconds: int, *, but: Host | None) -> None:
        """The clock jumps `seconds` while no collection runs and the broker delivers nothing
        (both down); then every reporter that is not silent heartbeats, but `but`. (Cheaper
        than ticks, for scenarios that need a grace period or a TTL to pass.)"""
        self.advance(seconds)
        for host in self.hosts.values():
            if host is not but and not host.silent:
                self.heartbeat_now(host)

    def lose_a_handle_and_report(self, host: Host, lose: bool, data) -> None:
        held = [(k, h) for k in KINDS for h in sorted(host.held[k])]
        if lose and held:
            host.remove(*data.draw(st.sampled_from(held), label="lost"))
            self.report_now(host)

    def send(self, host: Host, sent: Sent, *, queued: bool):
        if queued:
            host.pending.append(sent)
            return None
        return self.deliver(sent)

    def broker_drains(self, data) -> None:
        """Every waiting heartbeat, then up to three waiting reports, oldest first or in any
        order (without `data`: the oldest one); a message older than MAX_DELAY is dropped (see
        the module docstring)."""
        for host in self.hosts.values():
            host.pending = [m for m in host.pending if self.now - m.built_at <= MAX_DELAY]
            for sent in [m for m in host.pending if isinstance(m.message, Heartbeat)]:
                host.pending.remove(sent)
                self.deliver(sent)
        in_order = data is None or data.draw(st.booleans(), label="reports in order")
        count = 1 if data is None else data.draw(st.integers(0, 3), label="reports delivered")
        for _ in range(count):
            waiting = sorted(
                ((m, h) for h in self.hosts.values() for m in h.pending),
                key=lambda item: item[0].built_at,
            )
            if not waiting:
                return
            i = 0 if in_order else data.draw(st.integers(0, len(waiting) - 1), label="report")
            sent, host = waiting[i]
            host.pending.remove(sent)
            self.deliver(sent)

    @rule(how=st.sampled_from(["once", "dry run", "concurrently", "beside a fence holder"]))
    def collector(self, how):
        if how == "once":
            self.collect_now()
        elif how == "dry run":  # logs and audits what it would do, and changes nothing
            summary = self.plane.collect(dry_run=True)
            assert summary.outcome == "completed" and summary.dry_run
            self.expected += copy.deepcopy(self.cp).collect(self.now, dry_run=True)
        else:
            self.collect_concurrently(3, fence_held=how == "beside a fence holder")

    def collect_concurrently(self, n: int, *, fence_held: bool) -> None:
        """Rule 11: collections started at once from threads. They may only run one after the
        other: the model applies as many collections as report "completed", and the audit must
        show exactly their work (nothing twice). With `fence_held`, another collector holds the
        fence throughout, and every one of them must stand aside, changing nothing."""
        results: list = []
        errors: list = []
        barrier = threading.Barrier(n)

        def one():
            try:
                barrier.wait(timeout=30)
                results.append(self.plane.collect())
            except Exception as error:  # reported below, in the test's thread
                errors.append(error)

        def run_all():
            threads = [threading.Thread(target=one) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)

        if fence_held:
            with self.db.engine.connect() as conn, collection_fence(conn) as held:
                assert held
                run_all()
            assert not errors, errors
            assert [r.outcome for r in results] == ["skipped"] * n
            return
        run_all()
        assert not errors, errors
        outcomes = Counter(r.outcome for r in results)
        assert sum(outcomes.values()) == n and set(outcomes) <= {"completed", "skipped"}
        assert outcomes["completed"] >= 1, outcomes
        STATS[f"concurrent collections completed: {outcomes['completed']} of {n}"] += 1
        for _ in range(outcomes["completed"]):
            self.expected += self.cp.collect(self.now)

    def everyone_settles(self) -> None:
        """Liveness (invariant 5), at the end of every example: once the reporters are healthy
        and the broker delivers, a grace period and a confirming report leave every worker with
        a row for every handle it holds and none for a handle it lacks (but those still
        creating, which rule 10 handles on its own clock)."""
        for host in self.hosts.values():
            host.mode, host.answered = "healthy", True
            if host.incarnation <= self.cp.tombstones.get(host.name, 0):
                # Deleted (rule 16): its messages are refused until its reporter restarts.
                host.restart(lose_runtime=host.ephemeral)
            self.heartbeat_now(host)
        self.collect_now()  # leaves disruption mode if it was on: marks must be seen afresh
        for host in self.hosts.values():
            self.report_now(host)
        self.check()
        waited = timedelta(0)
        while waited < GRACE:  # past the grace period, never past the heartbeat TTL
            self.advance(TICK)
            waited += timedelta(seconds=TICK)
            for host in self.hosts.values():
                self.heartbeat_now(host)
        for host in self.hosts.values():
            # A report dates from the answer its reporter read after the one before: the second
            # is the first dated at the mark + grace, so it confirms.
            self.report_now(host)
            self.report_now(host)
        self.check()
        rows = self._rows_by_worker()
        for host in self.hosts.values():
            mine = rows.get(host.name, {})
            lacking = {k: state for k, state in mine.items() if not host.holds(*k)}
            assert "destroying" not in lacking.values(), (
                f"{host.name}: destroying rows not confirmed destroyed: {lacking}"
            )
            unrecorded = [(k, h) for k in KINDS for h in host.held[k] if (k, h) not in mine]
            assert not unrecorded, f"{host.name} holds handles without a row: {unrecorded}"
        self.collect_now()
        self.check()
        rows = self._rows_by_worker()
        for host in self.hosts.values():
            left = {
                k: state
                for k, state in rows.get(host.name, {}).items()
                if not host.holds(*k) and state == "created"
            }
            assert not left, f"{host.name}: rows of handles gone from its runtime survive: {left}"
        STATS["settled"] += 1

    def _rows_by_worker(self) -> dict[str, dict[tuple[str, str], str]]:
        rows: dict[str, dict[tuple[str, str], str]] = {}
        with self.db.transaction() as conn:
            for repo in (ContainerRepository(self.db), VolumeRepository(self.db)):
                for r in repo.list(conn):
                    rows.setdefault(r["worker"], {})[(repo.kind, r["handle"])] = r["state"]
        return rows

    # Checks after every step --------------------------------------------------------------------

    def _snapshot(self):
        with self.db.transaction() as conn:
            worker_rows = {
                r.name: (
                    r.state,
                    r.ephemeral,
                    r.incarnation,
                    r.last_heartbeat_seq,
                    r.last_report_seq,
                    r.running_since_seq,
                    r.heartbeat_expires_at,
                    r.stalled_at,
                    r.last_report_at,
                )
                for r in conn.execute(select(workers))
            }
            rows = {}
            for repo in (ContainerRepository(self.db), VolumeRepository(self.db)):
                for r in repo.list(conn):
                    rows[(repo.kind, r["handle"])] = (
                        r["worker"],
                        r["state"],
                        r["missing_since"],
                        r["state_changed_at"],
                        r.get("parent"),
                        r.get("container"),
                    )
            disruption = DisruptionRepository(self.db).current(conn) is not None
            # One entry per subject: a batch row of the collector's deletions holds many.
            audit = [
                SimpleNamespace(**entry)
                for entry in expand(
                    conn.execute(
                        select(audit_events)
                        .where(audit_events.c.id > self.audit_seen)
                        .order_by(audit_events.c.id)
                    )
                )
            ]
        return {"workers": worker_rows, "rows": rows, "disruption": disruption}, audit

    @invariant()
    def database_follows_the_rules(self):
        self.steps += 1
        self.check()

    def check(self):
        current, audit = self._snapshot()
        if audit:
            self.audit_seen = audit[-1].id
        rows, before = current["rows"], self.previous["rows"]

        # The audit: exactly what the model expects, nothing twice (rule 13, and rule 11).
        got = Counter((e.actor, e.action, e.kind, e.subject, e.dry_run) for e in audit)
        want = Counter(self.expected)
        assert got == want, f"audit entries: extra {dict(got - want)}, missing {dict(want - got)}"
        self.expected = []
        for e in audit:
            STATS[f"audit {e.action} {e.kind}{' (dry run)' if e.dry_run else ''}"] += 1

        # 1. No row of a held handle disappears but by the lifecycle.
        dropped = {e.subject for e in audit if e.action == "drop_rows"}
        deleted_workers = {e.subject for e in audit if e.action == "delete" and e.kind == "worker"}
        for e in audit:
            # A row deleted with its worker goes whatever its runtime holds (checked below).
            with_worker = e.reason.startswith(("deleted with worker", "ephemeral worker restarted"))
            if e.action == "delete" and e.kind in KINDS and not with_worker:
                host = self.hosts[e.worker_name]
                assert not host.holds(e.kind, e.subject), (
                    f"invariant 1: the collector {'would delete' if e.dry_run else 'deleted'} "
                    f"{e.kind} {e.subject} ({e.reason}) while {e.worker_name}'s runtime holds it"
                )
        for key in before.keys() - rows.keys():
            worker, state = before[key][0], before[key][1]
            if not self.hosts[worker].holds(*key):
                continue
            assert state == "destroying" or worker in dropped or worker in deleted_workers, (
                f"invariant 1: the row of {key} ({state}) vanished while {worker} holds it"
            )
            if state != "destroying":
                STATS[
                    "rows of held handles gone with their worker's new incarnation (ephemeral)"
                    if worker in dropped
                    else "rows of held handles gone with their worker"
                ] += 1

        # 2. A creating row is never marked missing.
        for key, (_, state, missing_since, *_) in rows.items():
            assert missing_since is None or state == "created", (
                f"invariant 2: {key} is {state} and marked missing since {missing_since}"
            )

        # 3. Deleted for being missing: marked for the grace period, confirmed by a report.
        for e in audit:
            if e.action == "delete" and e.kind in KINDS and e.reason.startswith("missing"):
                key = (e.kind, e.subject)
                state = rows if e.dry_run else before
                missing_since = state[key][2]
                seen = (self.cp.rows.get(key) or self.cp.graveyard[key]).lacking_seen_at
                assert missing_since is not None and missing_since <= self.now - GRACE, (
                    f"invariant 3: {key} deleted at {self.now}, marked since {missing_since}"
                )
                assert seen is not None and seen >= missing_since + GRACE, (
                    f"invariant 3: {key} marked since {missing_since}, deleted with no report "
                    f"lacking it at or after the grace period (last seen lacking: {seen})"
                )

        # The database equals the reference model.
        model = {
            "workers": {n: w.view() for n, w in self.cp.workers.items()},
            "rows": {k: r.view() for k, r in self.cp.rows.items()},
            "disruption": self.cp.disruption,
        }
        for part in ("workers", "rows"):
            got, want = current[part], model[part]
            diff = {
                k: {"database": got.get(k), "model": want.get(k)}
                for k in sorted(got.keys() | want.keys())
                if got.get(k) != want.get(k)
            }
            assert not diff, f"{part} differ from the model: {diff}"
        assert current["disruption"] == model["disruption"], "disruption mode differs"
        self.previous = current

    def teardown(self):
        STATS["steps"] += max(self.steps, 0)
        if sys.exc_info()[0] is None:  # not while a failing example unwinds
            self.everyone_settles()


def _engine_without_fsync(url: str):
    """The engine the library makes, with commits that do not wait for the disk: durability
    across a crash is no part of what this test checks, and it is most of the time spent."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        options = parsed.query.get("options", "")
        url = parsed.update_query_dict({"options": f"{options} -csynchronous_commit=off".strip()})
        return create_database_engine(url.render_as_string(hide_password=False))
    engine = create_database_engine(url)

    @event.listens_for(engine, "connect")
    def _no_sync(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA synchronous = OFF")

    return engine


def run_model(database_url: str, *, examples: int, steps: int) -> Counter:
    """Run the machine on a migrated database at `database_url` (one schema for the whole run,
    emptied before each example); returns the run's statistics."""
    STATS.clear()
    db = ModelClockDatabase(_engine_without_fsync(database_url))
    upgrade(db.engine)
    plane = ControlPlane(load_settings(database_url=database_url, **MODEL_SETTINGS), db)
    machine = type("GcModel", (GcMachine,), {"plane": plane, "db": db})
    started = time.perf_counter()
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        db.dispose()
    STATS["seconds"] = round(time.perf_counter() - started)
    return Counter(STATS)


@pytest.mark.timeout(900)
def test_model_based_gc_never_deletes_what_a_worker_holds(database_url):
    # PostgreSQL, the source of truth of the distributed mode, runs the full count; the embedded
    # mode's SQLite a quarter of it, to keep CI short.
    examples = EXAMPLES if database_url.startswith("postgresql") else max(EXAMPLES // 4, 1)
    stats = run_model(database_url, examples=examples, steps=STEPS)
    print(dict(sorted(stats.items())))
    assert stats["examples"] >= examples


@pytest.mark.parametrize("dated", [False, True], ids=["undated", "dated before creation"])
def test_a_report_delayed_past_the_grace_period_confirms_no_held_handles_absence(
    plane, make_worker, advance, dated
):
    """Rule 4: two reports built before c1 was created wait in a broker; the first marks c1 (the
    race of the seed discussion), the second arrives after `missing_since + grace`. Undated, it
    may not confirm at all; dated, only from its `after`, which is before the mark. c1 stays."""
    w = make_worker()
    after = plane.now() if dated else None
    before_creation = [w.report_message(after=after) for _ in range(2)]  # held in a broker
    plane.scheduler.create_container("w1", "c1")  # the worker creates c1 and holds it
    plane.scheduler.container_created("c1")

    marked = plane.reconciler.report(before_creation[0])
    for _ in range(5):
        advance(minutes=1)
        w.heartbeat()
    plane.reconciler.report(before_creation[1])  # arrives after missing_since + grace
    plane.collect()

    assert marked.marked == {"container": 1, "volume": 0}
    assert [c["handle"] for c in plane.containers()] == ["c1"]
