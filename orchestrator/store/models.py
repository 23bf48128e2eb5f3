"""Rows of the state database: frozen dataclasses, `StrEnum` states, `NewType` ids.

States are persisted as their text value; the schema's CHECK constraints list
the same values, so a row can never hold a state this module does not know.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NewType

ConversationId = NewType("ConversationId", str)
MessageId = NewType("MessageId", int)
ReplyId = NewType("ReplyId", int)
TurnId = NewType("TurnId", int)
SessionId = NewType("SessionId", str)
ShareId = NewType("ShareId", str)
CronJobId = NewType("CronJobId", str)
KeyId = NewType("KeyId", str)

Attachment = Mapping[str, Any]


class MessageState(enum.StrEnum):
    """The life of one inbound message (D1, D2).

    ACCEPTED -> RUNNING -> REPLIED -> DELIVERED, and FAILED from any
    non-terminal state; RUNNING -> ACCEPTED puts a crashed turn back in the
    queue. REPLIED is entered only by `record_reply` (which inserts the reply
    in the same transaction) and DELIVERED only by `mark_delivered`.
    """

    ACCEPTED = "accepted"
    RUNNING = "running"
    REPLIED = "replied"
    DELIVERED = "delivered"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (MessageState.DELIVERED, MessageState.FAILED)


# Edges `transition` may take; REPLIED and DELIVERED have their own operations.
MESSAGE_EDGES: Mapping[MessageState, frozenset[MessageState]] = {
    MessageState.ACCEPTED: frozenset({MessageState.RUNNING, MessageState.FAILED}),
    MessageState.RUNNING: frozenset({MessageState.ACCEPTED, MessageState.FAILED}),
    MessageState.REPLIED: frozenset({MessageState.FAILED}),
    MessageState.DELIVERED: frozenset(),
    MessageState.FAILED: frozenset(),
}

# Not yet answered: the recovery scan (D2) finishes these.
PENDING_STATES = (MessageState.ACCEPTED, MessageState.RUNNING, MessageState.REPLIED)


class SessionState(enum.StrEnum):
    LIVE = "live"
    ENDED = "ended"


class SandboxState(enum.StrEnum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


class CronType(enum.StrEnum):
    PROMPT = "prompt"
    COMMAND = "command"


@dataclass(frozen=True, slots=True)
class Conversation:
    id: ConversationId
    agent: str
    channel: str
    chat_id: str
    dir_name: str
    created_at: float
    last_active_at: float


@dataclass(frozen=True, slots=True)
class Message:
    id: MessageId
    conversation_id: ConversationId
    platform_message_id: str
    sender: str
    text: str
    attachments: tuple[Attachment, ...]
    received_at: float
    state: MessageState
    attempts: int
    error: str | None
    updated_at: float


@dataclass(frozen=True, slots=True)
class Reply:
    id: ReplyId
    message_id: MessageId
    conversation_id: ConversationId
    outbound_key: str
    text: str
    created_at: float
    delivered_at: float | None


@dataclass(frozen=True, slots=True)
class Turn:
    id: TurnId
    session_id: SessionId
    message_id: MessageId | None
    harness_turn_id: str | None
    ok: bool | None
    started_at: float
    finished_at: float | None


@dataclass(frozen=True, slots=True)
class Session:
    id: SessionId
    conversation_id: ConversationId
    agent: str
    harness: str
    harness_session_id: str | None
    state: SessionState
    started_at: float
    last_active_at: float
    ended_at: float | None
    busy: int
    """Open turns of this session; derived, never stored, so it cannot drift."""


@dataclass(frozen=True, slots=True)
class Sandbox:
    name: str
    conversation_id: ConversationId
    app: str
    agent: str
    spec_hash: str
    state: SandboxState
    created_at: float
    last_used_at: float


@dataclass(frozen=True, slots=True)
class Share:
    id: ShareId
    session_id: SessionId
    conversation_id: ConversationId
    path: str
    """Relative to the session's media directory (P5 is checked by the caller)."""
    created_at: float
    revoked_at: float | None
    revoked_by: str | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class ScheduleKind(enum.StrEnum):
    """How a job's `schedule` reads: a cron expression, seconds between runs, one time."""

    CRON = "cron"
    EVERY = "every"
    AT = "at"


@dataclass(frozen=True, slots=True)
class CronJob:
    """A scheduled job (C1, C2). `payload` is a prompt's text or a command's shell line."""

    id: CronJobId
    agent: str
    type: CronType
    schedule: str
    payload: str
    one_shot: bool
    enabled: bool
    created_at: float
    last_run_at: float | None
    name: str = ""
    schedule_kind: ScheduleKind = ScheduleKind.CRON
    timezone: str = "UTC"
    channel: str | None = None
    chat_id: str | None = None
    """A prompt job's conversation; None for a command job."""
    timeout_seconds: float = 60.0
    next_run_at: float | None = None
    """When it is due next; None: never (a used-up one-shot job)."""
    runs: int = 0
    last_status: str | None = None
    last_output: str | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: KeyId
    name: str
    prefix: str
    """The first characters of the secret, for display; not enough to use it."""
    agents: tuple[str, ...]
    admin: bool
    write: bool
    created_at: float
    last_used_at: float | None
    revoked_at: float | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True, slots=True)
class Refusal:
    id: int
    at: float
    conversation_id: ConversationId | None
    session_id: SessionId | None
    rule: str
    action: str
    reason: str
    detail: Mapping[str, Any]
