"""The `gcworker` command line: operators', schedulers' and workers' way in.

Every setting is an environment variable `GCWORKER_*` and a global flag of the same name
(`--missing-grace-period 5m`). Listings print a table, or a JSON array with `--json`. A bad
setting or an impossible request prints one line and exits non-zero, changing nothing.
"""

from __future__ import annotations

import operator
import sys
import time
from datetime import UTC, datetime

import click
from kombu.exceptions import OperationalError as BrokerOperationalError
from redis.exceptions import RedisError
from sqlalchemy.exc import OperationalError

from gcworker import logs
from gcworker.cli_output import print_rows as _print_rows
from gcworker.errors import GcworkerError, SetupError
from gcworker.messages import Heartbeat, Report
from gcworker.settings import ENV_PREFIX, Settings, SettingsError, load_settings

SETTING_FLAGS = (
    ("database_url", "SQLAlchemy URL of the database (default: SQLite in ./.gcworker/)."),
    ("broker_url", "Redis URL of the broker; unset, events apply in-process (embedded mode)."),
    ("missing_grace_period", "How long a row stays missing before it may be deleted [5m]."),
    ("report_interval", "How often workers report their inventory [30s]."),
    ("heartbeat_interval", "How often workers heartbeat [30s]."),
    ("heartbeat_ttl", "How long a heartbeat keeps a worker running [2 x heartbeat interval]."),
    ("creating_timeout", "How long a row may stay in creating before it fails [1h]."),
    ("gc_interval", "How often the collector runs [30s]."),
    ("stalled_worker_timeout", "Prune workers stalled for this long; 0 never prunes [0]."),
)

EXIT_ERROR = 1
# A setting, a file or a server the operator must fix (not a request gcworker refused).
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_ERROR):
    click.echo(f"gcworker: {message}", err=True)
    sys.exit(code)


class Context:
    def __init__(self, overrides: dict):
        self.overrides = overrides
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            try:
                self._settings = load_settings(**self.overrides)
            except SettingsError as error:
                _fail(str(error), EXIT_USAGE)
        return self._settings

    def control_plane(self, *, check_schema: bool = True):
        from gcworker.control_plane import ControlPlane

        return ControlPlane(self.settings, check_schema=check_schema)


