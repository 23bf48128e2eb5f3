"""S6: every conversation of an app agent without isolate mode runs in one container.

`SharedAppSandbox` keeps the app's one container, `<app>-agent`: the same
image, user, environment (minus secrets, K1), networks, limits and hardening
as a per-conversation sandbox (S2), verified before every turn like one (S4,
R5), and labelled with this gateway's id (R1). Its mounts are the seed's app
container's: the whole agent workspace read-write at `/workspace` (root
MEMORY.md and USER.md, every chat's directory, memory/, media/), one
`~/.claude` for the agent (`agents/<id>/sandbox-homes/_app/`), and the
agent's bridge directory read-only at `/run/cellgate`.

What that shares is everything between the agent's chats: memory, files,
processes, /tmp, the Claude home. Replies still go to the right chat: each
conversation keeps its own bridge socket (`/run/cellgate/<digest>/bridge.sock`,
named to the turn by `CELLGATE_BRIDGE`), and the gateway decides every call
by the socket it arrives on (P1). No disk quota (R2) applies: the workspace is
one writable tree; the container's memory, CPU and pids limits do.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from cellgate.errors import UnsafePath
from cellgate.models import ConversationKey
from orchestrator.apps import InstalledApp
from orchestrator.bridge import install_client
from orchestrator.config import GatewaySettings
from orchestrator.conversations import ConversationPaths, ensure_conversation
from orchestrator.safefs import SafeDir, left_out
from orchestrator.sandboxes import PreparedSandbox, limits_from, sandbox_env, sandbox_user
from sandbox.backends.base import ImageFacts, SandboxBackend
from sandbox.gateway_id import valid_gateway_id
from sandbox.mountplan import BRIDGE, plan_shared_mounts
from sandbox.spec import SandboxSpec, shared_sandbox_name

__all__ = ["SHARED_HOME", "SharedAppSandbox", "shared_paths"]

logger = logging.getLogger(__name__)

SHARED_HOME = "_app"
"""The agent's one `~/.claude` under `sandbox-homes/` (a conversation's name always has a `-`)."""


def shared_paths(app: InstalledApp, key: ConversationKey, session_id: str) -> ConversationPaths:
    """The conversation's paths; its home is the agent's one home."""
    ws = app.workspace
    return ConversationPaths(
        workspace=ws,
        chat_dir=ws / "chats" / key.dir_name,
        media_dir=ws / "media" / key.media_dir_name(session_id),
        home_dir=app.agent_root / "sandbox-homes" / SHARED_HOME,
        bridge_dir=app.agent_root / "bridge" / key.digest,
    )


def _hand_over_root(workspace: Path, owner: tuple[int, int]) -> None:
    """The workspace root and its USER.md/MEMORY.md become the container user's (M5 shared)."""
    with SafeDir.trusted(workspace) as ws:
        for name in ("USER.md", "MEMORY.md"):
            try:
                ws.ensure_file(name, owner=owner)
            except UnsafePath as exc:
                left_out(workspace.name, name, exc, None)
        ws.hand_over(owner)


class SharedAppSandbox:
    """The one container of an app agent without isolate mode (see the module docstring)."""

    isolated = False

    def __init__(
        self,
        app: InstalledApp,
        settings: GatewaySettings,
        backend: SandboxBackend,
        *,
        gateway_id: str,
    ) -> None:
        if not valid_gateway_id(gateway_id):
            raise ValueError(f"not a gateway id: {gateway_id!r}")
        self.app = app
        self.settings = settings
        self.backend = backend
        self.gateway_id = gateway_id
        self._image: ImageFacts | None = None

    @property
    def name(self) -> str:
        return shared_sandbox_name(self.app.name)

    async def image(self) -> ImageFacts:
        if self._image is None:
            self._image = await self.backend.image_facts(self.app.image_id)
        return self._image

    async def spec_for(
        self, key: ConversationKey, session_id: str
    ) -> tuple[SandboxSpec, ConversationPaths]:
        image = await self.image()
        user = sandbox_user(self.app.user, image.user)
        uid, gid = (int(x) for x in user.split(":"))
        paths = shared_paths(self.app, key, session_id)
        bridge_root = self.app.agent_root / "bridge"

        def prepare() -> SandboxSpec:
            ensure_conversation(paths, uid, gid)
            _hand_over_root(paths.workspace, (uid, gid))
            return SandboxSpec(
                name=self.name,
                image=self.app.image,
                image_id=image.id,
                user=user,
                env=sandbox_env(image.env, self.app.environment),
                networks=self.app.networks,
                plan=plan_shared_mounts(paths.workspace, paths.home_dir, bridge_root),
                limits=limits_from(self.settings),
                runtime=self.settings.runtime,
                app=self.app.name,
                agent=self.app.agent,
                conversation="",
                gateway=self.gateway_id,
            )

        return await asyncio.to_thread(prepare), paths

    async def release(self, key: ConversationKey) -> None:
        """Nothing to let go of: the one container holds no per-conversation quota mount."""

    async def ensure(self, key: ConversationKey, session_id: str) -> PreparedSandbox:
        spec, paths = await self.spec_for(key, session_id)
        await asyncio.to_thread(install_client, self.app.agent_root / "bridge")
        handle = await self.backend.ensure(spec)
        socket = BRIDGE / key.digest / "bridge.sock"
        return PreparedSandbox(spec, paths, handle, env={"CELLGATE_BRIDGE": str(socket)})
