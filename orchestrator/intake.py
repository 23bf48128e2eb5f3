"""Intake: accept a message from any channel, store it, and wake its conversation's turn.

A message is committed to the store (idempotent on its platform id) before
anyone is told it was accepted (D1); the turn loop picks it up from there.
"""

from __future__ import annotations

import asyncio
import uuid

from cellgate.models import ConversationKey
from orchestrator.agents import Agents
from orchestrator.store import Message
from orchestrator.store.views import IntakeStore
from orchestrator.turns import TurnLoop


class Intake:
    def __init__(self, agents: Agents, store: IntakeStore, loop: TurnLoop) -> None:
        self.agents = agents
        self.store = store
        self.loop = loop

    async def submit(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        *,
        message_id: str | None = None,
        sender: str = "",
    ) -> tuple[Message, bool]:
        """Store the message (idempotent on its platform id) and queue its turn."""
        self.agents.runnable(agent_id)
        key = ConversationKey(agent_id, channel, chat_id)
        conv = await asyncio.to_thread(self.store.upsert_conversation, key)
        msg, created = await asyncio.to_thread(
            self.store.accept_message,
            conv.id,
            message_id or uuid.uuid4().hex,
            sender=sender,
            text=text,
        )
        self.loop.wake(conv.id)
        return msg, created
