"""`POST /v1/agents/{agent}/chats/{chat_id}/messages`: one turn of the `api` channel.

`{"text": ...}` with `Authorization: Bearer <key>` runs one turn in that API
chat's conversation and answers `{ok, reply, turn_id, conversation, meta}`.
Here `{chat_id}` is the API client's own chat id (any string up to 512
characters), not a conversation id: an API chat is one conversation across
all of its sessions and keys. Sending needs a key naming the agent (K2);
it is the agent's ordinary use, so K3 does not apply and `write` is not needed.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.api.auth import CallerKey, require
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import agent_id
from orchestrator.gateway import TurnOutcome

__all__ = ["MessageIn", "MessageOut", "router"]

router = APIRouter(tags=["chat"])


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=100_000)


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
            meta=dict(r.meta),
        )


@router.post("/v1/agents/{agent}/chats/{chat_id}/messages", response_model=MessageOut)
async def post_message(
    agent: str,
    chat_id: str,
    body: MessageIn,
    who: CallerKey,
    ctx: Annotated[ApiContext, Depends(context)],
) -> MessageOut:
    """Send a message in the API chat `chat_id` and wait for the agent's reply."""
    agent_id(agent)
    if "\x00" in chat_id or len(chat_id) > 512:
        raise ApiError(400, "bad_chat_id", "chat id must be 1-512 characters without NUL")
    require(ctx, who, agent, "message")
    outcome = await ctx.gateway.turn(agent, "api", chat_id, body.text)
    return MessageOut.of(outcome)
