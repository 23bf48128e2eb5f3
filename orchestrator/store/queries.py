"""Read-only queries the admin API needs beyond the store's own operations.

Kept apart from the table mixins: these are views for operators (a chat's
sessions, its transcript, search, active days, an agent's shares), not
operations the turn loop depends on. Every function takes a `Store` and reads
through its connection API (`Database.read`), so each sees one snapshot.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from orchestrator.store import (
    ApiKey,
    Conversation,
    ConversationId,
    MessageId,
    MessageState,
    Session,
    Share,
    Store,
)
from orchestrator.store._base import opt_ts, sha256_hex, ts
from orchestrator.store.admin import key_from_row
from orchestrator.store.db import Database
from orchestrator.store.messages import conversation_from_row
from orchestrator.store.resources import share_from_row
from orchestrator.store.sessions import SESSION_SELECT, session_from_row

__all__ = [
    "ActiveDay",
    "TranscriptEntry",
    "active_days",
    "conversation_by_dir_name",
    "key_by_secret",
    "search_messages",
    "sessions_of",
    "shares_of_agent",
    "transcript",
]

MAX_LIMIT = 500


@dataclass(frozen=True, slots=True)
class TranscriptEntry:
    """One inbound message and, once answered, its reply."""

    conversation_id: ConversationId
    message_id: MessageId
    sender: str
    text: str
    received_at: float
    state: MessageState
    reply: str | None
    replied_at: float | None
    delivered_at: float | None


@dataclass(frozen=True, slots=True)
class ActiveDay:
    day: str
    """`YYYY-MM-DD`, in UTC."""
    messages: int


def _db(store: Store) -> Database:
    return store._db


def _limit(limit: int) -> int:
    return max(1, min(int(limit), MAX_LIMIT))


def _entry(row: sqlite3.Row) -> TranscriptEntry:
    return TranscriptEntry(
        conversation_id=ConversationId(row["conversation_id"]),
        message_id=MessageId(row["id"]),
        sender=row["sender"],
        text=row["text"],
        received_at=ts(row["received_at"]),
        state=MessageState(row["state"]),
        reply=row["reply"],
        replied_at=opt_ts(row["replied_at"]),
        delivered_at=opt_ts(row["delivered_at"]),
    )


_TRANSCRIPT_SELECT = (
    "SELECT m.id, m.conversation_id, m.sender, m.text, m.received_at, m.state,"
    " r.text AS reply, r.created_at AS replied_at, r.delivered_at"
    " FROM messages m LEFT JOIN replies r ON r.message_id = m.id"
)


def _like(q: str) -> str:
    """A LIKE pattern that matches `q` literally (escape char `\\`)."""
    escaped = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def conversation_by_dir_name(store: Store, agent: str, dir_name: str) -> Conversation | None:
    with _db(store).read() as c:
        row = c.execute(
            "SELECT * FROM conversations WHERE agent = ? AND dir_name = ?", (agent, dir_name)
        ).fetchone()
    return None if row is None else conversation_from_row(row)


def sessions_of(store: Store, conversation: ConversationId) -> list[Session]:
    """Every session of a conversation, live or ended, oldest first."""
    with _db(store).read() as c:
        rows = c.execute(
            f"{SESSION_SELECT} WHERE s.conversation_id = ? ORDER BY s.started_at, s.rowid",
            (conversation,),
        ).fetchall()
    return [session_from_row(r) for r in rows]


def transcript(
    store: Store,
    conversation: ConversationId,
    *,
    q: str | None = None,
    before: int | None = None,
    limit: int = 100,
) -> list[TranscriptEntry]:
    """A conversation's messages with their replies, newest first; `q` filters by substring."""
    where = "m.conversation_id = ?1 AND (?2 IS NULL OR m.id < ?2)"
    args: list[object] = [conversation, before]
    if q:
        where += " AND (m.text LIKE ?3 ESCAPE '\\' OR r.text LIKE ?3 ESCAPE '\\')"
        args.append(_like(q))
    with _db(store).read() as c:
        rows = c.execute(
            f"{_TRANSCRIPT_SELECT} WHERE {where} ORDER BY m.id DESC LIMIT {_limit(limit)}",
            args,
        ).fetchall()
    return [_entry(r) for r in rows]


def search_messages(
    store: Store, agent: str, q: str, *, channel: str | None = None, limit: int = 100
) -> list[TranscriptEntry]:
    """Messages (or their replies) of any chat of `agent` containing `q`, newest first."""
    with _db(store).read() as c:
        rows = c.execute(
            f"{_TRANSCRIPT_SELECT} JOIN conversations c ON c.id = m.conversation_id"
            " WHERE c.agent = ?1 AND (?2 IS NULL OR c.channel = ?2)"
            " AND (m.text LIKE ?3 ESCAPE '\\' OR r.text LIKE ?3 ESCAPE '\\')"
            f" ORDER BY m.id DESC LIMIT {_limit(limit)}",
            (agent, channel, _like(q)),
        ).fetchall()
    return [_entry(r) for r in rows]


def active_days(store: Store, conversation: ConversationId) -> list[ActiveDay]:
    """The UTC days on which the conversation received messages, oldest first."""
    with _db(store).read() as c:
        rows = c.execute(
            "SELECT date(received_at, 'unixepoch') AS day, count(*) AS n FROM messages"
            " WHERE conversation_id = ? GROUP BY day ORDER BY day",
            (conversation,),
        ).fetchall()
    return [ActiveDay(day=r["day"], messages=int(r["n"])) for r in rows]


def key_by_secret(store: Store, secret: str) -> ApiKey | None:
    """The key with this secret, revoked or not (so a revoked key is told it is revoked)."""
    with _db(store).read() as c:
        row = c.execute(
            "SELECT * FROM api_keys WHERE key_sha256 = ?", (sha256_hex(secret),)
        ).fetchone()
    return None if row is None else key_from_row(row)


def shares_of_agent(
    store: Store,
    agent: str | None,
    *,
    channel: str | None = None,
    include_revoked: bool = True,
) -> list[tuple[Share, Conversation]]:
    """Shares of every conversation of `agent` (None: of every agent), oldest first."""
    with _db(store).read() as c:
        rows = c.execute(
            "SELECT s.*, c.agent AS c_agent, c.channel AS c_channel, c.chat_id AS c_chat_id,"
            " c.dir_name AS c_dir_name, c.created_at AS c_created_at,"
            " c.last_active_at AS c_last_active_at"
            " FROM shares s JOIN conversations c ON c.id = s.conversation_id"
            " WHERE (?1 IS NULL OR c.agent = ?1) AND (?2 IS NULL OR c.channel = ?2)"
            " AND (?3 OR s.revoked_at IS NULL) ORDER BY s.created_at, s.rowid",
            (agent, channel, int(include_revoked)),
        ).fetchall()
    out: list[tuple[Share, Conversation]] = []
    for r in rows:
        out.append((share_from_row(r), conversation_from_row(r, "c_", "conversation_id")))
    return out
