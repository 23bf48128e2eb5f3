"""Harness sessions and the turns dispatched in them.

A session's `busy` count is the number of its turns that have started and
not finished; it is computed on every read, never stored, so it cannot drift.
No turn survives a restart: the recovery scan calls `close_open_turns()`.
"""

from __future__ import annotations

import sqlite3
import uuid

from cellgate.errors import NotFound, StoreError
from cellgate.models import SESSION_RE
from orchestrator.store._base import conflict, opt_ts, ts
from orchestrator.store.messages import MessagesMixin
from orchestrator.store.models import (
    ConversationId,
    MessageId,
    MessageState,
    Session,
    SessionId,
    SessionState,
    Turn,
    TurnId,
)

SESSION_SELECT = (
    "SELECT s.*, c.agent AS agent,"
    " (SELECT count(*) FROM turns t WHERE t.session_id = s.id AND t.finished_at IS NULL)"
    " AS busy FROM sessions s JOIN conversations c ON c.id = s.conversation_id"
)


def session_from_row(row: sqlite3.Row) -> Session:
    return Session(
        id=SessionId(row["id"]),
        conversation_id=ConversationId(row["conversation_id"]),
        agent=row["agent"],
        harness=row["harness"],
        harness_session_id=row["harness_session_id"],
        state=SessionState(row["state"]),
        started_at=ts(row["started_at"]),
        last_active_at=ts(row["last_active_at"]),
        ended_at=opt_ts(row["ended_at"]),
        busy=row["busy"],
    )


def _turn(row: sqlite3.Row) -> Turn:
    ok = row["ok"]
    message = row["message_id"]
    return Turn(
        id=TurnId(row["id"]),
        session_id=SessionId(row["session_id"]),
        message_id=None if message is None else MessageId(message),
        harness_turn_id=row["harness_turn_id"],
        ok=None if ok is None else bool(ok),
        started_at=ts(row["started_at"]),
        finished_at=opt_ts(row["finished_at"]),
    )


