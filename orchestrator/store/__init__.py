"""The state database: one SQLite file (WAL) under the state directory, the source of truth (D1).

    store = Store.open(state_dir)            # creates and migrates the file
    conv = store.upsert_conversation(key)
    msg, created = store.accept_message(conv.id, "tg-42", sender="u1", text="hi")
    turn = store.start_turn(session.id, msg.id)          # ACCEPTED -> RUNNING
    store.record_reply(msg.id, f"reply:{msg.id}", text)  # RUNNING -> REPLIED
    store.mark_delivered(f"reply:{msg.id}")              # REPLIED -> DELIVERED

The API is synchronous and safe from any thread (one connection per thread,
see `orchestrator.store.db`); async callers offload with `asyncio.to_thread`.
Guarded updates raise `StateConflict` (row in another state) or `NotFound`
and change nothing; `get_*` lookups return None for a missing row. Times
come from the clock given at construction, so tests control them.
"""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.store._base import Clock
from orchestrator.store.admin import AdminMixin
from orchestrator.store.channels import ChannelsMixin
from orchestrator.store.db import DB_FILE, Database
from orchestrator.store.messages import ATTACHMENT_LEDGER_SIZE, conversation_id
from orchestrator.store.models import (
    PENDING_STATES,
    ApiKey,
    Attachment,
    Conversation,
    ConversationId,
    CronJob,
    CronJobId,
    CronType,
    KeyId,
    Message,
    MessageId,
    MessageState,
    Refusal,
    Reply,
    ReplyId,
    Sandbox,
    SandboxState,
    ScheduleKind,
    Session,
    SessionId,
    SessionState,
    Share,
    ShareId,
    Turn,
    TurnId,
)
from orchestrator.store.threads import ThreadsMixin

__all__ = [
    "ATTACHMENT_LEDGER_SIZE",
    "DB_FILE",
    "PENDING_STATES",
    "ApiKey",
    "Attachment",
    "Conversation",
    "ConversationId",
    "CronJob",
    "CronJobId",
    "CronType",
    "KeyId",
    "Message",
    "MessageId",
    "MessageState",
    "Refusal",
    "Reply",
    "ReplyId",
    "Sandbox",
    "SandboxState",
    "ScheduleKind",
    "Session",
    "SessionId",
    "SessionState",
    "Share",
    "ShareId",
    "Store",
    "Turn",
    "TurnId",
    "conversation_id",
]


class Store(ChannelsMixin, ThreadsMixin, AdminMixin):
    """Every table of the state database behind one object.

    The methods are grouped by table in `messages`, `sessions`, `resources`,
    `admin` and `channels`; this class only opens and closes the file.
    """

    def __init__(self, db: Database, clock: Clock = time.time) -> None:
        super().__init__(db, clock)

    @classmethod
    def open(cls, state_dir: Path, *, clock: Clock = time.time) -> Store:
        """Open (creating and migrating) `<state_dir>/cellgate.sqlite3`."""
        return cls(Database(state_dir / DB_FILE), clock)

    @property
    def path(self) -> Path:
        return self._db.path

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
