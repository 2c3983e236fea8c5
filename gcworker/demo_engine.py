"""The demo's fleet on a real container engine (`gcworker demo --runtime docker[:URL]`).

One engine serves every simulated worker: each worker's objects carry `gcworker.worker` with a
value of this run alone (`gcworker-demo-<run>-<worker>`), so the demo never lists or removes
anything it did not make, even on an engine that serves real workers. Containers are created
from a tiny image the demo imports from a tarball it builds (one file; containers are never
started, so no registry, no network). At the end (also on failure or Ctrl-C) `Engine.clean`
removes every object labelled with this run and the image.
"""

from __future__ import annotations

import io
import secrets
import tarfile
import threading
from collections import Counter

import docker

from gcworker.runtimes import KINDS, RuntimeError_
from gcworker.runtimes.docker import (
    ENGINE_ERRORS,
    HANDLE_LABEL,
    WORKER_LABEL,
    DockerRuntime,
    short,
)

RUN_PREFIX = "gcworker-demo"


def import_image(api: docker.APIClient, repository: str, file: bytes, command: list[str]) -> str:
    """An image holding one file, `/placeholder`, imported from a tarball built here; returns
    its reference (`repository:latest`)."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        entry = tarfile.TarInfo("placeholder")
        entry.size, entry.mode = len(file), 0o755
        tar.addfile(entry, io.BytesIO(file))
    cmd = ", ".join(f'"{part}"' for part in command)
    api.import_image_from_data(data.getvalue(), repository=repository, changes=[f"CMD [{cmd}]"])
    return f"{repository}:latest"


class Engine:
    """The engine the demo's workers share, and everything this run made on it."""

    def __init__(self, url: str | None):
        self.url = url
        self.run = f"{RUN_PREFIX}-{secrets.token_hex(4)}"
        self.image: str | None = None
        self._api: docker.APIClient | None = None

    def open(self) -> None:
        """Check the engine answers and import the demo's image; RuntimeError_ if it cannot."""
        try:
            self._api = DockerRuntime(self.url).client()
            self._api.ping()
            self.image = import_image(
                self._api, f"localhost/{self.run}", b"gcworker demo\n", ["/placeholder"]
            )
        except ENGINE_ERRORS as error:
            raise RuntimeError_(
                f"the engine {self.url or 'DOCKER_HOST'} does not answer: {short(error)}"
            ) from error

    def runtime(self, worker: str) -> DockerRuntime:
        return DockerRuntime(self.url, worker=f"{self.run}-{worker}", image=self.image)

    def remove_all(self, runtime: DockerRuntime) -> list[tuple[str, str]]:
        """Remove every object of `runtime`'s worker behind gcworker's back (containers first:
        a volume in use cannot go). Returns the (kind, handle) pairs removed."""
        api = self._api
        removed = []
        for container in runtime.owned_containers():
            api.remove_container(container["Id"], force=True, v=True)
            removed.append(("container", container["Labels"][HANDLE_LABEL]))
        for volume in runtime.owned_volumes():
            api.remove_volume(volume["Name"])
            removed.append(("volume", volume["Labels"][HANDLE_LABEL]))
        return removed

    def clean(self) -> str:
        """Remove every object this run made and its image; says what was removed."""
        if self._api is None:
            return "nothing to remove"
        api = self._api
        objects = 0
        prefix = f"{self.run}-"
        for container in api.containers(all=True, filters={"label": WORKER_LABEL}):
            if container["Labels"].get(WORKER_LABEL, "").startswith(prefix):
                api.remove_container(container["Id"], force=True, v=True)
                objects += 1
        for volume in api.volumes(filters={"label": WORKER_LABEL})["Volumes"] or []:
            if (volume.get("Labels") or {}).get(WORKER_LABEL, "").startswith(prefix):
                api.remove_volume(volume["Name"])
                objects += 1
        if self.image is not None:
            api.remove_image(self.image, force=True)
        return f"removed {objects} objects and the image {self.image} from the engine"


class EngineRuntime:
    """A simulated worker's runtime on the shared engine: like the `dir` demo's, it can be
    unreachable, knows volumes need their parent, records its changes in `history`, and every
    change holds `lock`, the lock snapshots take."""

    def __init__(self, worker: str, engine: Engine, lock: threading.Lock, history):
        self.worker = worker
        self.engine = engine
        self.docker = engine.runtime(worker)
        self.lock = lock
        self.history = history
        self.reachable = True

    def inventory(self):
        if not self.reachable:
            raise RuntimeError_(f"{self.worker}: runtime unreachable")
        return self.docker.inventory()

    def create(self, kind: str, handle: str, *, parent: str | None = None) -> None:
        with self.lock:
            if not self.reachable:
                raise RuntimeError_(f"{self.worker}: runtime unreachable")
            if parent is not None and parent not in self.docker.inventory().volumes:
                raise RuntimeError_(f"{self.worker}: parent volume {parent} not found")
            self.docker.create(kind, handle)
            self.history.made((kind, handle), self.worker)

    def destroy(self, kind: str, handle: str) -> None:
        with self.lock:
            self.history.removed((kind, handle))
            self.docker.destroy(kind, handle)

    def wipe(self) -> Counter:
        """The engine lost this worker's objects. Returns what was lost."""
        with self.lock:
            lost = Counter()
            for key in self.engine.remove_all(self.docker):
                self.history.removed(key)
                lost[key[0]] += 1
            return lost

    def vanish(self) -> None:
        with self.lock:
            self.reachable = False
            for key in self.engine.remove_all(self.docker):
                self.history.removed(key)

    def listing(self) -> list[tuple[str, str]]:
        """What the engine holds of this worker now."""
        inventory = self.docker.inventory()
        return [(kind, h) for kind in KINDS for h in getattr(inventory, f"{kind}s")]
