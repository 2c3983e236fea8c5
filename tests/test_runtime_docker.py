"""The docker runtime against a real Podman service (its Docker-compatible API), driven through
the reporter and the control plane in embedded mode.

One Podman service per test session (private socket and storage, see tests/podman_support.py);
each test works under a `gcworker.worker` label of its own, so tests never see each other's
objects. Never skipped: CI installs podman (.ci/run).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest

from gcworker.commands.pipeline import MeteredRuntime
from gcworker.delivery import InProcessChannel
from gcworker.demo_engine import RUN_PREFIX
from gcworker.reporter import Reporter
from gcworker.runtimes import Inventory, RuntimeError_, load_runtime
from gcworker.runtimes.docker import HANDLE_LABEL, WORKER_LABEL, DockerRuntime
from gcworker.signing import generate_private_key, public_key_text
from gcworker.sweeper import Sweeper
from tests.conftest import created, states
from tests.pipeline_support import wait_for
from tests.podman_support import PodmanService
from tests.test_cli import gcworker


def _service() -> PodmanService:
    # Not under pytest's tmp_path: a unix socket's path must stay short.
    return PodmanService(Path(tempfile.mkdtemp(prefix="gcw-podman-")))


@pytest.fixture(scope="session")
def podman():
    service = _service()
    try:
        service.start()
        service.import_image()
        yield service
    finally:
        service.stop()
        service.remove_storage()


@pytest.fixture
def engine(podman):
    """The docker runtime for a worker of this test's own."""
    worker = f"w{uuid.uuid4().hex[:10]}"
    yield DockerRuntime(podman.url, worker=worker, image=podman.image)
    client = podman.client()
    mine = {"label": f"{WORKER_LABEL}={worker}"}
    for container in client.containers(all=True, filters=mine):
        client.remove_container(container["Id"], force=True, v=True)
    for volume in client.volumes(filters=mine)["Volumes"] or []:
        client.remove_volume(volume["Name"])


@pytest.fixture
def reporter(plane, engine):
    key = generate_private_key()
    plane.register_key(engine.worker, public_key_text(key))
    channel = InProcessChannel(plane, private_key=key)
    agent = Reporter(
        engine.worker, MeteredRuntime(engine), channel, heartbeat_interval=30, report_interval=30
    )
    agent.heartbeat()
    return agent


def report_until(reporter, condition, what: str, rounds: int = 6):
    """Report (and remove what the control plane destroys) until `condition()` holds."""
    for _ in range(rounds):
        assert reporter.report() is True
        if condition():
            return
    raise AssertionError(f"still not {what} after {rounds} reports")


def names(client, kind: str, **filters) -> set[str]:
    if kind == "container":
        found = client.containers(all=True, filters=filters)
        return {c["Names"][0].lstrip("/") for c in found}
    return {v["Name"] for v in client.volumes(filters=filters)["Volumes"] or []}


def test_labelled_container_and_volume_with_rows_are_kept(plane, engine, reporter, podman):
    engine.create("container", "c1")
    engine.create("volume", "v1")
    created(plane, engine.worker, "c1")
    created(plane, engine.worker, "v1", kind="volume")

    for _ in range(3):
        reporter.report()

    assert engine.inventory().containers == ["c1"]
    assert engine.inventory().volumes == ["v1"]
    assert states(plane) == {"c1": ("created", False)}
    assert states(plane, "volume") == {"v1": ("created", False)}


def test_inventory_counts_containers_in_every_state(engine, podman):
    client = podman.client()
    for handle in ("created", "running", "paused", "exited"):
        engine.create("container", handle)
    for handle in ("running", "paused", "exited"):
        client.start(handle)
    client.pause("paused")
    client.kill("exited")
    wait_for(
        lambda: client.inspect_container("exited")["State"]["Status"] == "exited",
        timeout=30,
        what="the killed container to exit",
    )

    assert engine.inventory().containers == ["created", "exited", "paused", "running"]


