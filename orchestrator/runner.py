"""The turn runner: one turn of one conversation in its verified sandbox.

`TurnRunner.run` is what the durable turn loop calls for a stored message: it
finds or opens the conversation's session, ensures and verifies its sandbox
(S3, S4), opens its bridge, composes its CLAUDE.md (M5, M7), runs the harness
under the turn timeout, and saves the transcript and harness session id (D3).
What a finished turn left for a caller waiting on it is kept in a small,
bounded map (`Outcomes`), taken once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cellgate.errors import CellgateError, SandboxSpent, TurnTimeout
from cellgate.models import ConversationKey
from orchestrator.admission import SandboxGate
from orchestrator.agents import AgentRuntime, Agents
from orchestrator.archive import refresh_at_spawn
from orchestrator.bounded import LruMap
from orchestrator.bridge import BridgeScope, BridgeServer, install_client
from orchestrator.config import GatewaySettings
from orchestrator.conversations import ConversationPaths
from orchestrator.delivery import GatewayOutbox
from orchestrator.harnesses.base import (
    HistoryEntry,
    SentMessage,
    SessionContext,
    TurnRequest,
    TurnResult,
)
from orchestrator.lane import in_lane
from orchestrator.memory import compose_claude_md, write_session_files
from orchestrator.metrics import Stage
from orchestrator.placement import Placement
from orchestrator.resident import ResidentBackend
from orchestrator.safefs import audit_left_out
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.store import Conversation, ConversationId, Message, MessageId, SessionId
from orchestrator.store.views import SandboxStore
from orchestrator.transcripts import (
    append_transcript,
    load_session_id,
    recent_history,
    save_session_id,
)
from orchestrator.turns import TurnAnswer
from policies.tools import session_env_flags
from sandbox.backends.base import SandboxBackend
from sandbox.mountplan import WORKSPACE

logger = logging.getLogger(__name__)

OUTCOMES_MAX = 1024


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the turn that answered a message left for a caller waiting on it."""

    sandbox: str
    result: TurnResult | None
    error: CellgateError | None


class Outcomes:
    """Message id -> outcome, the newest `size` only; a caller takes its own once."""

    def __init__(self, size: int = OUTCOMES_MAX) -> None:
        self._items: LruMap[MessageId, Outcome] = LruMap(size)

    def put(self, message_id: MessageId, outcome: Outcome) -> None:
        self._items.put(message_id, outcome)

    def take(self, message_id: MessageId) -> Outcome | None:
        return self._items.pop(message_id)

    def __len__(self) -> int:
        return len(self._items)


def session_env(key: ConversationKey, home: str) -> dict[str, str]:
    """A session's environment: its origin, its home, and no secret (K1, P1, T3)."""
    return {
        "HOME": home,
        "GATEWAY_ORIGIN_CHANNEL": key.channel,
        "GATEWAY_ORIGIN_CHAT_ID": key.chat_id,
        **session_env_flags(),
    }


def conversation_key(conv: Conversation) -> ConversationKey:
    return ConversationKey(conv.agent, conv.channel, conv.chat_id)


