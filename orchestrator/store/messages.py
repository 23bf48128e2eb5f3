"""Conversations, inbound messages and their replies (D1, D2).

"Every accepted message is answered exactly once" is held by the schema and
checkable by a query:

- `UNIQUE (conversation_id, platform_message_id)`: a redelivered inbound event
  is the same row (`accept_message` returns `created=False`);
- `replies.message_id UNIQUE` and `replies.outbound_key UNIQUE`: a message has
  at most one reply, and recording it twice returns the first;
- a reply is inserted in the same transaction that moves its message from
  RUNNING to REPLIED, and marked delivered in the same transaction that moves
  it to DELIVERED, so the message state alone says what is left to do;
- `delivery_violations()` lists every row where state and replies disagree.

A crash between sending a reply and `mark_delivered` leaves it REPLIED, so
the recovery scan sends it again: delivery to the platform is at least once,
keyed by `outbound_key` for channels that can deduplicate.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Sequence

from cellgate.errors import NotFound, StateConflict, StoreError
from cellgate.models import ConversationKey
from orchestrator.store._base import StoreBase, conflict, dumps, opt_ts, ts
from orchestrator.store.models import (
    MESSAGE_EDGES,
    PENDING_STATES,
    Attachment,
    Conversation,
    ConversationId,
    Message,
    MessageId,
    MessageState,
    Reply,
    ReplyId,
)

ATTACHMENT_LEDGER_SIZE = 200  # P3: the newest 200 file ids per chat
_PENDING_SQL = ",".join(f"'{s.value}'" for s in PENDING_STATES)
_MESSAGE_STATE_SQL = "SELECT state FROM messages WHERE id = ?"
# a conversation's turn queue, through the partial index `messages_queue` (schema: its
# WHERE is this very `state IN (...)` term), never through the conversation's history
QUEUE_SQL = f"FROM messages WHERE conversation_id = ? AND state IN ({_PENDING_SQL})"


def conversation_id(key: ConversationKey) -> ConversationId:
    """The store's id of a conversation: stable, and distinct per agent.

    `ConversationKey.digest` leaves the agent out (it is implied by a
    workspace); one database serves every agent, so the id includes it.
    """
    raw = f"{key.agent}\0{key.channel}\0{key.chat_id}".encode("utf-8", "surrogatepass")
    return ConversationId(hashlib.sha256(raw).hexdigest()[:32])


def remember(
    c: sqlite3.Connection, conversation: ConversationId, file_id: str, platform: str, now: float
) -> None:
    """`remember_attachment` inside the caller's write transaction."""
    c.execute(
        "DELETE FROM attachments WHERE conversation_id = ? AND platform = ? AND file_id = ?",
        (conversation, platform, file_id),
    )
    c.execute(
        "INSERT INTO attachments (conversation_id, platform, file_id, delivered_at)"
        " VALUES (?, ?, ?, ?)",
        (conversation, platform, file_id, now),
    )
    c.execute(
        "DELETE FROM attachments WHERE conversation_id = ?1 AND platform = ?2"
        " AND seq NOT IN (SELECT seq FROM attachments WHERE conversation_id = ?1"
        " AND platform = ?2 ORDER BY seq DESC LIMIT ?3)",
        (conversation, platform, ATTACHMENT_LEDGER_SIZE),
    )


def _upsert(c: sqlite3.Connection, key: ConversationKey, now: float) -> Conversation:
    row = c.execute(
        "INSERT INTO conversations"
        " (id, agent, channel, chat_id, dir_name, created_at, last_active_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (id) DO UPDATE SET last_active_at = excluded.last_active_at"
        " RETURNING *",
        (conversation_id(key), key.agent, key.channel, key.chat_id, key.dir_name, now, now),
    ).fetchone()
    return conversation_from_row(row)


