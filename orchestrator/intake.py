"""Intake: accept a message from any channel, store it, and wake its conversation's turn.

A message first passes admission (R4: the sender's and the chat's rates, the
chat's queue bound); a refused one raises `Throttled` and nothing is stored.
An admitted one is committed to the store (idempotent on its platform id)
before anyone is told it was accepted (D1); the turn loop picks it up there.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence

from cellgate.models import ConversationKey
from orchestrator.admission import MessageGate
from orchestrator.agents import Agents
from orchestrator.lane import in_lane
from orchestrator.store import Message, conversation_id
from orchestrator.store.views import IntakeStore
from orchestrator.turns import TurnLoop


class Intake:
    def __init__(
        self, agents: Agents, store: IntakeStore, loop: TurnLoop, gate: MessageGate
    ) -> None:
        self.agents = agents
        self.store = store
        self.loop = loop
        self.gate = gate

    async def submit(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        *,
        message_id: str | None = None,
        sender: str = "",
        files: Sequence[tuple[str, str]] = (),
    ) -> tuple[Message, bool]:
        """Store the message (idempotent on its platform id), with the (file id, platform)
        of each attachment it brought (P3), and queue its turn."""
        self.agents.runnable(agent_id)
        key = ConversationKey(agent_id, channel, chat_id)
        conv = conversation_id(key)

        async def pending() -> int:
            return len(await in_lane(self.store.pending_for_conversation, conv))

        # admitted first: a refused message (a flood of new chats) makes no conversation row
        await self.gate.admit(agent_id, channel, chat_id, sender, conv, pending)
        msg, created = await in_lane(
            functools.partial(
                self.store.accept_new,
                key,
                message_id or uuid.uuid4().hex,
                sender=sender,
                text=text,
                files=files,
            )
        )
        self.loop.wake(conv)
        return msg, created