def test_a_labelled_container_without_a_row_is_destroyed_then_its_row_deleted(
    plane, engine, reporter
):
    engine.create("container", "stray")

    reporter.report()
    assert states(plane) == {"stray": ("destroying", False)}  # rule 8: unknown -> destroying
    report_until(reporter, lambda: engine.inventory().containers == [], "removed")
    report_until(reporter, lambda: states(plane) == {}, "row deleted")  # rule 9


def test_a_container_removed_behind_gcworkers_back_is_marked_then_deleted_after_the_grace(
    plane, engine, reporter, podman, advance
):
    engine.create("container", "c1")
    created(plane, engine.worker, "c1")
    reporter.report()
    podman.client().remove_container("c1", force=True)  # the engine lost it

    reporter.report()
    assert states(plane) == {"c1": ("created", True)}
    plane.collect()
    assert states(plane) == {"c1": ("created", True)}  # not before the grace
    advance(minutes=5)
    reporter.heartbeat()

    def deleted():
        plane.collect()
        return states(plane) == {}

    report_until(reporter, deleted, "deleted after the grace and a confirming report")


def test_objects_without_this_workers_labels_are_never_reported_nor_removed(
    plane, engine, reporter, podman
):
    client = podman.client()
    client.create_container(podman.image, name="unlabelled")
    client.create_volume(name="unlabelled-volume")
    other = DockerRuntime(podman.url, worker=f"{engine.worker}-other", image=podman.image)
    other.create("container", "theirs")
    other.create("volume", "their-volume")
    try:
        for _ in range(3):
            reporter.report()
        assert states(plane) == {} and states(plane, "volume") == {}
        assert engine.inventory().containers == [] and engine.inventory().volumes == []
        for kind, handle in [
            ("container", "unlabelled"),
            ("container", "theirs"),
            ("volume", "unlabelled-volume"),
            ("volume", "their-volume"),
        ]:
            with pytest.raises(RuntimeError_, match="not this worker's"):
                engine.destroy(kind, handle)
        assert {"unlabelled", "theirs"} <= names(client, "container")
        assert {"unlabelled-volume", "their-volume"} <= names(client, "volume")
    finally:
        for name in ("unlabelled", "theirs"):
            client.remove_container(name, force=True)
        for name in ("unlabelled-volume", "their-volume"):
            client.remove_volume(name)


def test_an_engine_serving_several_workers_lists_each_only_its_own(engine, podman):
    other = DockerRuntime(podman.url, worker=f"{engine.worker}-b", image=podman.image)
    engine.create("container", "mine")
    other.create("container", "theirs")
    try:
        assert engine.inventory().containers == ["mine"]
        assert other.inventory().containers == ["theirs"]
    finally:
        other.destroy("container", "theirs")


def test_a_reporter_that_names_no_worker_refuses_an_engine_serving_several(engine, podman):
    """Unnamed, it would report every worker's objects as its own, and remove them once its
    control plane, not knowing them, destroys them: it sends no report instead."""
    engine.create("volume", "theirs")
    unnamed = DockerRuntime(podman.url)

    with pytest.raises(RuntimeError_, match=r"serves several workers.*\?worker="):
        unnamed.inventory()
    with pytest.raises(RuntimeError_, match="serves several workers"):
        unnamed.destroy("volume", "theirs")
    assert engine.inventory().volumes == ["theirs"]


def test_destroy_removes_only_the_handle_named(engine, podman):
    # Podman 4.3 ORs several label filters on volumes: "this handle" or "this worker" must not
    # select every object of the worker.
    for kind in ("container", "volume"):
        engine.create(kind, "target")
        engine.create(kind, "bystander")

    engine.destroy("container", "target")
    engine.destroy("volume", "target")

    assert engine.inventory() == Inventory(containers=["bystander"], volumes=["bystander"])


def test_a_handle_that_is_no_valid_name_is_created_listed_and_removed_by_its_label(engine):
    engine.create("container", "w1:c1")  # `:` is no valid name: the engine names it
    engine.create("volume", "w1:v1")
    assert engine.inventory() == Inventory(containers=["w1:c1"], volumes=["w1:v1"])

    engine.destroy("container", "w1:c1")
    engine.destroy("volume", "w1:v1")

    assert engine.inventory() == Inventory(containers=[], volumes=[])