class SessionsMixin(MessagesMixin):
    def _session_row(self, c: sqlite3.Connection, session_id: SessionId) -> Session:
        row = c.execute(f"{SESSION_SELECT} WHERE s.id = ?", (session_id,)).fetchone()
        if row is None:
            raise NotFound("session", session_id)
        return session_from_row(row)

    def open_session(
        self,
        conversation: ConversationId,
        harness: str,
        *,
        harness_session_id: str | None = None,
        session_id: SessionId | None = None,
    ) -> Session:
        """Start a LIVE session; its id is a fresh uuid unless the caller names one.

        Committed without an fsync of its own (`Database.write(durable=False)`): a
        session lost in a power cut is opened again by the turn recovery runs again."""
        sid = session_id or SessionId(uuid.uuid4().hex)
        if not SESSION_RE.fullmatch(sid):
            raise StoreError(f"session id {sid!r} is not a safe name ([A-Za-z0-9_-]{{1,64}})")
        with self._db.write(durable=False) as c:
            return self._open_session(c, conversation, harness, sid, harness_session_id)

    def _open_session(
        self,
        c: sqlite3.Connection,
        conversation: ConversationId,
        harness: str,
        sid: SessionId,
        harness_session_id: str | None = None,
    ) -> Session:
        now = self._now()
        exists = c.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation,))
        if exists.fetchone() is None:
            raise NotFound("conversation", conversation)
        c.execute(
            "INSERT INTO sessions (id, conversation_id, harness, harness_session_id,"
            " state, started_at, last_active_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (sid, conversation, harness, harness_session_id, SessionState.LIVE, now, now),
        )
        return self._session_row(c, sid)

    def get_session(self, session_id: SessionId) -> Session | None:
        with self._db.read() as c:
            row = c.execute(f"{SESSION_SELECT} WHERE s.id = ?", (session_id,)).fetchone()
        return None if row is None else session_from_row(row)

    def set_harness_session_id(self, session_id: SessionId, harness_session_id: str) -> Session:
        with self._db.write() as c:
            changed = c.execute(
                "UPDATE sessions SET harness_session_id = ?, last_active_at = ? WHERE id = ?",
                (harness_session_id, self._now(), session_id),
            ).rowcount
            if not changed:
                raise NotFound("session", session_id)
            return self._session_row(c, session_id)

    def end_session(self, session_id: SessionId) -> Session:
        """LIVE -> ENDED; raises `StateConflict` if it had already ended."""
        now = self._now()
        with self._db.write() as c:
            changed = c.execute(
                "UPDATE sessions SET state = ?, ended_at = ?, last_active_at = ?"
                " WHERE id = ? AND state = ?",
                (SessionState.ENDED, now, now, session_id, SessionState.LIVE),
            ).rowcount
            if not changed:
                raise conflict(
                    c,
                    kind="session",
                    sql="SELECT state FROM sessions WHERE id = ?",
                    key=session_id,
                    expected=SessionState.LIVE,
                )
            return self._session_row(c, session_id)

    def live_sessions(
        self, agent: str | None = None, *, conversation: ConversationId | None = None
    ) -> list[Session]:
        with self._db.read() as c:
            rows = c.execute(
                f"{SESSION_SELECT} WHERE s.state = 'live' AND (?1 IS NULL OR c.agent = ?1)"
                " AND (?2 IS NULL OR s.conversation_id = ?2) ORDER BY s.started_at, s.rowid",
                (agent, conversation),
            ).fetchall()
        return [session_from_row(r) for r in rows]

    def last_session_end(self, conversation: ConversationId) -> float | None:
        """When the conversation's most recent session ended; None if none has.

        A conversation with a LIVE session may still have an earlier end; the
        reaper (S5) asks `live_sessions(conversation=...)` first.
        """
        with self._db.read() as c:
            row = c.execute(
                "SELECT max(ended_at) FROM sessions WHERE conversation_id = ?", (conversation,)
            ).fetchone()
        value: float | None = row[0]
        return value

    # -- API chats and the key they are bound to (K4, P6) --------------------

    def bind_api_chat(self, conversation: ConversationId, key_ref: str) -> str | None:
        """Bind a new API chat to `key_ref`; the key it is bound to (maybe another).

        A chat already bound keeps its key. A chat that exists but is bound to
        none (started before chats were bound) stays unbound: None.
        """
        if not key_ref:
            raise StoreError("an API chat is bound to a key; the key reference is empty")
        with self._db.write() as c:
            c.execute(
                "INSERT INTO api_chat_keys (conversation_id, key_ref, bound_at)"
                " SELECT ?1, ?2, ?3 WHERE NOT EXISTS"
                " (SELECT 1 FROM conversations WHERE id = ?1) ON CONFLICT DO NOTHING",
                (conversation, key_ref, self._now()),
            )
            row = c.execute(
                "SELECT key_ref FROM api_chat_keys WHERE conversation_id = ?", (conversation,)
            ).fetchone()
        return None if row is None else str(row[0])

    def api_chat_owner(self, conversation: ConversationId) -> str | None:
        """The key an API chat is bound to; None if it is bound to none."""
        with self._db.read() as c:
            row = c.execute(
                "SELECT key_ref FROM api_chat_keys WHERE conversation_id = ?", (conversation,)
            ).fetchone()
        return None if row is None else str(row[0])

    def api_chat_owners(self, agent: str | None = None) -> dict[ConversationId, str]:
        """Every bound API chat (of `agent`, or of all agents) and its key."""
        with self._db.read() as c:
            rows = c.execute(
                "SELECT k.conversation_id, k.key_ref FROM api_chat_keys k"
                " JOIN conversations c ON c.id = k.conversation_id"
                " WHERE ?1 IS NULL OR c.agent = ?1",
                (agent,),
            ).fetchall()
        return {ConversationId(r[0]): str(r[1]) for r in rows}

    # -- turns ---------------------------------------------------------------

    def start_turn(self, session_id: SessionId, message_id: MessageId | None = None) -> Turn:
        """Open a turn in a LIVE session; with a message, move it ACCEPTED -> RUNNING too.

        A heartbeat turn (M4) has no message. Both writes are one transaction, committed
        without an fsync of its own: a start lost in a power cut leaves the message
        ACCEPTED, and recovery runs it again as it does a turn the crash cut short (D2).
        """
        with self._db.write(durable=False) as c:
            return self._start_turn(c, self._session_row(c, session_id), message_id)

    def begin_turn(
        self, conversation: ConversationId, harness: str, message_id: MessageId
    ) -> tuple[Session, Turn]:
        """The conversation's LIVE session (a new one if it has none) and, in it, the
        message's turn started (`start_turn`): one transaction, committed without an fsync
        of its own (F3: one commit for a turn's start, not two). Lost in a power cut, the
        message is ACCEPTED again and recovery runs it (D2)."""
        with self._db.write(durable=False) as c:
            row = c.execute(
                f"{SESSION_SELECT} WHERE s.state = 'live' AND s.conversation_id = ?"
                " ORDER BY s.started_at, s.rowid LIMIT 1",
                (conversation,),
            ).fetchone()
            if row is not None:
                session = session_from_row(row)
            else:
                sid = SessionId(uuid.uuid4().hex)
                session = self._open_session(c, conversation, harness, sid)
            return session, self._start_turn(c, session, message_id)

    def _start_turn(
        self, c: sqlite3.Connection, session: Session, message_id: MessageId | None
    ) -> Turn:
        now = self._now()
        if session.state is not SessionState.LIVE:
            raise StoreError(f"session {session.id} has ended; open a new one for this turn")
        if message_id is not None:
            message = self._transition(c, message_id, MessageState.ACCEPTED, MessageState.RUNNING)
            if message.conversation_id != session.conversation_id:
                raise StoreError(
                    f"message {message_id} belongs to conversation "
                    f"{message.conversation_id}, not to session {session.id}'s"
                )
        c.execute("UPDATE sessions SET last_active_at = ? WHERE id = ?", (now, session.id))
        row = c.execute(
            "INSERT INTO turns (session_id, message_id, started_at) VALUES (?, ?, ?) RETURNING *",
            (session.id, message_id, now),
        ).fetchone()
        return _turn(row)

    def finish_turn(self, turn_id: TurnId, *, ok: bool, harness_turn_id: str | None = None) -> Turn:
        """Close an open turn; raises `StateConflict` if it was already closed.

        Committed without an fsync of its own: the reply recorded next (durable, before
        it is sent) carries it to disk; lost in a power cut before that, the turn runs
        again at recovery (D2)."""
        now = self._now()
        with self._db.write(durable=False) as c:
            row = c.execute(
                "UPDATE turns SET ok = ?, harness_turn_id = coalesce(?, harness_turn_id),"
                " finished_at = ? WHERE id = ? AND finished_at IS NULL RETURNING *",
                (int(ok), harness_turn_id, now, turn_id),
            ).fetchone()
            if row is None:
                raise conflict(
                    c,
                    kind="turn",
                    sql="SELECT 'finished' FROM turns WHERE id = ?",
                    key=turn_id,
                    expected="open",
                )
            c.execute(
                "UPDATE sessions SET last_active_at = ? WHERE id = ?", (now, row["session_id"])
            )
        return _turn(row)

    def turns(self, message_id: MessageId) -> list[Turn]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM turns WHERE message_id = ? ORDER BY id", (message_id,)
            ).fetchall()
        return [_turn(r) for r in rows]

    def close_open_turns(self) -> int:
        """Recovery (D2): a turn open at start-up died with the old process; close it failed."""
        with self._db.write() as c:
            closed = c.execute(
                "UPDATE turns SET ok = 0, finished_at = ? WHERE finished_at IS NULL",
                (self._now(),),
            ).rowcount
        return int(closed)
