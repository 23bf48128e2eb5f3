"""The `api` channel: send a message in an API chat, and read its answer.

- `POST /v1/agents/{agent}/chats/{chat_id}/messages` with `{"text": ...}`
  runs one turn and answers `{ok, reply, turn_id, conversation, meta}`.
  With `?wait=false` it answers 202 `{message_id, state, conversation}` as soon
  as the message is stored, and the turn runs in the background.
- `GET /v1/agents/{agent}/chats/{chat_id}/messages/{message_id}` tells the
  message's state and, once answered, its reply.

`message_id` in the body is the client's idempotency key: the same id sent
again (a retry after a timeout or a gateway restart) is the same message,
answered once (D1). Without one the gateway makes one up.

Here `{chat_id}` is the API client's own chat id (any string up to 512
characters), not a conversation id: an API chat is one conversation across
all of its sessions. Sending needs a key naming the agent (K2); it is the
agent's ordinary use, so K3 does not apply and `write` is not needed. The
first message binds the chat, and every session in it, to the key that sent
it: another non-admin key is refused there (403, K4), as it is from the
chat's media and shares.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from cellgate.models import ConversationKey
from orchestrator.api.auth import CallerKey, require
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import agent_id
from orchestrator.gateway import TurnOutcome
from orchestrator.store import ConversationId, Message, Reply, Store, conversation_id
from policies.api_access import ApiChatFacts

__all__ = ["MessageIn", "MessageOut", "router"]

router = APIRouter(tags=["chat"])

MESSAGE_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=100_000)
    message_id: str | None = Field(None, pattern=MESSAGE_ID_PATTERN)
    sender: str = Field(
        "",
        max_length=128,
        description="the end user behind this message, when the caller relays several: "
        "rate limits and fair scheduling count per sender (R4)",
    )


class MessageOut(BaseModel):
    ok: bool
    reply: str
    turn_id: str
    conversation: str
    meta: dict[str, Any]

    @classmethod
    def of(cls, outcome: TurnOutcome) -> MessageOut:
        r = outcome.result
        return cls(
            ok=r.ok,
            reply=r.reply,
            turn_id=r.turn_id,
            conversation=outcome.conversation.dir_name,
            meta=r.meta,
        )


class MessageState(BaseModel):
    message_id: str
    state: str
    conversation: str
    reply: str | None = None


def _chat(chat_id: str) -> str:
    if "\x00" in chat_id or len(chat_id) > 512:
        raise ApiError(400, "bad_chat_id", "chat id must be 1-512 characters without NUL")
    return chat_id


@router.post(
    "/v1/agents/{agent}/chats/{chat_id}/messages",
    response_model=MessageOut | MessageState,
    responses={202: {"model": MessageState}},
)
async def post_message(
    agent: str,
    chat_id: str,
    body: MessageIn,
    who: CallerKey,
    ctx: Annotated[ApiContext, Depends(context)],
    response: Response,
    wait: Annotated[bool, Query(description="false: answer 202 once stored")] = True,
) -> MessageOut | MessageState:
    """Send a message in the API chat `chat_id`; by default wait for the agent's reply."""
    agent_id(agent)
    _chat(chat_id)
    require(ctx, who, agent, "message")
    conv = conversation_id(ConversationKey(agent, "api", chat_id))
    owner = await asyncio.to_thread(ctx.store.bind_api_chat, conv, who.facts.ref or "")
    require(ctx, who, agent, "message", api_chat=ApiChatFacts(owner))  # K4: its own chat
    mid = body.message_id or uuid.uuid4().hex
    if wait:
        outcome = await ctx.gateway.turn(
            agent, "api", chat_id, body.text, message_id=mid, sender=body.sender
        )
        return MessageOut.of(outcome)
    msg, _ = await ctx.gateway.submit(
        agent, "api", chat_id, body.text, message_id=mid, sender=body.sender
    )
    response.status_code = 202
    key = ConversationKey(agent, "api", chat_id)
    return MessageState(message_id=mid, state=msg.state.value, conversation=key.dir_name)


@router.get("/v1/agents/{agent}/chats/{chat_id}/messages/{message_id}", response_model=MessageState)
async def get_message(
    agent: str,
    chat_id: str,
    message_id: Annotated[str, Path(pattern=MESSAGE_ID_PATTERN)],
    who: CallerKey,
    ctx: Annotated[ApiContext, Depends(context)],
) -> MessageState:
    """The state of a message sent in the API chat `chat_id`, and its reply once answered."""
    agent_id(agent)
    _chat(chat_id)
    require(ctx, who, agent, "message")
    key = ConversationKey(agent, "api", chat_id)
    store = ctx.store
    owner = await asyncio.to_thread(store.api_chat_owner, conversation_id(key))
    exists = await asyncio.to_thread(store.get_conversation, conversation_id(key))
    if owner is not None or exists is not None:
        require(ctx, who, agent, "message", api_chat=ApiChatFacts(owner))  # K4: its own chat
    msg, reply = await asyncio.to_thread(_stored, store, conversation_id(key), message_id)
    if msg is None:
        raise ApiError(404, "unknown_message", f"no message {message_id!r} in this chat")
    return MessageState(
        message_id=message_id,
        state=msg.state.value,
        conversation=key.dir_name,
        reply=reply.text if reply else None,
    )


def _stored(
    store: Store, conversation: ConversationId, message_id: str
) -> tuple[Message | None, Reply | None]:
    """A message and its reply, told only once on disk: a reply committed a moment ago
    may still wait for its fsync (D1, group commit: `Store.deferred_sync`)."""
    with store.deferred_sync() as ticket:
        msg = store.find_message(conversation, message_id)
        reply = None if msg is None else store.reply_for_message(msg.id)
    store.sync(ticket)
    return msg, reply
