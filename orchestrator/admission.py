"""Admission (R4): the gates between a stranger and the gateway's turns and sandboxes.

- `MessageGate.admit` runs at intake, before anything is stored: the sender's
  and the chat's message rates (token buckets) and the chat's queue bound.
  A refusal raises `Throttled` with a polite reason; an audit row is written
  once a minute per refused sender or chat, so a flood cannot fill the table.
- `SandboxGate.make_room` runs before a conversation's sandbox is created:
  at most `maxSandboxes` live per gateway; the longest idle one is evicted to
  make room, and when every one is busy the turn is refused with
  `SandboxesBusy` ("busy, try again"), not a crash.

The decisions are the pure policies in `policies.admission`; this module
gathers their facts (time, buckets, counts) and applies them. Every map here
is bounded: buckets are kept for the most recent `BUCKETS_MAX` keys.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cellgate.errors import SandboxesBusy, Throttled
from orchestrator.bounded import LruMap
from orchestrator.config import Admission as AdmissionSettings
from orchestrator.store import ConversationId
from orchestrator.store.views import RefusalStore
from policies.admission import Bucket, queue_room, sandbox_room, take_token, token_wait
from policies.base import Decision

logger = logging.getLogger(__name__)

BUCKETS_MAX = 10_000
AUDIT_EVERY_SECONDS = 60.0
SANDBOX_SHARE_OF_MEMORY = 0.8


class MessageGate:
    def __init__(
        self,
        settings: AdmissionSettings,
        refusals: RefusalStore,
        *,
        clock: Callable[[], float],
        size: int = BUCKETS_MAX,
    ) -> None:
        self.settings = settings
        self.refusals = refusals
        self.clock = clock
        self._buckets: LruMap[str, Bucket] = LruMap(size)
        self._audited: LruMap[str, float] = LruMap(size)

    def check_rate(
        self, agent: str, channel: str, chat_id: str, sender: str
    ) -> tuple[Decision, str, float] | None:
        """The first refusal among the sender's and the chat's rates, with its key and the
        seconds until that rate takes a message again; or None."""
        now = self.clock()
        s = self.settings
        chat_key = f"chat\0{agent}\0{channel}\0{chat_id}"
        keys = [(chat_key, s.chat_per_minute, "this chat is getting")]
        if sender:
            keys.insert(
                0, (f"sender\0{agent}\0{channel}\0{sender}", s.sender_per_minute, "you are sending")
            )
        for key, per_minute, what in keys:
            decision, bucket = take_token(
                self._buckets.get(key), now, per_minute=per_minute, burst=s.burst, what=what
            )
            self._buckets.put(key, bucket)
            if not decision:
                return decision, key, token_wait(bucket, per_minute)
        return None

    async def admit(
        self,
        agent: str,
        channel: str,
        chat_id: str,
        sender: str,
        conversation: ConversationId | None,
        pending: Callable[[], Awaitable[int]],
    ) -> None:
        """Raise `Throttled` if this message must not be taken (R4)."""
        refused = self.check_rate(agent, channel, chat_id, sender)
        if refused is None and conversation is not None:
            decision = queue_room(await pending(), self.settings.max_queued_per_chat)
            if not decision:  # no wait is known: the queue drains as the turns answer
                refused = decision, f"queue\0{conversation}", self.settings.retry_after
        if refused is None:
            return
        decision, key, wait = refused
        await self._audit(key, decision, conversation)
        raise Throttled(decision.rule, decision.reason, retry_after=math.ceil(wait))

    async def _audit(
        self, key: str, decision: Decision, conversation: ConversationId | None
    ) -> None:
        now = self.clock()
        last = self._audited.get(key)
        if last is not None and now - last < AUDIT_EVERY_SECONDS:
            return
        self._audited.put(key, now)
        logger.info("admission refused a message: %s", decision.reason)
        await asyncio.to_thread(
            self.refusals.record_refusal,
            rule=decision.rule,
            action="message",
            reason=decision.reason,
            conversation=conversation,
        )


def default_max_sandboxes(memory_mb: int, host_memory_bytes: int | None = None) -> int:
    """As many sandboxes as fit in 80% of the host's memory at their memory limit, 1..256."""
    if host_memory_bytes is None:
        try:
            host_memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            host_memory_bytes = 4 * 1024**3
    fit = int(host_memory_bytes * SANDBOX_SHARE_OF_MEMORY) // (memory_mb * 1024 * 1024)
    return max(1, min(256, fit))


