"""This gateway's sandboxes over their life: reconcile at start, reap when idle (D2, S5).

`SandboxKeeper.reconcile` removes this gateway's containers whose conversation
the store does not know or whose spec is stale; `reaper()` builds the idle
reaper over the store's view of sessions, holding the conversation's lock
around each removal so a turn never starts in a sandbox being removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable

from orchestrator.admission import LiveSandbox
from orchestrator.agents import Agents
from orchestrator.bridge import BridgeServer
from orchestrator.config import GatewaySettings
from orchestrator.quota_sweep import QuotaSweep
from orchestrator.runner import TurnRunner, conversation_key
from orchestrator.store import ConversationId, Sandbox, Session
from orchestrator.store.views import SandboxStore
from orchestrator.turns import TurnLoop
from sandbox.backends.base import SandboxBackend, SandboxInfo
from sandbox.reaper import Reaper
from sandbox.spec import (
    LABEL_APP,
    LABEL_CONVERSATION,
    LABEL_GATEWAY,
    LABEL_MANAGED,
    LABEL_SPEC_HASH,
    shared_sandbox_name,
)

logger = logging.getLogger(__name__)


class SandboxKeeper:
    def __init__(
        self,
        gateway_id: str,
        settings: GatewaySettings,
        agents: Agents,
        store: SandboxStore,
        backend: SandboxBackend,
        loop: TurnLoop,
        runner: TurnRunner,
        bridge: BridgeServer,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.gateway_id = gateway_id
        self.settings = settings
        self.agents = agents
        self.store = store
        self.backend = backend
        self.loop = loop
        self.runner = runner
        self.bridge = bridge
        self.clock = clock
        self.on_removed: Callable[[str], None] = lambda agent: None  # metrics (O2)
        self.pooled: Callable[[str], bool] = lambda name: False  # held by a live warm pool (F1)
        self.claimed_by: Callable[[str], str | None] = lambda name: None  # F1: its claimer
        self.quota = QuotaSweep(agents, store, loop, settings.sandbox_idle_minutes)  # R3

    async def reconcile(self) -> int:
        """Remove this gateway's containers whose conversation is unknown or whose spec is stale."""
        removed = 0
        known = {c.id: c for c in await asyncio.to_thread(self.store.conversations)}
        apps = self.agents.app_names()
        mine = {LABEL_MANAGED: "1", LABEL_GATEWAY: self.gateway_id}  # R1: only our own
        for info in await self.backend.list(mine):
            if info.labels.get(LABEL_APP) not in apps:
                continue  # another gateway's, or an app this one does not serve
            if self.pooled(info.name):
                continue  # this process's warm pool made it; a previous run's is an orphan
            conv = known.get(ConversationId(info.labels.get(LABEL_CONVERSATION, "")))
            stale = conv is None
            if conv is not None:
                rt = self.agents.get(conv.agent)
                if rt is None or rt.sandboxes is None:
                    stale = True
                else:
                    session = await self.runner.session_for(conv, rt)
                    spec, _ = await rt.sandboxes.spec_for(conversation_key(conv), session)
                    stale = info.labels.get(LABEL_SPEC_HASH) != spec.spec_hash()
            if stale:
                logger.info("removing sandbox %s (no conversation or stale spec)", info.name)
                await self.backend.remove(info.name)
                await asyncio.to_thread(self.store.forget_sandbox, info.name)
                removed += 1
        return removed

    def reaper(self, *, release: bool = True) -> Reaper:
        """Removes this gateway's sandboxes `sandboxIdleMinutes` after their last turn;
        `release`: their conversations' quota images are given back (R3)."""
        return Reaper(
            self.backend,
            gateway_id=self.gateway_id,
            last_active=self._last_active,
            busy=self._busy,
            idle_minutes=self.settings.sandbox_idle_minutes,
            now=self.clock,
            guard=self._guard,
            scope=self._reapable,
            on_removed=functools.partial(self.removed, release=release),
        )

    def _reapable(self, info: SandboxInfo) -> bool:
        """An app this gateway serves, and not a spare its warm pool holds (F1: a pooled
        sandbox no conversation has claimed yet has no last turn to be idle since)."""
        if info.labels.get(LABEL_APP) not in self.agents.app_names():
            return False
        return not (self.pooled(info.name) and self.claimed_by(info.name) is None)

    async def _sessions_in(self, sb: Sandbox) -> list[Session]:
        """The live sessions running in `sb`: its conversation's, or for the app's one
        container `<app>-agent` (S6) every conversation's of its agent."""
        if sb.name == shared_sandbox_name(sb.app):
            return await asyncio.to_thread(self.store.live_sessions, sb.agent)
        return await asyncio.to_thread(self.store.live_sessions, conversation=sb.conversation_id)

    def _turn_in(self, sb: Sandbox, sessions: list[Session], *, own: bool = True) -> bool:
        """A turn runs (or waits) in `sb`; `own=False` leaves out its recorded conversation's
        lock (held by the reaper's guard around the check itself)."""
        convs = {s.conversation_id for s in sessions} | {sb.conversation_id}
        if not own:
            convs.discard(sb.conversation_id)
        return any(s.busy for s in sessions) or any(self.loop.conversation_busy(c) for c in convs)

    async def _last_active(self, name: str) -> float | None:
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            return None
        live = await self._sessions_in(sb)
        return max([sb.last_used_at, *(s.last_active_at for s in live)])

    async def _busy(self, name: str) -> bool:
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            return False
        return self._turn_in(sb, await self._sessions_in(sb), own=False)

    @contextlib.asynccontextmanager
    async def _guard(
        self, info: SandboxInfo, holding: ConversationId | None = None
    ) -> AsyncIterator[None]:
        """Holds the lock of the conversation `info` serves (the store's row, else the
        container's label or the pool's claim: a sandbox a starting turn made or claimed
        before its row was written), unless it is `holding`'s, which the caller holds."""
        sb = await asyncio.to_thread(self.store.get_sandbox, info.name)
        conv = ConversationId(
            sb.conversation_id
            if sb is not None
            else info.labels.get(LABEL_CONVERSATION) or self.claimed_by(info.name) or ""
        )
        if not conv or conv == holding:
            yield
            return
        async with self.loop.conversation_lock(conv):
            yield

    async def removed(self, name: str, *, release: bool = False) -> None:
        """The container is gone: its sessions end, its bridge closes, its row goes; with
        `release` (reaped or evicted) its conversation's quota image is given back."""
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            return
        await self.bridge.close(sb.conversation_id)
        self.runner.outbox.pending.take(sb.conversation_id)  # nothing waits for these now
        for s in await self._sessions_in(sb):
            await asyncio.to_thread(self.store.end_session, s.id)
        await asyncio.to_thread(self.store.forget_sandbox, name)
        if release:
            await self.quota.removed(sb.agent, sb.conversation_id)
        self.on_removed(sb.agent)

    async def live(self) -> list[LiveSandbox]:
        """This gateway's sandboxes as the store knows them, with whether a turn is in one."""
        out: list[LiveSandbox] = []
        for sb, sessions in await asyncio.to_thread(self._with_sessions):
            busy = self._turn_in(sb, sessions)
            out.append(LiveSandbox(sb.name, sb.conversation_id, sb.last_used_at, busy))
        return out

    def _with_sessions(self) -> list[tuple[Sandbox, list[Session]]]:
        """Every sandbox with its live sessions, read in one go (one thread hop for all:
        the sandbox cap asks this before every new conversation's first turn, F3)."""
        sandboxes = self.store.sandboxes()
        by_conv: dict[ConversationId, list[Session]] = {}
        for s in self.store.live_sessions():
            by_conv.setdefault(s.conversation_id, []).append(s)
        out: list[tuple[Sandbox, list[Session]]] = []
        for sb in sandboxes:
            if sb.name == shared_sandbox_name(sb.app):
                out.append((sb, self.store.live_sessions(sb.agent)))
            else:
                out.append((sb, by_conv.get(sb.conversation_id, [])))
        return out

    async def evict(self, name: str) -> bool:
        """Remove an idle sandbox now (R4), unless its conversation took it meanwhile."""
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is not None and self._turn_in(sb, await self._sessions_in(sb)):
            return False
        if sb is None:
            await self.backend.remove(name)
            return True
        async with self.loop.conversation_lock(sb.conversation_id):
            await self.backend.remove(name)
            await self.removed(name, release=True)
        return True

    async def remove_app(
        self, app: str, agent: str, holding: ConversationId | None = None
    ) -> list[str]:
        """S5, L5: remove every sandbox of `app` (an update or restart), each under its
        conversation's lock except `holding`'s, which the caller holds already."""
        removed: list[str] = []
        for sb in await asyncio.to_thread(self.store.sandboxes, app):
            if sb.agent != agent:
                continue
            lock = (
                contextlib.nullcontext()
                if sb.conversation_id == holding
                else self.loop.conversation_lock(sb.conversation_id)
            )
            async with lock:
                await self.backend.remove(sb.name)
                await self.removed(sb.name)
            removed.append(sb.name)
        # labelled ones the store forgot, or a turn started meanwhile (under its lock)
        removed += await self.reaper(release=False).remove_app(
            app, guard=lambda info: self._guard(info, holding)
        )
        return removed
