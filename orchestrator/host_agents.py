"""Host agents (no `app`): their turns run as processes on the gateway host (S6, K2).

NOT AN OPERATING-SYSTEM SANDBOX. A host agent's command (or the OpenAI
harness's shell tool) runs as the gateway's own user and can open any file
that user can: another conversation's directory, the gateway config, the
state directory. What `isolateMemory` gives a host agent is isolation of
memory, tools and the API only: each conversation gets its own memory
directory (`<workspace>/chats/<dir>/`, the workspace defaulting to
`<stateDir>/agents/<id>/workspace`), its own `~/.claude`
(`<stateDir>/agents/<id>/host-homes/<dir>/`, named by `HOME` and
`CLAUDE_CONFIG_DIR`), the tools `policies.tools` offers an isolated scope,
and a bridge socket that replies only into its own chat (P1). For senders
you do not trust, use an app agent.

Design: the harnesses reach their session only through
`ctx.backend.exec(ctx.sandbox, ...)`, so a host turn is the same command
and OpenAI harness over `sandbox.backends.host.HostExec` (bounded output and
time, clean environment, own process group) instead of a container: no
harness code forks into a host path. The shell harness (each message run as
a command) is refused for a host agent: it would hand any sender a host shell.

K2: `mint_key` gives the agent's MCP server a key minted for it at start,
non-admin, naming only this agent (`keys.mint_host_agent_key`); the
previous start's key of the same name is revoked. It reaches the session as
`CELLGATE_API_KEY`, and nothing else of the gateway's environment does.
"""

from __future__ import annotations

import logging
import sys
from pathlib import PurePosixPath

from cellgate.errors import StoreError
from cellgate.models import ConversationKey
from orchestrator.config import AgentConfig, GatewaySettings
from orchestrator.conversations import ConversationPaths, ensure_conversation
from orchestrator.keys import MCP_KEY_PREFIX, mint_host_agent_key
from orchestrator.placement import Placement
from orchestrator.store import Store
from sandbox.backends.host import HostExec, host_handle

__all__ = ["HOST_CAVEAT", "HOST_HARNESSES", "HostSessions", "host_refusal"]

logger = logging.getLogger(__name__)

HOST_HARNESSES = frozenset({"command", "openai"})
HOST_CAVEAT = (
    "its turns run as processes on this host, as the gateway's own user; isolateMemory "
    "isolates memory, tools and the API only and is NOT an operating-system sandbox (S6): "
    "its commands can read any file this user can. Use an app agent for untrusted senders"
)
SHARED_HOME = "_agent"


def host_refusal(agent: AgentConfig) -> str | None:
    """Why this host agent cannot take turns, or None."""
    if agent.harness.type not in HOST_HARNESSES:
        return (
            f"a host agent runs the command or openai harness, not {agent.harness.type!r} "
            "(it would run each message as a host command); declare it in an app instead"
        )
    return None


class HostSessions:
    """The turns of one host agent, on this host (see the module docstring)."""

    def __init__(self, agent: AgentConfig, settings: GatewaySettings) -> None:
        self.agent = agent
        self.isolated = agent.isolate_memory
        self.agent_root = settings.state_dir / "agents" / agent.id
        ws = agent.workspace.expanduser() if agent.workspace is not None else None
        self.workspace = ws or self.agent_root / "workspace"
        self.backend = HostExec()
        self._api_key: str | None = None

    def mint_key(self, store: Store) -> None:
        """K2: a fresh key for this agent's MCP server; the previous start's is revoked."""
        name = f"{MCP_KEY_PREFIX}{self.agent.id}"
        channels = ["telegram"] if self.agent.channels.telegram is not None else []
        row, secret = mint_host_agent_key(store, self.agent.id, channels)
        for old in store.list_keys(include_revoked=False):
            if old.name == name and old.id != row.id:
                try:
                    store.revoke_key(old.id)
                except StoreError:
                    logger.warning("could not revoke the old MCP key of agent %s", self.agent.id)
        self._api_key = secret

    def paths(self, key: ConversationKey, session_id: str) -> ConversationPaths:
        ws = self.workspace
        home = key.dir_name if self.isolated else SHARED_HOME
        return ConversationPaths(
            workspace=ws,
            chat_dir=ws / "chats" / key.dir_name,
            media_dir=ws / "media" / key.media_dir_name(session_id),
            home_dir=self.agent_root / "host-homes" / home,
            bridge_dir=self.agent_root / "bridge" / key.digest,
        )

    def prepare(self, key: ConversationKey, session_id: str) -> Placement:
        """Blocking: the conversation's directories, and where its turn runs."""
        paths = self.paths(key, session_id)
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.agent_root.mkdir(parents=True, exist_ok=True)
        ensure_conversation(paths, None, None)
        env = {
            "CLAUDE_CONFIG_DIR": str(paths.home_dir),
            "CELLGATE_BRIDGE": str(paths.bridge_dir / "bridge.sock"),
        }
        if self._api_key is not None:
            env["CELLGATE_API_KEY"] = self._api_key
        workdir = paths.chat_dir if self.isolated else paths.workspace
        return Placement(
            handle=host_handle(self.agent.id),
            paths=paths,
            home=str(paths.home_dir),
            workdir=str(workdir),
            backend=self.backend,
            env=env,
            shown_workspace=PurePosixPath(str(self.workspace)),
            bridge_argv=(sys.executable, str(paths.bridge_dir / "cellgate-tool")),
        )
