"""Structured logging: one event per line, `key=value` pairs after the message, every line
bounded: a field, the message or a traceback too long is cut in its middle (its start and its
end are kept, and how much was left out is said), whatever a hostile message carried."""

from __future__ import annotations

import json
import logging
import sys

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
FIELD_CHARS = 256
MESSAGE_CHARS = 1024
TRACEBACK_CHARS = 2048
LINE_CHARS = 4096


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


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        line = (
            f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} {record.levelname.lower()} "
            f"{record.name} {bounded(record.getMessage(), MESSAGE_CHARS)}"
        )
        for key, value in fields.items():
            line += f" {bounded(key, FIELD_CHARS)}={_shown(value)}"
        if record.exc_info:
            line += " " + json.dumps(
                bounded(self.formatException(record.exc_info), TRACEBACK_CHARS)
            )
        return bounded(line, LINE_CHARS)


def configure(level: str = "WARNING") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
