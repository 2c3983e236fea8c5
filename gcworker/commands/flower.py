"""`gcworker flower`: Flower on the control plane's Celery app, safe by default: it listens on
127.0.0.1 unless told otherwise and demands the credentials of GCWORKER_FLOWER_BASIC_AUTH (or
GCWORKER_FLOWER_BASIC_AUTH_FILE), passed to it through its environment, never its command line."""

from __future__ import annotations

import os
import sys

import click


@click.command()
@click.option(
    "--port", type=click.IntRange(1, 65535), default=5555, show_default=True, help="Its port."
)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Where Flower listens (0.0.0.0: every interface, e.g. in a container).",
)
@click.pass_obj
def flower(obj, port: int, address: str):
    """Run Flower (tasks, workers, broker) with basic auth. This process becomes Flower."""
    import logging

    from gcworker import processes
    from gcworker.settings import SettingsError

    if obj.settings.embedded:
        click.echo("gcworker: `gcworker flower` needs a broker: set GCWORKER_BROKER_URL", err=True)
        sys.exit(2)
    env = processes.settings_environment(obj.overrides)
    try:
        env = processes.flower_environment(obj.settings, env)
    except SettingsError as error:
        click.echo(f"gcworker: {error}", err=True)
        sys.exit(2)
    level = logging.getLevelName(logging.getLogger().level)
    argv = processes.flower_argv(port=port, address=address, log_level=level)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
