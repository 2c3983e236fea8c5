"""The `docker` runtime: containers and volumes of a container engine that speaks the Docker
Engine API (Docker, or Podman's compatible service), through the Docker SDK for Python.

Spec: `docker[:URL][?worker=NAME][&image=IMAGE]`, URL like `unix:///var/run/docker.sock`,
`unix:///run/podman/podman.sock` or `tcp://host:2375`; without one, `DOCKER_HOST` (and the other
`DOCKER_*` variables) or the default socket.

Ownership: an object belongs to gcworker only when it carries the label `gcworker.handle`; its
handle is that label's value. Nothing without the label is ever listed or removed. An engine may
serve several workers only if each object also carries `gcworker.worker=NAME` and each reporter
names its worker in the spec (`?worker=NAME`): it then lists and removes only objects with both
labels. A runtime that names no worker refuses (a failed listing, so no report) an engine where
any object carries `gcworker.worker`: it would take every worker's objects for its own.
`image` is the image of the containers `create` makes (the demo's scheduler side).
"""

from __future__ import annotations

import re

import docker
import requests

from gcworker.runtimes import Inventory, RuntimeError_

HANDLE_LABEL = "gcworker.handle"
WORKER_LABEL = "gcworker.worker"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # what the engine accepts as a name
# Every API call returns or fails within this, so a hung engine is a failed listing or removal,
# never a reporter (or a sweeper thread) waiting forever.
API_TIMEOUT_SECONDS = 60
# engine URL (None: DOCKER_HOST) -> the API version it answered, so that runtimes made later
# (the demo makes one per worker) do not each ask again.
_api_versions: dict[str | None, str] = {}
# What the SDK raises when the engine is unreachable, answers an error or times out.
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def from_spec(argument: str) -> DockerRuntime:
    """The runtime named by the part of a spec after `docker:`."""
    url, _, query = argument.partition("?")
    options: dict[str, str] = {}
    for field in filter(None, query.split("&")):
        key, _, value = field.partition("=")
        if key not in ("worker", "image") or not value or key in options:
            raise RuntimeError_(
                f"docker:{argument}: bad option {field!r} "
                "(write docker:URL?worker=NAME&image=IMAGE, each option at most once)"
            )
        options[key] = value
    return DockerRuntime(url or None, **options)


