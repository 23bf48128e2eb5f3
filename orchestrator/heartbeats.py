"""Heartbeats (M4): a periodic turn in every live session of an agent.

When the agent has no live session the heartbeat runs in its own
`__heartbeat__` conversation, which keeps a memory of its own. A heartbeat
takes the conversation's lock, so it never overlaps a message's turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cellgate.errors import CellgateError
from cellgate.models import ConversationKey
from orchestrator.agents import AgentRuntime, Agents
from orchestrator.config import HeartbeatSettings
from orchestrator.harnesses.base import TurnResult
from orchestrator.memory import heartbeat_targets
from orchestrator.runner import TurnRunner, conversation_key
from orchestrator.store.views import SessionStore
from orchestrator.turns import TurnLoop

logger = logging.getLogger(__name__)


class Heartbeats:
    def __init__(
        self,
        agents: Agents,
        store: SessionStore,
        loop: TurnLoop,
        runner: TurnRunner,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.agents = agents
        self.store = store
        self.loop = loop
        self.runner = runner
        self.clock = clock

    async def once(self, agent_id: str) -> list[tuple[ConversationKey, TurnResult]]:
        """One heartbeat in every live session of the agent, or in `__heartbeat__` if none."""
        rt = self.agents.runnable(agent_id)
        prompt = (rt.config.heartbeat or HeartbeatSettings(every_minutes=60)).prompt
        live = await asyncio.to_thread(self.store.live_sessions, agent_id)
        convs = [
            await asyncio.to_thread(self.store.get_conversation, s.conversation_id) for s in live
        ]
        keys = list(dict.fromkeys(conversation_key(c) for c in convs if c is not None))
        done: list[tuple[ConversationKey, TurnResult]] = []
        for target in heartbeat_targets(agent_id, keys):
            try:
                result = await self._beat(rt, target.conversation, prompt)
            except Exception:  # one conversation's failure never skips the others' heartbeats
                logger.exception("heartbeat in a conversation of %s failed", agent_id)
                continue
            done.append((target.conversation, result))
        return done

    async def _beat(self, rt: AgentRuntime, key: ConversationKey, prompt: str) -> TurnResult:
        conv = await asyncio.to_thread(self.store.upsert_conversation, key)
        async with self.loop.conversation_lock(conv.id):
            session_id = await self.runner.session_for(conv, rt)
            turn = await asyncio.to_thread(self.store.start_turn, session_id, None)
            ok = False
            try:
                result = await self.runner.execute(rt, conv, session_id, prompt, [])
                ok = result.ok
                await asyncio.to_thread(
                    self.runner.save_turn,
                    rt,
                    conv,
                    session_id,
                    "heartbeat",
                    prompt,
                    None,
                    result,
                )
            finally:
                await asyncio.to_thread(self.store.finish_turn, turn.id, ok=ok)
        return result

    async def run_forever(self) -> None:
        """Every agent with a `heartbeat` block, on its schedule."""
        agents = [(a, rt.config.heartbeat) for a, rt in self.agents.items() if rt.config.heartbeat]
        if not agents:
            return
        next_at = {a: self.clock() + hb.every_minutes * 60 for a, hb in agents}
        while True:
            await asyncio.sleep(min(1.0, max(0.0, min(next_at.values()) - self.clock())))
            for agent_id, hb in agents:
                if self.clock() < next_at[agent_id]:
                    continue
                next_at[agent_id] = self.clock() + hb.every_minutes * 60
                try:
                    await self.once(agent_id)
                except CellgateError as exc:
                    logger.error("heartbeat of %s failed: %s", agent_id, exc)