class TurnRunner:
    def __init__(
        self,
        settings: GatewaySettings,
        agents: Agents,
        store: SandboxStore,
        backend: SandboxBackend,
        bridge: BridgeServer,
        outbox: GatewayOutbox,
        *,
        clock: Callable[[], float],
        gate: SandboxGate | None = None,
    ) -> None:
        self.settings = settings
        self.gate = gate
        self.agents = agents
        self.store = store
        self.backend = backend
        self.bridge = bridge
        self.outbox = outbox
        self.clock = clock
        self.outcomes = Outcomes()
        self.observe: Callable[[Stage, str, float], None] = lambda *_: None  # metrics (O2)
        self.residents: ResidentBackend | None = None  # F2: turns through a resident runner

    async def session_for(self, conv: Conversation, rt: AgentRuntime) -> SessionId:
        """The conversation's live session, or a new one."""
        return await in_lane(self._session, conv.id, rt.config.harness.type)

    def _session(self, conversation: ConversationId, harness: str) -> SessionId:
        live = self.store.live_sessions(conversation=conversation)
        if live:
            return live[0].id
        return self.store.open_session(conversation, harness).id

    async def run(self, conv: Conversation, message: Message) -> TurnAnswer:
        """The turn loop's turn function: answer one stored message."""
        rt = self.agents.runnable(conv.agent)

        session, turn = await in_lane(
            self.store.begin_turn, conv.id, rt.config.harness.type, message.id
        )
        session_id = session.id
        ok = False
        harness_turn: str | None = None
        sandbox: list[str] = []
        finished = False
        try:
            try:
                result = await self.execute(rt, conv, session_id, message.text, sandbox)
            except SandboxSpent:
                # Nothing ran and the spent sandbox is gone: run once more in a fresh one.
                logger.warning("retrying message %s in a fresh sandbox", message.id)
                sandbox.clear()
                result = await self.execute(rt, conv, session_id, message.text, sandbox)
            ok, harness_turn = result.ok, result.turn_id

            def save_and_finish() -> None:  # one worker-thread hop (F3)
                try:
                    self.save_turn(rt, conv, session_id, "user", message.text, message.id, result)
                finally:
                    self.store.finish_turn(turn.id, ok=ok, harness_turn_id=harness_turn)

            # the job finishes the turn whatever happens to this task: shielded, a job still
            # queued on the lane when the task is cancelled (a shutdown) runs all the same
            finished = True
            await asyncio.shield(in_lane(save_and_finish))
            self.outcomes.put(message.id, Outcome(sandbox[0], result, None))
            return TurnAnswer(result.ok, result.reply)
        except CellgateError as exc:
            self.outcomes.put(message.id, Outcome(sandbox[0] if sandbox else "", None, exc))
            raise
        finally:
            if not finished:
                finish = in_lane(
                    self.store.finish_turn, turn.id, ok=ok, harness_turn_id=harness_turn
                )
                await asyncio.shield(finish)

    async def execute(
        self,
        rt: AgentRuntime,
        conv: Conversation,
        session_id: SessionId,
        text: str,
        sandbox: list[str],
    ) -> TurnResult:
        """One harness turn in the conversation's verified sandbox, with its bridge open.

        The sandbox is the conversation's own (isolated app agent), the app's
        one container (app agent without isolate mode, S6), or the host (host agent).
        However it ends (a claim whose turn failed before its harness ran too), the pool
        is then told that the turn left its sandbox (F3: a claim never settled would hold
        off every refill for the longest wait).
        """
        place: Placement | None = None
        try:
            key = conversation_key(conv)
            if rt.host is not None:
                place = await in_lane(rt.host.prepare, key, session_id)
                sandbox.append(place.handle.name)
            else:
                place = await self.place_in_sandbox(rt, conv, key, session_id, sandbox)
            paths = place.paths
            scope = BridgeScope.for_conversation(
                key,
                session_id,
                paths,
                isolated=rt.started_isolated,
                archive_enabled=not rt.config.disable_archive,
            )
            await self.bridge.open(scope)
            await refresh_at_spawn(  # A1/A2: the archive, before the session is told of it
                self.settings.state_dir,
                conv.agent,
                paths.workspace,
                isolated=rt.started_isolated,
                disabled=rt.config.disable_archive,
            )
            system_prompt, history, resume_id = await in_lane(
                self.session_files, rt, paths, conv.id, place.shown_workspace
            )
            request = TurnRequest(
                prompt=text,
                system_prompt=system_prompt,
                history=HistoryEntry.parse_many(history),
                resume_id=resume_id,
                tools=self.bridge.handlers.definitions(scope),
            )
            ctx = SessionContext(
                conversation=key,
                session_key=session_id,
                backend=place.backend or self.backend,
                sandbox=place.handle,
                env={**session_env(key, place.home), **place.env},
                workdir=place.workdir,
                shown_workspace=place.shown_workspace,
                bridge_argv=place.bridge_argv,
            )
            timeout = self.settings.turn_timeout_seconds
            started = time.perf_counter()
            try:
                async with asyncio.timeout(timeout):
                    await rt.harness.ensure_session(ctx)
                    result = await rt.harness.dispatch(ctx, request)
            except TimeoutError as exc:
                raise TurnTimeout(timeout) from exc
            finally:
                self.observe("harness", conv.agent, time.perf_counter() - started)
            sent = self.outbox.pending.take(conv.id)
            if sent:
                result = dataclasses.replace(
                    result, messages_sent=tuple(SentMessage.of(m) for m in sent)
                )
            return result
        finally:
            if place is not None:  # R7: a sandbox a command of this turn found saturated
                await (place.backend or self.backend).retire_if_spent(place.handle)
            if isinstance(rt.sandboxes, ConversationSandboxes) and rt.sandboxes.pool is not None:
                rt.sandboxes.pool.settled(conv.id)

    def session_files(
        self,
        rt: AgentRuntime,
        paths: ConversationPaths,
        conv_id: ConversationId,
        shown_workspace: PurePosixPath,
    ) -> tuple[str, list[dict[str, str]], str | None]:
        """The turn's host files, in one worker-thread job (F3: one hop, not five): the
        bridge's clients, the composed system prompt (written to the session's home),
        recent history, resume id."""
        install_client(paths.bridge_dir)
        system_prompt = self.compose(rt, paths.workspace, paths.chat_dir, conv_id, shown_workspace)
        write_session_files(paths.home_dir, system_prompt)
        d3 = audit_left_out(self.store, conv_id, "D3")
        history = recent_history(paths.chat_dir, report=d3)
        return system_prompt, history, load_session_id(paths.chat_dir, report=d3)

    async def place_in_sandbox(
        self,
        rt: AgentRuntime,
        conv: Conversation,
        key: ConversationKey,
        session_id: SessionId,
        sandbox: list[str],
    ) -> Placement:
        """Ensure and verify the container the turn runs in (S4), under the sandbox cap (R4)."""
        assert rt.sandboxes is not None
        if self.gate is not None:
            await self.gate.make_room(conv.id)  # R4: the sandbox cap
        try:
            started = time.perf_counter()
            prepared = await rt.sandboxes.ensure(key, session_id)
            self.observe("sandbox_ensure", conv.agent, time.perf_counter() - started)
            sandbox.append(prepared.handle.name)
            await in_lane(
                self.store.record_sandbox,
                prepared.handle.name,
                conversation=conv.id,
                app=prepared.spec.app,
                agent=conv.agent,
                spec_hash=prepared.handle.spec_hash,
            )
        finally:
            if self.gate is not None:
                self.gate.settled(conv.id)
        place = prepared.placement()
        if self.residents is not None and isinstance(rt.sandboxes, ConversationSandboxes):
            # F2: the turn goes through the runner resident in its own sandbox
            await self.residents.ready(prepared.handle, place.paths.bridge_dir, prepared.spec)
            place = dataclasses.replace(place, backend=self.residents)
        return place

    def compose(
        self,
        rt: AgentRuntime,
        workspace: Path,
        chat_dir: Path,
        conversation: ConversationId,
        shown_workspace: PurePosixPath = WORKSPACE,
    ) -> str:
        """M5, M7: the session's CLAUDE.md, composed on the host at spawn.

        A memory file the sandbox replaced with a FIFO, link or directory is
        left out, logged and audited (R3), never waited on."""
        return compose_claude_md(
            workspace,
            chat_dir,
            self.settings.memory,
            rt.started_isolated,
            not rt.config.disable_archive,
            shown_workspace=shown_workspace,
            report=audit_left_out(self.store, conversation, "M5"),
            secret_report=audit_left_out(self.store, conversation, "M8"),
        )

    def save_turn(
        self,
        rt: AgentRuntime,
        conv: Conversation,
        session_id: str,
        role: str,
        text: str,
        message_id: MessageId | None,
        result: TurnResult,
    ) -> None:
        """D3: the transcript and the harness session id, after every turn."""
        assert rt.workspace is not None
        key = conversation_key(conv)
        chat_dir = rt.workspace / "chats" / key.dir_name
        now = self.clock()
        d3 = audit_left_out(self.store, conv.id, "D3")
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
            report=d3,
        )
        save_session_id(chat_dir, session_id, result.harness_session_id, report=d3)
