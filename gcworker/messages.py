"""The events workers send: heartbeats and reports, as versioned JSON validated on arrival."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

from gcworker.errors import GcworkerError

MESSAGE_VERSION = 1
WORKER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
HANDLE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
MAX_HANDLES_PER_KIND = 200_000

# Every number and time a message carries fits the database's columns and any arithmetic on it:
# a counter is a signed 64-bit integer (PostgreSQL's bigint), a time is aware and, in UTC, within
# years that no timezone shift or grace period can carry out of Python's range. A host whose
# clock was never set reads 1970: its clock is only recorded, so its messages still count.
MAX_COUNTER = 2**63 - 1
EARLIEST_TIME = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_TIME = datetime(2200, 1, 1, tzinfo=UTC)


def _in_time_range(value: datetime) -> datetime:
    try:
        utc = value.astimezone(UTC)
    except OverflowError:  # year 1 at +14:00, year 9999 at -14:00
        utc = None
    if utc is None or not EARLIEST_TIME <= utc < LATEST_TIME:
        raise ValueError(
            f"a time from {EARLIEST_TIME.year} to {LATEST_TIME.year - 1} (UTC) is expected"
        )
    return value


WorkerName = Annotated[str, StringConstraints(pattern=WORKER_NAME_PATTERN)]
Handle = Annotated[str, StringConstraints(pattern=HANDLE_PATTERN)]
Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
Time = Annotated[AwareDatetime, AfterValidator(_in_time_range)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = MESSAGE_VERSION
    worker: WorkerName
    incarnation: Counter
    seq: Counter
    clock: Time | None = None


class Heartbeat(_Message):
    type: Literal["heartbeat"] = "heartbeat"
    ephemeral: bool = False
    ttl_seconds: float | None = Field(default=None, gt=0, le=24 * 3600)


class _Inventory(_Message):
    # The control plane's time of the newest answer (feedback) the reporter had read when it
    # built this report: the report dates from after it. Confirms absences (rule 4) from then.
    after: Time | None = None


class Report(_Inventory):
    type: Literal["report"] = "report"
    containers: list[Handle] = Field(max_length=MAX_HANDLES_PER_KIND)
    volumes: list[Handle] = Field(max_length=MAX_HANDLES_PER_KIND)

    @field_validator("containers", "volumes")
    @classmethod
    def _no_duplicates(cls, handles: list[str]) -> list[str]:
        if len(set(handles)) != len(handles):
            raise ValueError("a handle is listed twice")
        return handles


class UnchangedReport(_Inventory):
    """The compact report: "my handles are those of the full report with this digest".

    The control plane applies it only when the digest is that of the worker's last accepted full
    report and nothing changed since; otherwise it changes nothing and asks for a full report.
    """

    type: Literal["unchanged"] = "unchanged"
    digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


def check_handle(handle: str, what: str = "handle") -> str:
    """Refuse a handle outside the documented syntax (letters, digits, `_.:-`; 128 at most)."""
    if not re.fullmatch(HANDLE_PATTERN, handle):
        raise GcworkerError(
            f"invalid {what} {handle!r}: use 1-128 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return handle


def check_worker_name(name: str) -> str:
    """Refuse a worker name outside the documented syntax (letters, digits, `_.-`; 64 at most)."""
    if not re.fullmatch(WORKER_NAME_PATTERN, name):
        raise GcworkerError(
            f"invalid worker name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name
