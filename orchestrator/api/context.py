"""What every endpoint needs: the gateway, its store, and facts about its agents."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from orchestrator.gateway import Gateway
from orchestrator.store import Store

__all__ = ["ApiContext", "context", "gateway_store"]


def gateway_store(gateway: Gateway) -> Store:
    """The gateway's store: the one source of truth (D1)."""
    return gateway.store


@dataclass
class ApiContext:
    gateway: Gateway

    @property
    def store(self) -> Store:
        return gateway_store(self.gateway)

    def agent_known(self, agent: str) -> bool:
        return agent in self.gateway.agents

    def isolated(self, agent: str) -> bool:
        """Isolated now, started isolated, or about to restart isolated (L5)."""
        rt = self.gateway.agents.get(agent)
        if rt is None:
            return False
        return bool(
            rt.config.isolate_memory
            or rt.started_isolated
            or self.gateway.reloader.pending_isolated(agent)
        )

    def workspace(self, agent: str) -> Path:
        """The agent's workspace on the host: the app's, the configured one, or the default."""
        rt = self.gateway.agents.get(agent)
        if rt is not None and rt.app is not None:
            return rt.app.workspace
        if rt is not None and rt.config.workspace is not None:
            return rt.config.workspace.expanduser()
        return self.gateway.config.gateway.state_dir / "agents" / agent / "workspace"


def context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.cellgate
    return ctx
