"""The gateway: agents, their sandboxes and harnesses, and one turn end to end.

Turns of one conversation run one at a time, in order; conversations run in
parallel under a global bound (`gateway.maxConcurrentTurns`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.apps import InstalledApp
from orchestrator.config import AgentConfig, GatewayConfig
from orchestrator.conversations import ConversationKey
from orchestrator.errors import AgentUnavailable, AppError, TurnTimeout, UnknownAgent
from orchestrator.harnesses.base import DispatchResult, Harness, SessionContext
from orchestrator.harnesses.shell import ShellHarness
from orchestrator.sandboxes import ConversationSandboxes
from policies.tools import session_env_flags
from sandbox.backends.base import SandboxBackend

logger = logging.getLogger(__name__)


def build_harness(agent: AgentConfig) -> Harness:
    h = agent.harness
    match h.type:
        case "shell":
            return ShellHarness(timeout_seconds=h.timeout_seconds)


@dataclass
class AgentRuntime:
    config: AgentConfig
    harness: Harness
    app: InstalledApp | None = None
    sandboxes: ConversationSandboxes | None = None
    started_isolated: bool = False


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    conversation: ConversationKey
    sandbox: str
    result: DispatchResult


@dataclass
class _Activity:
    busy: int = 0
    last_end: float = field(default_factory=time.time)


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        backend: SandboxBackend,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.backend = backend
        self.clock = clock
        self.agents: dict[str, AgentRuntime] = {}
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._bound = asyncio.Semaphore(config.gateway.max_concurrent_turns)
        self.activity: dict[str, _Activity] = {}
        for agent in config.agents:
            self.agents[agent.id] = self._runtime(agent)

    def _runtime(self, agent: AgentConfig) -> AgentRuntime:
        rt = AgentRuntime(agent, build_harness(agent), started_isolated=agent.isolate_memory)
        if agent.app is None:
            return rt
        try:
            app = InstalledApp.load(self.config.gateway.state_dir, agent.app)
        except AppError as exc:
            logger.error("agent %s: %s", agent.id, exc)
            return rt
        rt.app = app
        rt.sandboxes = ConversationSandboxes(app, self.config.gateway, self.backend)
        return rt

    def agent(self, agent_id: str) -> AgentRuntime:
        rt = self.agents.get(agent_id)
        if rt is None:
            raise UnknownAgent(agent_id)
        return rt

    def _lock(self, key: ConversationKey) -> asyncio.Lock:
        k = (key.agent, key.channel, key.chat_id)
        lock = self._locks.get(k)
        if lock is None:
            lock = self._locks[k] = asyncio.Lock()
        return lock

    def session_env(self, key: ConversationKey, home: str) -> dict[str, str]:
        """A session's environment: its origin, its home, and no secret (K1, P1, T3)."""
        return {
            "HOME": home,
            "GATEWAY_ORIGIN_CHANNEL": key.channel,
            "GATEWAY_ORIGIN_CHAT_ID": key.chat_id,
            **session_env_flags(),
        }

    async def turn(
        self, agent_id: str, channel: str, chat_id: str, text: str, meta: dict[str, Any] | None = None
    ) -> TurnOutcome:
        rt = self.agent(agent_id)
        key = ConversationKey(agent_id, channel, chat_id)
        if rt.sandboxes is None:
            reason = (
                f"its app {rt.config.app!r} is not installed"
                if rt.config.app
                else "host agents are not served by this gateway yet; declare it in an app"
            )
            raise AgentUnavailable(agent_id, reason)
        timeout = self.config.gateway.turn_timeout_seconds
        async with self._lock(key), self._bound:
            prepared = await rt.sandboxes.ensure(key)
            act = self.activity.setdefault(prepared.handle.name, _Activity())
            act.busy += 1
            try:
                ctx = SessionContext(
                    conversation=key,
                    session_key=rt.sandboxes.session_id(key),
                    backend=self.backend,
                    sandbox=prepared.handle,
                    env=self.session_env(key, prepared.spec.home),
                    workdir=prepared.spec.workdir,
                )
                try:
                    async with asyncio.timeout(timeout):
                        await rt.harness.ensure_session(ctx)
                        result = await rt.harness.dispatch(ctx, text, meta or {})
                except TimeoutError as exc:
                    raise TurnTimeout(timeout) from exc
            finally:
                act.busy -= 1
                act.last_end = self.clock()
        return TurnOutcome(key, prepared.handle.name, result)

    def last_active(self, sandbox: str) -> float | None:
        act = self.activity.get(sandbox)
        return act.last_end if act else None

    def busy(self, sandbox: str) -> bool:
        act = self.activity.get(sandbox)
        return bool(act and act.busy)

    async def close(self) -> None:
        await self.backend.close()
