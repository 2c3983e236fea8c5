"""The wire format of workers' messages, and the decoder every message passes on arrival.

An envelope is `{"payload": "<the message as JSON text>", "signature": "<base64 Ed25519>"}`: the
signature covers the payload's exact bytes, so every field of the message. Decoding checks, in
order: the envelope's shape, the payload's size, the JSON, the message schema (version, names,
handles, caps, no duplicates), then the signature against the worker's registered public key.
Anything wrong raises `Rejected` with a reason meant for a log line and the dead-letter list.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import Field, TypeAdapter, ValidationError

from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.signing import sign, verify

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
Message = Heartbeat | Report | UnchangedReport
_message_adapter: TypeAdapter[Message] = TypeAdapter(
    Annotated[Message, Field(discriminator="type")]
)


class Rejected(ValueError):
    """A message that must change nothing; `reason` says why, `worker` who sent it (if known)."""

    def __init__(self, reason: str, worker: str | None = None, payload: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.worker = worker
        self.payload = payload


def encode(message: Message, private_key: Ed25519PrivateKey | None) -> dict[str, Any]:
    payload = message.model_dump_json()
    envelope: dict[str, Any] = {"payload": payload}
    if private_key is not None:
        envelope["signature"] = sign(private_key, payload.encode())
    return envelope


def decode(
    envelope: Any,
    public_key_of: Callable[[str], str | None],
    *,
    allow_unsigned: bool = False,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Message:
    """The message in `envelope`, checked; `public_key_of(worker)` gives the active key or None."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("payload"), str):
        raise Rejected("malformed envelope: expected an object with a string payload")
    unknown = sorted(set(envelope) - {"payload", "signature"})
    if unknown:
        raise Rejected(f"malformed envelope: unknown fields {unknown}")
    payload: str = envelope["payload"]
    if len(payload) > max_bytes:
        raise Rejected(
            f"oversized message: {len(payload)} bytes, the limit is {max_bytes}", payload=payload
        )
    try:
        fields = json.loads(payload)
    except ValueError as error:
        raise Rejected(f"malformed JSON: {error}", payload=payload) from None
    worker = fields.get("worker") if isinstance(fields, dict) else None
    worker = worker if isinstance(worker, str) else None
    try:
        message = _message_adapter.validate_python(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise Rejected(f"invalid message: {where}: {first['msg']}", worker, payload) from None
    _check_signature(message, payload, envelope.get("signature"), public_key_of, allow_unsigned)
    return message


def _check_signature(message, payload, signature, public_key_of, allow_unsigned) -> None:
    worker = message.worker
    if signature is None:
        if allow_unsigned:
            return
        raise Rejected(
            "unsigned message (set GCWORKER_ALLOW_UNSIGNED=true to accept them)", worker, payload
        )
    if not isinstance(signature, str):
        raise Rejected("malformed signature", worker, payload)
    public_key = public_key_of(worker)
    if public_key is None:
        raise Rejected(f"no active key for worker {worker!r} (unknown or revoked)", worker, payload)
    if not verify(public_key, payload.encode(), signature):
        raise Rejected(f"wrong signature for worker {worker!r}", worker, payload)
