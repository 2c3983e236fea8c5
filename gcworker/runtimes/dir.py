"""The `dir` runtime: containers and volumes are directories `PATH/containers/<handle>` and
`PATH/volumes/<handle>`; destroying one removes its directory tree.

An empty runtime and a missing one must not look alike (rule 15: a listing that cannot be
trusted sends no report): the root must exist, be a readable directory, and hold `containers/`,
`volumes/` or the marker file `.gcworker-runtime`. A mount point whose disk is not mounted is an
empty directory, so it fails the listing instead of reporting that every container is gone; to
declare a runtime that is empty on purpose, create the marker (`create` makes the folders).
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
            self._check_root()
            return Inventory(
                containers=sorted(self._list(self._folder("container"))),
                volumes=sorted(self._list(self._folder("volume"))),
            )
        except OSError as error:
            raise RuntimeError_(f"cannot list {self.root}: {error}") from error

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise RuntimeError_(
                f"runtime root {self.root} does not exist or is not a directory "
                "(a typo, or a disk not mounted?)"
            )
        names = {entry.name for entry in os.scandir(self.root)}
        if not names & {MARKER, *FOLDERS.values()}:
            raise RuntimeError_(
                f"runtime root {self.root} holds neither {', '.join(FOLDERS.values())} nor "
                f"{MARKER}: an empty mount point is no empty runtime (create {self.root / MARKER} "
                "to declare one)"
            )

    @staticmethod
    def _list(folder: Path) -> list[str]:
        if not folder.exists():
            return []
        return [entry.name for entry in os.scandir(folder) if entry.is_dir(follow_symlinks=False)]

    def declare_empty(self) -> DirRuntime:
        """Make the root, with its marker: a runtime that is empty on purpose."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).touch()
        return self

    def create(self, kind: str, handle: str) -> None:
        (self._folder(kind) / self._checked(handle)).mkdir(parents=True, exist_ok=True)

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
