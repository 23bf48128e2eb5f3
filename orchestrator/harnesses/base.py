"""The harness adapter contract (H1): ensure_session, dispatch, reset_session.

A harness runs turns of one conversation's session. It reaches the sandbox only
through the backend handle in its `SessionContext`; it never sees the gateway's
secrets.

What a turn gets and what it returns are frozen dataclasses, never
string-keyed dicts:

    TurnRequest(prompt, system_prompt, history, resume_id, tools)
        -> dispatch ->
    TurnResult(ok, reply, turn_id, harness_session_id, messages_sent, detail)

`TurnResult.meta` is the wire form of everything but ok, reply and turn id
(what the HTTP API answers as `meta`, H1).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from cellgate.models import ConversationKey, OutboundMessage
from orchestrator.bridge.catalogue import ToolDef
from sandbox.backends.base import SandboxBackend, SandboxHandle
from sandbox.mountplan import BRIDGE, WORKSPACE

__all__ = [
    "ExecDetail",
    "Harness",
    "HistoryEntry",
    "ModelDetail",
    "SentMessage",
    "SessionContext",
    "ToolDef",
    "TurnDetail",
    "TurnRequest",
    "TurnResult",
]

Role = Literal["user", "assistant"]
_WS = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One earlier user or assistant text of the conversation (D3: seeds a cold session)."""

    role: Role
    text: str

    @classmethod
    def parse_many(cls, raw: object) -> tuple[HistoryEntry, ...]:
        """Entries from a transcript's `{role, text}` records; anything else is dropped.

        The transcript lives in the sandbox-writable chat directory: every
        record is checked, none is trusted.
        """
        if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
            return ()
        out: list[HistoryEntry] = []
        for item in raw:
            if not isinstance(item, Mapping):
                continue
            role, text = item.get("role"), item.get("text", item.get("content"))
            if role in ("user", "assistant") and isinstance(text, str) and _WS.sub("", text):
                out.append(cls(role, text))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """What one turn gets.

    - `prompt`: the message.
    - `system_prompt`: the composed CLAUDE.md (M5); None: the harness's own default.
    - `history`: earlier texts, for a harness that keeps its history in memory (D3).
    - `resume_id`: the harness session id saved in the conversation's directory (D3).
    - `tools`: the bridge tools this scope is offered (T1, T2), from the catalogue.
    """

    prompt: str
    system_prompt: str | None = None
    history: tuple[HistoryEntry, ...] = ()
    resume_id: str | None = None
    tools: tuple[ToolDef, ...] = ()


@dataclass(frozen=True, slots=True)
class SentMessage:
    """A bridge delivery made during the turn, as the API shows it (no host paths)."""

    kind: str
    text: str | None
    file_name: str | None = None
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, message: OutboundMessage) -> SentMessage:
        extra = tuple(sorted((str(k), str(v)) for k, v in (message.extra or {}).items()))
        return cls(message.kind.value, message.text, message.file_name or None, extra)

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "text": self.text}
        if self.file_name:
            out["file_name"] = self.file_name
        if self.extra:
            out["extra"] = dict(self.extra)
        return out


@dataclass(frozen=True, slots=True)
class ExecDetail:
    """A turn that was one command in the sandbox (shell, command harnesses)."""

    exit_code: int
    timed_out: bool
    resumed: bool = False
    resume_failed: bool = False

    def wire(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "resumed": self.resumed,
            "resume_failed": self.resume_failed,
        }


@dataclass(frozen=True, slots=True)
class ModelDetail:
    """A turn of a model loop run by the gateway (OpenAI-compatible harness)."""

    model: str
    steps: int
    tools_called: tuple[str, ...] = ()
    max_steps_reached: bool = False
    error: str | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "steps": self.steps,
            "tools": list(self.tools_called),
            "max_steps": self.max_steps_reached,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


TurnDetail = ExecDetail | ModelDetail | None


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What `dispatch` returns (H1: ok, reply, turn_id, and the rest as typed fields)."""

    ok: bool
    reply: str
    turn_id: str
    harness_session_id: str | None = None
    messages_sent: tuple[SentMessage, ...] = ()
    detail: TurnDetail = None

    @property
    def meta(self) -> dict[str, Any]:
        """The wire form of everything but ok, reply and turn id (the API's `meta`)."""
        out: dict[str, Any] = {} if self.detail is None else self.detail.wire()
        if self.harness_session_id is not None:
            out["harness_session_id"] = self.harness_session_id
        if self.messages_sent:
            out["messages"] = [m.wire() for m in self.messages_sent]
        return out


@dataclass(frozen=True, slots=True)
class SessionContext:
    """Everything a harness may use for one session of one conversation."""

    conversation: ConversationKey
    session_key: str
    backend: SandboxBackend
    sandbox: SandboxHandle
    env: Mapping[str, str]
    workdir: str
    # Where the session sees its workspace, and how it calls a bridge tool: a
    # container's `/workspace` and `/run/cellgate/cellgate-tool`, or a host
    # agent's host paths (S6).
    shown_workspace: PurePosixPath = WORKSPACE
    bridge_argv: tuple[str, ...] = ("python3", str(BRIDGE / "cellgate-tool"))


class Harness(abc.ABC):
    @abc.abstractmethod
    async def ensure_session(self, ctx: SessionContext) -> str:
        """Prepare or reuse the session; return the harness's own session id."""

    @abc.abstractmethod
    async def dispatch(self, ctx: SessionContext, request: TurnRequest) -> TurnResult:
        """Run one turn and return its result."""

    @abc.abstractmethod
    async def reset_session(self, ctx: SessionContext) -> None:
        """Forget the session so the next turn starts cold."""