def test_destroying_a_container_removes_its_anonymous_volumes_not_named_ones(engine, podman):
    client = podman.client()
    engine.create("volume", "named")
    container = client.create_container(
        podman.image,
        name="c1",
        volumes=["/anonymous"],
        labels={HANDLE_LABEL: "c1", WORKER_LABEL: engine.worker},
        host_config=client.create_host_config(binds={"named": {"bind": "/named", "mode": "rw"}}),
    )
    mounts = client.inspect_container(container["Id"])["Mounts"]
    anonymous = {m["Name"] for m in mounts if m.get("Name") and m["Name"] != "named"}
    assert anonymous  # the engine made one

    engine.destroy("container", "c1")
    engine.destroy("container", "c1")  # already gone: fine

    assert engine.inventory().containers == []
    assert "named" in names(client, "volume")
    assert not anonymous & names(client, "volume")


def test_a_volume_in_use_is_retried_on_a_later_round_not_fatal(plane, engine, reporter, podman):
    client = podman.client()
    engine.create("volume", "busy")  # unknown to the control plane: it will be destroying
    client.create_container(
        podman.image,
        name="user",
        labels={HANDLE_LABEL: "user", WORKER_LABEL: engine.worker},
        host_config=client.create_host_config(binds={"busy": {"bind": "/data", "mode": "rw"}}),
    )
    created(plane, engine.worker, "user")
    with pytest.raises(RuntimeError_, match="in use"):
        engine.destroy("volume", "busy")

    for _ in range(3):  # removal fails each round; reports go on
        assert reporter.report() is True
    assert engine.inventory().volumes == ["busy"]
    assert states(plane, "volume") == {"busy": ("destroying", False)}

    plane.scheduler.destroy_container("user")
    empty = Inventory(containers=[], volumes=[])
    report_until(reporter, lambda: engine.inventory() == empty, "both removed", rounds=8)
    report_until(reporter, lambda: (states(plane), states(plane, "volume")) == ({}, {}), "gone")


def test_a_stopped_engine_is_a_listing_failure_no_report_nothing_marked(
    plane, database_url, tmp_path
):
    service = _service()
    try:
        service.start()
        service.import_image()
        runtime = DockerRuntime(service.url, worker="w1", image=service.image)
        key = generate_private_key()
        plane.register_key("w1", public_key_text(key))
        agent = Reporter(
            "w1", runtime, InProcessChannel(plane, private_key=key), heartbeat_interval=30,
            report_interval=30,
        )  # fmt: skip
        agent.heartbeat()
        runtime.create("container", "c1")
        created(plane, "w1", "c1")
        assert agent.report() is True
        service.stop()

        with pytest.raises(RuntimeError_, match="cannot list"):
            runtime.inventory()
        assert agent.report() is False
        assert states(plane) == {"c1": ("created", False)}
        once = gcworker(
            tmp_path,
            database_url,
            "reporter",
            "--worker",
            "w1",
            "--runtime",
            f"docker:{service.url}",
            "--once",
            GCWORKER_ALLOW_UNSIGNED="true",
        )
        assert once.returncode != 0, once.stderr
        assert "no report sent" in once.stderr
        assert states(plane) == {"c1": ("created", False)}

        service.start()  # the engine is back: the same runtime reads it again
        runtime.create("container", "c2")
        assert runtime.inventory().containers == ["c2"]  # (stop() removed c1)
    finally:
        service.stop()
        service.remove_storage()


