"""Quota images are mounted only while they are used (R2, R3).

A conversation's quota image (`sandbox.quota.LoopQuota`) is mounted by its
turns (`ensure`) and by readers outside a turn (`held`: a backup, the media
API, `/reset`). `QuotaSweep.removed` gives it back when the keeper reaps or
evicts its sandbox; `sweep` gives back, every reaper pass, what is mounted
with no sandbox and unused for `sandboxIdleMinutes` (a reader's mount, a
sandbox removed by an app's update or restart, by the CLI or by hand, one
left from before a restart). So the host's loop devices and mounts grow with
the conversations in use, not with every stranger ever seen.

An app's update or restart (L5) releases nothing at once: a switch to the
app's one container (S6) may read the conversations' dirs at its first turn.
Each release runs under the conversation's lock, after checking that no
sandbox of it is recorded, so it never pulls mounts from a turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cellgate.errors import QuotaError
from orchestrator.agents import Agents
from orchestrator.runner import conversation_key
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.store import ConversationId
from orchestrator.store.views import SandboxStore
from orchestrator.turns import TurnLoop

logger = logging.getLogger(__name__)


class QuotaSweep:
    def __init__(
        self,
        agents: Agents,
        store: SandboxStore,
        loop: TurnLoop,
        idle_minutes: float,
        *,
        now: Callable[[], float] = time.time,  # the lock files' clock, not the gateway's
    ) -> None:
        self.agents = agents
        self.store = store
        self.loop = loop
        self.idle_seconds = idle_minutes * 60.0
        self.now = now

    def _sandboxes(self, agent: str) -> ConversationSandboxes | None:
        """The agent's per-conversation sandboxes when they have quota images."""
        rt = self.agents.get(agent)
        sb = None if rt is None else rt.sandboxes
        if isinstance(sb, ConversationSandboxes) and sb.quota is not None:
            return sb
        return None

    def _in_use(self, conversation: ConversationId) -> bool:
        return any(s.conversation_id == conversation for s in self.store.sandboxes())

    def release(
        self, agent: str, conversation: ConversationId, unused_since: float | None = None
    ) -> bool:
        """Under the conversation's lock (the caller's): give back its image unless a
        sandbox of it is still recorded (or it was used after `unused_since`). Blocking."""
        sandboxes = self._sandboxes(agent)
        conv = self.store.get_conversation(conversation)
        if sandboxes is None or conv is None or self._in_use(conversation):
            return False
        try:
            sandboxes.release_memory(conversation_key(conv), unused_since)
        except (OSError, QuotaError) as exc:
            logger.warning("could not release the quota mounts of %s: %s", conversation, exc)
            return False
        return True

    async def removed(self, agent: str, conversation: ConversationId) -> None:
        """Its sandbox was reaped or evicted (the caller holds the conversation's lock)."""
        await asyncio.to_thread(self.release, agent, conversation)

    async def sweep(self) -> int:
        """Give back every image mounted with no sandbox and unused for the idle time."""
        gone = 0
        for agent in list(self.agents):
            sandboxes = self._sandboxes(agent)
            if sandboxes is None:
                continue
            cutoff = self.now() - self.idle_seconds
            idle = await asyncio.to_thread(self._idle, agent, sandboxes, cutoff)
            for conversation in idle:
                if self.loop.conversation_busy(conversation):
                    continue  # a turn began since: never wait for it (the next pass looks)
                async with self.loop.conversation_lock(conversation):
                    if await asyncio.to_thread(self.release, agent, conversation, cutoff):
                        gone += 1
        if gone:
            logger.info("quota (R2, R3): released %d idle conversation image(s)", gone)
        return gone

    def _idle(
        self, agent: str, sandboxes: ConversationSandboxes, cutoff: float
    ) -> list[ConversationId]:
        assert sandboxes.quota is not None
        stale = {d for d, used in sandboxes.quota.mounted(agent).items() if used <= cutoff}
        if not stale:
            return []
        live = {s.conversation_id for s in self.store.sandboxes()}
        return [
            c.id
            for c in self.store.conversations(agent)
            if c.id not in live and conversation_key(c).digest in stale
        ]
