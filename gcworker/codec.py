"""The wire format of workers' messages, and the decoder every message passes on arrival.

An envelope is `{"payload": "<the message as JSON text>", "signature": "<base64 Ed25519>"}`: the
signature covers the payload's exact bytes, so every field of the message. Decoding checks, in
order: the envelope's shape, the payload's size in UTF-8 bytes (text that has none, a lone
surrogate, is rejected), the JSON (however deeply nested), the message schema (version, names,
handles, caps, no duplicates), then the signature against the worker's registered public key.
Anything wrong raises `Rejected` with a reason meant for a log line and the dead-letter list.

The payload is a JSON object of the message's fields (those left at None are left out), except
for the compact unchanged report, the most frequent message, whose payload is its fields in a
fixed order, `COMPACT_LAYOUT`, as a JSON array:

    [1, "unchanged", "w1", 1732900000000000000, 1732900042000000000,
     "2024-11-29T17:07:22.045137Z", "2024-11-29T17:07:21.998000Z", "<digest>"]

(clock and after may be null): no field names, so about a hundred bytes fewer once the broker has
escaped it twice. The array is checked for its length and its type before it becomes the same
fields, validated by the same schema: a version or anything else wrong is rejected just as in an
object. Both forms decode, whichever a reporter sends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import Field, TypeAdapter, ValidationError

from gcworker.messages import WORKER_NAME_PATTERN, Heartbeat, Report, UnchangedReport
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


COMPACT_LAYOUT = ("version", "type", "worker", "incarnation", "seq", "clock", "after", "digest")
_COMPACT_OPTIONAL = frozenset({"clock", "after"})


def encode(message: Message, private_key: Ed25519PrivateKey | None) -> dict[str, Any]:
    if isinstance(message, UnchangedReport):
        fields = message.model_dump(mode="json")
        payload = json.dumps([fields[name] for name in COMPACT_LAYOUT], separators=(",", ":"))
    else:
        # Fields left at None (no clock, no `after`, no TTL) are left out: they decode to None.
        payload = message.model_dump_json(exclude_none=True)
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
    claimed: Callable[[str], None] | None = None,
) -> Message:
    """The message in `envelope`, checked; `public_key_of(worker)` gives the active key or None.
    `claimed(worker)` is told the worker a signed message names as soon as it is read, before
    the rest is checked (so that its key can be read meanwhile): a valid name, nothing more."""
    payload, data = _payload(envelope, max_bytes)
    fields = _parsed(payload)
    worker = fields.get("worker") if isinstance(fields, dict) else None
    worker = worker if isinstance(worker, str) else None
    signature = envelope.get("signature")
    if claimed is not None and signature is not None and _is_worker_name(worker):
        claimed(worker)
    message = _validated(fields, worker, payload)
    _check_signature(message, payload, data, signature, public_key_of, allow_unsigned)
    return message


def _payload(envelope: Any, max_bytes: int) -> tuple[str, bytes]:
    """The envelope's payload, as text and as the UTF-8 bytes its signature covers."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("payload"), str):
        raise Rejected("malformed envelope: expected an object with a string payload")
    unknown = sorted(str(name)[:40] for name in set(envelope) - {"payload", "signature"})
    if unknown:
        raise Rejected(f"malformed envelope: unknown fields {unknown[:5]}")
    payload: str = envelope["payload"]
    try:
        data = payload.encode()
    except UnicodeEncodeError as error:  # a lone surrogate: no bytes to sign, nothing to store
        raise Rejected(
            f"malformed payload: not UTF-8 text ({error.reason} at character {error.start})",
            payload=payload,
        ) from None
    if len(data) > max_bytes:
        raise Rejected(
            f"oversized message: {len(data)} bytes, the limit is {max_bytes}", payload=payload
        )
    return payload, data


def _parsed(payload: str) -> Any:
    """The payload's JSON: an object, or the array of a compact report made one."""
    try:
        fields = json.loads(payload)
    except ValueError as error:
        raise Rejected(f"malformed JSON: {error}", payload=payload) from None
    except RecursionError:
        raise Rejected("malformed JSON: nested too deeply", payload=payload) from None
    if isinstance(fields, list):
        fields = _compact_fields(fields, payload)
    return fields


def _validated(fields: Any, worker: str | None, payload: str) -> Message:
    try:
        return _message_adapter.validate_python(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise Rejected(f"invalid message: {where}: {first['msg']}", worker, payload) from None
    except Exception as error:  # noqa: BLE001 - whatever the input breaks, it is the input's fault
        raise Rejected(f"invalid message: {type(error).__name__}", worker, payload) from None


def _is_worker_name(worker: str | None) -> bool:
    return worker is not None and re.fullmatch(WORKER_NAME_PATTERN, worker) is not None


def _compact_fields(values: list, payload: str) -> dict[str, Any]:
    """The fields of a compact unchanged report sent as an array (`COMPACT_LAYOUT`)."""
    if len(values) != len(COMPACT_LAYOUT) or values[1] != "unchanged":
        raise Rejected(
            "malformed compact message: expected an array of "
            f"{len(COMPACT_LAYOUT)} values ({', '.join(COMPACT_LAYOUT)}) of type unchanged",
            payload=payload,
        )
    return {
        name: value
        for name, value in zip(COMPACT_LAYOUT, values, strict=True)
        if value is not None or name not in _COMPACT_OPTIONAL
    }


def _check_signature(message, payload, data, signature, public_key_of, allow_unsigned) -> None:
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
    if not verify(public_key, data, signature):
        raise Rejected(f"wrong signature for worker {worker!r}", worker, payload)
