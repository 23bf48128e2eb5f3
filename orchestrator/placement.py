"""Where one turn runs, whatever the agent's mode (S1, S6).

Three kinds of agent, one shape for the turn runner:

- an isolated app agent: the conversation's own sandbox (`sandboxes.ConversationSandboxes`);
- an app agent without isolate mode: the app's one container `<app>-agent`
  (`shared_sandbox.SharedAppSandbox`);
- a host agent: processes on the gateway host (`host_agents.HostSessions`).

The container kinds answer `ensure(key, session_id)` with a verified
`PreparedSandbox` (`.placement()`), the host kind `prepare(key, session_id)`
directly; `TurnRunner.execute` picks by `AgentRuntime.host`. A `Placement` is
the exec handle and backend, the conversation's host paths, and how the
session sees them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from orchestrator.conversations import ConversationPaths
from sandbox.backends.base import SandboxBackend, SandboxHandle
from sandbox.mountplan import BRIDGE, WORKSPACE

__all__ = ["DEFAULT_BRIDGE_ARGV", "Placement"]

DEFAULT_BRIDGE_ARGV: tuple[str, ...] = ("python3", str(BRIDGE / "cellgate-tool"))


@dataclass(frozen=True, slots=True)
class Placement:
    """One turn's place.

    - `handle`, `backend`: what harnesses exec through (`backend` None: the gateway's engine).
    - `paths`: the conversation's chat, media, home and bridge directories on the host.
    - `home`, `workdir`: the session's HOME and working directory as it sees them.
    - `env`: session environment added to `runner.session_env` (e.g. `CELLGATE_BRIDGE`).
    - `shown_workspace`: where the session sees the workspace (`/workspace` in a container).
    - `bridge_argv`: how the session calls a bridge tool (`cellgate-tool`).
    """

    handle: SandboxHandle
    paths: ConversationPaths
    home: str
    workdir: str
    backend: SandboxBackend | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    shown_workspace: PurePosixPath = WORKSPACE
    bridge_argv: tuple[str, ...] = DEFAULT_BRIDGE_ARGV
