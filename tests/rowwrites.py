"""Counting the rows a statement really writes, on SQLite and PostgreSQL alike.

Triggers on `containers` and `volumes` add one to a counter for every row inserted, updated or
deleted, whether or not the update changed a value: the database itself does the counting, so a
write that a statement hides (a no-op `SET missing_since = NULL`, a cascade) is still seen.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import text

from gcworker.db.database import Database

COUNTED_TABLES = ("containers", "volumes")


def install_row_write_counter(db: Database) -> Callable[[], int]:
    """Install the triggers; returns a function that reads the number of rows written so far."""
    with db.transaction() as conn:
        conn.execute(text("CREATE TABLE test_row_writes (n INTEGER NOT NULL)"))
        conn.execute(text("INSERT INTO test_row_writes (n) VALUES (0)"))
        if db.is_postgresql:
            conn.execute(
                text(
                    "CREATE FUNCTION test_count_row_write() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN UPDATE test_row_writes SET n = n + 1; RETURN NULL; END $$"
                )
            )
            for table in COUNTED_TABLES:
                conn.execute(
                    text(
                        f"CREATE TRIGGER test_count_{table} AFTER INSERT OR UPDATE OR DELETE "
                        f"ON {table} FOR EACH ROW EXECUTE FUNCTION test_count_row_write()"
                    )
                )
        else:
            for table in COUNTED_TABLES:
                for operation in ("INSERT", "UPDATE", "DELETE"):
                    conn.execute(
                        text(
                            f"CREATE TRIGGER test_count_{operation.lower()}_{table} "
                            f"AFTER {operation} ON {table} FOR EACH ROW "
                            "BEGIN UPDATE test_row_writes SET n = n + 1; END"
                        )
                    )

    def rows_written() -> int:
        with db.engine.connect() as conn:
            return conn.execute(text("SELECT n FROM test_row_writes")).scalar_one()

    return rows_written