class GcworkerGroup(click.Group):
    """Turns refused requests (exit 1), and a file or a server that fails (exit 2), into one
    line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SetupError as error:
            _fail(str(error), EXIT_USAGE)
        except GcworkerError as error:
            _fail(str(error))
        except OperationalError as error:
            _fail(f"database error: {_first_line(error.orig)}", EXIT_USAGE)
        except (BrokerOperationalError, RedisError) as error:
            _fail(f"broker error: {_first_line(error)}", EXIT_USAGE)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _setting_options(command):
    for name, help_text in reversed(SETTING_FLAGS):
        flag = "--" + name.replace("_", "-")
        command = click.option(
            flag,
            name,
            default=None,
            metavar="VALUE",
            help=f"{help_text} Env: {ENV_PREFIX}{name.upper()}.",
        )(command)
    return command


@click.group(
    cls=GcworkerGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="gcworker", message="%(prog)s %(version)s")
@_setting_options
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Logs go to stderr, one event per line.",
)
@click.option(
    "--log-format",
    default="text",
    show_default=True,
    envvar=f"{ENV_PREFIX}LOG_FORMAT",
    metavar="text|json",
    help=f"text (key=value) or json (one object a line). Env: {ENV_PREFIX}LOG_FORMAT.",
)
@click.pass_context
def main(ctx: click.Context, log_level: str, log_format: str, **overrides):
    """gcworker keeps a control plane's database of containers and volumes true to what its
    workers really hold: workers report their inventory, gcworker marks what went missing and
    deletes what stayed missing past a grace period, and never what still exists.

    With no settings everything runs embedded, on a SQLite file under ./.gcworker/.
    """
    if log_format not in logs.FORMATS:  # said like every setting, be it a flag or the env
        _fail(f"{ENV_PREFIX}LOG_FORMAT={log_format}: must be one of {', '.join(logs.FORMATS)}", 2)
    logs.configure(log_level, log_format)
    ctx.obj = Context({**overrides, "log_format": log_format})  # child processes log alike


# Schema ------------------------------------------------------------------------------------


@main.command()
@click.pass_obj
def migrate(obj: Context):
    """Upgrade the database to the newest schema (safe to run again)."""
    from gcworker.db.migrate import upgrade

    plane = obj.control_plane(check_schema=False)
    before, after = upgrade(plane.db.engine)
    url = plane.db.engine.url.render_as_string(hide_password=True)
    if before == after:
        click.echo(f"{url}: already at the newest schema ({after})")
    else:
        click.echo(f"{url}: migrated from {before or 'an empty database'} to {after}")


# Worker events -----------------------------------------------------------------------------


def _deliver(obj: Context, message, key_file):
    """Send an event, signed with the worker's key: in embedded mode it is checked and applied
    at once, as a reconciler would (the result is returned); with a broker it is published."""
    from gcworker.codec import Rejected, encode
    from gcworker.delivery import load_key, open_channel

    if key_file is not None:
        obj.overrides["key_file"] = key_file
    settings = obj.settings
    if not settings.embedded:
        open_channel(settings).send(message)  # undated: through a broker it confirms nothing
        return None
    plane = obj.control_plane()
    if message.type == "report":  # applied at once: built at the control plane's time now
        message = message.model_copy(update={"after": plane.now()})
    result = plane.receive(encode(message, load_key(settings)))
    if isinstance(result, Rejected):
        _fail(f"{message.type} of {message.worker} rejected: {result.reason}")
    return result


KEY_FILE_OPTION = click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The worker's private key, to sign with. Env: GCWORKER_KEY_FILE.",
)


def _event_fields(worker: str, incarnation: int, seq: int | None) -> dict:
    return {
        "worker": worker,
        "incarnation": incarnation,
        "seq": time.time_ns() if seq is None else seq,
        "clock": datetime.now(UTC),
    }


def _validated(model, **fields):
    from pydantic import ValidationError

    try:
        return model(**fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        _fail(f"invalid {model.__name__.lower()}: {where}: {first['msg']}", EXIT_USAGE)


@main.command()
@click.option("--worker", required=True, help="The worker's name.")
@click.option("--ephemeral", is_flag=True, help="The worker's rows die with it (no stalling).")
@click.option(
    "--incarnation",
    type=int,
    default=1,
    show_default=True,
    help="Increases when the worker restarts.",
)
@click.option("--seq", type=int, default=None, help="Sequence number [current time in ns].")
@click.option("--ttl", default=None, metavar="DURATION", help="Heartbeat TTL [the setting].")
@KEY_FILE_OPTION
@click.pass_obj
def heartbeat(obj: Context, worker, ephemeral, incarnation, seq, ttl, key_file):
    """Record that WORKER is alive (registers it on its first heartbeat)."""
    from gcworker.settings import parse_duration

    ttl_seconds = None
    if ttl is not None:
        try:
            ttl_seconds = parse_duration(ttl).total_seconds()
        except ValueError as error:
            _fail(f"--ttl: {error}", EXIT_USAGE)
    message = _validated(
        Heartbeat,
        **_event_fields(worker, incarnation, seq),
        ephemeral=ephemeral,
        ttl_seconds=ttl_seconds,
    )
    result = _deliver(obj, message, key_file)
    if result is None:
        click.echo(f"heartbeat of {worker}: published")
    else:
        click.echo(
            f"heartbeat of {worker}: {result.outcome}"
            + (f" ({result.reason})" if result.reason else "")
        )


def _handle_list(value: str) -> list[str]:
    return [h.strip() for h in value.split(",") if h.strip()]


@main.command()
@click.option("--worker", required=True, help="The worker's name.")
@click.option(
    "--incarnation", type=int, default=1, show_default=True, help="Increases when it restarts."
)
@click.option("--seq", type=int, default=None, help="Sequence number [current time in ns].")
@click.option(
    "--containers",
    required=True,
    metavar="H1,H2",
    help="Every container handle the worker has; empty: none.",
)
@click.option(
    "--volumes",
    required=True,
    metavar="V1,V2",
    help="Every volume handle the worker has; empty: none.",
)
@KEY_FILE_OPTION
@click.pass_obj
def report(obj: Context, worker, incarnation, seq, containers, volumes, key_file):
    """Report WORKER's complete inventory of container and volume handles."""
    message = _validated(
        Report,
        **_event_fields(worker, incarnation, seq),
        containers=_handle_list(containers),
        volumes=_handle_list(volumes),
    )
    result = _deliver(obj, message, key_file)
    if result is None:
        click.echo(f"report of {worker}: published")
        return
    line = f"report of {worker}: {result.outcome}"
    if result.reason:
        line += f" ({result.reason})"
    changes = [
        f"{what} {_count(n, kind)}"
        for what, counts in (
            ("marked missing", result.marked),
            ("cleared", result.cleared),
            ("recorded unknown", result.unknown),
            ("confirmed destroyed", result.destroyed),
        )
        for kind, n in counts.items()
        if n
    ]
    if changes:
        line += ": " + ", ".join(changes)
    elif result.outcome == "accepted":
        line += ": no change"
    click.echo(line)


