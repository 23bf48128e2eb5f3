"""L5: the gateway follows its config file and app records without a restart.

`Reloader.watch` polls a fingerprint (sha256 of the config file and of every
`apps/*/app.json`) and wakes on SIGHUP. A change is read with the app
declarations applied first (L3); then, per agent:

- a new agent is loaded at once; a removed one is dropped once idle;
- an agent whose config or app record changed keeps running as it started
  (mode included) until none of its sessions is busy, then restarts: its
  sandboxes are removed (S5) and its runtime rebuilt, so the next turn runs
  in a new sandbox with the new plan. `policies.lifecycle.restart_needed`
  decides and says why.

A turn of an agent waiting to restart settles it before it starts and after
it ends (`around`), so the turn after the last busy one already runs anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import AppError, CellgateError
from orchestrator.agents import AgentRuntime, Agents, load_runtime
from orchestrator.app_modes import apply_declarations
from orchestrator.apps import InstalledApp
from orchestrator.config import AgentConfig, GatewayConfig, load_config
from orchestrator.store import Conversation, ConversationId, Message, Store
from orchestrator.turns import RunTurn, TurnAnswer, TurnLoop
from policies.lifecycle import restart_needed
from sandbox.backends.base import SandboxBackend
from sandbox.runtime_check import check_runtimes

logger = logging.getLogger(__name__)

MAX_WATCHED_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Pending:
    """What an agent restarts into: its new config, or None when it goes away."""

    config: AgentConfig | None
    why: str


def _digest(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            return hashlib.sha256(fh.read(MAX_WATCHED_BYTES)).hexdigest()
    except OSError:
        return "-"


def _record_key(app: InstalledApp | None) -> tuple[object, ...] | None:
    if app is None:
        return None
    return (app.version, app.image, app.image_id, app.user, tuple(sorted(app.environment.items())),
            app.networks, app.isolate_memory, app.disable_archive, app.state)  # fmt: skip


class Reloader:
    def __init__(
        self,
        config_path: Path | None,
        config: GatewayConfig,
        agents: Agents,
        store: Store,
        backend: SandboxBackend,
        gateway_id: str,
        loop: TurnLoop,
        remove_sandboxes: Callable[[str, str, ConversationId | None], Awaitable[list[str]]],
        on_config: Callable[[GatewayConfig], None],
    ) -> None:
        self.config_path = config_path
        self.config = config
        self.agents = agents
        self.store = store
        self.backend = backend
        self.gateway_id = gateway_id
        self.loop = loop
        self.remove_sandboxes = remove_sandboxes
        self.on_config = on_config
        self.pending: dict[str, Pending] = {}
        self.restarts = 0
        # told of each restart or stop (the gateway's warm pools follow the agent, F1)
        self.restarted: Callable[[str], None] = lambda _agent: None
        self._hup = asyncio.Event()
        self._seen = self.fingerprint()
        self._lock = asyncio.Lock()

    # -- noticing -----------------------------------------------------------------------

    def fingerprint(self) -> str:
        if self.config_path is None:
            return ""
        parts = [_digest(self.config_path)]
        apps = self.config.gateway.state_dir / "apps"
        if apps.is_dir():
            for record in sorted(apps.glob("*/app.json")):
                parts.append(f"{record.parent.name}:{_digest(record)}")
        return "\n".join(parts)

    def install_sighup(self) -> bool:
        """SIGHUP reloads now; only possible on the main thread's loop."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hup.set)
        except (RuntimeError, ValueError, NotImplementedError):
            return False
        return True

    async def watch(self, interval: float = 1.0) -> None:
        """Reload on a changed fingerprint or SIGHUP; settle idle agents that wait."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._hup.wait()
            hup = self._hup.is_set()
            self._hup.clear()
            now = await asyncio.to_thread(self.fingerprint)
            if hup or now != self._seen:
                logger.info("config change noticed (%s); reloading", "SIGHUP" if hup else "file")
                try:
                    await self.reload()
                except CellgateError as exc:
                    logger.error("config reload failed, keeping the running config: %s", exc)
                    self._seen = now
            for agent in list(self.pending):
                await self.settle(agent)

    # -- reloading ----------------------------------------------------------------------

    async def reload(self) -> list[str]:
        """Read the config again (L3 applied); the agents that now wait for a restart."""
        if self.config_path is None:
            return []
        path = self.config_path
        async with self._lock:
            await asyncio.to_thread(apply_declarations, path, self.config.gateway.state_dir)
            self._seen = await asyncio.to_thread(self.fingerprint)
            cfg = await asyncio.to_thread(load_config, path)
            if cfg.gateway != self.config.gateway:
                logger.warning(
                    "the config's `gateway` section changed: it takes effect at the next "
                    "gateway start (agents and apps are followed now)"
                )
                cfg = cfg.model_copy(update={"gateway": self.config.gateway})
            self.config = cfg
            self.on_config(cfg)
            wanted = {a.id: a for a in cfg.agents}
            for agent_id, new in wanted.items():
                rt = self.agents.get(agent_id)
                if rt is None:  # as a restart brings an agent up: probe, pool
                    await self._bring_up(agent_id, new)
                    logger.info("agent %s added by a config change", agent_id)
                    continue
                why = self._changed(rt, new)
                if why:
                    self.pending[agent_id] = Pending(new, why)
                else:
                    self.pending.pop(agent_id, None)
            for agent_id in set(self.agents) - set(wanted):
                self.pending[agent_id] = Pending(None, "removed from the config")
        for agent_id in list(self.pending):
            await self.settle(agent_id)
        return sorted(self.pending)

    def _load(self, agent: AgentConfig) -> AgentRuntime:
        return load_runtime(agent, self.config.gateway, self.backend, self.gateway_id)

    def _changed(self, rt: AgentRuntime, new: AgentConfig) -> str:
        decision = restart_needed(
            rt.started_isolated,
            rt.config.disable_archive,
            new.isolate_memory,
            new.disable_archive,
            0,
        )
        if decision.changed:
            return decision.reason.split(":")[0]
        if new != rt.config:
            return "its config entry changed"
        if new.app is not None:
            try:
                app = InstalledApp.load(self.config.gateway.state_dir, new.app)
            except AppError:
                app = None
            if _record_key(app) != _record_key(rt.app):
                return f"app {new.app} changed (update, reconfigure, start or stop)"
        return ""

    # -- restarting ---------------------------------------------------------------------

    async def busy(self, agent_id: str, holding: ConversationId | None = None) -> int:
        """How many of the agent's conversations (other than `holding`) run a turn now."""
        convs = await asyncio.to_thread(self.store.conversations, agent_id)
        return sum(1 for c in convs if c.id != holding and self.loop.conversation_busy(c.id))

    def busy_now(self, agent_id: str) -> int:
        """`busy`, synchronously (for a status read from another thread)."""
        convs = self.store.conversations(agent_id)
        return sum(1 for c in convs if self.loop.conversation_busy(c.id))

    def pending_isolated(self, agent_id: str) -> bool:
        p = self.pending.get(agent_id)
        return p is not None and p.config is not None and p.config.isolate_memory

    async def settle(self, agent_id: str, holding: ConversationId | None = None) -> bool:
        """Restart the agent now if it waits for one and none of its sessions is busy."""
        p = self.pending.get(agent_id)
        rt = self.agents.get(agent_id)
        if p is None or rt is None:
            return False
        busy = await self.busy(agent_id, holding)
        new = p.config
        decision = restart_needed(
            rt.started_isolated,
            rt.config.disable_archive,
            rt.started_isolated if new is None else new.isolate_memory,
            rt.config.disable_archive if new is None else new.disable_archive,
            busy,
        )
        if busy:
            logger.info("agent %s waits to restart (%s): %d busy session(s) (L5: %s)",
                        agent_id, p.why, busy, decision.reason)  # fmt: skip
            return False
        if self.pending.get(agent_id) is not p:
            return False
        del self.pending[agent_id]
        try:
            await self._restart(agent_id, rt, p, holding)
        except CellgateError as exc:
            logger.error("agent %s could not restart: %s", agent_id, exc)
            rt.unavailable = f"it failed to restart after a config change: {exc}"
            return False
        return True

    async def _restart(
        self, agent_id: str, rt: AgentRuntime, p: Pending, holding: ConversationId | None
    ) -> None:
        if rt.app is not None:
            removed = await self.remove_sandboxes(rt.app.name, agent_id, holding)
            if removed:
                logger.info("agent %s: removed %d sandbox(es) (S5)", agent_id, len(removed))
        if p.config is None:
            self.agents.drop(agent_id)
            self.restarted(agent_id)
            logger.info("agent %s stopped: %s", agent_id, p.why)
            return
        new = await self._bring_up(agent_id, p.config)
        self.restarts += 1
        logger.info(
            "agent %s restarted (%s): isolateMemory %s, disableArchive %s (L5)",
            agent_id, p.why, str(new.started_isolated).lower(),
            str(new.config.disable_archive).lower(),
        )  # fmt: skip

    async def _bring_up(self, agent_id: str, config: AgentConfig) -> AgentRuntime:
        """Load the agent, probe its runtime (S2, as at start), serve it, and tell the
        gateway (`restarted`: its warm pool is started again)."""
        new = await asyncio.to_thread(self._load, config)
        if new.app is not None and new.sandboxes is not None and new.unavailable is None:
            wanted = {agent_id: (self.config.gateway.runtime, new.app.image_id)}
            verdict = (await check_runtimes(self.backend, wanted)).get(agent_id)
            if verdict is not None and not verdict.ok:
                new.unavailable = verdict.summary
        self.agents.put(agent_id, new)
        self.restarted(agent_id)
        return new

    def around(self, fn: RunTurn) -> RunTurn:
        """Settle the conversation's agent before and after each of its turns."""

        async def run(conv: Conversation, message: Message) -> TurnAnswer:
            if conv.agent in self.pending:
                await self.settle(conv.agent, holding=conv.id)
            try:
                return await fn(conv, message)
            finally:
                if conv.agent in self.pending:
                    await self.settle(conv.agent, holding=conv.id)

        return run
