"""What one bridge socket stands for: the conversation, session and directories of its sandbox.

A scope is bound to a socket when the gateway opens it; every tool call on
that socket runs in it. Nothing a call sends can change it (P1, T4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath

from cellgate.models import ConversationKey
from orchestrator.conversations import ConversationPaths
from orchestrator.store import ConversationId, SessionId, conversation_id
from sandbox.mountplan import WORKSPACE

__all__ = ["BridgeScope", "ScopeState"]


@dataclass(frozen=True, slots=True)
class BridgeScope:
    """One conversation's session as the gateway knows it (never as the sandbox claims it).

    - `key`: agent, channel and chat of the conversation.
    - `session_id`: the store's session serving it (shares are owned by it, P6).
    - `paths`: host paths of its chat, media and bridge directories.
    - `origin_chat_id`: the chat replies may go to; None or "" refuses every reply (P1).
    - `origin_thread_id`: the thread a reply goes to when the call names none.
    - `isolated`, `archive_enabled`: what `policies.tools` needs to offer tools (T1, T2).
    """

    key: ConversationKey
    session_id: SessionId
    paths: ConversationPaths
    origin_chat_id: str | None
    origin_thread_id: str | None = None
    isolated: bool = True
    archive_enabled: bool = False

    @classmethod
    def for_conversation(
        cls,
        key: ConversationKey,
        session_id: str,
        paths: ConversationPaths,
        *,
        thread_id: str | None = None,
        isolated: bool = True,
        archive_enabled: bool = False,
    ) -> BridgeScope:
        """The scope of a session serving `key`: its origin is the conversation's own chat."""
        return cls(
            key=key,
            session_id=SessionId(session_id),
            paths=paths,
            origin_chat_id=key.chat_id,
            origin_thread_id=thread_id,
            isolated=isolated,
            archive_enabled=archive_enabled,
        )

    @property
    def scope_key(self) -> str:
        """The socket's identity: one per conversation (the store's conversation id)."""
        return self.conversation_id

    @property
    def conversation_id(self) -> ConversationId:
        return conversation_id(self.key)

    @property
    def channel(self) -> str:
        return self.key.channel

    @property
    def media_dir_in_sandbox(self) -> str:
        """Where the sandbox sees its media directory (`/workspace/media/<dir>`)."""
        rel = self.paths.media_dir.relative_to(self.paths.workspace)
        return str(WORKSPACE / PurePosixPath(rel.as_posix()))

    @property
    def socket_path(self) -> str:
        return str(self.paths.bridge_dir / "bridge.sock")


@dataclass(slots=True)
class ScopeState:
    """What a socket learns while it serves: Discord threads its session opened itself (P2)."""

    own_threads: set[str] = field(default_factory=set)
