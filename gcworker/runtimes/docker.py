"""The `docker` runtime: containers and volumes of a container engine that speaks the Docker
Engine API (Docker, or Podman's compatible service), through the Docker SDK for Python.

Spec: `docker[:URL][?worker=NAME][&image=IMAGE]`, URL like `unix:///var/run/docker.sock`,
`unix:///run/podman/podman.sock` or `tcp://host:2375`; without one, `DOCKER_HOST` (and the other
`DOCKER_*` variables) or the default socket.

Ownership: an object belongs to gcworker only when it carries the label `gcworker.handle`; its
handle is that label's value. Nothing without the label is ever listed or removed. An engine may
serve several workers only if each object also carries `gcworker.worker=NAME` and each reporter
names its worker in the spec (`?worker=NAME`): it then lists and removes only objects with both
labels. `image` is the image of the containers `create` makes (the demo's scheduler side).
"""

from __future__ import annotations

from urllib.parse import parse_qs

import docker
import requests

from gcworker.runtimes import Inventory, RuntimeError_

HANDLE_LABEL = "gcworker.handle"
WORKER_LABEL = "gcworker.worker"
# Every API call returns or fails within this, so a hung engine is a failed listing or removal,
# never a reporter (or a sweeper thread) waiting forever.
API_TIMEOUT_SECONDS = 60
# What the SDK raises when the engine is unreachable, answers an error or times out.
_ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def from_spec(argument: str) -> DockerRuntime:
    """The runtime named by the part of a spec after `docker:`."""
    url, _, query = argument.partition("?")
    options = parse_qs(query, strict_parsing=bool(query), keep_blank_values=False)
    unknown = set(options) - {"worker", "image"}
    if unknown:
        raise RuntimeError_(
            f"unknown option(s) {', '.join(sorted(unknown))} in docker:{argument} "
            "(known: worker, image)"
        )
    return DockerRuntime(
        url or None,
        worker=options.get("worker", [None])[-1],
        image=options.get("image", [None])[-1],
    )


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

    def _client(self) -> docker.APIClient:
        # Made on first use (the SDK asks the engine its API version): an engine that is down
        # when the reporter starts is a failed listing, retried at the next report.
        if self._api is None:
            if self.url:
                self._api = docker.APIClient(
                    base_url=self.url, version="auto", timeout=self.timeout
                )
            else:
                self._api = docker.from_env(version="auto", timeout=self.timeout).api
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
        if self.worker is not None and labels.get(WORKER_LABEL) != self.worker:
            return None
        return labels[HANDLE_LABEL]

    def _containers(self, handle: str | None = None) -> list[dict]:
        found = self._client().containers(all=True, filters={"label": self._labels(handle)})
        # Filter again on our side: ownership must not rest on the engine's filter alone.
        return [c for c in found if self._owned(c.get("Labels")) is not None]

    def _volumes(self, handle: str | None = None) -> list[dict]:
        found = self._client().volumes(filters={"label": self._labels(handle)}) or {}
        return [v for v in found.get("Volumes") or [] if self._owned(v.get("Labels")) is not None]

    def inventory(self) -> Inventory:
        try:
            containers = {self._owned(c["Labels"]) for c in self._containers()}
            volumes = {self._owned(v["Labels"]) for v in self._volumes()}
        except _ENGINE_ERRORS as error:
            raise RuntimeError_(f"cannot list {self!r}: {_short(error)}") from error
        return Inventory(containers=sorted(containers), volumes=sorted(volumes))

    def create(self, kind: str, handle: str) -> None:
        labels = {HANDLE_LABEL: handle}
        if self.worker is not None:
            labels[WORKER_LABEL] = self.worker
        try:
            if kind == "container":
                if not self.image:
                    raise RuntimeError_(
                        "the docker runtime creates containers from an image: "
                        "docker:URL?image=IMAGE"
                    )
                self._client().create_container(self.image, name=handle, labels=labels)
            else:
                self._client().create_volume(name=handle, labels=labels)
        except _ENGINE_ERRORS as error:
            raise RuntimeError_(f"cannot create {kind} {handle}: {_short(error)}") from error

    def destroy(self, kind: str, handle: str) -> None:
        """Remove this worker's objects labelled with `handle`: a container by force with its
        anonymous volumes (named volumes stay), a volume only when no container uses it (else
        RuntimeError_, retried later). Gone already is fine; an object named `handle` that is
        not this worker's is refused."""
        try:
            if kind == "container":
                owned = [c["Id"] for c in self._containers(handle)]
                remove = self._remove_container
            else:
                owned = [v["Name"] for v in self._volumes(handle)]
                remove = self._client().remove_volume
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
                + f": {_short(error)}"
            ) from error
        except _ENGINE_ERRORS as error:
            raise RuntimeError_(f"cannot remove {kind} {handle}: {_short(error)}") from error

    def _remove_container(self, container_id: str) -> None:
        self._client().remove_container(container_id, v=True, force=True)

    def _refuse_if_present(self, kind: str, handle: str) -> None:
        """None of ours is labelled `handle`; one that merely bears its name is not ours."""
        client = self._client()
        try:
            if kind == "container":
                labels = client.inspect_container(handle)["Config"].get("Labels")
            else:
                labels = client.inspect_volume(handle).get("Labels")
        except docker.errors.NotFound:
            return  # gone: nothing to do
        if self._owned(labels) != handle:
            raise RuntimeError_(f"refused to remove {kind} {handle}: not this worker's (labels)")


def _short(error: Exception, limit: int = 300) -> str:
    text = str(error)
    return text if len(text) <= limit else text[: limit - 3] + "..."
