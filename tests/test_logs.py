"""Log formats: `--log-format json` (GCWORKER_LOG_FORMAT) gives one JSON object a line with
`time` (ISO 8601, UTC), `level`, `logger`, `message` and the event's fields, bounded like the
text format; Celery's and Flower's own lines come out the same way; INFO is not Alembic chatter."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from datetime import datetime, timedelta

import pytest

from gcworker.logs import LINE_CHARS, JsonLineFormatter
from tests.pipeline_support import GCWORKER, Pipeline, free_port, wait_for
from tests.test_cli import gcworker, ok


def parsed(line: str) -> dict:
    """A JSON log line: an object with the four keys, its time ISO 8601 in UTC with a zone."""
    event = json.loads(line)
    assert {"time", "level", "logger", "message"} <= set(event), event
    time = datetime.fromisoformat(event["time"])
    assert time.utcoffset() == timedelta(0)
    assert event["time"].endswith("+00:00")
    return event


def stderr_events(stderr: str) -> list[dict]:
    return [parsed(line) for line in stderr.splitlines() if line.strip()]


def test_a_json_line_has_time_level_logger_message_and_the_event_fields():
    record = logging.makeLogRecord(
        {
            "name": "gcworker.test",
            "msg": "message rejected",
            "levelname": "WARNING",
            "levelno": logging.WARNING,
            "worker": "w1",
            "count": 3,
            "handles": ["c1", "c2"],
        }
    )

    event = parsed(JsonLineFormatter().format(record))

    assert event["level"] == "warning" and event["logger"] == "gcworker.test"
    assert event["message"] == "message rejected"
    assert (event["worker"], event["count"], event["handles"]) == ("w1", 3, ["c1", "c2"])


def test_json_lines_are_bounded_whatever_their_fields_and_still_parse():
    record = logging.makeLogRecord(
        {
            "msg": "m" * 100_000,
            "levelname": "WARNING",
            "worker": "w" * 10_000_000,
            "n": 10**5000,
            "handles": ["h" * 1000] * 1000,
            **{f"k{i}": "v" * 200 for i in range(100)},
        }
    )
    try:
        raise ValueError("x" * 1_000_000)
    except ValueError:
        record.exc_info = sys.exc_info()

    line = JsonLineFormatter().format(record)

    assert len(line) <= LINE_CHARS
    event = parsed(line)
    assert event["message"].startswith("mmm") and "more]" in event["message"]
    assert event["fields_left_out"] > 0
    assert len(event["worker"]) <= 256 and "ValueError" in event["exc_info"]


def test_the_cli_logs_json_lines_from_the_flag_or_the_environment(tmp_path):
    ok(gcworker(tmp_path, "", "migrate"))
    for args, env in (
        (("--log-format", "json"), {}),
        ((), {"GCWORKER_LOG_FORMAT": "json"}),
    ):
        result = gcworker(
            tmp_path,
            "",
            *args,
            "--log-level",
            "INFO",
            "heartbeat",
            "--worker",
            "w1",
            GCWORKER_ALLOW_UNSIGNED="true",
            **env,
        )
        assert result.returncode == 0, result.stderr
        events = stderr_events(result.stderr)
        assert any("ALLOW_UNSIGNED" in e["message"] for e in events)


def test_info_is_not_alembic_chatter_but_debug_shows_it(tmp_path):
    ok(gcworker(tmp_path, "", "migrate"))

    info = gcworker(tmp_path, "", "--log-level", "INFO", "workers")
    debug = gcworker(tmp_path, "", "--log-level", "DEBUG", "workers")

    assert info.returncode == 0 and "alembic" not in info.stderr, info.stderr
    assert "alembic.runtime" in debug.stderr


def test_an_unknown_log_format_is_one_line_and_exit_2(tmp_path):
    result = gcworker(tmp_path, "", "workers", GCWORKER_LOG_FORMAT="xml")

    assert result.returncode == 2
    assert result.stderr == "gcworker: GCWORKER_LOG_FORMAT=xml: must be one of text, json\n"


@pytest.mark.timeout(120)
@pytest.mark.backends("postgresql")
def test_celery_and_flower_lines_come_out_as_json(database_url, db, plane, tmp_path):
    pipeline = Pipeline(database_url, tmp_path)
    stderr_path, stdout_path = tmp_path / "up.err", tmp_path / "up.out"
    with open(stderr_path, "wb") as stderr, open(stdout_path, "wb") as stdout:
        up = subprocess.Popen(
            [GCWORKER, "--log-level", "INFO", "up", "--flower", "--flower-port", str(free_port())]
            + ["--metrics-port", "0", "--concurrency", "1"],
            env=pipeline.env(log_format="json", flower_basic_auth="admin:s3cret"),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:

        def loggers() -> set[str]:
            return {e["logger"] for e in stderr_events(stderr_path.read_text())}

        wanted = {"celery.apps.worker", "celery.beat", "flower.command"}
        wait_for(
            lambda: wanted <= loggers(),
            timeout=60,
            what="the reconciler, beat and Flower to log",
            details=lambda: stderr_path.read_text()[-3000:] + stdout_path.read_text()[-3000:],
        )
        os.kill(up.pid, signal.SIGTERM)
        assert up.wait(timeout=40) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        pipeline.close()

    events = stderr_events(stderr_path.read_text())  # every line, through the shutdown
    assert any(e["message"].endswith(" ready.") for e in events)
    assert "gcworker up: stopped" in stdout_path.read_text()
    assert "[queues]" not in stdout_path.read_text()  # no Celery banner among JSON logs
