"""The control plane's answers to a worker, and how a reporter knows they are true (rule 15).

A reporter acts on two answers the control plane leaves for its worker (in Redis, with a
broker; see `gcworker.handoff`):

- a **stamp**: "I received your message `seq` of incarnation `incarnation`; my clock then read
  `as_of`, and your rows were at generation `generation`". The reporter dates every report it
  builds after reading it with `as_of` (a report's `after`, rule 4): the only proof a report
  can give of when it was built.
- a **destroy list**: the worker's `destroying` handles, read at `generation` and `as_of`. The
  reporter removes them (rules 8-10) only while a current stamp names the same incarnation and
  the list was read not long before it (`Reporter`).

Anyone who can write to Redis can write these keys, so each answer is a JSON payload signed
with the control plane's Ed25519 key (`GCWORKER_CONTROL_PLANE_KEY_FILE`, on the reconcilers);
reporters verify it with the public half (`GCWORKER_CONTROL_PLANE_PUBLIC_KEY`). What a reporter
then checks of a stamp (`Reporter`): its worker, its incarnation, and that its `seq` is one the
reporter itself sent, recently (a replayed old stamp is stale, one naming a message never sent
is from the future). With `GCWORKER_ALLOW_UNSIGNED=true`, unsigned answers are accepted.

Sealed form: `{"payload": "<the answer as JSON text>", "signature": "<base64>"}` (no signature
when unsigned), as for workers' messages (`gcworker.codec`).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gcworker.messages import Handle, WorkerName
from gcworker.signing import sign, verify

MAX_SEALED_CHARS = 4 * 1024 * 1024
MAX_LISTED = 10_000
Number = Annotated[int, Field(ge=0, lt=2**63)]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: WorkerName
    incarnation: Number
    generation: Number
    as_of: Number  # the control plane's clock, in microseconds since the epoch


class Stamp(_Answer):
    type: Literal["stamp"] = "stamp"
    seq: Number  # the worker's message the control plane had received


class DestroyList(_Answer):
    type: Literal["destroy"] = "destroy"
    containers: list[Handle] = Field(default_factory=list, max_length=MAX_LISTED)
    volumes: list[Handle] = Field(default_factory=list, max_length=MAX_LISTED)

    def by_kind(self) -> dict[str, list[str]]:
        return {"container": self.containers, "volume": self.volumes}


class Untrusted(ValueError):
    """An answer the reporter must ignore; the message says why."""


def seal(answer: Stamp | DestroyList, private_key: Ed25519PrivateKey | None) -> str:
    payload = answer.model_dump_json()
    sealed = {"payload": payload}
    if private_key is not None:
        sealed["signature"] = sign(private_key, payload.encode())
    return json.dumps(sealed, separators=(",", ":"))


def unseal(
    sealed: str,
    kind: type[Stamp] | type[DestroyList],
    worker: str,
    *,
    public_key: str | None,
    allow_unsigned: bool,
) -> Stamp | DestroyList:
    """The answer in `sealed`, if the control plane signed it for `worker`; raises Untrusted."""
    if len(sealed) > MAX_SEALED_CHARS:
        raise Untrusted(f"oversized: {len(sealed)} characters")
    try:
        envelope = json.loads(sealed)
    except (ValueError, RecursionError):
        raise Untrusted("not JSON") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("payload"), str):
        raise Untrusted("malformed: expected an object with a string payload")
    payload, signature = envelope["payload"], envelope.get("signature")
    if signature is None:
        if not allow_unsigned:
            raise Untrusted("unsigned (set GCWORKER_ALLOW_UNSIGNED=true to accept it)")
    elif public_key is None:
        if not allow_unsigned:
            raise Untrusted("signed, but no GCWORKER_CONTROL_PLANE_PUBLIC_KEY to verify it")
    elif not isinstance(signature, str) or not verify(public_key, payload.encode(), signature):
        raise Untrusted("wrong signature (not the control plane's key)")
    try:
        answer = kind.model_validate_json(payload)
    except (ValidationError, RecursionError) as error:
        raise Untrusted(f"invalid {kind.__name__}: {str(error)[:200]}") from None
    if answer.worker != worker:
        raise Untrusted(f"made for worker {answer.worker!r}, not {worker!r}")
    return answer
