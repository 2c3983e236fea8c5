"""`gcworker keys` (workers' signing keys) and `gcworker dead-letters` (rejected messages)."""

from __future__ import annotations

from pathlib import Path

import click

from gcworker.cli_output import print_rows
from gcworker.signing import generate_private_key, public_key_text, write_private_key


@click.group()
def keys():
    """Workers' Ed25519 signing keys: the control plane holds only the public halves."""


@keys.command("generate")
@click.argument("worker")
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the private key (created readable by its owner alone).",
)
@click.option("--replace", is_flag=True, help="Replace the worker's active key.")
@click.pass_obj
def keys_generate(obj, worker: str, out: Path, replace: bool):
    """Make a key pair for WORKER: write the private key to --out, register the public key."""
    from gcworker.messages import check_worker_name

    check_worker_name(worker)
    plane = obj.control_plane()
    private_key = generate_private_key()
    write_private_key(private_key, out)
    try:
        plane.register_key(worker, public_key_text(private_key), replace=replace)
    except Exception:
        out.unlink()  # nothing half-written: no orphan private key
        raise
    click.echo(f"key for {worker}: private key written to {out}, public key registered")


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_obj
def keys_list(obj, as_json: bool):
    """List registered public keys."""
    rows = obj.control_plane().keys()
    for row in rows:
        row["worker"] = row.pop("worker_name")
    print_rows(rows, ["worker", "public_key", "created_at", "revoked_at"], as_json, title="keys")


@keys.command("revoke")
@click.argument("worker")
@click.pass_obj
def keys_revoke(obj, worker: str):
    """Revoke WORKER's key: its messages are rejected until a new key is generated."""
    obj.control_plane().revoke_key(worker)
    click.echo(f"key for {worker}: revoked")


@click.command("dead-letters")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the newest N.")
@click.pass_obj
def dead_letters(obj, as_json: bool, limit: int | None):
    """List rejected messages, newest first, with the reason each was rejected."""
    rows = obj.control_plane().dead_letters(limit)
    for row in rows:
        row["worker"] = row.pop("worker_name")
    print_rows(rows, ["at", "worker", "reason", "excerpt"], as_json, title="dead letters")
