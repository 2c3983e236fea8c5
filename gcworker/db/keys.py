"""Every SQL statement on workers' public keys and on the dead-letter list."""

from __future__ import annotations

import functools
from datetime import datetime

from sqlalchemy import Connection, bindparam, delete, select, update

from gcworker.db.tables import dead_letters, worker_keys
from gcworker.errors import Conflict, NotFound

EXCERPT_CHARS = 512
REASON_CHARS = 1024


class KeyRepository:
    def register(
        self, conn: Connection, worker: str, public_key: str, now: datetime, *, replace: bool
    ) -> None:
        existing = conn.execute(
            select(worker_keys.c.revoked_at).where(worker_keys.c.worker_name == worker)
        ).one_or_none()
        if existing is not None and existing.revoked_at is None and not replace:
            raise Conflict(
                f"worker {worker!r} already has an active key: revoke it first, or pass --replace"
            )
        conn.execute(delete(worker_keys).where(worker_keys.c.worker_name == worker))
        conn.execute(
            worker_keys.insert().values(worker_name=worker, public_key=public_key, created_at=now)
        )

    def active(self, conn: Connection, worker: str) -> str | None:
        return conn.execute(active_key_statement(), {"p_worker": worker}).scalar_one_or_none()

    def revoke(self, conn: Connection, worker: str, now: datetime) -> None:
        revoked = conn.execute(
            update(worker_keys)
            .where(worker_keys.c.worker_name == worker, worker_keys.c.revoked_at.is_(None))
            .values(revoked_at=now)
        ).rowcount
        if not revoked:
            raise NotFound(f"worker {worker!r} has no active key")

    def list(self, conn: Connection) -> list[dict]:
        query = select(worker_keys).order_by(worker_keys.c.worker_name)
        return [dict(r._mapping) for r in conn.execute(query)]


def active_key_select(worker):
    """The active public key of `worker` (a bind parameter): one row or none. A revoked key is
    never active; a replaced one is gone."""
    return select(worker_keys.c.public_key).where(
        worker_keys.c.worker_name == worker, worker_keys.c.revoked_at.is_(None)
    )


@functools.cache
def active_key_statement():
    """`active_key_select` of `p_worker`, built once: every message runs it."""
    return active_key_select(bindparam("p_worker"))


class DeadLetterRepository:
    def add(
        self,
        conn: Connection,
        *,
        now: datetime,
        worker: str | None,
        reason: str,
        payload: str,
        keep: int,
    ) -> None:
        """Keep a rejected message's reason and an excerpt; only the newest `keep` are kept.
        What a hostile message says is stored bounded, and as text the database takes."""
        conn.execute(
            dead_letters.insert().values(
                at=now,
                worker_name=storable(worker, dead_letters.c.worker_name.type.length),
                reason=storable(reason, REASON_CHARS),
                excerpt=storable(payload, EXCERPT_CHARS),
            )
        )
        newest = select(dead_letters.c.id).order_by(dead_letters.c.id.desc()).limit(keep)
        conn.execute(delete(dead_letters).where(dead_letters.c.id.not_in(newest.scalar_subquery())))

    def list(self, conn: Connection, limit: int | None = None) -> list[dict]:
        query = select(dead_letters).order_by(dead_letters.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        return [dict(r._mapping) for r in conn.execute(query)]


def storable(text: str | None, limit: int) -> str | None:
    """`text` in `limit` characters at most (a longer one cut, ending in "…"), its NUL and lone
    surrogates escaped (`\\x00`, `\\ud800`): PostgreSQL stores neither."""
    if text is None:
        return None
    text = text[: limit + 1].encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00")
    return text if len(text) <= limit else text[: limit - 1] + "…"
