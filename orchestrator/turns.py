"""The durable turn loop (D1, D2).

A message is committed to the store before it is acknowledged. Turns of one
conversation run one at a time, in arrival order (one worker task per
conversation, draining the store's queue); conversations run in parallel under
a global bound. A turn that fails or times out is answered with an error reply
that says so: the failure reaches the chat, it is not swallowed. Every reply is
recorded under an outbound key before it is delivered, so a crash between the
two delivers the stored reply again instead of running the turn again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cellgate.errors import CellgateError, StateConflict
from orchestrator.store import (
    Conversation,
    ConversationId,
    Message,
    MessageId,
    MessageState,
    Reply,
    Store,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TurnAnswer:
    ok: bool
    text: str


RunTurn = Callable[[Conversation, Message], Awaitable[TurnAnswer]]
Deliver = Callable[[Conversation, Reply], Awaitable[None]]


def outbound_key(message_id: MessageId) -> str:
    return f"reply:{message_id}"


class TurnLoop:
    def __init__(self, store: Store, run_turn: RunTurn, deliver: Deliver, *, bound: int) -> None:
        self.store = store
        self._run_turn = run_turn
        self._deliver = deliver
        self._bound = asyncio.Semaphore(bound)
        self._workers: dict[ConversationId, asyncio.Task[None]] = {}
        self._again: set[ConversationId] = set()
        self._locks: dict[ConversationId, asyncio.Lock] = {}
        self._waiters: dict[MessageId, list[asyncio.Future[Reply]]] = {}
        self._closing = False

    def conversation_lock(self, conversation_id: ConversationId) -> asyncio.Lock:
        """Held while a turn of this conversation runs; a heartbeat takes it too (M4)."""
        lock = self._locks.get(conversation_id)
        if lock is None:
            lock = self._locks[conversation_id] = asyncio.Lock()
        return lock

    # -- intake ------------------------------------------------------------

    def wake(self, conversation_id: ConversationId) -> None:
        """Make sure a worker drains this conversation's queue."""
        if self._closing:
            return
        task = self._workers.get(conversation_id)
        if task is not None and not task.done():
            self._again.add(conversation_id)
            return
        self._workers[conversation_id] = asyncio.create_task(
            self._worker(conversation_id), name=f"turns:{conversation_id}"
        )

    async def recover(self) -> int:
        """D2: finish what a crash interrupted; returns how many messages were pending."""
        closed = await asyncio.to_thread(self.store.close_open_turns)
        pending = await asyncio.to_thread(self.store.undelivered_messages)
        for conv in dict.fromkeys(m.conversation_id for m in pending):
            self.wake(conv)
        if pending or closed:
            logger.info("recovery: %d pending messages, %d interrupted turns", len(pending), closed)
        return len(pending)

    async def wait(self, message_id: MessageId, timeout: float) -> Reply:  # noqa: ASYNC109
        """The reply to a message, once it exists (raises TimeoutError)."""
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(message_id, []).append(fut)
        try:
            reply = await asyncio.to_thread(self.store.reply_for_message, message_id)
            if reply is not None:
                return reply
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            waiters = self._waiters.get(message_id, [])
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._waiters.pop(message_id, None)

    # -- the worker --------------------------------------------------------

    async def _worker(self, conversation_id: ConversationId) -> None:
        while True:
            self._again.discard(conversation_id)
            pending = await asyncio.to_thread(self.store.pending_for_conversation, conversation_id)
            for message in pending:
                if self._closing:
                    return
                await self._process(message)
            if conversation_id not in self._again:
                return

    async def _process(self, message: Message) -> None:
        conv = await asyncio.to_thread(self.store.get_conversation, message.conversation_id)
        if conv is None:
            logger.error("message %s has no conversation; failing it", message.id)
            await asyncio.to_thread(
                self.store.transition,
                message.id,
                message.state,
                MessageState.FAILED,
                error="conversation missing",
            )
            return
        existing = await asyncio.to_thread(self.store.reply_for_message, message.id)
        if existing is not None:
            reply = existing
        else:
            if message.state is MessageState.RUNNING:
                # The previous process died mid-turn: run it again.
                message = await asyncio.to_thread(
                    self.store.transition, message.id, MessageState.RUNNING, MessageState.ACCEPTED
                )
            async with self.conversation_lock(conv.id), self._bound:
                answer = await self._answer(conv, message)
            reply, _ = await asyncio.to_thread(
                self.store.record_reply, message.id, outbound_key(message.id), answer.text
            )
        if reply.delivered_at is None:
            await self._deliver(conv, reply)
            try:
                reply = await asyncio.to_thread(self.store.mark_delivered, reply.outbound_key)
            except StateConflict:
                logger.debug("reply %s already marked delivered", reply.outbound_key)
        for fut in self._waiters.get(message.id, []):
            if not fut.done():
                fut.set_result(reply)

    async def _answer(self, conv: Conversation, message: Message) -> TurnAnswer:
        try:
            return await self._run_turn(conv, message)
        except CellgateError as exc:
            logger.warning(
                "turn for message %s failed: %s",
                message.id,
                exc,
                extra={"conversation": conv.id},
            )
            return TurnAnswer(False, f"⚠️ This message could not be answered: {exc}")
        except Exception as exc:
            logger.exception("turn for message %s crashed", message.id)
            name = type(exc).__name__
            return TurnAnswer(
                False, f"⚠️ This message could not be answered (internal error: {name})"
            )

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in self._workers.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
