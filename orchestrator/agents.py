"""The agents a gateway serves: their config, harness, app and sandboxes.

`Agents` is a read-only mapping from agent id to `AgentRuntime`, built once at
start; `require` and `runnable` are the two questions intake and the turn
runner ask of it, each answered with a clear error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import AgentUnavailable, AppError, UnknownAgent
from orchestrator.apps import InstalledApp
from orchestrator.config import AgentConfig, GatewaySettings
from orchestrator.harnesses.base import Harness
from orchestrator.harnesses.command import CommandHarness
from orchestrator.harnesses.openai import OpenAIHarness
from orchestrator.harnesses.shell import ShellHarness
from orchestrator.host_agents import HOST_CAVEAT, HostSessions, host_refusal
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.shared_sandbox import SharedAppSandbox
from orchestrator.store import Store
from sandbox.backends.base import SandboxBackend

logger = logging.getLogger(__name__)


def build_harness(agent: AgentConfig) -> Harness:
    h = agent.harness
    match h.type:
        case "command":
            return CommandHarness.from_config(h, claude_flags=agent.claude.extra_flags)
        case "openai":
            return OpenAIHarness.from_config(h)
        case "shell":
            return ShellHarness(timeout_seconds=h.timeout_seconds)


@dataclass
class AgentRuntime:
    config: AgentConfig
    harness: Harness
    app: InstalledApp | None = None
    sandboxes: ConversationSandboxes | SharedAppSandbox | None = None
    started_isolated: bool = False
    unavailable: str | None = None  # why it cannot take turns (a failed runtime check)
    host: HostSessions | None = None  # a host agent's turns on this host (S6)

    @property
    def workspace(self) -> Path | None:
        """Where its conversations' chats/ live on the host, once it can take turns."""
        if self.sandboxes is not None:
            return self.sandboxes.app.workspace
        return None if self.host is None else self.host.workspace


def load_runtime(
    agent: AgentConfig, settings: GatewaySettings, backend: SandboxBackend, gateway_id: str
) -> AgentRuntime:
    """The agent's harness, and for an app agent its installed app and sandboxes."""
    rt = AgentRuntime(agent, build_harness(agent), started_isolated=agent.isolate_memory)
    if agent.app is None:
        rt.unavailable = host_refusal(agent)
        if rt.unavailable is not None:
            logger.error("host agent %s takes no turns: %s", agent.id, rt.unavailable)
            return rt
        rt.host = HostSessions(agent, settings)
        logger.warning("host agent %s: %s", agent.id, HOST_CAVEAT)
        return rt
    try:
        app = InstalledApp.load(settings.state_dir, agent.app)
    except AppError as exc:
        logger.error("agent %s: %s", agent.id, exc)
        return rt
    rt.app = app
    if agent.isolate_memory:
        rt.sandboxes = ConversationSandboxes(app, settings, backend, gateway_id=gateway_id)
    else:  # S6: every conversation in the app's one container
        rt.sandboxes = SharedAppSandbox(app, settings, backend, gateway_id=gateway_id)
    if not app.running:
        rt.unavailable = f"its app {app.name} is stopped; `cellgate apps start {app.name}`"
    return rt


class Agents(Mapping[str, AgentRuntime]):
    """Agent id -> runtime, fixed for the gateway's life (L5 restarts rebuild it)."""

    def __init__(self, runtimes: Mapping[str, AgentRuntime]) -> None:
        self._runtimes = dict(runtimes)

    @classmethod
    def load(
        cls,
        agents: Sequence[AgentConfig],
        settings: GatewaySettings,
        backend: SandboxBackend,
        gateway_id: str,
    ) -> Agents:
        return cls({a.id: load_runtime(a, settings, backend, gateway_id) for a in agents})

    def __getitem__(self, agent_id: str) -> AgentRuntime:
        return self._runtimes[agent_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runtimes)

    def __len__(self) -> int:
        return len(self._runtimes)

    def put(self, agent_id: str, rt: AgentRuntime) -> None:
        """Add or replace an agent's runtime (L5: a restart after a config change)."""
        self._runtimes[agent_id] = rt

    def drop(self, agent_id: str) -> None:
        self._runtimes.pop(agent_id, None)

    def require(self, agent_id: str) -> AgentRuntime:
        rt = self._runtimes.get(agent_id)
        if rt is None:
            raise UnknownAgent(agent_id)
        return rt

    def runnable(self, agent_id: str) -> AgentRuntime:
        """The agent's runtime if it can take turns now, else `AgentUnavailable` saying why."""
        rt = self.require(agent_id)
        if rt.unavailable is not None:
            raise AgentUnavailable(agent_id, rt.unavailable)
        if rt.sandboxes is None and rt.host is None:
            raise AgentUnavailable(agent_id, f"its app {rt.config.app!r} is not installed")
        return rt

    def mint_host_keys(self, store: Store) -> None:
        """K2: each host agent's MCP server gets a key of its own, minted at start."""
        for rt in self._runtimes.values():
            if rt.host is not None:
                rt.host.mint_key(store)

    def app_names(self) -> frozenset[str]:
        """The apps whose sandboxes this gateway owns."""
        return frozenset(rt.app.name for rt in self._runtimes.values() if rt.app is not None)
