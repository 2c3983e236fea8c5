"""`gcworker keys` (workers' signing keys) and `gcworker dead-letters` (rejected messages)."""

from __future__ import annotations

from pathlib import Path

import click

from gcworker.cli_output import print_rows
from gcworker.signing import generate_private_key, public_key_text, write_private_key


@click.group()
def keys():
    """Workers' Ed25519 signing keys: the control plane holds only the public halves."""


def _out_option(help_text: str):
    return click.option(
        "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help=help_text
    )


def _write_new_key(out: Path) -> str:
    """Write a new private key to `out` (readable by its owner alone, never over a file);
    returns its public half."""
    private_key = generate_private_key()
    write_private_key(private_key, out)
    return public_key_text(private_key)


@keys.command("generate")
@click.argument("worker")
@_out_option("Where to write the private key (created readable by its owner alone).")
@click.option(
    "--public-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the public half to this file (it is always printed).",
)
def keys_generate(worker: str, out: Path, public_out: Path | None):
    """Make WORKER's key pair on the worker host, with no database access: the private key
    goes to --out, the public half is printed, to be registered on the control plane with
    `gcworker keys register WORKER --public-key FILE|-`."""
    from gcworker.messages import check_worker_name

    check_worker_name(worker)
    public = _write_new_key(out)
    if public_out is not None:
        public_out.write_text(public + "\n")
    click.echo(f"key for {worker}: private key written to {out}; public key:", err=True)
    click.echo(public)


@keys.command("register")
@click.argument("worker")
@click.option(
    "--public-key",
    "public_key_file",
    required=True,
    type=click.File("r"),
    help="A file holding the public key that `keys generate` printed, or - for stdin.",
)
@click.option("--replace", is_flag=True, help="Replace the worker's active key.")
@click.pass_obj
def keys_register(obj, worker: str, public_key_file, replace: bool):
    """Register WORKER's public key: its signed messages are accepted from now on."""
    from gcworker.errors import GcworkerError
    from gcworker.messages import check_worker_name
    from gcworker.signing import parse_public_key

    check_worker_name(worker)
    text = public_key_file.read(1000).strip()
    try:
        parse_public_key(text)
    except ValueError:
        raise GcworkerError(
            f"{public_key_file.name}: not an Ed25519 public key (expected the base64 text that "
            "`gcworker keys generate` prints)"
        ) from None
    obj.control_plane().register_key(worker, text, replace=replace)
    click.echo(f"key for {worker}: public key registered")


@keys.command("generate-control-plane")
@_out_option("Where to write the control plane's private key (readable by its owner alone).")
def keys_generate_control_plane(out: Path):
    """Make the control plane's key pair: reconcilers sign their answers to workers with the
    private key (GCWORKER_CONTROL_PLANE_KEY_FILE=FILE), reporters verify them with the public
    half, printed (GCWORKER_CONTROL_PLANE_PUBLIC_KEY=...)."""
    public = _write_new_key(out)
    click.echo(f"control plane key: private key written to {out}; public key:", err=True)
    click.echo(public)


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
