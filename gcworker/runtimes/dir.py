"""The `dir` runtime: containers and volumes are directories `PATH/containers/<handle>` and
`PATH/volumes/<handle>`; destroying one removes its directory tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gcworker.runtimes import Inventory, RuntimeError_


class DirRuntime:
    def __init__(self, argument: str):
        if not argument:
            raise RuntimeError_("the dir runtime needs a path: dir:/path/to/runtime")
        self.root = Path(argument)

    def _folder(self, kind: str) -> Path:
        return self.root / f"{kind}s"

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
        if not folder.exists():
            return []
        return [entry.name for entry in os.scandir(folder) if entry.is_dir()]

    def create(self, kind: str, handle: str) -> None:
        (self._folder(kind) / handle).mkdir(parents=True, exist_ok=True)

    def destroy(self, kind: str, handle: str) -> None:
        try:
            shutil.rmtree(self._folder(kind) / handle)
        except FileNotFoundError:
            pass
