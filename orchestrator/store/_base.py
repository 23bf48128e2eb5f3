"""What every part of the store shares: the database, the clock, row helpers."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from cellgate.errors import NotFound, StateConflict
from orchestrator.store.db import Database
from orchestrator.store.walsync import SyncTicket

Clock = Callable[[], float]


class StoreBase:
    def __init__(self, db: Database, clock: Clock = time.time) -> None:
        self._db = db
        self._clock = clock

    def _now(self) -> float:
        return float(self._clock())

    def deferred_sync(self) -> AbstractContextManager[SyncTicket]:
        """Durable writes inside skip their own fsync until `sync` (`Database.deferred_sync`)."""
        return self._db.deferred_sync()

    def sync(self, ticket: SyncTicket) -> None:
        """Blocking: the writes `ticket` covers are on disk (one fsync shared by many)."""
        self._db.sync(ticket)


def ts(value: Any) -> float:
    """A timestamp column as float: `RETURNING` hands back a whole REAL as an int."""
    return float(value)


def opt_ts(value: Any) -> float | None:
    return None if value is None else float(value)


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def conflict(
    conn: sqlite3.Connection,
    *,
    kind: str,
    sql: str,
    key: object,
    expected: str,
) -> NotFound | StateConflict:
    """Explain why a guarded UPDATE changed nothing; `sql` selects the actual state by key."""
    row = conn.execute(sql, (key,)).fetchone()
    if row is None:
        return NotFound(kind, key)
    return StateConflict(kind, key, expected, str(row[0]))