# Scheduler's side ----------------------------------------------------------------------------


def _row_group(kind: str):
    @click.group(kind + "s", invoke_without_command=True)
    @click.option("--worker", default=None, help="Only this worker's rows.")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
    @click.pass_context
    def group(ctx: click.Context, worker, as_json):
        if ctx.invoked_subcommand is None:
            plane = ctx.obj.control_plane()
            if worker is not None:
                plane.worker(worker)  # an unknown one is an error, not an empty listing
            rows = plane.containers(worker) if kind == "container" else plane.volumes(worker)
            columns = ["handle", "worker", "state", "missing_since"]
            if kind == "volume":
                columns += ["parent", "container"]
            _print_rows(rows, columns, as_json, title=f"{kind}s")

    group.help = f"List {kind}s, or move one through its lifecycle."
    return group


containers_group = _row_group("container")
volumes_group = _row_group("volume")
main.add_command(containers_group)
main.add_command(volumes_group)


@containers_group.command("create")
@click.option("--worker", required=True, help="The worker that will hold it.")
@click.argument("handle")
@click.pass_obj
def container_create(obj: Context, worker, handle):
    """Record HANDLE as creating on WORKER (before asking the worker to create it)."""
    obj.control_plane().scheduler.create_container(worker, handle)
    click.echo(f"container {handle}: creating on {worker}")


@volumes_group.command("create")
@click.option("--worker", required=True, help="The worker that will hold it.")
@click.option("--parent", default=None, help="Copy-on-write parent volume.")
@click.option("--container", default=None, help="The container that owns this volume.")
@click.argument("handle")
@click.pass_obj
def volume_create(obj: Context, worker, parent, container, handle):
    """Record HANDLE as creating on WORKER (before asking the worker to create it)."""
    obj.control_plane().scheduler.create_volume(worker, handle, parent=parent, container=container)
    click.echo(f"volume {handle}: creating on {worker}")


def _move_command(
    group, name: str, argument: str, subject: str, state: str, action: str, help_text: str
):
    """`gcworker <group> NAME ARGUMENT`: calls the control plane's `action` (a dotted name,
    e.g. `fleet.land`) on the argument, then says "<subject> <argument>: <state>"."""

    @group.command(name, help=help_text)
    @click.argument(argument)
    @click.pass_obj
    def command(obj: Context, **arguments):
        value = arguments[argument]
        operator.attrgetter(action)(obj.control_plane())(value)
        click.echo(f"{subject} {value}: {state}")

    return command


