"""The harness adapter contract (H1): ensure_session, dispatch, reset_session.

A harness runs turns of one conversation's session. It reaches the sandbox only
through the backend handle in its `SessionContext`; it never sees the gateway's
secrets.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cellgate.models import ConversationKey
from sandbox.backends.base import SandboxBackend, SandboxHandle


@dataclass(frozen=True, slots=True)
class DispatchResult:
    """What `dispatch` returns: `{ok, reply, turn_id, meta}`."""

    ok: bool
    reply: str
    turn_id: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SessionContext:
    """Everything a harness may use for one session of one conversation."""

    conversation: ConversationKey
    session_key: str
    backend: SandboxBackend
    sandbox: SandboxHandle
    env: Mapping[str, str]
    workdir: str


class Harness(abc.ABC):
    @abc.abstractmethod
    async def ensure_session(self, ctx: SessionContext) -> str:
        """Prepare or reuse the session; return the harness's own session id."""

    @abc.abstractmethod
    async def dispatch(
        self, ctx: SessionContext, message: str, meta: Mapping[str, Any]
    ) -> DispatchResult:
        """Run one turn and return its result."""

    @abc.abstractmethod
    async def reset_session(self, ctx: SessionContext) -> None:
        """Forget the session so the next turn starts cold."""
