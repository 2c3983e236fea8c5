"""The real `gcworker` command, run as a subprocess against the test's database (embedded mode:
events apply in-process). Few and focused: each run costs about half a second."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import created, states

CONTAINER_FIELDS = {"handle", "worker", "state", "missing_since"}
VOLUME_FIELDS = CONTAINER_FIELDS | {"parent", "container"}
WORKER_FIELDS = {"name", "state", "ephemeral", "incarnation"}
# The installed console script; the one beside this interpreter skips any version-manager shim.
_BESIDE = os.path.join(os.path.dirname(sys.executable), "gcworker")
GCWORKER = _BESIDE if os.access(_BESIDE, os.X_OK) else shutil.which("gcworker") or "gcworker"


def gcworker(cwd, database_url: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GCWORKER_")}
    environment.update(GCWORKER_DATABASE_URL=database_url, **env)
    return subprocess.run(
        [GCWORKER, *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess) -> str:
    """A refusal: a non-zero exit, nothing on stdout, one line on stderr."""
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def utc_timestamp(value) -> datetime | None:
    """An ISO 8601 UTC timestamp, or null."""
    if value is None:
        return None
    assert isinstance(value, str) and (value.endswith("Z") or value.endswith("+00:00"))
    parsed = datetime.fromisoformat(value)
    assert parsed.utcoffset() == timedelta(0)
    return parsed


def test_cli_migrate_is_safe_to_run_twice(tmp_path, database_url):
    first = ok(gcworker(tmp_path, database_url, "migrate"))
    second = ok(gcworker(tmp_path, database_url, "migrate"))

    assert "migrated from an empty database to" in first
    assert "already at the newest schema" in second


@pytest.mark.backends("postgresql")
def test_cli_a_worker_session_with_json_listings(tmp_path, database_url, plane):
    def run(*args):
        return ok(gcworker(tmp_path, database_url, *args))

    key = tmp_path / "w1.key"
    public = run("keys", "generate", "w1", "--out", str(key)).strip()
    public_file = tmp_path / "w1.pub"
    public_file.write_text(public)
    registered = run("keys", "register", "w1", "--public-key", str(public_file))
    assert "public key registered" in registered
    signed = ("--key-file", str(key))
    rejected = gcworker(tmp_path, database_url, "heartbeat", "--worker", "w1")
    assert rejected.returncode == 1
    assert "gcworker: heartbeat of w1 rejected: unsigned message" in rejected.stderr
    assert run("heartbeat", "--worker", "w1", *signed).strip() == "heartbeat of w1: registered"
    run("containers", "create", "--worker", "w1", "c1")
    run("containers", "created", "c1")
    run("volumes", "create", "--worker", "w1", "--container", "c1", "v1")
    plane.scheduler.create_container("w1", "c2")
    plane.scheduler.fail_container("c2")
    before_report = datetime.now(UTC)

    reported = run("report", "--worker", "w1", "--containers", "", "--volumes", "stray", *signed)

    assert reported.strip() == (
        "report of w1: accepted: marked missing 1 container, recorded unknown 1 volume"
    )
    summary = run("collect").strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("collection: 1 containers moved to")

    containers = json.loads(run("containers", "--json"))
    assert all(set(c) == CONTAINER_FIELDS for c in containers)
    by_handle = {c["handle"]: c for c in containers}
    assert {h: (c["worker"], c["state"]) for h, c in by_handle.items()} == {
        "c1": ("w1", "created"),
        "c2": ("w1", "destroying"),
    }
    marked_at = utc_timestamp(by_handle["c1"]["missing_since"])
    assert abs(marked_at - before_report) < timedelta(minutes=1)
    assert by_handle["c2"]["missing_since"] is None

    volumes = json.loads(run("volumes", "--worker", "w1", "--json"))
    assert all(set(v) == VOLUME_FIELDS for v in volumes)
    assert sorted((v["handle"], v["state"], v["parent"], v["container"]) for v in volumes) == [
        ("stray", "destroying", None, None),
        ("v1", "creating", None, "c1"),
    ]

    [worker] = json.loads(run("workers", "--json"))
    assert WORKER_FIELDS <= set(worker)
    assert (worker["name"], worker["state"], worker["ephemeral"], worker["incarnation"]) == (
        "w1",
        "running",
        False,
        1,
    )
    assert utc_timestamp(worker["heartbeat_expires_at"]) > before_report
    assert worker["stalled_at"] is None
    utc_timestamp(worker["last_report_at"])

    events = json.loads(run("events", "--json"))
    assert [(e["actor"], e["action"], e["subject"]) for e in events[1:]] == [
        ("reconciler", "record_unknown", "stray")  # rule 8, by handle
    ]
    event = events[0]
    assert (event["action"], event["kind"], event["subject"], event["reason"]) == (
        "destroy",
        "container",
        "c2",
        "failed",
    )
    assert event["worker"] == "w1" and event["dry_run"] is False
    utc_timestamp(event["at"])

    table = run("containers")  # without --json: a readable table
    assert "handle" in table and "c1" in table and "destroying" in table


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("containers", "created", "nope"), "unknown container 'nope'"),
        (("containers", "create", "--worker", "ghost", "c9"), "unknown worker 'ghost'"),
        (("volumes", "create", "--worker", "w1", "v1"), "already exists"),
        (("containers", "created", "gone"), "is destroying"),
        (("workers", "prune", "w1"), "is running"),
    ],
)
def test_cli_a_refused_request_exits_non_zero_with_one_line_and_changes_nothing(
    tmp_path, database_url, plane, make_worker, args, says
):
    make_worker()
    created(plane, "w1", "c1", "gone")
    created(plane, "w1", "v1", kind="volume")
    plane.scheduler.destroy_container("gone")
    before = (states(plane), states(plane, "volume"), plane.workers(), plane.events())

    line = refused(gcworker(tmp_path, database_url, *args))

    assert line.startswith("gcworker: ") and says in line
    assert (states(plane), states(plane, "volume"), plane.workers(), plane.events()) == before


def test_cli_rule14_a_bad_setting_exits_non_zero_with_one_line_naming_it(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'never-created.db'}"

    by_flag = refused(
        gcworker(tmp_path, database_url, "--missing-grace-period", "50s", "workers", "--json")
    )
    by_env = refused(gcworker(tmp_path, database_url, "workers", GCWORKER_HEARTBEAT_TTL="banana"))

    assert "GCWORKER_MISSING_GRACE_PERIOD=50s" in by_flag and "two report intervals" in by_flag
    assert "GCWORKER_HEARTBEAT_TTL=banana" in by_env and "not a duration" in by_env
    assert not (tmp_path / "never-created.db").exists()


def test_cli_worker_and_control_plane_keys_are_made_without_database_access(tmp_path):
    unreachable = "postgresql://nobody@127.0.0.1:1/none"
    worker = ok(gcworker(tmp_path, unreachable, "keys", "generate", "w1", "--out", "w1.key"))
    plane = ok(gcworker(tmp_path, unreachable, "keys", "generate-control-plane", "--out", "cp.key"))

    for public, private in ((worker, "w1.key"), (plane, "cp.key")):
        assert len(public.strip()) == 44 and public.strip().endswith("=")  # base64 of 32 bytes
        assert (tmp_path / private).stat().st_mode & 0o777 == 0o600
    again = gcworker(tmp_path, unreachable, "keys", "generate", "w1", "--out", "w1.key")
    assert "already exists" in refused(again)


@pytest.mark.backends("postgresql")
def test_cli_keys_register_takes_the_public_half_from_stdin_and_refuses_garbage(
    tmp_path, database_url, plane
):
    public = ok(gcworker(tmp_path, database_url, "keys", "generate", "w1", "--out", "w1.key"))
    registered = subprocess.run(
        [GCWORKER, "keys", "register", "w1", "--public-key", "-"],
        input=public,
        env={**os.environ, "GCWORKER_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert registered.returncode == 0, registered.stderr
    assert [k["public_key"] for k in plane.keys()] == [public.strip()]
    (tmp_path / "bad.pub").write_text("not a key")
    bad = gcworker(tmp_path, database_url, "keys", "register", "w2", "--public-key", "bad.pub")
    assert "not an Ed25519 public key" in refused(bad)