def _insert_message(
    c: sqlite3.Connection,
    conversation: ConversationId,
    platform_message_id: str,
    sender: str,
    text: str,
    attachments: Sequence[Attachment],
    now: float,
) -> tuple[Message, bool]:
    """The message stored once (its platform id); a redelivery: the stored row and False."""
    row = c.execute(
        "INSERT INTO messages (conversation_id, platform_message_id, sender, text,"
        " attachments, received_at, state, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (conversation_id, platform_message_id) DO NOTHING RETURNING *",
        (
            conversation,
            platform_message_id,
            sender,
            text,
            dumps([dict(a) for a in attachments]),
            now,
            MessageState.ACCEPTED,
            now,
        ),
    ).fetchone()
    if row is not None:
        return _message(row), True
    row = c.execute(
        "SELECT * FROM messages WHERE conversation_id = ? AND platform_message_id = ?",
        (conversation, platform_message_id),
    ).fetchone()
    return _message(row), False


def conversation_from_row(
    row: sqlite3.Row, prefix: str = "", id_column: str = "id"
) -> Conversation:
    """A conversation row; `prefix` reads the columns of a join that aliased them."""
    return Conversation(
        id=ConversationId(row[id_column]),
        agent=row[f"{prefix}agent"],
        channel=row[f"{prefix}channel"],
        chat_id=row[f"{prefix}chat_id"],
        dir_name=row[f"{prefix}dir_name"],
        created_at=ts(row[f"{prefix}created_at"]),
        last_active_at=ts(row[f"{prefix}last_active_at"]),
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=MessageId(row["id"]),
        conversation_id=ConversationId(row["conversation_id"]),
        platform_message_id=row["platform_message_id"],
        sender=row["sender"],
        text=row["text"],
        attachments=tuple(json.loads(row["attachments"])),
        received_at=ts(row["received_at"]),
        state=MessageState(row["state"]),
        attempts=row["attempts"],
        error=row["error"],
        updated_at=ts(row["updated_at"]),
    )


def _reply(row: sqlite3.Row) -> Reply:
    return Reply(
        id=ReplyId(row["id"]),
        message_id=MessageId(row["message_id"]),
        conversation_id=ConversationId(row["conversation_id"]),
        outbound_key=row["outbound_key"],
        text=row["text"],
        created_at=ts(row["created_at"]),
        delivered_at=opt_ts(row["delivered_at"]),
    )


