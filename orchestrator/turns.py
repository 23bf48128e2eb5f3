"""The durable turn loop (D1, D2).

A message is committed to the store before it is acknowledged. Turns of one
conversation run one at a time, in arrival order (one worker task per
conversation, draining the store's queue); conversations run in parallel under
a global bound, shared fairly between senders (`FairSlots`, R4), so one
stranger's slow turns never hold every slot. A turn that fails or times out
is answered with a short reply that says so and carries a reference id; the
details go to the log and the audit table, never to the chat (R6). Every reply
is recorded under an outbound key before it is delivered, so a crash between
the two delivers the stored reply again instead of running the turn again. A
delivery that fails is retried with a growing pause, in order, and given up
(the message FAILED, the log says why) after `DELIVERY_ATTEMPTS`; it never
ends the conversation's worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from cellgate.errors import (
    CellgateError,
    EngineUnavailable,
    StateConflict,
    TurnTimeout,
    new_ref,
)
from orchestrator.bounded import LruMap
from orchestrator.lane import in_lane, in_sync_lane
from orchestrator.slots import FairSlots
from orchestrator.store import (
    Conversation,
    ConversationId,
    Message,
    MessageId,
    MessageState,
    Reply,
)
from orchestrator.store.views import RefusalStore, TurnQueueStore
from orchestrator.store.walsync import SyncTicket

logger = logging.getLogger(__name__)

DELIVERY_ATTEMPTS = 6
ENGINE_ATTEMPTS = 8
FIRST_RETRY_SECONDS = 2.0
MAX_RETRY_SECONDS = 300.0
_ATTEMPTS_MAX = 4096


@dataclass(frozen=True, slots=True)
class TurnAnswer:
    ok: bool
    text: str


RunTurn = Callable[[Conversation, Message], Awaitable[TurnAnswer]]
Deliver = Callable[[Conversation, Reply], Awaitable[None]]


class LoopStore(TurnQueueStore, RefusalStore, Protocol):
    """The store as the turn loop uses it: the queue, and the audit of failures."""


def outbound_key(message_id: MessageId) -> str:
    return f"reply:{message_id}"


def failure_text(exc: BaseException, ref: str) -> str:
    """What a chat sees of a failed turn: what kind of failure, and the reference (R6)."""
    if isinstance(exc, TurnTimeout):
        what = f"it took longer than {exc.seconds:g} s"
    elif isinstance(exc, CellgateError) and exc.public:
        what = exc.public
    else:
        what = "something went wrong on our side"
    return f"⚠️ This message could not be answered: {what}. (ref {ref})"


class TurnLoop:
    def __init__(
        self,
        store: LoopStore,
        run_turn: RunTurn,
        deliver: Deliver,
        *,
        bound: int,
        delivered_by_store: Callable[[Conversation], bool] = lambda conv: False,
        per_sender: int | None = None,
        turn_timeout: float | None = None,
        retry_pause: float = FIRST_RETRY_SECONDS,
    ) -> None:
        self.store = store
        self._run_turn = run_turn
        self._deliver = deliver
        self._by_store = delivered_by_store  # its caller reads the stored reply (`api`)
        self.slots = FairSlots(bound, per_sender)
        self._turn_timeout = turn_timeout
        self._retry_pause = retry_pause
        self._workers: dict[ConversationId, asyncio.Task[None]] = {}
        self._again: set[ConversationId] = set()
        self._locks: dict[ConversationId, asyncio.Lock] = {}
        self._waiters: dict[MessageId, list[asyncio.Future[Reply]]] = {}
        self._attempts: LruMap[MessageId, int] = LruMap(_ATTEMPTS_MAX)
        self._engine_attempts: LruMap[MessageId, int] = LruMap(_ATTEMPTS_MAX)
        self._engine_down = False
        self._retries: dict[ConversationId, asyncio.TimerHandle] = {}
        self._closing = False

    def conversation_lock(self, conversation_id: ConversationId) -> asyncio.Lock:
        """Held while a turn of this conversation runs; a heartbeat takes it too (M4).

        A lock lives only while someone holds or waits for it, or its worker
        runs, so the map is bounded by the conversations in flight.
        """
        lock = self._locks.get(conversation_id)
        if lock is None:
            lock = self._locks[conversation_id] = asyncio.Lock()
        return lock

    def _forget_lock(self, conversation_id: ConversationId) -> None:
        lock = self._locks.get(conversation_id)
        if lock is not None and not lock.locked() and not getattr(lock, "_waiters", None):
            del self._locks[conversation_id]

    def conversation_busy(self, conversation_id: ConversationId) -> bool:
        """A turn or heartbeat holds, or waits for, this conversation right now."""
        lock = self._locks.get(conversation_id)
        return lock is not None and (lock.locked() or bool(getattr(lock, "_waiters", None)))

    @property
    def workers(self) -> int:
        """Conversations with a worker draining their queue right now."""
        return sum(1 for t in self._workers.values() if not t.done())

    # -- intake ------------------------------------------------------------

    def wake(self, conversation_id: ConversationId) -> None:
        """Make sure a worker drains this conversation's queue."""
        if self._closing:
            return
        task = self._workers.get(conversation_id)
        if task is not None and not task.done():
            self._again.add(conversation_id)
            return
        task = asyncio.create_task(self._worker(conversation_id), name=f"turns:{conversation_id}")
        self._workers[conversation_id] = task
        task.add_done_callback(partial(self._worker_done, conversation_id))

    def _worker_done(self, conversation_id: ConversationId, task: asyncio.Task[None]) -> None:
        if self._workers.get(conversation_id) is task:
            del self._workers[conversation_id]
        self._forget_lock(conversation_id)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "turn worker of %s ended with an error; retrying",
                conversation_id,
                exc_info=task.exception(),
            )
            self._retry_later(conversation_id, self._retry_pause)

    def _retry_later(self, conversation_id: ConversationId, delay: float) -> None:
        if self._closing or conversation_id in self._retries:
            return

        def fire() -> None:
            self._retries.pop(conversation_id, None)
            self.wake(conversation_id)

        self._retries[conversation_id] = asyncio.get_running_loop().call_later(delay, fire)

    async def recover(self) -> int:
        """D2: finish what a crash interrupted; returns how many messages were pending."""
        closed = await in_lane(self.store.close_open_turns)
        pending = await in_lane(self.store.undelivered_messages)
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
            reply, ticket = await in_lane(self._stored_reply, message_id)
            if reply is not None:
                await in_sync_lane(self.store.sync, ticket)  # D1: on disk before it is told
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
            pending = await in_lane(self.store.pending_for_conversation, conversation_id)
            for message in pending:
                if self._closing:
                    return
                if not await self._process(message):
                    return  # a delivery failed: retried later, in order
            if conversation_id not in self._again:
                return

    async def _process(self, message: Message) -> bool:
        """Answer and deliver one message; False when its delivery must be retried later."""
        conv, existing, stored = await in_lane(self._lookup, message)
        if conv is None:
            logger.error("message %s has no conversation; failing it", message.id)
            await in_lane(
                self.store.transition,
                message.id,
                message.state,
                MessageState.FAILED,
                error="conversation missing",
            )
            return True
        by_store = False
        if existing is not None:
            # recorded before (a delivery to retry): its fsync may not have ended (D1)
            await in_sync_lane(self.store.sync, stored)
            reply = existing
        else:
            if message.state is MessageState.RUNNING:
                # The previous process died mid-turn: run it again.
                message = await in_lane(
                    self.store.transition, message.id, MessageState.RUNNING, MessageState.ACCEPTED
                )
            owner = message.sender or f"conversation:{conv.id}"
            async with self.conversation_lock(conv.id), self.slots.slot(owner):
                answer = await self._answer(conv, message)
            if answer is None:
                await self._engine_wait(conv, message)
                return False
            if self._engine_down:
                self._engine_down = False
                logger.info("the sandbox engine answers again; turns go on")
            # a reply its caller reads from the store is delivered as it is stored (F3: one
            # commit, not two); the delivery below only counts it
            by_store = self._by_store(conv)
            reply, ticket = await in_lane(self._record, message.id, answer.text, by_store)
            # D1: on disk before it is sent or handed to its caller (a group fsync, off
            # the turn lane)
            await in_sync_lane(self.store.sync, ticket)
        self._engine_attempts.pop(message.id)
        self._resolve(message.id, reply)
        undelivered = by_store or reply.delivered_at is None
        if undelivered and not await self._try_deliver(conv, message, reply):
            return False
        self._attempts.pop(message.id)
        return True

    def _stored_reply(self, message_id: MessageId) -> tuple[Reply | None, SyncTicket]:
        """The message's reply if it has one, and a ticket that covers its commit (it may
        be a reply recorded a moment ago, whose fsync has not ended yet)."""
        with self.store.deferred_sync() as ticket:
            return self.store.reply_for_message(message_id), ticket

    def _lookup(self, message: Message) -> tuple[Conversation | None, Reply | None, SyncTicket]:
        """The message's conversation and its reply if it has one (one thread hop, F3)."""
        with self.store.deferred_sync() as ticket:
            conv = self.store.get_conversation(message.conversation_id)
            reply = None if conv is None else self.store.reply_for_message(message.id)
        return conv, reply, ticket

    async def _engine_wait(self, conv: Conversation, message: Message) -> None:
        """R7: the engine is away; the message goes back in the queue and waits for it."""
        self._engine_down = True
        current = await in_lane(self.store.get_message, message.id)
        if current is not None and current.state is MessageState.RUNNING:
            await in_lane(
                self.store.transition, message.id, MessageState.RUNNING, MessageState.ACCEPTED
            )
        attempts = (self._engine_attempts.pop(message.id) or 0) + 1
        self._engine_attempts.put(message.id, attempts)
        pause = min(MAX_RETRY_SECONDS, self._retry_pause * 2 ** (attempts - 1))
        logger.warning(
            "the sandbox engine is unavailable; message %s waits and is tried again in %.0f s",
            message.id,
            pause,
            extra={"conversation": conv.id},
        )
        self._retry_later(conv.id, pause)

    def _record(
        self, message_id: MessageId, text: str, delivered: bool = False
    ) -> tuple[Reply, SyncTicket]:
        """Record the answer (`delivered`: see `Store.record_reply`), committed without an
        fsync of its own: `Store.sync(ticket)` before it is told. A turn that failed
        before it started (the message still ACCEPTED, e.g. its agent is unavailable) is
        answered all the same."""
        key = outbound_key(message_id)
        with self.store.deferred_sync() as ticket:
            try:
                reply, _ = self.store.record_reply(message_id, key, text, delivered=delivered)
            except StateConflict as exc:
                if exc.actual != MessageState.ACCEPTED.value:
                    raise
                self.store.transition(message_id, MessageState.ACCEPTED, MessageState.RUNNING)
                reply, _ = self.store.record_reply(message_id, key, text, delivered=delivered)
        return reply, ticket

    def _resolve(self, message_id: MessageId, reply: Reply) -> None:
        for fut in self._waiters.get(message_id, []):
            if not fut.done():
                fut.set_result(reply)

    async def _try_deliver(self, conv: Conversation, message: Message, reply: Reply) -> bool:
        try:
            await self._deliver(conv, reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            attempts = (self._attempts.pop(message.id) or 0) + 1
            if attempts >= DELIVERY_ATTEMPTS:
                logger.error(
                    "giving up delivering the reply to message %s after %d attempts: %s",
                    message.id,
                    attempts,
                    exc,
                    extra={"conversation": conv.id},
                )
                await in_lane(
                    self.store.transition,
                    message.id,
                    MessageState.REPLIED,
                    MessageState.FAILED,
                    error=f"delivery failed {attempts} times: {type(exc).__name__}",
                )
                return True
            self._attempts.put(message.id, attempts)
            pause = min(MAX_RETRY_SECONDS, self._retry_pause * 2 ** (attempts - 1))
            logger.warning(
                "delivering the reply to message %s failed (attempt %d, next in %.0f s): %s",
                message.id,
                attempts,
                pause,
                exc,
                extra={"conversation": conv.id},
            )
            self._retry_later(conv.id, pause)
            return False
        if reply.delivered_at is not None:
            return True  # delivered as it was stored
        try:
            ticket = await in_lane(self._mark_delivered, reply.outbound_key)
        except StateConflict:
            logger.debug("reply %s already marked delivered", reply.outbound_key)
            return True
        # on disk before the worker goes on (as FULL was), through the shared fsync: the
        # turn lane does not wait for it (F3)
        await in_sync_lane(self.store.sync, ticket)
        return True

    def _mark_delivered(self, outbound_key: str) -> SyncTicket:
        """Stamp the sent reply, committed without an fsync of its own (`Store.sync`)."""
        with self.store.deferred_sync() as ticket:
            self.store.mark_delivered(outbound_key)
        return ticket

    async def _answer(self, conv: Conversation, message: Message) -> TurnAnswer | None:
        """The turn's answer; None when the engine is away and the message must wait (R7)."""
        try:
            if self._turn_timeout is None:
                return await self._run_turn(conv, message)
            try:
                async with asyncio.timeout(self._turn_timeout):
                    return await self._run_turn(conv, message)
            except TimeoutError as exc:
                raise TurnTimeout(self._turn_timeout) from exc
        except EngineUnavailable as exc:
            if (self._engine_attempts.get(message.id) or 0) < ENGINE_ATTEMPTS:
                logger.debug("turn for message %s: %s", message.id, exc)
                return None
            return await self._failed(conv, message, exc)
        except CellgateError as exc:
            return await self._failed(conv, message, exc)
        except Exception as exc:
            ref = new_ref()
            logger.exception(
                "turn for message %s crashed (ref %s)",
                message.id,
                ref,
                extra={"conversation": conv.id, "ref": ref},
            )
            await self._audit(conv, exc, ref)
            return TurnAnswer(False, failure_text(exc, ref))

    async def _failed(self, conv: Conversation, message: Message, exc: CellgateError) -> TurnAnswer:
        self._engine_attempts.pop(message.id)
        ref = new_ref()
        logger.warning(
            "turn for message %s failed (ref %s): %s",
            message.id,
            ref,
            exc,
            extra={"conversation": conv.id, "ref": ref},
        )
        await self._audit(conv, exc, ref)
        return TurnAnswer(False, failure_text(exc, ref))

    async def _audit(self, conv: Conversation, exc: BaseException, ref: str) -> None:
        """R6: the failure's details, for the operator, under the reference the chat saw."""
        try:
            await in_lane(
                self.store.record_refusal,
                rule=getattr(exc, "rule", None) or "R6",
                action="turn",
                reason=f"{type(exc).__name__}: {exc}"[:2000],
                conversation=conv.id,
                detail={"ref": ref},
            )
        except CellgateError:
            logger.exception("could not record the failure %s in the audit table", ref)

    async def close(self) -> None:
        self._closing = True
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        tasks = [t for t in self._workers.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
