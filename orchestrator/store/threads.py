"""P2 (Discord): the threads a session opened itself, the only other chats it may post in.

- `record_own_thread`: `discord_create_thread` made a thread for this
  session; recorded right after Discord created it, so it outlives a gateway
  restart (the socket's in-memory `ScopeState` does not).
- `own_threads`: the threads a session opened (newest first, bounded).
- `own_thread_count`: how many it opened (a session may open a bounded number).
"""

from __future__ import annotations

from orchestrator.store._base import StoreBase

__all__ = ["OWN_THREADS_MAX", "ThreadsMixin"]

OWN_THREADS_MAX = 50  # threads one session may open


class ThreadsMixin(StoreBase):
    def record_own_thread(
        self, session_id: str, thread_id: str, *, conversation: str, parent_chat_id: str
    ) -> None:
        with self._db.write() as c:
            c.execute(
                "INSERT INTO own_threads (session_id, thread_id, conversation_id,"
                " parent_chat_id, created_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (session_id, thread_id) DO NOTHING",
                (session_id, thread_id, conversation, parent_chat_id, self._now()),
            )

    def own_threads(self, session_id: str) -> frozenset[str]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT thread_id FROM own_threads WHERE session_id = ?"
                " ORDER BY created_at DESC LIMIT ?",
                (session_id, OWN_THREADS_MAX),
            ).fetchall()
        return frozenset(str(r[0]) for r in rows)

    def own_thread_count(self, session_id: str) -> int:
        with self._db.read() as c:
            row = c.execute(
                "SELECT count(*) FROM own_threads WHERE session_id = ?", (session_id,)
            ).fetchone()
        return int(row[0])
