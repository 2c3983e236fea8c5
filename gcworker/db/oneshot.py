"""One statement as its own transaction: the cheapest way to ask or tell the database one thing.

On PostgreSQL it runs on the database's autocommit engine, on the connection the thread holds
there (no checkout, no BEGIN, no COMMIT, no liveness ping: one round trip), falling back to an
ordinary transaction when that connection turns out dead (SQLAlchemy drops it from the pool
then) or there is no such engine (SQLite).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import DBAPIError


def execute_one(db, statement, params: dict[str, Any], *, prepared: str | None = None):
    """The first row of `statement` (or None), read in a transaction of its own. `prepared`
    names it as a server-side prepared statement of each connection (`Database.execute_prepared`:
    parsed and planned once; only for a statement whose plan does not depend on its values)."""
    if db.autocommit_engine is not None:
        try:
            with db.autocommit() as conn:
                if prepared:
                    return db.execute_prepared(conn, prepared, statement, params).first()
                return conn.execute(statement, params).first()
        except DBAPIError as error:
            if not error.connection_invalidated:
                raise
    with db.transaction() as conn:
        return conn.execute(statement, params).first()