@dataclass(frozen=True, slots=True)
class LiveSandbox:
    name: str
    conversation: ConversationId
    last_used_at: float
    busy: bool


LiveSandboxes = Callable[[], Awaitable[list[LiveSandbox]]]
Evict = Callable[[str], Awaitable[bool]]


COUNT_FRESH = 1.0  # seconds a count of the live sandboxes stands for the next newcomers


class SandboxGate:
    """At most `max_sandboxes` live; idle ones make room, busy ones never.

    One count of the live sandboxes serves the newcomers of the next second:
    each takes one of the rooms it left (a sandbox removed meanwhile only
    leaves more room), so a burst of new conversations is not counted once
    per newcomer under the lock (F3)."""

    def __init__(
        self, max_sandboxes: int, live: LiveSandboxes, evict: Evict, refusals: RefusalStore
    ) -> None:
        self.max_sandboxes = max_sandboxes
        self._live = live
        self._evict = evict
        self._refusals = refusals
        self._lock = asyncio.Lock()
        self._starting: set[ConversationId] = set()
        # the last count: who has a sandbox, how much room was left, until when it holds
        self._counted: set[ConversationId] = set()
        self._free = 0
        self._count_until = float("-inf")

    async def make_room(self, conversation: ConversationId) -> None:
        """Before the conversation's sandbox starts: evict an idle one, or raise `SandboxesBusy`.

        A granted room is held for the conversation (it counts as live) until
        `settled` says its sandbox is recorded or did not start.
        """
        async with self._lock:
            now = asyncio.get_running_loop().time()
            if now < self._count_until:  # F3: a burst is not counted once per newcomer
                if conversation in self._counted:
                    # its own sandbox already counts; held too, in case it was removed
                    # meanwhile and starts again before the next count sees it
                    self._starting.add(conversation)
                    return
                if self._free > 0:
                    self._free -= 1
                    self._starting.add(conversation)
                    return
            for _ in range(3):
                live = await self._live()
                self._counted = {sb.conversation for sb in live}
                starting = self._starting - self._counted
                if conversation in self._counted:
                    self._free = self.max_sandboxes - len(live) - len(starting)
                    self._count_until = now + COUNT_FRESH
                    return  # its own sandbox already counts
                idle = [
                    sb.name for sb in sorted(live, key=lambda sb: sb.last_used_at) if not sb.busy
                ]
                room = sandbox_room(len(live) + len(starting), self.max_sandboxes, idle)
                if not room.decision:
                    await asyncio.to_thread(
                        self._refusals.record_refusal,
                        rule=room.decision.rule,
                        action="sandbox",
                        reason=room.decision.reason,
                        conversation=conversation,
                    )
                    raise SandboxesBusy(room.decision.reason)
                if room.evict is None:
                    self._starting.add(conversation)
                    self._free = self.max_sandboxes - len(live) - len(starting) - 1
                    self._count_until = now + COUNT_FRESH
                    return
                logger.info("evicting idle sandbox %s to make room (R4)", room.evict)
                await self._evict(room.evict)
            raise SandboxesBusy("could not make room for a new sandbox; try again")

    def settled(self, conversation: ConversationId) -> None:
        """The conversation's sandbox is recorded (or did not start): its hold ends."""
        self._starting.discard(conversation)
