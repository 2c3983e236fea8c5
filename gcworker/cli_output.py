"""Printing listings: a readable table, or a JSON array with ISO 8601 UTC timestamps."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click
from rich.console import Console
from rich.table import Table


def jsonable(value):
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return value


def print_rows(rows: list[dict], columns: list[str], as_json: bool, *, title: str) -> None:
    if as_json:
        click.echo(json.dumps([{c: jsonable(r.get(c)) for c in columns} for r in rows], indent=2))
        return
    if not rows:
        click.echo(f"no {title}")
        return
    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(jsonable(row.get(c))) for c in columns))
    Console(width=200).print(table)