for _group, _kind in ((containers_group, "container"), (volumes_group, "volume")):
    for _name, _state, _action, _help in (
        ("created", "created", f"{_kind}_created", f"The worker finished creating the {_kind}."),
        ("fail", "failed", f"fail_{_kind}", f"Creating the {_kind} failed."),
        ("destroy", "destroying", f"destroy_{_kind}", f"Ask the worker to remove the {_kind}."),
    ):
        _move_command(_group, _name, "handle", _kind, _state, f"scheduler.{_action}", _help)


# Workers -----------------------------------------------------------------------------------


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def workers(ctx: click.Context, as_json):
    """List workers, or land, retire or prune one."""
    if ctx.invoked_subcommand is None:
        rows = ctx.obj.control_plane().workers()
        _print_rows(
            rows,
            [
                "name",
                "state",
                "ephemeral",
                "incarnation",
                "heartbeat_expires_at",
                "stalled_at",
                "last_report_at",
            ],
            as_json,
            title="workers",
        )


_move_command(
    workers,
    "land",
    "worker",
    "worker",
    "landing",
    "fleet.land",
    "Land WORKER: it takes no new work and lands once it holds no active containers.",
)
_move_command(
    workers,
    "retire",
    "worker",
    "worker",
    "retiring",
    "fleet.retire",
    "Retire WORKER: it is deleted, with its rows, once it stops heartbeating.",
)


@workers.command("prune")
@click.option(
    "--revoke-key",
    is_flag=True,
    help="Also revoke NAME's key: it can never come back under it, even restarted.",
)
@click.argument("name")
@click.pass_obj
def worker_prune(obj: Context, name, revoke_key):
    """Delete NAME and its rows now; refused while it is running. A tombstone of its last
    incarnation stays: its old messages, replayed, are rejected; it comes back only with a new
    incarnation (a restarted reporter)."""
    counts = obj.control_plane().fleet.prune(name, revoke_key=revoke_key)
    click.echo(
        f"worker {name}: pruned with {_count(counts['containers'], 'container')} and "
        f"{_count(counts['volumes'], 'volume')}{', its key revoked' if revoke_key else ''}"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# Collector and audit -----------------------------------------------------------------------


@main.command()
@click.option("--dry-run", is_flag=True, help="Log and audit what would change; change nothing.")
@click.pass_obj
def collect(obj: Context, dry_run):
    """Run one collection: worker expiry, stuck creating, orphans, missing rows (rule 4)."""
    summary = obj.control_plane().collect(dry_run=dry_run)
    click.echo(summary.line())


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the newest N.")
@click.option("--worker", default=None, help="Only this worker's events (deleted ones too).")
@click.option("--since", default=None, metavar="DURATION", help="Only the last DURATION (1h).")
@click.option(
    "--action",
    "actions",
    multiple=True,
    metavar="ACTION",
    help="Only this action (delete, stall, destroy...); may be repeated.",
)
@click.pass_obj
def events(obj: Context, as_json, limit, worker, since, actions):
    """List the audit log, newest first: every row or worker changed, by whom and why."""
    from gcworker.settings import parse_duration

    try:
        age = None if since is None else parse_duration(since)
    except ValueError as error:
        _fail(f"--since: {error}", EXIT_USAGE)
    rows = obj.control_plane().events(limit, worker=worker, age=age, actions=actions)
    for row in rows:
        row["worker"] = row.pop("worker_name")
    _print_rows(
        rows,
        ["at", "actor", "action", "kind", "subject", "worker", "reason", "dry_run"],
        as_json,
        title="events",
    )


from gcworker.commands.security import dead_letters, keys  # noqa: E402

main.add_command(keys)
main.add_command(dead_letters)

from gcworker.commands.bench import bench  # noqa: E402

main.add_command(bench)

from gcworker.commands.demo import demo  # noqa: E402

main.add_command(demo)

from gcworker.commands.pipeline import beat, reconciler, reporter, up  # noqa: E402

main.add_command(reporter)
main.add_command(reconciler)
main.add_command(beat)
main.add_command(up)

from gcworker.commands.flower import flower  # noqa: E402

main.add_command(flower)

if __name__ == "__main__":
    main()