class DockerRuntime:
    def __init__(
        self,
        url: str | None = None,
        *,
        worker: str | None = None,
        image: str | None = None,
        timeout: float = API_TIMEOUT_SECONDS,
    ):
        self.url = url
        self.worker = worker
        self.image = image
        self.timeout = timeout
        self._api: docker.APIClient | None = None

    def __repr__(self) -> str:
        return f"DockerRuntime({self.url or 'DOCKER_HOST'}, worker={self.worker})"

    def client(self) -> docker.APIClient:
        """The engine's API client, made on first use (an engine down when the reporter starts
        is a failed listing, not a crash), speaking the API version the engine serves: asked
        once per engine and process, since the question costs Podman seconds."""
        if self._api is None:
            version = _api_versions.get(self.url, "auto")
            if self.url:
                api = docker.APIClient(base_url=self.url, version=version, timeout=self.timeout)
            else:
                api = docker.from_env(version=version, timeout=self.timeout).api
            _api_versions[self.url] = api.api_version
            self._api = api
        return self._api

    def _labels(self, handle: str | None = None) -> list[str]:
        """The label filter that selects this worker's objects (one handle's, if given)."""
        labels = [HANDLE_LABEL if handle is None else f"{HANDLE_LABEL}={handle}"]
        if self.worker is not None:
            labels.append(f"{WORKER_LABEL}={self.worker}")
        return labels

    def _owned(self, labels: dict | None) -> str | None:
        """The handle of an object with these labels, None if it is not this worker's."""
        labels = labels or {}
        if HANDLE_LABEL not in labels:
            return None
        if labels.get(WORKER_LABEL) != self.worker:
            return None
        return labels[HANDLE_LABEL]

    def _mine(self, found: list[dict], handle: str | None) -> list[dict]:
        """The objects of `found` that are this worker's (labelled `handle`, if given). The
        engine's label filter only narrows the listing: Podman 4.3 ORs several labels on
        volumes, so ownership must not rest on it."""
        if self.worker is None and any(WORKER_LABEL in (o.get("Labels") or {}) for o in found):
            raise RuntimeError_(
                f"{self!r}: the engine serves several workers (objects labelled "
                f"{WORKER_LABEL}): name this one with docker:URL?worker=NAME"
            )
        return [
            o
            for o in found
            if (owned := self._owned(o.get("Labels"))) is not None
            and (handle is None or owned == handle)
        ]

    def owned_containers(self, handle: str | None = None) -> list[dict]:
        """This worker's containers (all states; labelled `handle`, if given), as the API
        lists them."""
        found = self.client().containers(all=True, filters={"label": self._labels(handle)})
        return self._mine(found, handle)

    def owned_volumes(self, handle: str | None = None) -> list[dict]:
        """This worker's volumes (labelled `handle`, if given), as the API lists them."""
        found = self.client().volumes(filters={"label": self._labels(handle)}) or {}
        return self._mine(found.get("Volumes") or [], handle)

    def inventory(self) -> Inventory:
        try:
            containers = {self._owned(c["Labels"]) for c in self.owned_containers()}
            volumes = {self._owned(v["Labels"]) for v in self.owned_volumes()}
        except ENGINE_ERRORS as error:
            raise RuntimeError_(f"cannot list {self!r}: {short(error)}") from error
        return Inventory(containers=sorted(containers), volumes=sorted(volumes))

    def create(self, kind: str, handle: str) -> None:
        """Create a container (not started) or a volume labelled with `handle`, named after it
        when the handle is a valid name (`:` is not), else named by the engine."""
        labels = {HANDLE_LABEL: handle}
        if self.worker is not None:
            labels[WORKER_LABEL] = self.worker
        name = handle if NAME.fullmatch(handle) else None
        try:
            if kind == "container":
                if not self.image:
                    raise RuntimeError_(
                        "the docker runtime creates containers from an image: "
                        "docker:URL?image=IMAGE"
                    )
                self.client().create_container(self.image, name=name, labels=labels)
            else:
                self.client().create_volume(name=name, labels=labels)
        except ENGINE_ERRORS as error:
            raise RuntimeError_(f"cannot create {kind} {handle}: {short(error)}") from error

    def destroy(self, kind: str, handle: str) -> None:
        """Remove this worker's objects labelled with `handle`: a container by force with its
        anonymous volumes (named volumes stay), a volume only when no container uses it (else
        RuntimeError_, retried later). Gone already is fine; an object named `handle` that is
        not this worker's is refused."""
        try:
            if kind == "container":
                owned = [c["Id"] for c in self.owned_containers(handle)]
                remove = self._remove_container
            else:
                owned = [v["Name"] for v in self.owned_volumes(handle)]
                remove = self.client().remove_volume
            if not owned:
                self._refuse_if_present(kind, handle)
            for name in owned:
                try:
                    remove(name)
                except docker.errors.NotFound:
                    pass  # removed meanwhile: that is what we wanted
        except docker.errors.APIError as error:
            in_use = error.status_code == 409
            raise RuntimeError_(
                f"cannot remove {kind} {handle}"
                + (" (in use: retried on a later round)" if in_use else "")
                + f": {short(error)}"
            ) from error
        except ENGINE_ERRORS as error:
            raise RuntimeError_(f"cannot remove {kind} {handle}: {short(error)}") from error

    def _remove_container(self, container_id: str) -> None:
        self.client().remove_container(container_id, v=True, force=True)

    def _refuse_if_present(self, kind: str, handle: str) -> None:
        """None of ours is labelled `handle`; one that merely bears its name is not ours."""
        client = self.client()
        try:
            if kind == "container":
                labels = client.inspect_container(handle)["Config"].get("Labels")
            else:
                labels = client.inspect_volume(handle).get("Labels")
        except docker.errors.NotFound:
            return  # gone: nothing to do
        if self._owned(labels) != handle:
            raise RuntimeError_(f"refused to remove {kind} {handle}: not this worker's (labels)")


def short(error: Exception, limit: int = 300) -> str:
    text = str(error)
    return text if len(text) <= limit else text[: limit - 3] + "..."
