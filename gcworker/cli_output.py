"""Printing listings: a readable table, or a JSON array with ISO 8601 UTC timestamps.

A listing may show what a hostile message said (`gcworker dead-letters`): the table prints every
value as plain text (never read as markup) with its control and format characters escaped
(`\x1b`, `\u202e`), so that what a terminal receives it shows and never obeys; JSON escapes
them itself."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

import click
import humanfriendly
from rich.console import Console
from rich.table import Table
from rich.text import Text


def jsonable(value):
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return value


def shown(value) -> str:
    """A table cell: the value as text, anything unprintable in it escaped."""
    text = "" if value is None else str(jsonable(value))
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def for_people(value, now: datetime):
    """A table's view of a value: an instant as an age ("3m ago", "in 40s"), a flag as yes/no."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        seconds = (now - value).total_seconds()
        age = humanfriendly.format_timespan(abs(round(seconds)), max_units=2)
        return f"{age} ago" if seconds >= 0 else f"in {age}"
    return value


def print_rows(rows: list[dict], columns: list[str], as_json: bool, *, title: str) -> None:
    """JSON keeps exact UTC instants; the table, for people, ages and yes/no, fitted to the
    terminal's width (200 columns when not a terminal, so that a pipe truncates nothing)."""
    if as_json:
        click.echo(json.dumps([{c: jsonable(r.get(c)) for c in columns} for r in rows], indent=2))
        return
    if not rows:
        click.echo(f"no {title}")
        return
    now = datetime.now(UTC)
    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*(Text(shown(for_people(row.get(c), now))) for c in columns))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