class GatedRuntime(DockerRuntime):
    """Removals wait for `release`; counts how many run at once, per kind."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()

    def destroy(self, kind: str, handle: str) -> None:
        with self.lock:
            self.running[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.running[kind])
        try:
            self.release.wait(timeout=60)
            super().destroy(kind, handle)
        finally:
            with self.lock:
                self.running[kind] -= 1


def test_a_sweep_removes_a_bounded_number_at_once_per_kind(engine, podman):
    runtime = GatedRuntime(podman.url, worker=engine.worker, image=podman.image)
    containers = [f"c{i}" for i in range(7)]
    volumes = [f"v{i}" for i in range(5)]
    for handle in containers:
        runtime.create("container", handle)
    for handle in volumes:
        runtime.create("volume", handle)
    sweeper = Sweeper(runtime, containers_in_flight=3, volumes_in_flight=2)
    try:
        for handle in containers:
            sweeper.submit("container", handle)
        for handle in volumes:
            sweeper.submit("volume", handle)
        sweeper.submit("container", "c0")  # in flight already: not twice

        wait_for(
            lambda: runtime.running == Counter(container=3, volume=2),
            timeout=30,
            what="the first removals to start",
        )
        assert len(sweeper.in_flight()) == 12
        runtime.release.set()
        wait_for(lambda: not sweeper.in_flight(), timeout=60, what="the sweep to end")
    finally:
        runtime.release.set()
        sweeper.close()

    assert runtime.peak == Counter(container=3, volume=2)
    assert runtime.inventory() == Inventory([], [])


def test_the_spec_names_the_engine_the_worker_and_the_image(podman, monkeypatch):
    runtime = load_runtime(f"docker:{podman.url}?worker=w7&image={podman.image}")
    assert (runtime.url, runtime.worker, runtime.image) == (podman.url, "w7", podman.image)
    assert runtime.inventory() == Inventory([], [])
    monkeypatch.setenv("DOCKER_HOST", podman.url)
    default = load_runtime("docker")
    assert default.url is None
    assert isinstance(default.inventory(), Inventory)  # read through DOCKER_HOST
    for bad in ("colour=blue", "worker", "worker=", "worker=a&worker=b"):
        with pytest.raises(RuntimeError_, match=f"bad option '{bad.split('&')[-1]}'"):
            load_runtime(f"docker:{podman.url}?{bad}")


# The demo on the engine ------------------------------------------------------------------------


def demo_objects(podman) -> tuple[list, list, list]:
    """What any demo run left on the engine: containers, volumes, images."""
    client = podman.client()
    label = {"label": WORKER_LABEL}
    left = [
        [c["Labels"][WORKER_LABEL] for c in client.containers(all=True, filters=label)],
        [v["Labels"][WORKER_LABEL] for v in client.volumes(filters=label)["Volumes"] or []],
        [tag for image in client.images() for tag in image.get("RepoTags") or []],
    ]
    return tuple([x for x in found if RUN_PREFIX in x] for found in left)


def demo(tmp_path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    argv = [sys.executable, "-m", "gcworker.cli", "demo", "--plain", *args]
    return subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_demo_runs_on_the_engine_and_removes_everything_it_made(podman, tmp_path):
    proc = demo(tmp_path, "--runtime", f"docker:{podman.url}", "--workers", "4", "--duration", "12")
    out, _ = proc.communicate(timeout=180)

    assert proc.returncode == 0, out
    assert re.search(r"^verdict: database and workers agree \(", out, re.M), out
    assert re.search(r"^rows wrongly deleted: 0$", out, re.M), out
    # The restart happened on the engine (what it lost depends on how far the scheduler got).
    assert re.search(r"^worker-2: runtime restarted at .*, lost \d+ container", out, re.M), out
    assert re.search(r"^engine: removed [1-9]\d* objects and the image ", out, re.M), out
    assert demo_objects(podman) == ([], [], [])


def test_demo_interrupted_removes_everything_it_made(podman, tmp_path):
    proc = demo(tmp_path, "--runtime", f"docker:{podman.url}", "--workers", "4", "--duration", "60")
    try:
        wait_for(
            lambda: any(demo_objects(podman)[0]), timeout=60, what="the demo to create containers"
        )
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert proc.returncode != 0, out
    assert demo_objects(podman) == ([], [], []), out


def test_demo_on_an_engine_that_does_not_answer_says_so_in_one_line(tmp_path):
    url = f"unix://{tmp_path}/nothing.sock"
    proc = demo(tmp_path, "--runtime", f"docker:{url}", "--workers", "4", "--duration", "12")
    out, _ = proc.communicate(timeout=60)

    assert proc.returncode == 1, out
    assert f"gcworker demo: could not run: the engine {url} does not answer" in out
