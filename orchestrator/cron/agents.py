"""What cron needs of the gateway's agents: C1/C2 facts and where a command job runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orchestrator.agents import Agents
from orchestrator.cron.jobs import AgentFacts, AgentLookup

__all__ = ["agent_facts", "agent_workdir"]


def agent_facts(agents: Agents) -> AgentLookup:
    """Isolated if the config says so now or the agent started so (L5); an app's agent."""

    def facts(agent_id: str) -> AgentFacts | None:
        rt = agents.get(agent_id)
        if rt is None:
            return None
        return AgentFacts(
            isolated=bool(rt.config.isolate_memory or rt.started_isolated),
            is_app=rt.config.app is not None,
        )

    return facts


def agent_workdir(agents: Agents, state_dir: Path) -> Callable[[str], Path]:
    """A host agent's workspace: the configured one, else `<state>/agents/<id>/workspace`."""

    def workdir(agent_id: str) -> Path:
        rt = agents.get(agent_id)
        if rt is not None and rt.config.workspace is not None:
            return rt.config.workspace.expanduser()
        return state_dir / "agents" / agent_id / "workspace"

    return workdir
