"""The command line's manners: every option says what it does, `events` filters, listings show
ages and yes/no and say plurals right, and an unknown worker is an error, not an empty list."""

from __future__ import annotations

import json
import re

import click
import pytest

from gcworker.cli import main
from tests.conftest import created
from tests.test_cli import gcworker, ok, refused


def every_option(command: click.Command, path: tuple[str, ...] = ("gcworker",)):
    for param in command.params:
        if isinstance(param, click.Option):
            yield path, param
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from every_option(sub, (*path, name))


def test_every_option_has_help_text():
    missing = [f"{' '.join(p)} {o.opts[0]}" for p, o in every_option(main) if not o.help]

    assert missing == []


def test_events_filter_by_worker_since_and_action(tmp_path, database_url, plane, make_worker):
    for name in ("w1", "w2"):
        make_worker(name)
    plane.fleet.land("w1")
    plane.fleet.retire("w2")

    def events(*args: str) -> list[tuple[str, str]]:
        rows = json.loads(ok(gcworker(tmp_path, database_url, "events", "--json", *args)))
        return sorted((row["worker"], row["action"]) for row in rows)

    everything = events()
    land = next(action for worker, action in everything if worker == "w1")
    assert {w for w, _ in everything} >= {"w1", "w2"}
    assert {w for w, _ in events("--worker", "w1")} == {"w1"}
    assert events("--action", land) == [("w1", land)]
    assert events("--since", "1h") == everything
    assert events("--since", "1h", "--worker", "w2", "--action", land) == []


@pytest.mark.parametrize("listing", ["containers", "volumes"])
def test_an_unknown_worker_is_an_error_not_an_empty_listing(tmp_path, database_url, plane, listing):
    line = refused(gcworker(tmp_path, database_url, listing, "--worker", "nosuch"))

    assert "unknown worker 'nosuch'" in line


def test_tables_show_ages_and_yes_no(tmp_path, database_url, plane, make_worker):
    make_worker("w1")
    created(plane, "w1", "c1")

    workers = ok(gcworker(tmp_path, database_url, "workers"))
    containers = ok(gcworker(tmp_path, database_url, "containers"))

    row = next(line for line in workers.splitlines() if line.startswith("w1"))
    assert " no " in row  # ephemeral
    assert re.search(r"\bin \d+ \w+|\b\d+ \w+ ago\b", row), row  # the heartbeat's expiry
    assert "T" not in row.split()[-1]  # no raw ISO timestamp
    assert "c1" in containers


def test_prune_says_plurals_right(tmp_path, database_url, plane, make_worker):
    worker = make_worker("w1")
    created(plane, "w1", "c1")
    plane.fleet.retire("w1")
    del worker

    with plane.db.transaction() as conn:  # stalled, so that it may be pruned
        from gcworker.db.tables import workers

        conn.execute(workers.update().values(state="stalled"))
    line = ok(gcworker(tmp_path, database_url, "workers", "prune", "w1"))

    assert "with 1 container and 0 volumes" in line
