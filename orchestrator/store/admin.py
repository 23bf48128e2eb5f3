"""Cron jobs, API keys and the audit of refusals: the operator's side of the store.

API keys: a secret is `cg_` + `secrets.token_urlsafe(32)` (256 random bits),
shown once by `create_key`. The store keeps only its sha256. A slow password
hash (scrypt, PBKDF2) protects guessable secrets; against 256 random bits a
single sha256 is already out of reach of brute force, and it lets a request
find its key by an indexed lookup instead of hashing against every row.
"""

from __future__ import annotations

import hmac
import json
import secrets
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from cellgate.errors import NotFound, StateConflict, StoreError
from orchestrator.store._base import conflict, dumps, opt_ts, sha256_hex, ts
from orchestrator.store.models import (
    ApiKey,
    ConversationId,
    CronJob,
    CronJobId,
    CronType,
    KeyId,
    Refusal,
    ScheduleKind,
    SessionId,
)
from orchestrator.store.resources import ResourcesMixin

KEY_PREFIX = "cg_"
_DISPLAY_CHARS = 8  # after "cg_": 48 of 256 bits, enough to tell keys apart
_SECRET_LEN = len(KEY_PREFIX) + 43  # token_urlsafe(32) is 43 characters


def _cron(row: sqlite3.Row) -> CronJob:
    return CronJob(
        id=CronJobId(row["id"]),
        agent=row["agent"],
        type=CronType(row["type"]),
        schedule=row["schedule"],
        payload=row["payload"],
        one_shot=bool(row["one_shot"]),
        enabled=bool(row["enabled"]),
        created_at=ts(row["created_at"]),
        last_run_at=opt_ts(row["last_run_at"]),
        name=row["name"],
        schedule_kind=ScheduleKind(row["schedule_kind"]),
        timezone=row["timezone"],
        channel=row["channel"],
        chat_id=row["chat_id"],
        timeout_seconds=float(row["timeout_seconds"]),
        next_run_at=opt_ts(row["next_run_at"]),
        runs=int(row["runs"]),
        last_status=row["last_status"],
        last_output=row["last_output"],
    )


def key_from_row(row: sqlite3.Row) -> ApiKey:
    return ApiKey(
        id=KeyId(row["id"]),
        name=row["name"],
        prefix=row["prefix"],
        agents=tuple(json.loads(row["agents"])),
        admin=bool(row["admin"]),
        write=bool(row["write"]),
        created_at=ts(row["created_at"]),
        last_used_at=opt_ts(row["last_used_at"]),
        revoked_at=opt_ts(row["revoked_at"]),
    )


def _refusal(row: sqlite3.Row) -> Refusal:
    conv, sess = row["conversation_id"], row["session_id"]
    return Refusal(
        id=row["id"],
        at=ts(row["at"]),
        conversation_id=None if conv is None else ConversationId(conv),
        session_id=None if sess is None else SessionId(sess),
        rule=row["rule"],
        action=row["action"],
        reason=row["reason"],
        detail=json.loads(row["detail"]),
    )


