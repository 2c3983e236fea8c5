"""The `dir` runtime: containers and volumes are directories `PATH/containers/<handle>` and
`PATH/volumes/<handle>`; destroying one removes its directory tree.

An empty runtime and a missing one must not look alike (rule 15: a listing that cannot be
trusted sends no report): each of `containers/` and `volumes/` must be a readable directory (not
a symlink) holding the marker file `.gcworker-runtime`, which `create` writes when it first
makes something of that kind. A folder that is missing, renamed, or a mount point whose disk is
not mounted (an empty directory: no marker) fails the listing instead of reporting that all its
containers are gone. To declare a runtime that is empty on purpose, `declare_empty` (or create
both folders and their markers by hand).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gcworker.errors import GcworkerError
from gcworker.messages import check_handle
from gcworker.runtimes import Inventory, RuntimeError_

MARKER = ".gcworker-runtime"
FOLDERS = {"container": "containers", "volume": "volumes"}


class DirRuntime:
    def __init__(self, argument: str):
        if not argument:
            raise RuntimeError_("the dir runtime needs a path: dir:/path/to/runtime")
        self.root = Path(argument)

    def _folder(self, kind: str) -> Path:
        return self.root / FOLDERS[kind]

    def inventory(self) -> Inventory:
        try:
            return Inventory(
                containers=sorted(self._list(self._folder("container"))),
                volumes=sorted(self._list(self._folder("volume"))),
            )
        except OSError as error:
            raise RuntimeError_(f"cannot list {self.root}: {error}") from error

    @staticmethod
    def _list(folder: Path) -> list[str]:
        """The folder's entries; a folder that cannot be trusted raises."""
        if folder.is_symlink() or not folder.is_dir():
            raise RuntimeError_(
                f"{folder} is missing, a symlink or no directory (a typo, or a disk not "
                "mounted?): no report"
            )
        entries = list(os.scandir(folder))
        if MARKER not in {entry.name for entry in entries}:
            raise RuntimeError_(
                f"{folder} holds no {MARKER}: an empty mount point is no empty runtime (a "
                f"runtime empty on purpose has the marker: touch {folder / MARKER})"
            )
        # Directories; and symlinks, which are never removed (`destroy`) but kept as present,
        # so that a row is never deleted for something the runtime holds in an odd form.
        return [
            entry.name
            for entry in entries
            if entry.is_symlink() or entry.is_dir(follow_symlinks=False)
        ]

    def declare_empty(self) -> DirRuntime:
        """Make both folders with their markers: a runtime that is empty on purpose."""
        for kind in FOLDERS:
            self._declared(kind)
        return self

    def _declared(self, kind: str) -> Path:
        folder = self._folder(kind)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).touch()
        return folder

    def create(self, kind: str, handle: str) -> None:
        """Make a container or volume; the runtime's first use declares it (both folders)."""
        if not self.root.exists():
            self.declare_empty()
        (self._declared(kind) / self._checked(handle)).mkdir(exist_ok=True)

    def destroy(self, kind: str, handle: str) -> None:
        path = self._folder(kind) / self._checked(handle)
        if path.is_symlink() or path.resolve().parent != self._folder(kind).resolve():
            raise RuntimeError_(f"refused to remove {path}: it leads outside {self._folder(kind)}")
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise RuntimeError_(f"cannot remove {path}: {error}") from error

    @staticmethod
    def _checked(handle: str) -> str:
        """A name that is a valid handle, so never a path (no `/`, no leading `.`)."""
        try:
            return check_handle(handle)
        except GcworkerError as error:
            raise RuntimeError_(str(error)) from None
