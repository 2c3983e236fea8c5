"""What one reconciler process knows of a worker's rows after the last report it applied.

A report that changes a few handles need not read all of the worker's rows again: after a
report's transaction commits, its process knows exactly what the worker's rows are, at the
worker's generation of that moment. Every change to a worker or to its rows bumps the
generation, and a registration starts it at a random value, so an entry of the same generation,
read under the worker's lock, is the rows as they are (`Reconciler.report` checks it there).
Another process's report, a collection or a scheduler call moves the generation on: the entry
is then stale and the rows are read. Bounded by a number of handles, the least recently used
workers first out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

from gcworker.rules import WorkerRows

# About 120 bytes a handle in sets: some 25 MB at most per reconciler process.
DEFAULT_MAX_HANDLES = 200_000


def handle_count(rows: Mapping[str, WorkerRows]) -> int:
    return sum(
        len(r.created) + len(r.marked) + len(r.destroying) + len(r.other) for r in rows.values()
    )


class WorkerRowsCache:
    def __init__(self, max_handles: int = DEFAULT_MAX_HANDLES):
        self.max_handles = max_handles
        self._entries: OrderedDict[str, tuple[int, dict[str, WorkerRows], int]] = OrderedDict()
        self._handles = 0
        self._lock = threading.Lock()

    def get(self, worker: str, generation: int) -> dict[str, WorkerRows] | None:
        """The worker's rows by kind if known at exactly this generation."""
        with self._lock:
            entry = self._entries.get(worker)
            if entry is None or entry[0] != generation:
                return None
            self._entries.move_to_end(worker)
            return entry[1]

    def put(self, worker: str, generation: int, rows: dict[str, WorkerRows]) -> None:
        size = handle_count(rows)
        with self._lock:
            self._drop(worker)
            if size > self.max_handles:
                return
            self._entries[worker] = (generation, rows, size)
            self._handles += size
            while self._handles > self.max_handles:
                self._drop(next(iter(self._entries)))

    def forget(self, worker: str) -> None:
        with self._lock:
            self._drop(worker)

    def _drop(self, worker: str) -> None:
        entry = self._entries.pop(worker, None)
        if entry is not None:
            self._handles -= entry[2]
