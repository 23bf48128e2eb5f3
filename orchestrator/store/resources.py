"""Sandboxes, shares and the attachment ledger: what a conversation owns outside itself."""

from __future__ import annotations

import secrets
import sqlite3

from cellgate.errors import NotFound, StateConflict
from orchestrator.store._base import opt_ts, sha256_hex, ts
from orchestrator.store.messages import remember
from orchestrator.store.models import (
    ConversationId,
    Sandbox,
    SandboxState,
    SessionId,
    Share,
    ShareId,
)
from orchestrator.store.sessions import SessionsMixin

_SHARE_ID_PREFIX = "sh_"


def _sandbox(row: sqlite3.Row) -> Sandbox:
    return Sandbox(
        name=row["name"],
        conversation_id=ConversationId(row["conversation_id"]),
        app=row["app"],
        agent=row["agent"],
        spec_hash=row["spec_hash"],
        state=SandboxState(row["state"]),
        created_at=ts(row["created_at"]),
        last_used_at=ts(row["last_used_at"]),
    )


def share_from_row(row: sqlite3.Row) -> Share:
    return Share(
        id=ShareId(row["id"]),
        session_id=SessionId(row["session_id"]),
        conversation_id=ConversationId(row["conversation_id"]),
        path=row["path"],
        created_at=ts(row["created_at"]),
        revoked_at=opt_ts(row["revoked_at"]),
        revoked_by=row["revoked_by"],
    )


class ResourcesMixin(SessionsMixin):
    # -- sandboxes -----------------------------------------------------------

    def record_sandbox(
        self,
        name: str,
        *,
        conversation: ConversationId,
        app: str,
        agent: str,
        spec_hash: str,
        state: SandboxState = SandboxState.RUNNING,
    ) -> Sandbox:
        """Insert or update a sandbox row; a changed spec hash counts as a new container.

        Committed without an fsync of its own: a power cut that loses it stops the
        container too (no restart policy), and the reaper and the reconcile at start
        work from the engine's list of containers, not from these rows (D2)."""
        now = self._now()
        with self._db.write(durable=False) as c:
            row = c.execute(
                "INSERT INTO sandboxes (name, conversation_id, app, agent, spec_hash, state,"
                " created_at, last_used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET"
                "  created_at = CASE WHEN spec_hash = excluded.spec_hash"
                "               THEN created_at ELSE excluded.created_at END,"
                "  conversation_id = excluded.conversation_id, app = excluded.app,"
                "  agent = excluded.agent, spec_hash = excluded.spec_hash,"
                "  state = excluded.state, last_used_at = excluded.last_used_at"
                " RETURNING *",
                (name, conversation, app, agent, spec_hash, state, now, now),
            ).fetchone()
        return _sandbox(row)

    def touch_sandbox(self, name: str) -> Sandbox:
        with self._db.write() as c:
            row = c.execute(
                "UPDATE sandboxes SET last_used_at = ? WHERE name = ? RETURNING *",
                (self._now(), name),
            ).fetchone()
        if row is None:
            raise NotFound("sandbox", name)
        return _sandbox(row)

    def forget_sandbox(self, name: str) -> bool:
        """Drop the row of a removed container; False if there was none."""
        with self._db.write() as c:
            return bool(c.execute("DELETE FROM sandboxes WHERE name = ?", (name,)).rowcount)

    def get_sandbox(self, name: str) -> Sandbox | None:
        with self._db.read() as c:
            row = c.execute("SELECT * FROM sandboxes WHERE name = ?", (name,)).fetchone()
        return None if row is None else _sandbox(row)

    def sandboxes(self, app: str | None = None) -> list[Sandbox]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM sandboxes WHERE ?1 IS NULL OR app = ?1 ORDER BY name", (app,)
            ).fetchall()
        return [_sandbox(r) for r in rows]

    # -- shares --------------------------------------------------------------

    def create_share(self, session_id: SessionId, path: str) -> tuple[Share, str]:
        """Record a share made by a session; returns the row and the token, shown once.

        Only the token's sha256 is stored: the token is the capability for a
        public fetch, and a copy of the database must not grant it.
        """
        token = secrets.token_urlsafe(32)
        share_id = ShareId(_SHARE_ID_PREFIX + secrets.token_hex(8))
        with self._db.write() as c:
            row = c.execute(
                "INSERT INTO shares (id, token_sha256, session_id, conversation_id, path,"
                " created_at) SELECT ?, ?, id, conversation_id, ?, ? FROM sessions WHERE id = ?"
                " RETURNING *",
                (share_id, sha256_hex(token), path, self._now(), session_id),
            ).fetchone()
            if row is None:
                raise NotFound("session", session_id)
        return share_from_row(row), token

    def get_share_by_token(self, token: str, *, include_revoked: bool = False) -> Share | None:
        """The share a token opens; None for an unknown or (by default) revoked one."""
        with self._db.read() as c:
            row = c.execute(
                "SELECT * FROM shares WHERE token_sha256 = ?", (sha256_hex(token),)
            ).fetchone()
        if row is None:
            return None
        share = share_from_row(row)
        return share if include_revoked or share.active else None

    def get_share(self, share_id: ShareId) -> Share | None:
        with self._db.read() as c:
            row = c.execute("SELECT * FROM shares WHERE id = ?", (share_id,)).fetchone()
        return None if row is None else share_from_row(row)

    def revoke_share(self, token_or_id: str, *, revoked_by: str) -> Share:
        """Revoke by share id or by token, recording who did (P6 is decided by the caller).

        Raises `NotFound` for neither, `StateConflict` if already revoked.
        """
        key = token_or_id
        with self._db.write() as c:
            row = c.execute(
                "SELECT id, revoked_at FROM shares WHERE id = ? OR token_sha256 = ?",
                (key, sha256_hex(key)),
            ).fetchone()
            if row is None:
                raise NotFound("share", key if key.startswith(_SHARE_ID_PREFIX) else "(token)")
            if row["revoked_at"] is not None:
                raise StateConflict("share", row["id"], "active", "revoked")
            updated = c.execute(
                "UPDATE shares SET revoked_at = ?, revoked_by = ? WHERE id = ?"
                " AND revoked_at IS NULL RETURNING *",
                (self._now(), revoked_by, row["id"]),
            ).fetchone()
        return share_from_row(updated)

    def list_shares(
        self, conversation: ConversationId | None = None, *, include_revoked: bool = True
    ) -> list[Share]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM shares WHERE (?1 IS NULL OR conversation_id = ?1)"
                " AND (?2 OR revoked_at IS NULL) ORDER BY created_at, rowid",
                (conversation, int(include_revoked)),
            ).fetchall()
        return [share_from_row(r) for r in rows]

    # -- attachment ledger (P3) ---------------------------------------------

    def remember_attachment(
        self, conversation: ConversationId, file_id: str, *, platform: str = "telegram"
    ) -> None:
        """Note a file id delivered in this chat; keep only the newest 200 per chat.

        Seeing a file id again makes it the newest. Insert and prune are one transaction.
        """
        with self._db.write() as c:
            remember(c, conversation, file_id, platform, self._now())

    def attachment_known(
        self, conversation: ConversationId, file_id: str, *, platform: str = "telegram"
    ) -> bool:
        """Was this file id delivered in this chat (and still among its newest 200)? P3."""
        with self._db.read() as c:
            row = c.execute(
                "SELECT 1 FROM attachments WHERE conversation_id = ? AND platform = ?"
                " AND file_id = ?",
                (conversation, platform, file_id),
            ).fetchone()
        return row is not None
