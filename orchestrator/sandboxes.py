"""From a conversation to its verified sandbox (S1-S4, K1).

`ConversationSandboxes.ensure` creates the conversation's directories, plans
its mounts from the workspace as it is now, builds the spec (image, user,
environment without secrets, networks, limits) and asks the backend for a
container matching it, verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from cellgate.errors import QuotaError
from cellgate.models import ConversationKey
from orchestrator.apps import InstalledApp
from orchestrator.config import GatewaySettings
from orchestrator.conversations import ConversationPaths, conversation_paths
from orchestrator.host_side import HostJob, host_side
from orchestrator.host_worker import WORKER
from orchestrator.placement import Placement
from orchestrator.store.messages import conversation_id
from policies.secrets import env_entry
from sandbox.backends.base import ImageFacts, SandboxBackend, SandboxHandle
from sandbox.gateway_id import valid_gateway_id
from sandbox.quota import Busy, LoopQuota, QuotaLimits, QuotaTarget, probe
from sandbox.spec import DEFAULT_UID, SandboxLimits, SandboxSpec, sandbox_name

logger = logging.getLogger(__name__)


def sandbox_user(declared: str | None, image_user: str) -> str:
    """The app's user, unless it is root or not numeric: then a fixed unprivileged uid."""
    for candidate in (declared, image_user):
        if not candidate:
            continue
        uid, _, gid = candidate.partition(":")
        if uid.isdigit() and uid != "0" and (not gid or gid.isdigit()):
            return f"{uid}:{gid or uid}"
    return f"{DEFAULT_UID}:{DEFAULT_UID}"


def sandbox_env(image_env: Mapping[str, str], app_env: Mapping[str, str]) -> dict[str, str]:
    """The app's environment minus every secret (K1).

    Image ENV entries are applied by the engine whatever the container asks,
    so a secret-looking one is overridden with an empty value.
    """
    out: dict[str, str] = {}
    for name, value in {**image_env, **app_env}.items():
        if env_entry(name, value).allowed:
            out[name] = value
        elif name in image_env:
            out[name] = ""
    return out


def limits_from(settings: GatewaySettings) -> SandboxLimits:
    lim = settings.limits
    return SandboxLimits(
        pids=lim.pids,
        memory_bytes=lim.memory_mb * 1024 * 1024,
        nano_cpus=int(lim.cpus * 1_000_000_000),
    )


def quota_from(settings: GatewaySettings, app: InstalledApp) -> tuple[LoopQuota | None, str | None]:
    """The disk quota (R2) for an app agent's conversations, or why there is none.

    Returns `(quota, None)`, `(None, None)` when the operator turned it off, or
    `(None, reason)` when it is required and does not work here. The images
    live in the state directory the app is installed in (`<stateDir>/quota/`).
    """
    agent = app.agent
    root = app.agent_root.parent.parent / "quota"
    if settings.quota == "off":
        logger.warning(
            'gateway.quota is "off": agent %s\'s conversations have no disk quota, so one '
            "stranger's `dd` can fill this host's disk (R2)",
            agent,
        )
        return None, None
    support = probe(root)
    if not support.ok:
        logger.error(
            "agent %s is refused: no disk quota works here (R2): %s", agent, support.reason
        )
        return None, support.reason
    lim = settings.limits
    limits = QuotaLimits(lim.disk_mb * 1024 * 1024, lim.disk_inodes, lim.writable_exec)
    return LoopQuota(root, limits), None


@dataclass(frozen=True, slots=True)
class PreparedSandbox:
    spec: SandboxSpec
    paths: ConversationPaths
    handle: SandboxHandle
    env: Mapping[str, str] = field(default_factory=dict)

    def placement(self) -> Placement:
        """Where the runner runs the turn: this verified container."""
        return Placement(
            handle=self.handle,
            paths=self.paths,
            home=self.spec.home,
            workdir=self.spec.workdir,
            env=self.env,
        )


