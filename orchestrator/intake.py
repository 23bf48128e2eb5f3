"""Intake: accept a message from any channel, store it, and wake its conversation's turn.

A message first passes admission (R4: the sender's and the chat's rates, the
chat's queue bound); a refused one raises `Throttled` and nothing is stored.
An admitted one is committed to the store (idempotent on its platform id)
before anyone is told it was accepted (D1); the turn loop picks it up there.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence

from cellgate.models import ConversationKey
from orchestrator.admission import MessageGate
from orchestrator.agents import Agents
from orchestrator.lane import in_lane, in_sync_lane
from orchestrator.store import Message, conversation_id
from orchestrator.store.views import IntakeStore
from orchestrator.store.walsync import SyncTicket
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
            return await in_lane(self.store.pending_count, conv)

        # admitted first: a refused message (a flood of new chats) makes no conversation row
        await self.gate.admit(agent_id, channel, chat_id, sender, conv, pending)
        accept = functools.partial(
            self.store.accept_new,
            key,
            message_id or uuid.uuid4().hex,
            sender=sender,
            text=text,
            files=files,
        )
        msg, created, ticket = await in_lane(self._accept, accept)
        try:
            # D1: on disk before anyone is told (the channel acknowledges the platform once
            # this returns); the fsync is shared with the other messages committed meanwhile
            await in_sync_lane(self.store.sync, ticket)
        finally:
            # stored all the same when the fsync failed: its turn is not lost, and its
            # reply's own sync (later in the same WAL) covers the message too
            self.loop.wake(conv)
        return msg, created

    def _accept(
        self, accept: Callable[[], tuple[Message, bool]]
    ) -> tuple[Message, bool, SyncTicket]:
        with self.store.deferred_sync() as ticket:
            msg, created = accept()
        return msg, created, ticket
