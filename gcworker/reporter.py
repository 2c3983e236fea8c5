"""The reporter: one per worker host. It heartbeats every heartbeat-interval, reports the
runtime's inventory every report-interval, and after each report removes, a few at a time, the
handles the control plane holds as destroying. A listing that fails sends no report (never an
empty one); nothing a runtime lists or does ends the reporter.

A report is compact when nothing changed: if the inventory's digest equals that of the last full
report sent, the reporter sends only the digest (`UnchangedReport`), unless `full_report_every`
reports have passed since the last full one or the control plane asked for a full report (it
does when it cannot confirm a digest, e.g. after its own rows of the worker changed).

What the reporter believes of the control plane's answers (rule 15, `gcworker.answers`): a stamp
is current when it is authentic, made for this worker's incarnation, and answers a message this
reporter sent within `answer_max_age` (an older one is stale, one naming a message it never
sent is from the future). Reports built after reading a current stamp are dated with its time
(`after`, rule 4); before any, reports are undated and confirm nothing; a stamp older than one
already read is stale. A destroy list is acted on only with a current stamp of the same
incarnation and generation (the list then says what the database held at the stamp's time), and
only for handles that are valid and that the runtime held at every listing since the newest one
the stamp answers: the list was read after that listing, so a handle it names is the one the
runtime holds, never an earlier holder of a reused name.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, deque
from datetime import UTC, datetime

from gcworker import metrics
from gcworker.answers import Stamp
from gcworker.delivery import Channel, Feedback
from gcworker.messages import HANDLE_PATTERN, Heartbeat, Report, UnchangedReport
from gcworker.rules import report_digest
from gcworker.runtimes import Inventory, Runtime, RuntimeError_
from gcworker.sweeper import Sweeper

log = logging.getLogger(__name__)

DESTROY_PER_REPORT = 50
FULL_REPORT_EVERY = 10
MIN_ANSWER_MAX_AGE_S = 600.0
MAX_WARNED_NAMES = 1000
LISTINGS_KEPT = 4
_HANDLE = re.compile(HANDLE_PATTERN)


class Reporter:
    def __init__(
        self,
        worker: str,
        runtime: Runtime,
        channel: Channel,
        *,
        heartbeat_interval: float,
        report_interval: float,
        ttl_seconds: float | None = None,
        ephemeral: bool = False,
        incarnation: int | None = None,
        destroy_per_report: int = DESTROY_PER_REPORT,
        full_report_every: int = FULL_REPORT_EVERY,
        answer_max_age: float | None = None,
        sweeper: Sweeper | None = None,
    ):
        self.worker = worker
        self.runtime = runtime
        self.channel = channel
        self.heartbeat_interval = heartbeat_interval
        self.report_interval = report_interval
        self.ttl_seconds = ttl_seconds
        self.ephemeral = ephemeral
        # Taken from the clock at start, so a restarted reporter's incarnation is always higher.
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.destroy_per_report = destroy_per_report
        self.full_report_every = full_report_every
        self.answer_max_age = answer_max_age or max(10 * report_interval, MIN_ANSWER_MAX_AGE_S)
        # Removals off the reporter's loop, bounded and timed out; without one, one at a time.
        self.sweeper = sweeper
        self._last_seq = 0
        self._sent: OrderedDict[int, float] = OrderedDict()  # seq -> monotonic time, recent
        self._last_full_digest: str | None = None
        self._compact_since_full = 0
        self._full_report_wanted = False
        self._stamp: Stamp | None = None  # the newest current stamp
        self._warned: set[str] = set()  # names already warned about (bounded)
        self._complaints: set[tuple[str, str]] = set()  # answers warned about since the last
        # The last few listings, with the sequence number of the report built from each.
        self._listings: deque[tuple[int, Inventory]] = deque(maxlen=LISTINGS_KEPT)

    @property
    def heard_at(self) -> datetime | None:
        """The date of the reports built now: the newest current stamp's control-plane time."""
        return Feedback(self._stamp).as_of

    def _next_seq(self) -> int:
        self._last_seq = max(time.time_ns(), self._last_seq + 1)
        return self._last_seq

    def _send(self, message) -> None:
        now = time.monotonic()
        self._sent[message.seq] = now
        while self._sent and next(iter(self._sent.values())) < now - self.answer_max_age:
            self._sent.popitem(last=False)
        self.channel.send(message)

    def heartbeat(self) -> None:
        self._send(
            Heartbeat(
                worker=self.worker,
                incarnation=self.incarnation,
                seq=self._next_seq(),
                clock=datetime.now(UTC),
                ephemeral=self.ephemeral,
                ttl_seconds=self.ttl_seconds,
            )
        )

    def report(self) -> bool:
        """Send one report and remove what the control plane destroys; False if none was sent."""
        if self._stamp is None:  # date the first report too, if an answer is there already:
            self._take_feedback()  # read before the listing, as every later report's date is
        try:
            inventory = self._listing()
        except RuntimeError_ as error:
            log.warning(
                "listing failed: no report sent", extra={"worker": self.worker, "error": str(error)}
            )
            return False
        digest = report_digest(inventory.containers, inventory.volumes)
        fields = {
            "after": self.heard_at,
            "worker": self.worker,
            "incarnation": self.incarnation,
            "seq": self._next_seq(),
            "clock": datetime.now(UTC),
        }
        if self._may_send_compact(digest):
            self._send(UnchangedReport(**fields, digest=digest))
            self._compact_since_full += 1
        else:
            self._send(Report(**fields, containers=inventory.containers, volumes=inventory.volumes))
            self._last_full_digest, self._compact_since_full = digest, 0
            self._full_report_wanted = False
        self._listings.append((fields["seq"], inventory))
        log.info(
            "report sent",
            extra={
                "worker": self.worker,
                "compact": self._compact_since_full > 0,
                "dated": fields["after"] is not None,
                "containers": len(inventory.containers),
                "volumes": len(inventory.volumes),
            },
        )
        self._act_on_feedback()
        return True

    def _listing(self) -> Inventory:
        """The runtime's inventory, less the entries that are no valid handle (each warned
        about once): a stray `lost+found` is never reported, and never stops a report."""
        inventory = self.runtime.inventory()
        return Inventory(
            containers=self._valid(inventory.containers, "container"),
            volumes=self._valid(inventory.volumes, "volume"),
        )

    def _valid(self, names, kind: str) -> list[str]:
        valid = [name for name in names if isinstance(name, str) and _HANDLE.fullmatch(name)]
        if len(valid) != len(names):
            for name in names:
                if name not in valid:
                    metrics.REPORTER_HANDLES_SKIPPED.labels("invalid_listed").inc()
                    self._warn_once(f"{kind}:{name!r}", "runtime entry is no valid handle: skipped")
        return valid

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned or len(self._warned) >= MAX_WARNED_NAMES:
            return
        self._warned.add(key)
        log.warning(message, extra={"worker": self.worker, "entry": key[:200]})

    def _may_send_compact(self, digest: str) -> bool:
        return (
            digest == self._last_full_digest
            and self._compact_since_full + 1 < self.full_report_every
            and not self._full_report_wanted
        )

    def _take_feedback(self) -> tuple[Stamp | None, dict[str, list[str]]]:
        """Read the control plane's answer: keep its stamp if it is current (reports built from
        now on date from it), and return it with the destroy list's handles if the list is
        current too: of the stamp's incarnation and generation, so read when the stamp says
        nothing had changed since (None and empty otherwise)."""
        feedback = self.channel.feedback(self.worker)
        self._full_report_wanted |= feedback.full_report_wanted
        stamp = feedback.stamp
        if stamp is None or not self._is_current(stamp, "stamp"):
            return None, {}
        self._stamp = stamp
        self._complaints.clear()  # the control plane answers again: warn afresh
        listed = feedback.destroy_list
        if listed is None:
            return stamp, {}
        if (listed.incarnation, listed.generation) != (stamp.incarnation, stamp.generation):
            metrics.REPORTER_ANSWERS_IGNORED.labels("destroylist", "other_generation").inc()
            return stamp, {}  # a newer list is on its way: no warning
        return stamp, listed.by_kind()

    def _is_current(self, stamp: Stamp, answer: str) -> bool:
        if stamp.worker != self.worker or stamp.incarnation != self.incarnation:
            return self._ignored(answer, "other_incarnation", f"incarnation {stamp.incarnation}")
        if stamp.seq > self._last_seq:
            return self._ignored(answer, "future", f"answers message {stamp.seq}, never sent")
        sent = self._sent.get(stamp.seq)
        if sent is None or time.monotonic() - sent > self.answer_max_age:
            return self._ignored(answer, "stale", f"answers message {stamp.seq}, not recent")
        if self._stamp is not None and stamp.as_of < self._stamp.as_of:
            return self._ignored(answer, "stale", "older than an answer already read")
        return True

    def _ignored(self, answer: str, reason: str, detail: str) -> bool:
        """Count an answer that is not current; warn once for each kind of complaint until the
        control plane answers again (a restarted reporter reads its old life's answer until
        its first heartbeat is answered: one line, not one per round)."""
        metrics.REPORTER_ANSWERS_IGNORED.labels(answer, reason).inc()
        if (answer, reason) not in self._complaints:
            self._complaints.add((answer, reason))
            log.warning(
                "control plane answer ignored: not current",
                extra={"worker": self.worker, "answer": answer, "reason": reason, "detail": detail},
            )
        return False

    def _act_on_feedback(self) -> int:
        """Remove up to `destroy_per_report` handles of the current destroy list that are valid
        and that the runtime held at every listing since the newest one the stamp answers (the
        list was read after that listing: the handle it names is the one the runtime holds, not
        an earlier holder of the same name); a removal that fails is logged and tried again at
        a later round. Returns how many handles were removed."""
        stamp, destroying = self._take_feedback()
        held = self._held_since(stamp.seq) if destroying else None
        removed = 0
        for kind, handles in destroying.items():
            for handle in handles:
                if removed >= self.destroy_per_report:
                    break
                if not _HANDLE.fullmatch(handle):
                    metrics.REPORTER_HANDLES_SKIPPED.labels("invalid_named").inc()
                    self._warn_once(f"{kind}:{handle!r}", "destroy list names no valid handle")
                    continue
                if handle not in held[kind]:
                    metrics.REPORTER_HANDLES_SKIPPED.labels("not_held").inc()
                    continue
                if self.sweeper is not None:
                    self.sweeper.submit(kind, handle)  # logs and counts its own failures
                    removed += 1
                    continue
                try:
                    self.runtime.destroy(kind, handle)
                except RuntimeError_ as error:
                    log.warning(
                        "removal failed: tried again at a later round",
                        extra={
                            "worker": self.worker,
                            "kind": kind,
                            "handle": handle,
                            "error": str(error)[:500],
                        },
                    )
                    continue
                removed += 1
        if removed:
            log.info(
                "removing destroying handles", extra={"worker": self.worker, "count": removed}
            )
        return removed

    def _held_since(self, answered_seq: int) -> dict[str, set[str]]:
        """The handles of each kind in every kept listing from the newest whose report was sent
        no later than the message `answered_seq` on (none if no kept listing is that old)."""
        listings = list(self._listings)
        answered = [i for i, (seq, _) in enumerate(listings) if seq <= answered_seq]
        if not answered:
            return {"container": set(), "volume": set()}
        window = [inventory for _, inventory in listings[answered[-1] :]]
        return {
            kind: set.intersection(*(set(getattr(inv, f"{kind}s")) for inv in window))
            for kind in ("container", "volume")
        }

    def acknowledged(self) -> bool:
        """Whether the control plane answered this reporter's newest message (a current stamp
        for it): it was authentic and it arrived."""
        self._take_feedback()
        return self._stamp is not None and self._stamp.seq >= self._last_seq

    def step(self, action) -> bool:
        """Run one heartbeat or report; whatever goes wrong is logged and the reporter goes
        on (nothing a runtime lists or does ends it). False when it failed or sent nothing."""
        try:
            return action() is not False
        except Exception:  # noqa: BLE001 - the next round tries again
            log.exception(
                "reporter step failed: trying again at the next round",
                extra={"worker": self.worker},
            )
            return False

    def run(self, stop: threading.Event, *, once: bool = False) -> bool:
        """Heartbeat and report on their intervals until `stop` is set; with `once`, one
        heartbeat and one report, then return whether the report was sent."""
        next_heartbeat = next_report = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                self.step(self.heartbeat)
                next_heartbeat = now + self.heartbeat_interval
            if now >= next_report:
                sent = self.step(self.report)
                next_report = now + self.report_interval
                if once:
                    return sent
            stop.wait(max(0.0, min(next_heartbeat, next_report) - time.monotonic()))
        return True
