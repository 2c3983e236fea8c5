"""A real Podman service for the docker runtime's tests: started on a private socket, with a
private storage root and a private `containers.conf`, so that tests never touch other storage;
stopped by its own PID.

`containers.conf` holds what starting containers needs on a CI machine: runc (crun fails with
"cgroups in hybrid mode not supported"), ulimits no higher than the machine's, and no network.
The test image is imported offline: one static file (catatonit, installed with podman) as
`/placeholder`, which pauses forever when started, so containers can be made running, paused
or exited.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path

import docker

from tests.pipeline_support import wait_for

CONTAINERS_CONF = """\
[engine]
runtime = "runc"
events_logger = "file"

[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
netns = "none"
"""
IMAGE = "localhost/gcworker-placeholder:latest"
PLACEHOLDER = "/usr/bin/catatonit"


class PodmanService:
    def __init__(self, base: Path):
        self.base = base
        self.socket = base / "engine.sock"
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None
        self.image = IMAGE

    def start(self) -> PodmanService:
        conf = self.base / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        command = ["podman", "--root", str(self.base / "root"), "--runroot", str(self.base / "run")]
        command += ["--tmpdir", str(self.base / "tmp"), "--storage-driver", "vfs"]
        command += ["system", "service", "--time=0", self.url]
        if shutil.which("podman") is None:
            raise AssertionError("podman is not installed: apt-get install podman runc (.ci/run)")
        with open(self.base / "podman.log", "ab") as log:
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(self._answers, timeout=30, what="the podman service to answer", details=self.log)
        return self

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"podman exited early ({self.proc.returncode}):\n{self.log()}")
        if not self.socket.exists():
            return False
        try:
            return self.client().ping()
        except (docker.errors.DockerException, OSError):
            return False

    def log(self) -> str:
        return (self.base / "podman.log").read_text(errors="replace")[-3000:]

    def client(self) -> docker.APIClient:
        # Podman 4.3 serves API 1.41; a fixed version spares a `/version` call per client.
        return docker.APIClient(base_url=self.url, version="1.41", timeout=30)

    def import_image(self) -> None:
        """Import `self.image` from a tarball built here (no registry, no network)."""
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w", dereference=True) as tar:
            tar.add(PLACEHOLDER, arcname="placeholder")
        repository = self.image.rpartition(":")[0]
        self.client().import_image_from_data(
            data.getvalue(), repository=repository, changes=['CMD ["/placeholder", "-P"]']
        )

    def stop(self) -> None:
        """Remove every container (a started one has a monitor process of its own), then stop
        the service by its PID."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            client = self.client()
            for container in client.containers(all=True):
                client.remove_container(container["Id"], force=True, v=True)
        finally:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def remove_storage(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