class AdminMixin(ResourcesMixin):
    # -- cron jobs (policy, e.g. C1/C2, is decided elsewhere) -----------------

    def create_cron_job(
        self,
        agent: str,
        type: CronType,
        schedule: str,
        payload: str,
        *,
        one_shot: bool = False,
        enabled: bool = True,
        name: str = "",
        schedule_kind: ScheduleKind = ScheduleKind.CRON,
        timezone: str = "UTC",
        channel: str | None = None,
        chat_id: str | None = None,
        timeout_seconds: float = 60.0,
        next_run_at: float | None = None,
    ) -> CronJob:
        job_id = CronJobId("cron_" + secrets.token_hex(8))
        with self._db.write() as c:
            row = c.execute(
                "INSERT INTO cron_jobs (id, agent, type, schedule, payload, one_shot, enabled,"
                " created_at, name, schedule_kind, timezone, channel, chat_id, timeout_seconds,"
                " next_run_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING *",
                (job_id, agent, type, schedule, payload, one_shot, enabled, self._now(), name,
                 schedule_kind, timezone, channel, chat_id, timeout_seconds, next_run_at),
            ).fetchone()  # fmt: skip
        return _cron(row)

    def get_cron_job(self, job_id: CronJobId) -> CronJob | None:
        with self._db.read() as c:
            row = c.execute("SELECT * FROM cron_jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _cron(row)

    def cron_jobs(self, agent: str | None = None) -> list[CronJob]:
        """Read only: listing never touches a row, so a skipped job stays as it was (C1)."""
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM cron_jobs WHERE ?1 IS NULL OR agent = ?1 ORDER BY created_at, rowid",
                (agent,),
            ).fetchall()
        return [_cron(r) for r in rows]

    def count_cron_jobs(self, agent: str) -> int:
        with self._db.read() as c:
            return int(
                c.execute("SELECT count(*) FROM cron_jobs WHERE agent = ?", (agent,)).fetchone()[0]
            )

    def due_cron_jobs(self, now: float, limit: int = 100) -> list[CronJob]:
        """Enabled jobs due at `now`, oldest due first. Read only (C1: a skipped job stays)."""
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM cron_jobs WHERE enabled AND next_run_at IS NOT NULL"
                " AND next_run_at <= ? ORDER BY next_run_at, rowid LIMIT ?",
                (now, limit),
            ).fetchall()
        return [_cron(r) for r in rows]

    def next_cron_due(self) -> float | None:
        """The earliest `next_run_at` of an enabled job, or None."""
        with self._db.read() as c:
            row = c.execute(
                "SELECT min(next_run_at) FROM cron_jobs WHERE enabled AND next_run_at IS NOT NULL"
            ).fetchone()
        return opt_ts(row[0])

    def update_cron_job(
        self,
        job_id: CronJobId,
        *,
        schedule: str | None = None,
        payload: str | None = None,
        enabled: bool | None = None,
        next_run_at: float | None = None,
    ) -> CronJob:
        with self._db.write() as c:
            row = c.execute(
                "UPDATE cron_jobs SET schedule = coalesce(?, schedule),"
                " payload = coalesce(?, payload), enabled = coalesce(?, enabled),"
                " next_run_at = coalesce(?, next_run_at)"
                " WHERE id = ? RETURNING *",
                (schedule, payload, enabled, next_run_at, job_id),
            ).fetchone()
        if row is None:
            raise NotFound("cron job", job_id)
        return _cron(row)

    def mark_cron_run(
        self,
        job_id: CronJobId,
        *,
        next_run_at: float | None = None,
        status: str | None = None,
        due: float | None = None,
    ) -> CronJob:
        """The scheduler ran an enabled job; a one-shot job is used up (disabled) by this.

        `next_run_at` is when a recurring job is due next (kept if None). With
        `due`, the row changes only if it is still due then: a run that raced a
        pause, a delete or another gateway changes nothing (`StateConflict`).
        """
        with self._db.write() as c:
            row = c.execute(
                "UPDATE cron_jobs SET last_run_at = ?, runs = runs + 1,"
                " last_status = coalesce(?, last_status),"
                " next_run_at = CASE WHEN one_shot THEN NULL"
                "   ELSE coalesce(?, next_run_at) END,"
                " enabled = CASE WHEN one_shot THEN 0 ELSE enabled END"
                " WHERE id = ? AND enabled AND (? IS NULL OR next_run_at = ?) RETURNING *",
                (self._now(), status, next_run_at, job_id, due, due),
            ).fetchone()
            if row is None:
                raise conflict(
                    c,
                    kind="cron job",
                    sql="SELECT CASE WHEN enabled THEN 'ran already' ELSE 'disabled' END"
                    " FROM cron_jobs WHERE id = ?",
                    key=job_id,
                    expected="enabled and due",
                )
        return _cron(row)

    def record_cron_result(self, job_id: CronJobId, status: str, output: str) -> None:
        """What the last run of a job did (a command's exit and its capped output)."""
        with self._db.write() as c:
            c.execute(
                "UPDATE cron_jobs SET last_status = ?, last_output = ? WHERE id = ?",
                (status, output, job_id),
            )

    def delete_cron_job(self, job_id: CronJobId) -> bool:
        with self._db.write() as c:
            return bool(c.execute("DELETE FROM cron_jobs WHERE id = ?", (job_id,)).rowcount)

    # -- API keys ------------------------------------------------------------

    def create_key(
        self, name: str, agents: Sequence[str], *, admin: bool = False, write: bool = False
    ) -> tuple[ApiKey, str]:
        """A new key; returns its row and the secret, which is never stored or shown again."""
        if isinstance(agents, str):
            raise StoreError("agents must be a list of agent ids (or ['*']), not one string")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = KeyId("key_" + secrets.token_hex(8))
        prefix = secret[: len(KEY_PREFIX) + _DISPLAY_CHARS]
        with self._db.write() as c:
            row = c.execute(
                "INSERT INTO api_keys (id, name, key_sha256, prefix, agents, admin, write,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING *",
                (key_id, name, sha256_hex(secret), prefix, dumps(list(agents)), admin, write,
                 self._now()),
            ).fetchone()  # fmt: skip
        return key_from_row(row), secret

    def lookup_key(self, secret: str) -> ApiKey | None:
        """The active key with this secret, or None (unknown, malformed or revoked)."""
        if len(secret) != _SECRET_LEN or not secret.startswith(KEY_PREFIX):
            return None
        digest = sha256_hex(secret)
        with self._db.read() as c:
            row = c.execute(
                "SELECT * FROM api_keys WHERE key_sha256 = ? AND revoked_at IS NULL",
                (digest,),
            ).fetchone()
        if row is None or not hmac.compare_digest(row["key_sha256"], digest):
            return None
        return key_from_row(row)

    def touch_key(self, key_id: KeyId) -> None:
        with self._db.write() as c:
            changed = c.execute(
                "UPDATE api_keys SET last_used_at = ? WHERE id = ?", (self._now(), key_id)
            ).rowcount
        if not changed:
            raise NotFound("API key", key_id)

    def revoke_key(self, key_id: KeyId) -> ApiKey:
        with self._db.write() as c:
            row = c.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL"
                " RETURNING *",
                (self._now(), key_id),
            ).fetchone()
            if row is None:
                found = c.execute("SELECT 1 FROM api_keys WHERE id = ?", (key_id,)).fetchone()
                if found is None:
                    raise NotFound("API key", key_id)
                raise StateConflict("API key", key_id, "active", "revoked")
        return key_from_row(row)

    def list_keys(self, *, include_revoked: bool = True) -> list[ApiKey]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM api_keys WHERE ? OR revoked_at IS NULL ORDER BY created_at, rowid",
                (int(include_revoked),),
            ).fetchall()
        return [key_from_row(r) for r in rows]

    # -- audit of refusals ---------------------------------------------------

    def record_refusal(
        self,
        *,
        rule: str,
        action: str,
        reason: str,
        conversation: ConversationId | None = None,
        session_id: SessionId | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Refusal:
        with self._db.write() as c:
            row = c.execute(
                "INSERT INTO refusals (at, conversation_id, session_id, rule, action, reason,"
                " detail) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING *",
                (self._now(), conversation, session_id, rule, action, reason,
                 dumps(dict(detail or {}))),
            ).fetchone()  # fmt: skip
        return _refusal(row)

    def refusals(
        self, conversation: ConversationId | None = None, *, limit: int = 100
    ) -> list[Refusal]:
        """Newest first."""
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM refusals WHERE ?1 IS NULL OR conversation_id = ?1"
                " ORDER BY id DESC LIMIT ?2",
                (conversation, limit),
            ).fetchall()
        return [_refusal(r) for r in rows]
