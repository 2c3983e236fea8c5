"""Structured logging: one event per line, every line bounded: a field, the message or a
traceback too long is cut in its middle (its start and its end are kept, and how much was left
out is said), whatever a hostile message carried.

Two formats (`--log-format`, GCWORKER_LOG_FORMAT): `text`, `key=value` pairs after the message,
for people; `json`, one JSON object a line (python-json-logger) with `time` (ISO 8601, UTC),
`level`, `logger`, `message` and the event's fields, for log shippers. The Celery processes and
Flower log through the same handler (`tasks.app`). Alembic's start-up chatter (plugins set up,
DDL mode) is kept below INFO: it is said on every command.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from pythonjsonlogger.json import JsonFormatter

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
FIELD_CHARS = 256
MESSAGE_CHARS = 1024
TRACEBACK_CHARS = 2048
LINE_CHARS = 4096
FORMATS = ("text", "json")
# Loggers that say at INFO what only a developer needs: shown from DEBUG on.
_CHATTY = ("alembic",)


def bounded(text: str, limit: int) -> str:
    """`text`, or its start and end around a note of how many characters were left out."""
    if len(text) <= limit:
        return text
    note = f"...[{len(text) - limit} more]..."
    keep = max(0, limit - len(note))
    return text[: keep - keep // 2] + note + text[len(text) - keep // 2 :]


def _shown(value) -> str:
    if isinstance(value, str):
        return json.dumps(bounded(value, FIELD_CHARS))
    try:
        shown = str(value) if isinstance(value, int | float) else json.dumps(value, default=str)
    except ValueError:  # an integer of more digits than Python prints
        shown = f'"<{type(value).__name__} too long to print>"'
    return bounded(shown, FIELD_CHARS)


def _fields(record: logging.LogRecord) -> dict:
    """The event's own fields: what the caller passed in `extra`."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _utc_time(record: logging.LogRecord) -> datetime:
    return datetime.fromtimestamp(record.created, UTC)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{_utc_time(record):%Y-%m-%dT%H:%M:%SZ} {record.levelname.lower()} "
            f"{record.name} {bounded(record.getMessage(), MESSAGE_CHARS)}"
        )
        for key, value in _fields(record).items():
            line += f" {bounded(key, FIELD_CHARS)}={_shown(value)}"
        if record.exc_info:
            line += " " + json.dumps(
                bounded(self.formatException(record.exc_info), TRACEBACK_CHARS)
            )
        return bounded(line, LINE_CHARS)


def _json_value(value):
    """`value` as JSON can hold it, bounded: strings cut, other objects shown as bounded text."""
    if isinstance(value, str):
        return bounded(value, FIELD_CHARS)
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else _shown(value)
    shown = _shown(value)
    return json.loads(shown) if len(shown) < FIELD_CHARS else shown


_ALWAYS_KEPT = ("time", "level", "logger", "message", "exc_info")


class JsonLineFormatter(JsonFormatter):
    """One JSON object a line; fields that would push the line past LINE_CHARS are left out
    (their number is said in `fields_left_out`), so that every line still parses."""

    def add_fields(self, log_data: dict, record: logging.LogRecord, message_dict: dict) -> None:
        log_data["time"] = _utc_time(record).isoformat(timespec="milliseconds")
        log_data["level"] = record.levelname.lower()
        log_data["logger"] = record.name
        log_data["message"] = bounded(record.message, MESSAGE_CHARS)
        if "exc_info" in message_dict:
            log_data["exc_info"] = bounded(message_dict["exc_info"], TRACEBACK_CHARS)
        for key, value in _fields(record).items():
            log_data.setdefault(bounded(key, FIELD_CHARS), _json_value(value))

    def serialize_log_record(self, log_data: dict) -> str:
        line = json.dumps(log_data, default=str)
        keys = [k for k in log_data if k not in _ALWAYS_KEPT]
        left_out = 0
        while len(line) > LINE_CHARS and keys:
            log_data.pop(keys.pop())
            left_out += 1
            line = json.dumps({**log_data, "fields_left_out": left_out}, default=str)
        return line


def configure(level: str = "WARNING", log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python's warnings (Celery's as root) as log lines too
    for name in _CHATTY:
        quiet = max(root.level, logging.WARNING) if root.level > logging.DEBUG else logging.NOTSET
        logging.getLogger(name).setLevel(quiet)
