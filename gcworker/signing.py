"""Ed25519 keys for workers' messages. A worker holds its private key (a file only its owner can
read); the control plane holds only public keys, so a leaked database forges nothing."""

from __future__ import annotations

import base64
import functools
import logging
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gcworker.errors import GcworkerError, SetupError

log = logging.getLogger(__name__)


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_text(private_key: Ed25519PrivateKey) -> str:
    raw = private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return base64.b64encode(raw).decode()


def write_private_key(private_key: Ed25519PrivateKey, path: Path) -> None:
    """Write the key as PEM, readable and writable by its owner alone; never overwrite."""
    pem = private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SetupError(f"{path} already exists: choose another --out") from None
    except OSError as error:
        raise SetupError(f"cannot write the key {path}: {error.strerror}") from None
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as error:
        raise GcworkerError(f"cannot read the private key {path}: {error}") from None
    if mode & 0o077:
        log.warning(
            "private key readable by others: whoever reads it can sign as its owner "
            "(chmod 600 it)",
            extra={"path": str(path), "mode": oct(mode & 0o777)},
        )
    if not isinstance(key, Ed25519PrivateKey):
        raise GcworkerError(f"{path} is not an Ed25519 private key")
    return key


def sign(private_key: Ed25519PrivateKey, payload: bytes) -> str:
    return base64.b64encode(private_key.sign(payload)).decode()


def verify(public_key: str, payload: bytes, signature: str) -> bool:
    try:
        key = _public_key(public_key)
        key.verify(base64.b64decode(signature, validate=True), payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A public key from its base64 text; raises ValueError for anything else."""
    return _public_key(text)


@functools.lru_cache(maxsize=4096)
def _public_key(text: str) -> Ed25519PublicKey:
    """A registered key's text, parsed. Only the parsing is cached: which key is a worker's
    active one is asked of the database for every message (`ControlPlane.public_key_of`)."""
    return Ed25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