class MessagesMixin(StoreBase):
    # -- conversations -------------------------------------------------------

    def upsert_conversation(self, key: ConversationKey) -> Conversation:
        """Create the conversation, or mark an existing one active now."""
        with self._db.write() as c:
            return _upsert(c, key, self._now())

    def get_conversation(self, conversation: ConversationId) -> Conversation | None:
        rows = self._db.query("SELECT * FROM conversations WHERE id = ?", (conversation,))
        return conversation_from_row(rows[0]) if rows else None

    def conversations(self, agent: str | None = None) -> list[Conversation]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT * FROM conversations WHERE ?1 IS NULL OR agent = ?1"
                " ORDER BY created_at, rowid",
                (agent,),
            ).fetchall()
        return [conversation_from_row(r) for r in rows]

    # -- inbound messages ----------------------------------------------------

    def accept_message(
        self,
        conversation: ConversationId,
        platform_message_id: str,
        *,
        sender: str,
        text: str,
        attachments: Sequence[Attachment] = (),
    ) -> tuple[Message, bool]:
        """Store an inbound message once; a redelivery returns the stored row and False."""
        now = self._now()
        with self._db.write() as c:
            touched = c.execute(
                "UPDATE conversations SET last_active_at = ? WHERE id = ?", (now, conversation)
            ).rowcount
            if not touched:
                raise NotFound("conversation", conversation)
            return _insert_message(
                c, conversation, platform_message_id, sender, text, attachments, now
            )

    def accept_new(
        self,
        key: ConversationKey,
        platform_message_id: str,
        *,
        sender: str,
        text: str,
        files: Sequence[tuple[str, str]] = (),
    ) -> tuple[Message, bool]:
        """`upsert_conversation`, `remember_attachment` of each (file id, platform) of
        `files` and `accept_message` in one transaction (one commit, one sync): a message
        admitted from a chat that may be new (R4: a refused one stores nothing at all)."""
        now = self._now()
        with self._db.write() as c:
            conv = _upsert(c, key, now)
            for file_id, platform in files:
                remember(c, conv.id, file_id, platform, now)
            return _insert_message(c, conv.id, platform_message_id, sender, text, (), now)

    def find_message(
        self, conversation: ConversationId, platform_message_id: str
    ) -> Message | None:
        """The message a platform (or an API client) knows by its own id."""
        with self._db.read() as c:
            row = c.execute(
                "SELECT * FROM messages WHERE conversation_id = ? AND platform_message_id = ?",
                (conversation, platform_message_id),
            ).fetchone()
        return None if row is None else _message(row)

    def get_message(self, message_id: MessageId) -> Message | None:
        rows = self._db.query("SELECT * FROM messages WHERE id = ?", (message_id,))
        return _message(rows[0]) if rows else None

    def transition(
        self,
        message_id: MessageId,
        from_state: MessageState,
        to_state: MessageState,
        *,
        error: str | None = None,
    ) -> Message:
        """Move a message from `from_state` to `to_state`, or raise and change nothing.

        Raises `StateConflict` when the row is in another state (someone else
        moved it first), `NotFound` when there is no such message. Entering
        RUNNING counts an attempt. REPLIED and DELIVERED are entered only by
        `record_reply` and `mark_delivered`, which write the reply row too.
        """
        with self._db.write() as c:
            return self._transition(c, message_id, from_state, to_state, error=error)

    def _transition(
        self,
        c: sqlite3.Connection,
        message_id: MessageId,
        from_state: MessageState,
        to_state: MessageState,
        *,
        error: str | None = None,
    ) -> Message:
        if to_state not in MESSAGE_EDGES[from_state]:
            hint = {
                MessageState.REPLIED: "; use record_reply",
                MessageState.DELIVERED: "; use mark_delivered",
            }.get(to_state, "")
            raise StoreError(f"a message cannot go from {from_state} to {to_state}{hint}")
        row = c.execute(
            "UPDATE messages SET state = ?, error = coalesce(?, error), updated_at = ?,"
            " attempts = attempts + ? WHERE id = ? AND state = ? RETURNING *",
            (
                to_state,
                error,
                self._now(),
                int(to_state is MessageState.RUNNING),
                message_id,
                from_state,
            ),
        ).fetchone()
        if row is None:
            raise conflict(
                c, kind="message", sql=_MESSAGE_STATE_SQL, key=message_id, expected=from_state
            )
        return _message(row)

    def undelivered_messages(self) -> list[Message]:
        """Every message not yet answered (ACCEPTED, RUNNING, REPLIED), in arrival order.

        This is the recovery scan's work list (D2): RUNNING rows are turns a
        crash interrupted, REPLIED rows have a reply recorded but not delivered.
        """
        with self._db.read() as c:
            rows = c.execute(
                f"SELECT * FROM messages WHERE state IN ({_PENDING_SQL}) ORDER BY id"  # noqa: S608
            ).fetchall()
        return [_message(r) for r in rows]

    def pending_for_conversation(self, conversation: ConversationId) -> list[Message]:
        """The conversation's unanswered messages, oldest first (its turn queue)."""
        rows = self._db.query(f"SELECT * {QUEUE_SQL} ORDER BY id", (conversation,))
        return [_message(r) for r in rows]

    def pending_count(self, conversation: ConversationId) -> int:
        """How many messages wait in the conversation's turn queue (R4: its admission)."""
        rows = self._db.query(f"SELECT count(*) {QUEUE_SQL}", (conversation,))
        return int(rows[0][0])

    # -- replies -------------------------------------------------------------

    def record_reply(
        self, message_id: MessageId, outbound_key: str, text: str, *, delivered: bool = False
    ) -> tuple[Reply, bool]:
        """Record the reply to a RUNNING message and move it to REPLIED, in one transaction.

        `delivered`: its channel's caller reads the stored reply (the `api` channel), so
        storing it delivers it: stamped delivered and the message DELIVERED in the same
        transaction (one commit, not two, F3). Idempotent on `outbound_key`: a second
        call returns the stored reply and False, whatever its text. Reusing a key for
        another message raises.
        """
        now = self._now()
        with self._db.write() as c:
            row = c.execute(
                "SELECT * FROM replies WHERE outbound_key = ?", (outbound_key,)
            ).fetchone()
            if row is not None:
                existing = _reply(row)
                if existing.message_id != message_id:
                    raise StoreError(
                        f"outbound key {outbound_key!r} already answers message "
                        f"{existing.message_id}, not {message_id}"
                    )
                return existing, False
            self._transition_to(c, message_id, MessageState.RUNNING, MessageState.REPLIED, now)
            row = c.execute(
                "INSERT INTO replies (message_id, conversation_id, outbound_key, text,"
                " created_at, delivered_at)"
                " SELECT id, conversation_id, ?, ?, ?, ? FROM messages WHERE id = ? RETURNING *",
                (outbound_key, text, now, now if delivered else None, message_id),
            ).fetchone()
            if delivered:
                self._transition_to(
                    c, message_id, MessageState.REPLIED, MessageState.DELIVERED, now
                )
        return _reply(row), True

    def _transition_to(
        self,
        c: sqlite3.Connection,
        message_id: MessageId,
        from_state: MessageState,
        to_state: MessageState,
        now: float,
    ) -> None:
        changed = c.execute(
            "UPDATE messages SET state = ?, updated_at = ? WHERE id = ? AND state = ?",
            (to_state, now, message_id, from_state),
        ).rowcount
        if not changed:
            raise conflict(
                c, kind="message", sql=_MESSAGE_STATE_SQL, key=message_id, expected=from_state
            )

    def mark_delivered(self, outbound_key: str) -> Reply:
        """The channel has sent the reply: stamp it and move its message to DELIVERED."""
        now = self._now()
        with self._db.write() as c:
            row = c.execute(
                "UPDATE replies SET delivered_at = ? WHERE outbound_key = ?"
                " AND delivered_at IS NULL RETURNING *",
                (now, outbound_key),
            ).fetchone()
            if row is None:
                found = c.execute(
                    "SELECT 1 FROM replies WHERE outbound_key = ?", (outbound_key,)
                ).fetchone()
                if found is None:
                    raise NotFound("reply", outbound_key)
                raise StateConflict("reply", outbound_key, "undelivered", "delivered")
            reply = _reply(row)
            self._transition_to(
                c, reply.message_id, MessageState.REPLIED, MessageState.DELIVERED, now
            )
        return reply

    def reply_for_message(self, message_id: MessageId) -> Reply | None:
        rows = self._db.query("SELECT * FROM replies WHERE message_id = ?", (message_id,))
        return _reply(rows[0]) if rows else None

    def get_reply(self, outbound_key: str) -> Reply | None:
        with self._db.read() as c:
            row = c.execute(
                "SELECT * FROM replies WHERE outbound_key = ?", (outbound_key,)
            ).fetchone()
        return None if row is None else _reply(row)

    def delivery_violations(self) -> list[str]:
        """Rows where a message's state and its reply disagree; empty when all is well."""
        checks = (
            ("is delivered but has no delivered reply",
             "m.state = 'delivered' AND (r.id IS NULL OR r.delivered_at IS NULL)"),
            ("is replied but has no undelivered reply",
             "m.state = 'replied' AND (r.id IS NULL OR r.delivered_at IS NOT NULL)"),
            ("is not yet answered but has a reply",
             "m.state IN ('accepted', 'running') AND r.id IS NOT NULL"),
            ("has a delivered reply but is not delivered",
             "r.delivered_at IS NOT NULL AND m.state <> 'delivered'"),
            ("has a reply filed under another conversation",
             "r.id IS NOT NULL AND r.conversation_id <> m.conversation_id"),
        )  # fmt: skip
        found: list[str] = []
        with self._db.read() as c:
            for what, where in checks:
                rows = c.execute(
                    "SELECT m.id, m.state FROM messages m"  # noqa: S608
                    f" LEFT JOIN replies r ON r.message_id = m.id WHERE {where} ORDER BY m.id"
                ).fetchall()
                found += [f"message {r[0]} ({r[1]}) {what}" for r in rows]
        return found
