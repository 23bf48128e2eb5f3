"""The gateway: the small object that wires its rooms together.

    channel / HTTP API ──▶ Intake ──▶ store ──▶ TurnLoop ──▶ TurnRunner ──▶ sandbox
                                                  │              └─ bridge ─▶ GatewayOutbox
                                                  └─ ReplyDelivery ──▶ channel
    Heartbeats ──▶ TurnRunner          SandboxKeeper: reconcile at start, idle reaper
    CronScheduler ──▶ Intake (prompt jobs) / host command (C1, C2)

- `agents.Agents`: each agent's config, harness, app and sandboxes.
- `intake.Intake`: accept and store a message from any channel (D1).
- `turns.TurnLoop`: turns of one conversation in order, conversations in
  parallel under a bound; recovery after a crash (D2).
- `runner.TurnRunner`: one turn in a verified sandbox (S3, S4, M5, D3).
- `delivery`: bridge deliveries and the final reply into its chat.
- `heartbeats.Heartbeats`: periodic turns (M4).
- `sandbox_keeper.SandboxKeeper`: start-up reconciliation and the reaper (D2, S5).
- `cron`: the job service (CLI, API, `cron_*` tools) and the scheduler (C1, C2).

Nothing here keeps state the store already has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import TurnTimeout
from cellgate.models import ConversationKey
from channels.base import Channel
from orchestrator.admission import MessageGate, SandboxGate, default_max_sandboxes
from orchestrator.agents import AgentRuntime, Agents, build_harness
from orchestrator.archive import kb_path
from orchestrator.bridge import BridgeServer, BuiltinTools, StoreRefusals, ToolHandlers
from orchestrator.bridge.cron_tools import CronTools
from orchestrator.bridge.discord_tools import DiscordTools
from orchestrator.bridge.line_tools import LineTools
from orchestrator.bridge.memory_tools import MemoryTools
from orchestrator.bridge.telegram_tools import TelegramTools
from orchestrator.channel_hub import ChannelInbox, ChannelKey, build_channels
from orchestrator.config import GatewayConfig
from orchestrator.cron import CronJobs, CronScheduler
from orchestrator.cron.agents import agent_facts, agent_workdir
from orchestrator.delivery import GatewayOutbox, ReplyDelivery, read_from_store
from orchestrator.harnesses.base import TurnResult
from orchestrator.heartbeats import Heartbeats
from orchestrator.host_worker import CLAIMER, WORKER
from orchestrator.intake import Intake
from orchestrator.lane import in_host_lane
from orchestrator.metrics import Metrics
from orchestrator.pool import WarmPools
from orchestrator.reload import Reloader
from orchestrator.resident import ResidentBackend
from orchestrator.runner import TurnRunner, session_env
from orchestrator.sandbox_keeper import SandboxKeeper
from orchestrator.store import Conversation, Message, Store
from orchestrator.supervise import supervised
from orchestrator.turns import TurnAnswer, TurnLoop
from sandbox.backends.base import SandboxBackend
from sandbox.backends.docker import DockerBackend
from sandbox.gateway_id import load_gateway_id
from sandbox.reaper import Reaper
from sandbox.runtime_check import check_runtimes

__all__ = ["AgentRuntime", "Gateway", "TurnOutcome", "build_harness"]


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    conversation: ConversationKey
    sandbox: str
    result: TurnResult


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        backend: SandboxBackend,
        *,
        store: Store | None = None,
        clock: Callable[[], float] = time.time,
        config_path: Path | None = None,
    ) -> None:
        settings = config.gateway
        self.config = config
        self.config_path = config_path  # followed for changes (L5)
        self.backend = backend
        self.clock = clock
        self.store = store or Store.open(settings.state_dir, clock=clock)
        self.gateway_id = load_gateway_id(settings.state_dir)  # R1: what this gateway owns
        self.agents = Agents.load(config.agents, settings, backend, self.gateway_id)
        self.agents.mint_host_keys(self.store)  # K2
        self.metrics = Metrics(self.store.path, clock)  # O2
        self.channels: dict[ChannelKey, Channel] = build_channels(config, self.store)
        self.outbox = GatewayOutbox(self.channels)
        tools = BuiltinTools(self.outbox, self.store, settings.state_dir / "bridge-spool")
        handlers = tools.install(ToolHandlers(refusals=StoreRefusals(self.store)))
        handlers = LineTools(tools, self.channels).install(handlers)
        handlers = DiscordTools(tools, self.channels).install(handlers)
        self.cron_jobs = CronJobs(self.store, agent_facts(self.agents), clock=clock)  # C1, C2
        CronTools(self.cron_jobs).install(handlers)
        MemoryTools(lambda agent: kb_path(settings.state_dir, agent)).install(handlers)  # A1
        self.bridge = BridgeServer(TelegramTools(tools, self.channels).install(handlers))
        self.runner = TurnRunner(
            settings, self.agents, self.store, backend, self.bridge, self.outbox, clock=clock
        )
        self.runner.observe = self.metrics.observe
        bound = settings.max_concurrent_turns
        self.loop = TurnLoop(
            self.store,
            self.metrics.turn(self._turn),
            self.metrics.delivery(ReplyDelivery(self.channels)),
            bound=bound,
            delivered_by_store=read_from_store,
            per_sender=settings.admission.turns_per_sender or max(1, bound // 2),
            turn_timeout=settings.turn_timeout_seconds + 60,
        )
        self.intake = Intake(
            self.agents,
            self.store,
            self.loop,
            MessageGate(settings.admission, self.store, clock=clock),
        )
        self.cron = CronScheduler(
            self.store,
            agent_facts(self.agents),
            self.intake.submit,
            clock=clock,
            workdir=agent_workdir(self.agents, settings.state_dir),
        )
        self.cron_jobs.on_change = self.cron.wake
        self.inbox = ChannelInbox(self.agents, self.store, self.intake, self.loop, self.channels)
        self.heartbeats = Heartbeats(self.agents, self.store, self.loop, self.runner, clock=clock)
        self.sandboxes = SandboxKeeper(
            self.gateway_id,
            settings,
            self.agents,
            self.store,
            backend,
            self.loop,
            self.runner,
            self.bridge,
            clock=clock,
        )
        self.sandboxes.on_removed = self.metrics.reaped
        self.runner.gate = SandboxGate(
            settings.limits.max_sandboxes or default_max_sandboxes(settings.limits.memory_mb),
            self.sandboxes.live,
            self.sandboxes.evict,
            self.store,
        )
        self.reloader = Reloader(
            config_path, config, self.agents, self.store, backend, self.gateway_id, self.loop,
            self.sandboxes.remove_app, self._config_changed,
        )  # fmt: skip
        if settings.resident_runner and isinstance(backend, DockerBackend):
            self.runner.residents = ResidentBackend(backend)  # F2
        self.pools = WarmPools(  # F1
            self.agents,
            settings.pool,
            backend,
            settings.state_dir,
            self.gateway_id,
            max_sandboxes=lambda: self.runner.gate.max_sandboxes if self.runner.gate else 1 << 30,
            live=lambda: _count(self.sandboxes.live()),
            residents=self.runner.residents,
        )
        self.sandboxes.pooled = self.pools.holds  # reconcile leaves the live pools' sandboxes
        self.sandboxes.claimed_by = self.pools.conversation_of  # a pooled one's conversation
        self.reloader.restarted = self.pools.restarted  # L5: pools follow their agents
        self._starting: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []

    async def _turn(self, conv: Conversation, message: Message) -> TurnAnswer:
        """A turn, with an agent waiting for an L5 restart settled around it."""
        return await self.reloader.around(self.runner.run)(conv, message)

    def _config_changed(self, config: GatewayConfig) -> None:
        self.config = config

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Recovery (D2): remove orphaned or stale sandboxes, then finish pending messages.

        Once per gateway. Callers that come while it runs (the first messages of a
        gateway started by its first `submit`) wait for it: recovery closes every open
        turn, so a turn of theirs opened meanwhile would be closed under them. A start
        that failed is not run again."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
            await asyncio.shield(self._starting)
        elif not self._starting.done():
            await asyncio.wait({self._starting})

    async def _start(self) -> None:
        await self.check_runtimes()
        await self.sandboxes.reconcile()
        for channel in self.channels.values():  # W1: before recovery delivers replies
            await channel.start(self.inbox)
        await self.loop.recover()

    async def check_runtimes(self) -> None:
        """S2: an agent whose runtime cannot list, stat or write a tmpfs is not served."""
        wanted = {
            a: (self.config.gateway.runtime, rt.app.image_id)
            for a, rt in self.agents.items()
            if rt.app is not None and rt.sandboxes is not None
        }
        for agent_id, verdict in (await check_runtimes(self.backend, wanted)).items():
            if not verdict.ok:
                self.agents[agent_id].unavailable = verdict.summary

    def start_background(self, reaper_interval: float = 60.0) -> None:
        """The reaper, heartbeats and cron, supervised: a failing pass is logged and retried."""
        self._background += [
            asyncio.create_task(supervised("reaper", lambda: self.run_reaper(reaper_interval))),
            asyncio.create_task(supervised("heartbeats", self.run_heartbeats)),
            asyncio.create_task(supervised("loop-lag", self.metrics.watch_loop)),
            asyncio.create_task(supervised("cron", self.cron.run_forever)),  # C1, missed runs
            *(asyncio.create_task(supervised("pool", p.run_forever)) for p in self.pools.pools),
        ]
        if self.pools.pools:  # F3: its imports done before the pool's first claim
            for worker in (WORKER, CLAIMER):
                self._background.append(asyncio.create_task(in_host_lane(worker.start)))
        self.pools.spawn = lambda pool: self._background.append(
            asyncio.create_task(supervised("pool", pool.run_forever))
        )
        if self.config_path is not None:  # L5: config changes without a restart
            self.reloader.install_sighup()
            self._background.append(
                asyncio.create_task(supervised("config-watch", self.reloader.watch))
            )

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        await self.inbox.close()
        await self.loop.close()
        for channel in self.channels.values():
            await channel.stop()
        await self.bridge.close_all()
        if self.runner.residents is not None:
            await self.runner.residents.close()
        await self.backend.close()
        self.store.close()

    # -- what callers use --------------------------------------------------

    def agent(self, agent_id: str) -> AgentRuntime:
        return self.agents.require(agent_id)

    async def submit(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        *,
        message_id: str | None = None,
        sender: str = "",
    ) -> tuple[Message, bool]:
        """Store the message (idempotent on its platform id) and queue its turn."""
        await self.start()
        return await self.intake.submit(
            agent_id, channel, chat_id, text, message_id=message_id, sender=sender
        )

    async def turn(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        *,
        message_id: str | None = None,
        sender: str = "",
    ) -> TurnOutcome:
        """Submit a message and wait for its reply (the synchronous form)."""
        msg, _ = await self.submit(
            agent_id, channel, chat_id, text, message_id=message_id, sender=sender
        )
        key = ConversationKey(agent_id, channel, chat_id)
        timeout = self.config.gateway.turn_timeout_seconds + 30
        try:
            reply = await self.loop.wait(msg.id, timeout)
        except TimeoutError as exc:
            raise TurnTimeout(timeout) from exc
        ran = self.runner.outcomes.take(msg.id)
        if ran is not None and ran.error is not None:
            raise ran.error
        if ran is not None and ran.result is not None:
            return TurnOutcome(key, ran.sandbox, ran.result)
        result = TurnResult(ok=True, reply=reply.text, turn_id=str(msg.id))
        return TurnOutcome(key, ran.sandbox if ran else "", result)

    def session_env(self, key: ConversationKey, home: str) -> dict[str, str]:
        return session_env(key, home)

    async def heartbeat_once(self, agent_id: str) -> list[tuple[ConversationKey, TurnResult]]:
        return await self.heartbeats.once(agent_id)

    async def run_heartbeats(self) -> None:
        await self.heartbeats.run_forever()

    async def reconcile_sandboxes(self) -> int:
        return await self.sandboxes.reconcile()

    def reaper(self) -> Reaper:
        return self.sandboxes.reaper()

    async def run_reaper(self, interval: float = 60.0) -> None:
        await self.reaper().run_forever(interval, after=self.sandboxes.quota.sweep)  # R3


async def _count(items: Awaitable[Sized]) -> int:
    return len(await items)
