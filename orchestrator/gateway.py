"""The gateway: agents, their sandboxes and harnesses, and one turn end to end.

Every message goes through the durable turn loop (`orchestrator.turns`): it is
stored before it is acknowledged, turns of one conversation run in order, and
a restarted gateway finishes what a crash interrupted (D1, D2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cellgate.errors import AgentUnavailable, AppError, CellgateError, TurnTimeout, UnknownAgent
from cellgate.models import ConversationKey, DeliveryReceipt, OutboundMessage
from channels.base import Channel
from orchestrator.apps import InstalledApp
from orchestrator.bridge import (
    BridgeScope,
    BridgeServer,
    BuiltinTools,
    ChannelOutbox,
    PendingOutbox,
    StoreRefusals,
    ToolHandlers,
    install_client,
)
from orchestrator.config import AgentConfig, GatewayConfig, HeartbeatSettings
from orchestrator.harnesses.base import DispatchResult, Harness, SessionContext
from orchestrator.harnesses.command import CommandHarness
from orchestrator.harnesses.openai import OpenAIHarness
from orchestrator.harnesses.shell import ShellHarness
from orchestrator.memory import compose_claude_md, heartbeat_targets, write_session_files
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.store import (
    Conversation,
    ConversationId,
    Message,
    MessageId,
    Reply,
    SessionId,
    Store,
)
from orchestrator.transcripts import (
    append_transcript,
    load_session_id,
    recent_history,
    save_session_id,
)
from orchestrator.turns import TurnAnswer, TurnLoop
from policies.tools import session_env_flags
from sandbox.backends.base import SandboxBackend
from sandbox.gateway_id import load_gateway_id
from sandbox.reaper import Reaper
from sandbox.spec import (
    LABEL_APP,
    LABEL_CONVERSATION,
    LABEL_GATEWAY,
    LABEL_MANAGED,
    LABEL_SPEC_HASH,
)

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


class _GatewayOutbox:
    """Bridge deliveries: the `api` channel keeps them for the HTTP answer; others send."""

    def __init__(self, channels: dict[str, Channel]) -> None:
        self.pending = PendingOutbox()
        self.channels = ChannelOutbox(channels)

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        if message.channel == "api":
            return await self.pending.deliver(scope, message)
        return await self.channels.deliver(scope, message)


@dataclass
class AgentRuntime:
    config: AgentConfig
    harness: Harness
    app: InstalledApp | None = None
    sandboxes: ConversationSandboxes | None = None
    started_isolated: bool = False


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    conversation: ConversationKey
    sandbox: str
    result: DispatchResult


@dataclass(frozen=True, slots=True)
class _Ran:
    """What the turn that answered a message left for a caller waiting on it."""

    sandbox: str
    result: DispatchResult | None
    error: CellgateError | None


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        backend: SandboxBackend,
        *,
        store: Store | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.backend = backend
        self.clock = clock
        self.store = store or Store.open(config.gateway.state_dir, clock=clock)
        self.gateway_id = load_gateway_id(config.gateway.state_dir)  # R1
        self.agents: dict[str, AgentRuntime] = {a.id: self._runtime(a) for a in config.agents}
        self.channels: dict[str, Channel] = {}
        self.outbox = _GatewayOutbox(self.channels)
        tools = BuiltinTools(self.outbox, self.store, config.gateway.state_dir / "bridge-spool")
        self.bridge = BridgeServer(tools.install(ToolHandlers(refusals=StoreRefusals(self.store))))
        self.loop = TurnLoop(
            self.store, self._run_turn, self._deliver, bound=config.gateway.max_concurrent_turns
        )
        self._ran: dict[MessageId, _Ran] = {}
        self._started = False

    def _runtime(self, agent: AgentConfig) -> AgentRuntime:
        rt = AgentRuntime(agent, build_harness(agent), started_isolated=agent.isolate_memory)
        if agent.app is None:
            return rt
        try:
            app = InstalledApp.load(self.config.gateway.state_dir, agent.app)
        except AppError as exc:
            logger.error("agent %s: %s", agent.id, exc)
            return rt
        rt.app = app
        rt.sandboxes = ConversationSandboxes(
            app, self.config.gateway, self.backend, gateway_id=self.gateway_id
        )
        return rt

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Recovery (D2): remove orphaned or stale sandboxes, then finish pending messages."""
        if self._started:
            return
        self._started = True
        await self.reconcile_sandboxes()
        await self.loop.recover()

    async def reconcile_sandboxes(self) -> int:
        """Remove this gateway's containers whose conversation is unknown or whose spec is stale."""
        removed = 0
        known = {c.id: c for c in await asyncio.to_thread(self.store.conversations)}
        apps = {rt.app.name for rt in self.agents.values() if rt.app is not None}
        mine = {LABEL_MANAGED: "1", LABEL_GATEWAY: self.gateway_id}  # R1: only our own
        for info in await self.backend.list(mine):
            if info.labels.get(LABEL_APP) not in apps:
                continue  # another gateway's, or an app this one does not serve
            conv = known.get(ConversationId(info.labels.get(LABEL_CONVERSATION, "")))
            stale = conv is None
            if conv is not None:
                rt = self.agents.get(conv.agent)
                if rt is None or rt.sandboxes is None:
                    stale = True
                else:
                    key = ConversationKey(conv.agent, conv.channel, conv.chat_id)
                    session = await self._session(conv, rt)
                    spec, _ = await rt.sandboxes.spec_for(key, session)
                    stale = info.labels.get(LABEL_SPEC_HASH) != spec.spec_hash()
            if stale:
                logger.info("removing sandbox %s (no conversation or stale spec)", info.name)
                await self.backend.remove(info.name)
                await asyncio.to_thread(self.store.forget_sandbox, info.name)
                removed += 1
        return removed

    async def close(self) -> None:
        await self.loop.close()
        await self.bridge.close_all()
        await self.backend.close()
        self.store.close()

    # -- intake ------------------------------------------------------------

    def agent(self, agent_id: str) -> AgentRuntime:
        rt = self.agents.get(agent_id)
        if rt is None:
            raise UnknownAgent(agent_id)
        return rt

    def _runnable(self, agent_id: str) -> AgentRuntime:
        rt = self.agent(agent_id)
        if rt.sandboxes is None:
            reason = (
                f"its app {rt.config.app!r} is not installed"
                if rt.config.app
                else "host agents are not served by this gateway yet; declare it in an app"
            )
            raise AgentUnavailable(agent_id, reason)
        return rt

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
        self._runnable(agent_id)
        key = ConversationKey(agent_id, channel, chat_id)
        conv = await asyncio.to_thread(self.store.upsert_conversation, key)
        msg, created = await asyncio.to_thread(
            self.store.accept_message,
            conv.id,
            message_id or uuid.uuid4().hex,
            sender=sender,
            text=text,
        )
        self.loop.wake(conv.id)
        return msg, created

    async def turn(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        meta: dict[str, Any] | None = None,
        *,
        message_id: str | None = None,
    ) -> TurnOutcome:
        """Submit a message and wait for its reply (the synchronous form)."""
        msg, _ = await self.submit(agent_id, channel, chat_id, text, message_id=message_id)
        key = ConversationKey(agent_id, channel, chat_id)
        timeout = self.config.gateway.turn_timeout_seconds + 30
        try:
            reply = await self.loop.wait(msg.id, timeout)
        except TimeoutError as exc:
            raise TurnTimeout(timeout) from exc
        ran = self._ran.pop(msg.id, None)
        if ran is not None and ran.error is not None:
            raise ran.error
        if ran is not None and ran.result is not None:
            return TurnOutcome(key, ran.sandbox, ran.result)
        result = DispatchResult(ok=True, reply=reply.text, turn_id=str(msg.id), meta={})
        return TurnOutcome(key, ran.sandbox if ran else "", result)

    # -- one turn ----------------------------------------------------------

    async def _session(self, conv: Conversation, rt: AgentRuntime) -> SessionId:
        live = await asyncio.to_thread(self.store.live_sessions, conversation=conv.id)
        if live:
            return live[0].id
        session = await asyncio.to_thread(self.store.open_session, conv.id, rt.config.harness.type)
        return session.id

    def session_env(self, key: ConversationKey, home: str) -> dict[str, str]:
        """A session's environment: its origin, its home, and no secret (K1, P1, T3)."""
        return {
            "HOME": home,
            "GATEWAY_ORIGIN_CHANNEL": key.channel,
            "GATEWAY_ORIGIN_CHAT_ID": key.chat_id,
            **session_env_flags(),
        }

    async def _run_turn(self, conv: Conversation, message: Message) -> TurnAnswer:
        rt = self._runnable(conv.agent)
        session_id = await self._session(conv, rt)
        turn = await asyncio.to_thread(self.store.start_turn, session_id, message.id)
        ok = False
        harness_turn: str | None = None
        sandbox: list[str] = []
        try:
            result = await self._execute(rt, conv, session_id, message.text, sandbox)
            ok, harness_turn = result.ok, result.turn_id
            await asyncio.to_thread(
                self._save_turn, rt, conv, session_id, "user", message.text, message.id, result
            )
            self._ran[message.id] = _Ran(sandbox[0], result, None)
            return TurnAnswer(result.ok, result.reply)
        except CellgateError as exc:
            self._ran[message.id] = _Ran(sandbox[0] if sandbox else "", None, exc)
            raise
        finally:
            await asyncio.to_thread(
                self.store.finish_turn, turn.id, ok=ok, harness_turn_id=harness_turn
            )

    async def _execute(
        self,
        rt: AgentRuntime,
        conv: Conversation,
        session_id: SessionId,
        text: str,
        sandbox: list[str],
    ) -> DispatchResult:
        """One harness turn in the conversation's verified sandbox, with its bridge open."""
        assert rt.sandboxes is not None
        key = ConversationKey(conv.agent, conv.channel, conv.chat_id)
        prepared = await rt.sandboxes.ensure(key, session_id)
        sandbox.append(prepared.handle.name)
        await asyncio.to_thread(
            self.store.record_sandbox,
            prepared.handle.name,
            conversation=conv.id,
            app=prepared.spec.app,
            agent=conv.agent,
            spec_hash=prepared.handle.spec_hash,
        )
        paths = prepared.paths
        await asyncio.to_thread(install_client, paths.bridge_dir)
        await self.bridge.open(
            BridgeScope.for_conversation(
                key,
                session_id,
                paths,
                isolated=rt.started_isolated,
                archive_enabled=not rt.config.disable_archive,
            )
        )
        system_prompt = await asyncio.to_thread(self._compose, rt, paths.workspace, paths.chat_dir)
        await asyncio.to_thread(write_session_files, paths.home_dir, system_prompt)
        meta = {
            "resume": await asyncio.to_thread(load_session_id, paths.chat_dir),
            "system_prompt": system_prompt,
            "history": await asyncio.to_thread(recent_history, paths.chat_dir),
        }
        ctx = SessionContext(
            conversation=key,
            session_key=session_id,
            backend=self.backend,
            sandbox=prepared.handle,
            env=self.session_env(key, prepared.spec.home),
            workdir=prepared.spec.workdir,
        )
        timeout = self.config.gateway.turn_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                await rt.harness.ensure_session(ctx)
                result = await rt.harness.dispatch(ctx, text, meta)
        except TimeoutError as exc:
            raise TurnTimeout(timeout) from exc
        sent = self.outbox.pending.take(conv.id)
        if sent:
            result = DispatchResult(
                ok=result.ok,
                reply=result.reply,
                turn_id=result.turn_id,
                meta={**result.meta, "messages": [_sent(m) for m in sent]},
            )
        return result

    # -- heartbeat (M4) ----------------------------------------------------

    async def heartbeat_once(self, agent_id: str) -> list[tuple[ConversationKey, DispatchResult]]:
        """One heartbeat in every live session of the agent, or in `__heartbeat__` if none."""
        rt = self._runnable(agent_id)
        prompt = (rt.config.heartbeat or HeartbeatSettings(every_minutes=60)).prompt
        live = await asyncio.to_thread(self.store.live_sessions, agent_id)
        convs = {
            s.conversation_id: await asyncio.to_thread(
                self.store.get_conversation, s.conversation_id
            )
            for s in live
        }
        keys = [
            ConversationKey(c.agent, c.channel, c.chat_id) for c in convs.values() if c is not None
        ]
        done: list[tuple[ConversationKey, DispatchResult]] = []
        for target in heartbeat_targets(agent_id, keys):
            conv = await asyncio.to_thread(self.store.upsert_conversation, target.conversation)
            async with self.loop.conversation_lock(conv.id):
                session_id = await self._session(conv, rt)
                turn = await asyncio.to_thread(self.store.start_turn, session_id, None)
                ok = False
                try:
                    result = await self._execute(rt, conv, session_id, prompt, [])
                    ok = result.ok
                    await asyncio.to_thread(
                        self._save_turn, rt, conv, session_id, "heartbeat", prompt, None, result
                    )
                finally:
                    await asyncio.to_thread(self.store.finish_turn, turn.id, ok=ok)
            done.append((target.conversation, result))
        return done

    async def run_heartbeats(self) -> None:
        """Every agent with a `heartbeat` block, on its schedule (M4)."""
        agents = [(a, rt.config.heartbeat) for a, rt in self.agents.items() if rt.config.heartbeat]
        if not agents:
            return
        next_at = {a: self.clock() + hb.every_minutes * 60 for a, hb in agents}
        while True:
            await asyncio.sleep(min(1.0, max(0.0, min(next_at.values()) - self.clock())))
            for agent_id, hb in agents:
                if self.clock() < next_at[agent_id]:
                    continue
                next_at[agent_id] = self.clock() + hb.every_minutes * 60
                try:
                    await self.heartbeat_once(agent_id)
                except CellgateError as exc:
                    logger.error("heartbeat of %s failed: %s", agent_id, exc)

    def _compose(self, rt: AgentRuntime, workspace: Any, chat_dir: Any) -> str:
        """M5, M7: the session's CLAUDE.md, composed on the host at spawn."""
        return compose_claude_md(
            workspace,
            chat_dir,
            self.config.gateway.memory,
            rt.started_isolated,
            not rt.config.disable_archive,
        )

    def _save_turn(
        self,
        rt: AgentRuntime,
        conv: Conversation,
        session_id: str,
        role: str,
        text: str,
        message_id: MessageId | None,
        result: DispatchResult,
    ) -> None:
        """D3: the transcript and the harness session id, after every turn."""
        assert rt.sandboxes is not None
        key = ConversationKey(conv.agent, conv.channel, conv.chat_id)
        chat_dir = rt.sandboxes.app.workspace / "chats" / key.dir_name
        now = self.clock()
        append_transcript(
            chat_dir,
            [
                {"at": now, "role": role, "message": message_id, "text": text},
                {
                    "at": now,
                    "role": "assistant",
                    "message": message_id,
                    "ok": result.ok,
                    "turn": result.turn_id,
                    "text": result.reply,
                },
            ],
        )
        harness_sid = result.meta.get("harness_session_id")
        save_session_id(chat_dir, session_id, harness_sid if isinstance(harness_sid, str) else None)

    async def _deliver(self, conv: Conversation, reply: Reply) -> None:
        if conv.channel == "api":
            return  # the API caller reads the stored reply
        channel = self.channels.get(conv.channel)
        if channel is None:
            raise AgentUnavailable(conv.agent, f"channel {conv.channel!r} is not running")
        await channel.send(
            OutboundMessage(
                channel=conv.channel,
                chat_id=conv.chat_id,
                outbound_key=reply.outbound_key,
                text=reply.text,
            )
        )

    # -- reaping (S5) ------------------------------------------------------

    def reaper(self) -> Reaper:
        """Removes this gateway's sandboxes `sandboxIdleMinutes` after their last turn."""
        apps = {rt.app.name for rt in self.agents.values() if rt.app is not None}
        return Reaper(
            self.backend,
            gateway_id=self.gateway_id,
            last_active=self._last_active,
            busy=self._busy,
            idle_minutes=self.config.gateway.sandbox_idle_minutes,
            now=self.clock,
            guard=self._sandbox_guard,
            scope=lambda info: info.labels.get(LABEL_APP) in apps,
            on_removed=self._sandbox_removed,
        )

    async def run_reaper(self, interval: float = 60.0) -> None:
        await self.reaper().run_forever(interval)

    async def _last_active(self, name: str) -> float | None:
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            return None
        live = await asyncio.to_thread(self.store.live_sessions, conversation=sb.conversation_id)
        return max([sb.last_used_at, *(s.last_active_at for s in live)])

    async def _busy(self, name: str) -> bool:
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            return False
        live = await asyncio.to_thread(self.store.live_sessions, conversation=sb.conversation_id)
        return any(s.busy for s in live)

    @contextlib.asynccontextmanager
    async def _sandbox_guard(self, name: str) -> AsyncIterator[None]:
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            yield
            return
        async with self.loop.conversation_lock(sb.conversation_id):
            yield

    async def _sandbox_removed(self, name: str) -> None:
        """The container is gone: its sessions end, its bridge closes, its row goes."""
        sb = await asyncio.to_thread(self.store.get_sandbox, name)
        if sb is None:
            return
        await self.bridge.close(sb.conversation_id)
        for s in await asyncio.to_thread(self.store.live_sessions, conversation=sb.conversation_id):
            await asyncio.to_thread(self.store.end_session, s.id)
        await asyncio.to_thread(self.store.forget_sandbox, name)


def _sent(m: OutboundMessage) -> dict[str, Any]:
    """A bridge delivery as the API shows it (no host paths)."""
    out: dict[str, Any] = {"kind": m.kind.value, "text": m.text}
    if m.file_name:
        out["file_name"] = m.file_name
    if m.extra:
        out["extra"] = dict(m.extra)
    return out
