"""Schema migrations (Alembic, `migrations/` at the project's top level): upgrade, downgrade, and
the check every command makes that the database is at the newest schema."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from gcworker.errors import GcworkerError

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaOutOfDate(GcworkerError):
    pass


def _config(engine: Engine) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise GcworkerError(
            f"migrations not found at {MIGRATIONS_DIR} (install with pip install -e .)"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; returns (revision before, revision after). Safe to run twice."""
    before = current_revision(engine)
    config = _config(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    return before, current_revision(engine)


def downgrade(engine: Engine, revision: str) -> None:
    config = _config(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config(None)).get_current_head()


def require_current(engine: Engine) -> None:
    current, head = current_revision(engine), head_revision()
    if current != head:
        state = "has no gcworker schema" if current is None else f"is at schema {current}"
        raise SchemaOutOfDate(
            f"the database {state}, not the newest ({head}): run `gcworker migrate`"
        )
