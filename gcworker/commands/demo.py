"""`gcworker demo`: a simulated fleet with scripted trouble, watched live, ending in a verdict."""

from __future__ import annotations

import os
import shutil
import sys
import time

import click

from gcworker.settings import ENV_PREFIX

EXIT_VERDICT_FAILED = 1
EXIT_USAGE = 2


@click.command()
@click.option(
    "--workers",
    "n_workers",
    type=click.IntRange(min=4, max=10),
    default=5,
    show_default=True,
    help="Simulated workers (the last one is ephemeral).",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=12),
    default=30.0,
    show_default=True,
    help="Seconds of scheduling and trouble, before the system settles.",
)
@click.option("--seed", type=int, default=None, help="Seed for the scheduler's choices.")
@click.option("--plain", is_flag=True, help="Plain lines instead of the live view.")
@click.option("--keep", is_flag=True, help="Keep the temporary folder (database, runtimes).")
@click.option(
    "--runtime",
    "runtime_spec",
    default="dir",
    show_default=True,
    metavar="dir|docker[:URL]",
    callback=lambda _ctx, _param, value: _check_runtime(value),
    help="The workers' runtime: folders, or one Docker/Podman engine (default: DOCKER_HOST).",
)
@click.pass_obj
def demo(
    obj,
    n_workers: int,
    duration: float,
    seed: int | None,
    plain: bool,
    keep: bool,
    runtime_spec: str,
):
    """Run a simulated fleet on short intervals, with trouble, and check the outcome.

    Everything stays in a temporary folder: its own SQLite database and one `dir` runtime per
    worker (./.gcworker and the global timing settings are not used). A scheduler creates and
    destroys containers and volumes; one worker's runtime restarts and loses its state, one is
    cut off for longer than the grace period and comes back, one ephemeral worker vanishes, and
    one container is stuck in creating. At the end the database is compared with the workers'
    directories: exit 0 when they agree and no row was deleted while its handle still existed,
    1 otherwise.

    With --runtime docker[:URL] the workers live on a real engine (Docker, or Podman's
    service): one label gcworker.worker per simulated worker, a runtime restart removes that
    worker's objects behind gcworker's back, and the verdict compares the database with the
    engine. It imports a tiny image from a tarball it builds, creates containers (never started)
    and volumes, and removes everything it made at the end, also on failure or Ctrl-C.

    With GCWORKER_BROKER_URL set, the same demo runs through Redis: it starts a Celery
    reconciler and Celery beat as child processes (stopped by their process ids at the end),
    the reporters publish signed messages, and the keys live under a namespace of this run
    alone, removed at the end.
    """
    from rich.console import Console

    from gcworker.demo import Demo, DemoConfig, DemoError, make_root, render

    broker_url = (obj.overrides.get("broker_url") if obj else None) or os.environ.get(
        f"{ENV_PREFIX}BROKER_URL", ""
    )
    if broker_url:
        _check_broker(broker_url)
    config = DemoConfig(
        workers=n_workers,
        duration=duration,
        seed=seed,
        broker_url=broker_url,
        runtime=runtime_spec,
    )
    console = Console()
    live_view = console.is_terminal and not plain
    root = make_root()
    started = time.monotonic()
    mode = "through Redis and Celery" if broker_url else "embedded (SQLite, no servers)"
    if runtime_spec != "dir":
        mode += f", workers on {runtime_spec}"
    click.echo(f"gcworker demo: {n_workers} workers for {duration:g}s, {mode}, in {root}")
    try:
        if live_view:
            verdict, simulation = _run_live(Demo, config, root, console, render)
        else:
            verdict, simulation = _run_plain(Demo, config, root)
    except DemoError as error:
        click.echo(f"gcworker demo: could not run: {error}", err=True)
        sys.exit(EXIT_VERDICT_FAILED)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    click.echo("")
    for line in simulation.outcomes:
        click.echo(line)
    for line in verdict.lines():
        click.echo(line)
    click.echo(
        f"demo finished in {time.monotonic() - started:.1f}s" + (f"; kept {root}" if keep else "")
    )
    sys.exit(0 if verdict.ok else EXIT_VERDICT_FAILED)


def _check_runtime(spec: str) -> str:
    kind, _, url = spec.partition(":")
    if spec != "dir" and (kind != "docker" or "?" in url):
        raise click.BadParameter(
            f"{spec!r}: the demo runs on dir or docker[:URL] (it makes its own labels and image)"
        )
    return spec


def _check_broker(url: str) -> None:
    """Fail early, in one line, when the broker does not answer."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3)
        client.ping()
        client.close()
    except (redis.RedisError, ValueError) as error:
        from kombu.utils.url import maybe_sanitize_url

        click.echo(
            f"gcworker demo: the broker {maybe_sanitize_url(url)} does not answer: {error}",
            err=True,
        )
        sys.exit(EXIT_VERDICT_FAILED)


def _run_live(Demo, config, root, console, render):
    from rich.live import Live

    with Live(console=console, refresh_per_second=5, transient=False) as live:
        simulation = Demo(config, root=root, view=lambda frame: live.update(render(frame)))
        verdict = simulation.run()
    return verdict, simulation


def _run_plain(Demo, config, root):
    last = [0.0]

    def view(frame) -> None:
        if frame.elapsed - last[0] >= 3.0 or frame.phase == "done":
            last[0] = frame.elapsed
            click.echo(frame.plain_line())

    simulation = Demo(config, root=root, view=view, say=click.echo)
    return simulation.run(), simulation
