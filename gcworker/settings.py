"""Settings: environment variables `GCWORKER_*` (and the matching CLI flags), checked at start.

Durations are written like `30s`, `5m`, `1h` (or a plain number of seconds), sizes like `32 MiB`
(or a plain number of bytes). Rule 14: a bad value stops the program with one line that names the
setting and says what is wrong (never a URL's password).
"""

from __future__ import annotations

import logging
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import humanfriendly
from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)

ENV_PREFIX = "GCWORKER_"
DEFAULT_DATABASE_PATH = Path(".gcworker") / "gcworker.db"
# Far enough for any setting, near enough that now() plus it is still a date Python can hold.
MAX_DURATION = timedelta(days=100 * 365)
# The stack's drivers: a URL naming another one would fail at its first connection, deep inside.
SUPPORTED_DATABASES = {"postgresql": ("", "psycopg2"), "sqlite": ("", "pysqlite")}


class SettingsError(ValueError):
    """A setting is invalid; the message names it."""


def parse_duration(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    text = str(value).strip()
    try:
        seconds = humanfriendly.parse_timespan(text)
    except humanfriendly.InvalidTimespan:
        raise ValueError(f"{text!r} is not a duration (write it like 30s, 5m or 1h)") from None
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError(f"{text!r} is too long (at most {MAX_DURATION.days // 365} years)")
    return timedelta(seconds=seconds)


def parse_size(value: Any) -> int:
    if isinstance(value, int):
        return value
    text = str(value).strip()
    try:
        return humanfriendly.parse_size(text)
    except humanfriendly.InvalidSize:
        raise ValueError(f"{text!r} is not a size (write it like 32 MiB or 1048576)") from None


def check_database_url(value: str) -> str:
    """`value` if gcworker can use it: PostgreSQL (psycopg2) or SQLite in a folder that exists
    (only the default file's folder is created: a typo must not grow a new tree)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(value)
    except ArgumentError:
        raise ValueError(
            "is not a database URL (write it like postgresql://user@host/db or "
            "sqlite:///path/to/file.db)"
        ) from None
    backend, _, driver = url.drivername.partition("+")
    if driver not in SUPPORTED_DATABASES.get(backend, ()):
        raise ValueError(
            f"unsupported database {url.drivername!r} (gcworker runs on postgresql:// or sqlite://)"
        )
    if backend == "sqlite" and url.database and url.database != ":memory:":
        folder = Path(url.database).parent
        if not folder.is_dir():
            raise ValueError(f"the folder {folder} does not exist")
    return value


def without_password(url: str) -> str:
    """`url` with the password of its `user:password@` part starred out, parsable or not."""
    return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", str(url))


def format_duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    database_url: str = Field(default="", description="SQLAlchemy URL; default: a SQLite file")
    broker_url: str = Field(default="", description="Redis URL; empty: embedded mode")
    # Prefix of every Redis key the pipeline uses (queues, beat schedule, destroying lists), so
    # that several control planes (or test runs) can share one Redis.
    broker_namespace: str = Field(default="gcworker", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    # How long a reserved, unacknowledged message waits for its reconciler before the broker
    # hands it to another (a reconciler host that died mid-task).
    broker_visibility_timeout: Duration = timedelta(minutes=5)
    missing_grace_period: Duration = timedelta(minutes=5)
    report_interval: Duration = timedelta(seconds=30)
    heartbeat_interval: Duration = timedelta(seconds=30)
    heartbeat_ttl: Duration | None = None
    creating_timeout: Duration = timedelta(hours=1)
    gc_interval: Duration = timedelta(seconds=30)
    stalled_worker_timeout: Duration = timedelta(0)
    delete_batch_size: int = Field(default=10_000, ge=1)
    max_deletes_per_collection: int = Field(default=10_000, ge=1)
    dry_run: bool = False
    brake_stalled_fraction: float = Field(default=0.5, gt=0, le=1)
    brake_min_workers: int = Field(default=3, ge=1)
    allow_unsigned: bool = False
    key_file: Path | None = None
    # The control plane's Ed25519 key: reconcilers sign their answers to workers with the
    # private half (a PEM file); reporters verify them with the public half (base64).
    control_plane_key_file: Path | None = None
    control_plane_public_key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9+/]{43}=$")
    max_message_bytes: Size = Field(default=32 * 1024 * 1024, ge=1024)
    dead_letter_limit: int = Field(default=1000, ge=1)
    # The reporter's sweeper: removals in flight at once, per kind, and how long one may take
    # before its handle is freed for a later round (Concourse: 5 containers, 3 volumes, 5m).
    sweep_containers_in_flight: int = Field(default=5, ge=1)
    sweep_volumes_in_flight: int = Field(default=3, ge=1)
    destroy_timeout: Duration = timedelta(minutes=5)
    log_format: Literal["text", "json"] = "text"
    # Flower's basic auth, "user:password" (several: comma-separated); `up --flower` and
    # `gcworker flower` refuse to start Flower without it.
    flower_basic_auth: SecretStr | None = None

    @field_validator(
        "missing_grace_period",
        "report_interval",
        "heartbeat_interval",
        "creating_timeout",
        "gc_interval",
        "broker_visibility_timeout",
        "destroy_timeout",
    )
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("must be longer than zero")
        return value

    @field_validator("flower_basic_auth")
    @classmethod
    def _credentials(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(
            r"[^:,]+:[^,]+(,[^:,]+:[^,]+)*", value.get_secret_value()
        ):
            raise ValueError("must be user:password (several: comma-separated)")
        return value

    @field_validator("database_url")
    @classmethod
    def _usable_database(cls, value: str) -> str:
        return check_database_url(value) if value else value  # empty: the default, below

    @field_validator("stalled_worker_timeout")
    @classmethod
    def _not_negative(cls, value: timedelta) -> timedelta:
        if value < timedelta(0):
            raise ValueError("must not be negative (0 means never)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.heartbeat_ttl is None:
            self.heartbeat_ttl = 2 * self.heartbeat_interval
        if self.heartbeat_ttl < self.heartbeat_interval:
            raise SettingsError(
                f"{ENV_PREFIX}HEARTBEAT_TTL={format_duration(self.heartbeat_ttl)} must be at least "
                f"one heartbeat interval ({ENV_PREFIX}HEARTBEAT_INTERVAL="
                f"{format_duration(self.heartbeat_interval)})"
            )
        if self.missing_grace_period < 2 * self.report_interval:
            raise SettingsError(
                f"{ENV_PREFIX}MISSING_GRACE_PERIOD={format_duration(self.missing_grace_period)} "
                f"must cover at least two report intervals ({ENV_PREFIX}REPORT_INTERVAL="
                f"{format_duration(self.report_interval)}, so at least "
                f"{format_duration(2 * self.report_interval)})"
            )
        if not self.database_url:
            self.database_url = f"sqlite:///{DEFAULT_DATABASE_PATH}"
        return self

    @property
    def embedded(self) -> bool:
        return not self.broker_url

    def control_plane_signing_key(self):
        """The control plane's private key (GCWORKER_CONTROL_PLANE_KEY_FILE), or None."""
        if self.control_plane_key_file is None:
            return None
        from gcworker.signing import load_private_key

        return load_private_key(self.control_plane_key_file)

    def require_control_plane_key(self, role: str) -> None:
        """Rule 15: with a broker, a reconciler signs what it tells workers and a reporter
        believes only what the control plane signed, unless unsigned answers are allowed."""
        if self.embedded or self.allow_unsigned:
            return
        name, present = (
            ("CONTROL_PLANE_PUBLIC_KEY", self.control_plane_public_key)
            if role == "reporter"
            else ("CONTROL_PLANE_KEY_FILE", self.control_plane_key_file)
        )
        if present is None:
            raise SettingsError(
                f"{ENV_PREFIX}{name} is not set: with a broker, the {role} needs the control "
                "plane's key (make one with `gcworker keys generate-control-plane --out FILE`), "
                f"or {ENV_PREFIX}ALLOW_UNSIGNED=true"
            )


# Settings that are secrets: each may be read from the file GCWORKER_<NAME>_FILE names (compose
# secrets, systemd credentials) instead of an environment value; an error never shows one.
SECRET_SETTINGS = ("database_url", "broker_url", "flower_basic_auth")


def _secrets_from_files(overrides: dict) -> dict:
    read = {}
    for name in SECRET_SETTINGS:
        variable = f"{ENV_PREFIX}{name.upper()}"
        path = os.environ.get(f"{variable}_FILE")
        if not path or name in overrides:
            continue
        if os.environ.get(variable):
            raise SettingsError(f"both {variable} and {variable}_FILE are set: keep one")
        try:
            read[name] = Path(path).read_text().strip()
        except OSError as error:
            raise SettingsError(
                f"{variable}_FILE={path}: cannot read it: {error.strerror}"
            ) from None
    return read


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment (secrets possibly from files), with `overrides` (CLI
    flags) on top; raises SettingsError."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    overrides = {**_secrets_from_files(overrides), **overrides}
    try:
        settings = Settings(**overrides)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        message = first["msg"].removeprefix("Value error, ")
        if not field:  # raised by the model validator: the message already names the settings
            raise SettingsError(message) from None
        value = overrides.get(field, first.get("input"))
        if field.endswith("_url"):
            value = without_password(value)
        elif field in SECRET_SETTINGS:
            value = "***"
        raise SettingsError(f"{ENV_PREFIX}{field.upper()}={value}: {message}") from None
    if settings.allow_unsigned:
        log.warning(
            f"{ENV_PREFIX}ALLOW_UNSIGNED=true: unsigned messages are accepted, and reporters "
            "accept unsigned answers, so any host that reaches the broker can speak for any "
            "worker, and for the control plane"
        )
    return settings
