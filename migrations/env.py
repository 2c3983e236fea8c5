"""Alembic environment: migrates the database that gcworker's settings name (or the URL that
`gcworker migrate` passes in the config)."""

from alembic import context

from gcworker.db.database import create_database_engine
from gcworker.db.tables import metadata
from gcworker.settings import load_settings

config = context.config


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or load_settings().database_url
    engine = create_database_engine(url)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported: run `gcworker migrate`")
run_migrations()
