"""An agent's chats, for the operator: list, one chat, sessions, messages, search, active days,
and session inject (K3).

`{chat}` is a conversation id (32 hex) or its directory name
(`<channel>-<chatId>-<hash>`), both as the chat list shows them, and is
resolved only through the store. For an isolated agent every endpoint here
needs an admin key (K3); for any other agent, a key naming it (K2), and
inject, which writes, a key with `write: true`. An API chat belongs to the
key that started it (K4): another non-admin key does not see it in the list
or in search, and is refused (403) on it and its sessions.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.api.auth import CallerKey, api_chat_facts, require, sees_conversation
from orchestrator.api.chat import MessageOut
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import CHAT_PATTERN, agent_id, chat_ref
from orchestrator.store import Conversation, ConversationId, Session
from orchestrator.store.queries import (
    MAX_LIMIT,
    ActiveDay,
    TranscriptEntry,
    active_days,
    conversation_by_dir_name,
    search_messages,
    sessions_of,
    transcript,
)

__all__ = ["router"]

router = APIRouter(tags=["chats"])

Ctx = Annotated[ApiContext, Depends(context)]
AgentPath = Annotated[str, Path(description="The agent id.", json_schema_extra={
    "pattern": r"^[a-z0-9][a-z0-9-]{0,39}$"})]  # fmt: skip
ChatPath = Annotated[str, Path(
    description="A conversation id or its directory name, as the chat list shows them.",
    json_schema_extra={"pattern": CHAT_PATTERN},
)]  # fmt: skip
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]


class ChatOut(BaseModel):
    id: str
    dir_name: str
    channel: str
    chat_id: str
    created_at: float
    last_active_at: float

    @classmethod
    def of(cls, c: Conversation) -> ChatOut:
        return cls(id=c.id, dir_name=c.dir_name, channel=c.channel, chat_id=c.chat_id,
                   created_at=c.created_at, last_active_at=c.last_active_at)  # fmt: skip


class SessionOut(BaseModel):
    id: str
    conversation: str
    harness: str
    state: str
    busy: int
    started_at: float
    last_active_at: float
    ended_at: float | None

    @classmethod
    def of(cls, s: Session) -> SessionOut:
        return cls(id=s.id, conversation=s.conversation_id, harness=s.harness, state=s.state,
                   busy=s.busy, started_at=s.started_at, last_active_at=s.last_active_at,
                   ended_at=s.ended_at)  # fmt: skip


class MessageEntryOut(BaseModel):
    id: int
    conversation: str
    sender: str
    text: str
    received_at: float
    state: str
    reply: str | None
    replied_at: float | None
    delivered_at: float | None

    @classmethod
    def of(cls, e: TranscriptEntry) -> MessageEntryOut:
        return cls(id=e.message_id, conversation=e.conversation_id, sender=e.sender, text=e.text,
                   received_at=e.received_at, state=e.state, reply=e.reply,
                   replied_at=e.replied_at, delivered_at=e.delivered_at)  # fmt: skip


class ActiveDayOut(BaseModel):
    day: str
    messages: int

    @classmethod
    def of(cls, d: ActiveDay) -> ActiveDayOut:
        return cls(day=d.day, messages=d.messages)


class InjectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=100_000)


def _agent(ctx: ApiContext, agent: str) -> None:
    if not ctx.agent_known(agent):
        raise ApiError(404, "unknown_agent", f"no agent {agent!r} is configured")


def _chat(
    ctx: ApiContext, who: CallerKey, agent: str, chat: str, *, write: bool = False
) -> Conversation:
    conv = (
        ctx.store.get_conversation(ConversationId(chat))
        if len(chat) == 32 and "-" not in chat
        else conversation_by_dir_name(ctx.store, agent, chat)
    )
    if conv is None or conv.agent != agent:
        raise ApiError(404, "not_found", f"agent {agent!r} has no chat {chat!r}")
    api_chat = api_chat_facts(ctx, conv)
    if api_chat is not None:  # K4: an API chat only for the key it is bound to
        require(ctx, who, agent, "chats", is_write=write, api_chat=api_chat)
    return conv


def _open(
    ctx: ApiContext, who: CallerKey, agent: str, chat: str | None = None, *, write: bool = False
) -> None:
    """Validate the ids (400), decide (K2/K3: 401/403), then check the agent exists (404)."""
    agent_id(agent)
    if chat is not None:
        chat_ref(chat)
    require(ctx, who, agent, "chats", is_write=write)
    _agent(ctx, agent)


@router.get("/v1/agents/{agent}/chats", response_model=list[ChatOut])
def list_chats(agent: AgentPath, who: CallerKey, ctx: Ctx) -> list[ChatOut]:
    """Every chat of the agent, oldest first."""
    _open(ctx, who, agent)
    owners = ctx.store.api_chat_owners(agent)
    return [ChatOut.of(c) for c in ctx.store.conversations(agent)
            if sees_conversation(who, c, owners)]  # fmt: skip


@router.get("/v1/agents/{agent}/chats/search", response_model=list[MessageEntryOut])
def search_chats(
    agent: AgentPath,
    who: CallerKey,
    ctx: Ctx,
    q: Annotated[str, Query(min_length=1, max_length=500, description="Substring to find.")],
    channel: Annotated[str | None, Query(max_length=16)] = None,
    limit: Limit = 100,
) -> list[MessageEntryOut]:
    """Messages (and replies) of any chat of the agent that contain `q`, newest first."""
    _open(ctx, who, agent)
    found = search_messages(ctx.store, agent, q, channel=channel, limit=limit)
    if not who.admin:  # K4: not another key's API chats
        owners = ctx.store.api_chat_owners(agent)
        convs = {c.id: c for c in ctx.store.conversations(agent)}
        found = [e for e in found
                 if e.conversation_id in convs
                 and sees_conversation(who, convs[e.conversation_id], owners)]  # fmt: skip
    return [MessageEntryOut.of(e) for e in found]


@router.get("/v1/agents/{agent}/chats/{chat}", response_model=ChatOut)
def get_chat(agent: AgentPath, chat: ChatPath, who: CallerKey, ctx: Ctx) -> ChatOut:
    _open(ctx, who, agent, chat)
    return ChatOut.of(_chat(ctx, who, agent, chat))


@router.get("/v1/agents/{agent}/chats/{chat}/sessions", response_model=list[SessionOut])
def chat_sessions(agent: AgentPath, chat: ChatPath, who: CallerKey, ctx: Ctx) -> list[SessionOut]:
    """Every session of the chat, live or ended, oldest first."""
    _open(ctx, who, agent, chat)
    conv = _chat(ctx, who, agent, chat)
    return [SessionOut.of(s) for s in sessions_of(ctx.store, conv.id)]


@router.get("/v1/agents/{agent}/chats/{chat}/messages", response_model=list[MessageEntryOut])
def chat_messages(
    agent: AgentPath,
    chat: ChatPath,
    who: CallerKey,
    ctx: Ctx,
    q: Annotated[
        str | None, Query(max_length=500, description="Only messages containing this.")
    ] = None,
    before: Annotated[
        int | None, Query(ge=1, le=2**62, description="Older than this message id.")
    ] = None,
    limit: Limit = 100,
) -> list[MessageEntryOut]:
    """The chat's messages with their replies, newest first."""
    _open(ctx, who, agent, chat)
    conv = _chat(ctx, who, agent, chat)
    entries = transcript(ctx.store, conv.id, q=q or None, before=before, limit=limit)
    return [MessageEntryOut.of(e) for e in entries]


@router.get("/v1/agents/{agent}/chats/{chat}/active-days", response_model=list[ActiveDayOut])
def chat_active_days(
    agent: AgentPath, chat: ChatPath, who: CallerKey, ctx: Ctx
) -> list[ActiveDayOut]:
    """The UTC days with messages in this chat, and how many."""
    _open(ctx, who, agent, chat)
    conv = _chat(ctx, who, agent, chat)
    return [ActiveDayOut.of(d) for d in active_days(ctx.store, conv.id)]


@router.post("/v1/agents/{agent}/chats/{chat}/inject", response_model=MessageOut)
async def inject(
    agent: AgentPath, chat: ChatPath, body: InjectIn, who: CallerKey, ctx: Ctx
) -> MessageOut:
    """Run a turn in this chat as the operator; a channel chat gets the reply on its channel."""
    _open(ctx, who, agent, chat, write=True)
    conv = await asyncio.to_thread(_chat, ctx, who, agent, chat, write=True)
    outcome = await ctx.gateway.turn(agent, conv.channel, conv.chat_id, body.text)
    return MessageOut.of(outcome)