class SandboxPool(Protocol):
    """F1: a pooled sandbox for the conversation of `spec`, or None (start cold)."""

    async def claim(self, spec: SandboxSpec) -> SandboxHandle | None: ...

    def settled(self, conversation: str) -> None:
        """The conversation's turn left its sandbox (F3: a refill may compete again)."""


class ConversationSandboxes:
    """Ensures the sandbox of each conversation of one app agent.

    `gateway_id` (R1) labels every sandbox and is mixed into its name, so another
    gateway serving an app of the same name never shares a container with this one.
    """

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
        self.pool: SandboxPool | None = None  # orchestrator.pool (F1)
        self.quota, self.quota_refusal = quota_from(settings, app)

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
        paths = conversation_paths(self.app.agent_root, self.app.workspace, key, session_id)

        job = HostJob(self.app.agent, key.digest, paths, self.app.agent_root, (uid, gid))
        # quick, in the host worker (a process with its own interpreter lock, F3): anything
        # that may take long (a quota image to make or mount, its lock held, data to move
        # in) is `Busy` there and done on the default executor, in this process, so that it
        # never queues every new conversation behind it
        try:
            plan = await WORKER.host_side(self.quota, job)
        except Busy:
            plan = await asyncio.to_thread(partial(host_side, self.quota, job, quick=False))
        spec = SandboxSpec(
            name=sandbox_name(self.app.name, key.digest, gateway=self.gateway_id),
            image=self.app.image,
            image_id=image.id,
            user=user,
            env=sandbox_env(image.env, self.app.environment),
            networks=self.app.networks,
            plan=plan,
            limits=limits_from(self.settings),
            runtime=self.settings.runtime,
            app=self.app.name,
            agent=self.app.agent,
            conversation=conversation_id(key),
            gateway=self.gateway_id,
        )
        return spec, paths

    async def ensure(self, key: ConversationKey, session_id: str) -> PreparedSandbox:
        if self.quota_refusal is not None:
            raise QuotaError(self.quota_refusal)
        spec, paths = await self.spec_for(key, session_id)
        handle = await self.pool.claim(spec) if self.pool is not None else None
        if handle is None:
            handle = await self.backend.ensure(spec)
        logger.debug("sandbox %s ready", handle.name, extra={"conversation": key.digest})
        return PreparedSandbox(spec, paths, handle)

    def memory_held(
        self, key: ConversationKey, media: str | None = None
    ) -> AbstractContextManager[object]:
        """R2: while held, the conversation's quota image is on its chat dir (and its
        media dir `media`, a name under `media/`): `LoopQuota.held`, for what reads or
        writes them outside a turn. Blocking."""
        if self.quota is None:
            return contextlib.nullcontext()
        return self.quota.held(self.app.agent, key.digest, reader_targets(self.app, key, media))

    def release_memory(self, key: ConversationKey, unused_since: float | None = None) -> None:
        """R2, R3: its sandbox is gone; the image is unmounted until it is needed (if not
        used after `unused_since`). Blocking."""
        if self.quota is not None:
            self.quota.release(self.app.agent, key.digest, unused_since=unused_since)


def memory_held(
    sandboxes: object, key: ConversationKey, media: str | None = None
) -> AbstractContextManager[object]:
    """`ConversationSandboxes.memory_held` for any agent's sandboxes: a host agent's or the
    app's one container's (S6) conversations have no image of their own (a no-op)."""
    if isinstance(sandboxes, ConversationSandboxes):
        return sandboxes.memory_held(key, media)
    return contextlib.nullcontext()


def reader_targets(
    app: InstalledApp, key: ConversationKey, media: str | None = None
) -> tuple[QuotaTarget, ...]:
    """The conversation's chat dir, and the media dir named `media`, as quota targets."""
    ws = app.workspace
    chat = (QuotaTarget("chat", ws, ws / "chats" / key.dir_name),)
    if media is None:
        return chat
    return (*chat, QuotaTarget(f"media/{media}", ws, ws / "media" / media))
