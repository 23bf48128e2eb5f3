"""What channels keep in the store (W3, W4): poll cursors, posted parts, blocked chats.

- `channel_cursor` / `set_channel_cursor`: where a poller (Telegram getUpdates)
  stopped. It is advanced only after the updates before it are stored, so a
  crash neither loses an update (it is fetched again) nor repeats one (the
  message store is idempotent on its platform id).
- `posted_part` / `record_posted_part`: one row per part of an outbound
  delivery under its durable outbound key. A retry skips what is recorded;
  the only window left is "the platform accepted it, the row was not yet
  written", which the Bot API cannot close (it has no idempotency key).
- `bot_message_known`: did the bot post this message id in this chat (edits).
- `block_chat` / `chat_blocked`: a chat that blocked the bot is not retried.
"""

from __future__ import annotations

from orchestrator.store._base import StoreBase

__all__ = ["ChannelsMixin"]


class ChannelsMixin(StoreBase):
    # -- poll cursors ----------------------------------------------------------

    def channel_cursor(self, agent: str, channel: str) -> int | None:
        with self._db.read() as c:
            row = c.execute(
                "SELECT cursor FROM channel_cursors WHERE agent = ? AND channel = ?",
                (agent, channel),
            ).fetchone()
        return None if row is None else int(row[0])

    def set_channel_cursor(self, agent: str, channel: str, cursor: int) -> None:
        """Move the cursor forward (never back: a late writer cannot rewind it)."""
        with self._db.write() as c:
            c.execute(
                "INSERT INTO channel_cursors (agent, channel, cursor, updated_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (agent, channel) DO UPDATE"
                " SET cursor = max(cursor, excluded.cursor), updated_at = excluded.updated_at",
                (agent, channel, cursor, self._now()),
            )

    # -- posted parts ----------------------------------------------------------

    def posted_part(self, outbound_key: str, part: int) -> str | None:
        """The platform message id of a part already posted under this key, or None."""
        with self._db.read() as c:
            row = c.execute(
                "SELECT platform_message_id FROM outbound_parts"
                " WHERE outbound_key = ? AND part = ?",
                (outbound_key, part),
            ).fetchone()
        return None if row is None else str(row[0])

    def record_posted_part(
        self,
        outbound_key: str,
        part: int,
        *,
        agent: str,
        channel: str,
        chat_id: str,
        platform_message_id: str,
    ) -> None:
        with self._db.write() as c:
            c.execute(
                "INSERT INTO outbound_parts (outbound_key, part, agent, channel, chat_id,"
                " platform_message_id, sent_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (outbound_key, part) DO NOTHING",
                (outbound_key, part, agent, channel, chat_id, platform_message_id, self._now()),
            )

    def bot_message_known(
        self, agent: str, channel: str, chat_id: str, platform_message_id: str
    ) -> bool:
        with self._db.read() as c:
            row = c.execute(
                "SELECT 1 FROM outbound_parts WHERE agent = ? AND channel = ? AND chat_id = ?"
                " AND platform_message_id = ? LIMIT 1",
                (agent, channel, chat_id, platform_message_id),
            ).fetchone()
        return row is not None

    # -- blocked chats ---------------------------------------------------------

    def block_chat(self, agent: str, channel: str, chat_id: str, reason: str) -> None:
        with self._db.write() as c:
            c.execute(
                "INSERT INTO blocked_chats (agent, channel, chat_id, reason, blocked_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (agent, channel, chat_id) DO NOTHING",
                (agent, channel, chat_id, reason[:500], self._now()),
            )

    def unblock_chat(self, agent: str, channel: str, chat_id: str) -> bool:
        """The chat wrote to the bot again: it may be answered again."""
        with self._db.write() as c:
            n = c.execute(
                "DELETE FROM blocked_chats WHERE agent = ? AND channel = ? AND chat_id = ?",
                (agent, channel, chat_id),
            ).rowcount
        return bool(n)

    def chat_blocked(self, agent: str, channel: str, chat_id: str) -> bool:
        with self._db.read() as c:
            row = c.execute(
                "SELECT 1 FROM blocked_chats WHERE agent = ? AND channel = ? AND chat_id = ?",
                (agent, channel, chat_id),
            ).fetchone()
        return row is not None
