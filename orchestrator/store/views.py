"""The narrow parts of the store each room of the gateway uses.

`Store` satisfies every one of these structurally; a room that takes a
`TurnQueueStore` can touch messages and replies and nothing else, and a test
can hand it a small scripted stand-in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from cellgate.models import ConversationKey
from orchestrator.store.models import (
    Attachment,
    Conversation,
    ConversationId,
    CronJob,
    CronJobId,
    CronType,
    Message,
    MessageId,
    MessageState,
    Refusal,
    Reply,
    Sandbox,
    SandboxState,
    ScheduleKind,
    Session,
    SessionId,
    Turn,
    TurnId,
)
from orchestrator.store.walsync import SyncTicket

__all__ = [
    "ConversationStore",
    "CronStore",
    "IntakeStore",
    "RefusalStore",
    "SandboxStore",
    "SessionStore",
    "SyncStore",
    "TurnQueueStore",
]


class SyncStore(Protocol):
    """Group commit (D1, F3): durable writes committed now, on disk before anyone is told."""

    def deferred_sync(self) -> AbstractContextManager[SyncTicket]: ...

    def sync(self, ticket: SyncTicket) -> None: ...


class ConversationStore(Protocol):
    def upsert_conversation(self, key: ConversationKey) -> Conversation: ...

    def get_conversation(self, conversation: ConversationId) -> Conversation | None: ...

    def conversations(self, agent: str | None = None) -> list[Conversation]: ...


class RefusalStore(Protocol):
    def record_refusal(
        self,
        *,
        rule: str,
        action: str,
        reason: str,
        conversation: ConversationId | None = None,
        session_id: SessionId | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Refusal: ...


class IntakeStore(ConversationStore, RefusalStore, SyncStore, Protocol):
    """Accepting a message: its conversation, the message row, the queue it joins."""

    def accept_message(
        self,
        conversation: ConversationId,
        platform_message_id: str,
        *,
        sender: str,
        text: str,
        attachments: Sequence[Attachment] = (),
    ) -> tuple[Message, bool]: ...

    def accept_new(
        self,
        key: ConversationKey,
        platform_message_id: str,
        *,
        sender: str,
        text: str,
        files: Sequence[tuple[str, str]] = (),
    ) -> tuple[Message, bool]: ...

    def pending_count(self, conversation: ConversationId) -> int: ...


class TurnQueueStore(SyncStore, Protocol):
    """The durable turn queue (D1, D2): message states and their replies."""

    def get_conversation(self, conversation: ConversationId) -> Conversation | None: ...

    def close_open_turns(self) -> int: ...

    def get_message(self, message_id: MessageId) -> Message | None: ...

    def undelivered_messages(self) -> list[Message]: ...

    def pending_for_conversation(self, conversation: ConversationId) -> list[Message]: ...

    def transition(
        self,
        message_id: MessageId,
        from_state: MessageState,
        to_state: MessageState,
        *,
        error: str | None = None,
    ) -> Message: ...

    def record_reply(
        self, message_id: MessageId, outbound_key: str, text: str, *, delivered: bool = False
    ) -> tuple[Reply, bool]: ...

    def mark_delivered(self, outbound_key: str) -> Reply: ...

    def reply_for_message(self, message_id: MessageId) -> Reply | None: ...


class SessionStore(ConversationStore, Protocol):
    """Sessions and their turns."""

    def open_session(
        self,
        conversation: ConversationId,
        harness: str,
        *,
        harness_session_id: str | None = None,
        session_id: SessionId | None = None,
    ) -> Session: ...

    def live_sessions(
        self, agent: str | None = None, *, conversation: ConversationId | None = None
    ) -> list[Session]: ...

    def end_session(self, session_id: SessionId) -> Session: ...

    def start_turn(self, session_id: SessionId, message_id: MessageId | None = None) -> Turn: ...

    def begin_turn(
        self, conversation: ConversationId, harness: str, message_id: MessageId
    ) -> tuple[Session, Turn]: ...

    def finish_turn(
        self, turn_id: TurnId, *, ok: bool, harness_turn_id: str | None = None
    ) -> Turn: ...


class SandboxStore(SessionStore, RefusalStore, Protocol):
    """Sandbox rows beside the sessions that keep them busy."""

    def record_sandbox(
        self,
        name: str,
        *,
        conversation: ConversationId,
        app: str,
        agent: str,
        spec_hash: str,
        state: SandboxState = SandboxState.RUNNING,
    ) -> Sandbox: ...

    def get_sandbox(self, name: str) -> Sandbox | None: ...

    def forget_sandbox(self, name: str) -> bool: ...

    def sandboxes(self, app: str | None = None) -> list[Sandbox]: ...


class CronStore(RefusalStore, Protocol):
    """Cron jobs (C1, C2): what the job service and the scheduler touch."""

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
    ) -> CronJob: ...

    def get_cron_job(self, job_id: CronJobId) -> CronJob | None: ...

    def cron_jobs(self, agent: str | None = None) -> list[CronJob]: ...

    def count_cron_jobs(self, agent: str) -> int: ...

    def due_cron_jobs(self, now: float, limit: int = 100) -> list[CronJob]: ...

    def next_cron_due(self) -> float | None: ...

    def update_cron_job(
        self,
        job_id: CronJobId,
        *,
        schedule: str | None = None,
        payload: str | None = None,
        enabled: bool | None = None,
        next_run_at: float | None = None,
    ) -> CronJob: ...

    def mark_cron_run(
        self,
        job_id: CronJobId,
        *,
        next_run_at: float | None = None,
        status: str | None = None,
        due: float | None = None,
    ) -> CronJob: ...

    def record_cron_result(self, job_id: CronJobId, status: str, output: str) -> None: ...

    def delete_cron_job(self, job_id: CronJobId) -> bool: ...
