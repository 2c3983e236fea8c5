"""Container runtimes a reporter reads its inventory from, as plugins.

A runtime is named on the command line as `KIND:ARGUMENT` (e.g. `dir:/var/lib/worker`); KIND is
looked up in the `gcworker.runtimes` entry-point group, so another package can add its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol

from gcworker.errors import GcworkerError

KINDS = ("container", "volume")


@dataclass(frozen=True)
class Inventory:
    containers: list[str]
    volumes: list[str]


class RuntimeError_(GcworkerError):
    """The runtime could not be read or changed."""


class Runtime(Protocol):
    def inventory(self) -> Inventory:
        """Every container and volume handle the runtime holds; raises RuntimeError_ on failure."""

    def create(self, kind: str, handle: str) -> None:
        """Create a container or volume (used by the demo's scheduler)."""

    def destroy(self, kind: str, handle: str) -> None:
        """Remove a container or volume; removing one that is already gone is not an error."""


def load_runtime(spec: str) -> Runtime:
    kind, _, argument = spec.partition(":")
    found = {e.name: e for e in entry_points(group="gcworker.runtimes")}
    if kind not in found:
        raise GcworkerError(
            f"unknown runtime {kind!r} in {spec!r} (known: {', '.join(sorted(found)) or 'none'})"
        )
    return found[kind].load()(argument)
