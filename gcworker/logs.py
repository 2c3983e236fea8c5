"""Structured logging: one event per line, `key=value` pairs after the message."""

from __future__ import annotations

import json
import logging
import sys

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        line = (
            f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} {record.levelname.lower()} "
            f"{record.name} {record.getMessage()}"
        )
        for key, value in fields.items():
            shown = value if isinstance(value, int | float) else json.dumps(value, default=str)
            line += f" {key}={shown}"
        if record.exc_info:
            line += " " + json.dumps(self.formatException(record.exc_info))
        return line


def configure(level: str = "WARNING") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
