"""The tools a sandbox calls over its bridge, and the registry that holds them.

`ToolHandlers.call` is the one entry point: it checks the tool is offered to
this scope (T1, T2 via `policies.tools`), runs the handler, and records every
refusal (`PolicyDenied`) through the refusal sink before it reaches the caller.
Handlers have one signature, `async def handler(call: ToolCall) -> dict`, so a
channel adds its own module's tools with `register(..., module="telegram")`.

`BuiltinTools` holds the standard tools; each asks the pure policies for every
decision and does the I/O itself:

    reply, react, edit     P1/P2  policies.chats.reply_target
    send_file, share_file  P5     safefiles.open_media_file (policies.paths)
    revoke_share           P6     policies.shares.revoke_share
    task_memory_append     M6 M8  policies.memory.memory_target / memory_content
    narrate                T4     policies.tools.narrate_target
    list_tools             T1 T2  what this scope is offered, with input schemas

Their names, descriptions and argument schemas are not written here: they are
`catalogue.BUILTIN_TOOLS`, the one source every client's view derives from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cellgate.errors import BridgeError, CellgateError, NotFound, PolicyDenied, StateConflict
from cellgate.models import OutboundKind, OutboundMessage
from orchestrator.bridge import safefiles
from orchestrator.bridge.catalogue import BUILTIN_TOOLS, ToolDef
from orchestrator.bridge.outbox import Outbox, outbound_key
from orchestrator.bridge.scope import BridgeScope, ScopeState
from orchestrator.bridge.spool import Spool
from orchestrator.store import Share, ShareId, Store
from policies import chats, memory, shares
from policies import tools as tool_policy

__all__ = [
    "BridgeRefusal",
    "BuiltinTools",
    "Handler",
    "JSONObject",
    "RefusalSink",
    "StoreRefusals",
    "ToolCall",
    "ToolHandlers",
    "ToolSpec",
]

logger = logging.getLogger(__name__)

JSONObject = dict[str, Any]
MAX_TEXT_CHARS = 16_000
MAX_MEMORY_CHARS = 8_000
OFFERS_KEPT = 64  # kinds of scope (channel, isolated, archive) whose offer is kept


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call as the bridge received it; `scope` comes from the socket, never from `args`."""

    scope: BridgeScope
    state: ScopeState
    call_id: str
    tool: str
    args: Mapping[str, Any]

    def outbound_key(self) -> str:
        return outbound_key(self.scope, self.call_id, self.tool, self.args)

    def text(self, name: str, *, required: bool = True, limit: int = MAX_TEXT_CHARS) -> str | None:
        """A string argument; a chat or message id may also be sent as an integer."""
        value = self.args.get(name)
        if value is None or value == "":
            if required:
                raise BridgeError("bad_request", f"{self.tool} needs a non-empty {name!r}")
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise BridgeError("bad_request", f"{self.tool}: {name!r} must be a string")
        if len(value) > limit:
            raise BridgeError(
                "too_large", f"{self.tool}: {name!r} is {len(value)} characters, over {limit}"
            )
        return value

    def required(self, name: str, *, limit: int = MAX_TEXT_CHARS) -> str:
        value = self.text(name, limit=limit)
        assert value is not None
        return value


Handler = Callable[[ToolCall], Awaitable[JSONObject]]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A registered tool: its catalogue entry and its handler."""

    definition: ToolDef
    handler: Handler

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def module(self) -> str | None:
        """Its MCP module (T1); None for the bridge's own tools."""
        return self.definition.module

    def describe(self) -> JSONObject:
        return self.definition.describe()


@dataclass(frozen=True, slots=True)
class BridgeRefusal:
    scope: BridgeScope
    tool: str
    call_id: str
    rule: str
    reason: str


class RefusalSink(Protocol):
    async def __call__(self, refusal: BridgeRefusal) -> None: ...


class StoreRefusals:
    """Records each refusal in the store's audit table (offloaded: the store is synchronous)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def __call__(self, refusal: BridgeRefusal) -> None:
        await asyncio.to_thread(
            self._store.record_refusal,
            rule=refusal.rule,
            action=refusal.tool,
            reason=refusal.reason,
            conversation=refusal.scope.conversation_id,
            session_id=refusal.scope.session_id,
            detail={"call_id": refusal.call_id, "via": "bridge"},
        )


class ToolHandlers:
    """The tools one gateway serves over every bridge socket."""

    def __init__(self, refusals: RefusalSink | None = None) -> None:
        self._tools: dict[str, ToolSpec] = {}
        self._refusals = refusals
        # what each kind of scope is offered (the policies are pure, F3: not redone per turn)
        self._offers: dict[tuple[str, bool, bool], tuple[ToolSpec, ...]] = {}

    def register(
        self,
        name: str,
        handler: Handler,
        *,
        description: str = "",
        input_schema: JSONObject | None = None,
        module: str | None = None,
    ) -> None:
        """Register a tool that is not in the catalogue (a channel module's own)."""
        schema = input_schema or {"type": "object", "properties": {}}
        self.add(ToolDef(name, description, schema, module), handler)

    def add(self, definition: ToolDef, handler: Handler) -> None:
        if definition.name in self._tools:
            raise ValueError(f"bridge tool {definition.name!r} is already registered")
        self._tools[definition.name] = ToolSpec(definition, handler)
        self._offers.clear()

    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def _offer(self, spec: ToolSpec, scope: BridgeScope) -> PolicyDenied | None:
        if spec.module is not None:
            loads = tool_policy.module_allowed(spec.module, scope.channel, scope.isolated)
            if not loads:
                return PolicyDenied(loads.rule, loads.reason)
        offered = tool_policy.tool_offered(spec.name, scope.isolated, scope.archive_enabled)
        if not offered:
            return PolicyDenied(offered.rule, offered.reason)
        return None

    def offered(self, scope: BridgeScope) -> tuple[ToolSpec, ...]:
        """T1/T2: the tools this scope may call, in registration order."""
        key = (scope.channel, scope.isolated, scope.archive_enabled)
        offers = self._offers.get(key)
        if offers is None:
            if len(self._offers) >= OFFERS_KEPT:
                self._offers.clear()
            offers = tuple(s for s in self._tools.values() if self._offer(s, scope) is None)
            self._offers[key] = offers
        return offers

    def definitions(self, scope: BridgeScope) -> tuple[ToolDef, ...]:
        """What a turn in this scope is offered (`TurnRequest.tools`), as `list_tools` shows it."""
        return tuple(s.definition for s in self.offered(scope))

    async def call(
        self, scope: BridgeScope, state: ScopeState, call_id: str, tool: str, args: JSONObject
    ) -> JSONObject:
        """Run one call; raises `PolicyDenied` (already recorded) or `BridgeError`."""
        spec = self._tools.get(tool)
        if spec is None:
            raise BridgeError(
                "unknown_tool", f"no bridge tool {tool!r}; call list_tools to see what is offered"
            )
        try:
            refused = self._offer(spec, scope)
            if refused is not None:
                raise refused
            return await spec.handler(ToolCall(scope, state, call_id, tool, args))
        except PolicyDenied as exc:
            logger.info(
                "bridge refused %s by %s: %s",
                tool,
                exc.rule,
                exc.reason,
                extra={"conversation": scope.conversation_id},
            )
            if self._refusals is not None:
                await self._refusals(BridgeRefusal(scope, tool, call_id, exc.rule, exc.reason))
            raise


class BuiltinTools:
    """The standard bridge tools over an outbox and the store.

    `spool_dir` is a gateway-only directory (never mounted into a sandbox)
    where `send_file` puts the one checked copy of a file it hands to the
    outbox; the copy is removed when the delivery returns (`bridge.spool`).
    """

    def __init__(
        self,
        outbox: Outbox,
        store: Store,
        spool_dir: Path,
        *,
        max_file_bytes: int = safefiles.DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        self.outbox = outbox
        self.store = store
        self.spool_dir = spool_dir
        self.spool = Spool(spool_dir)
        self.max_file_bytes = max_file_bytes
        self._handlers: ToolHandlers | None = None

    def install(self, handlers: ToolHandlers) -> ToolHandlers:
        """Register every standard tool under its catalogue entry (names, schemas: `catalogue`)."""
        self._handlers = handlers
        own: dict[str, Handler] = {
            "reply": self.reply,
            "react": self.react,
            "edit": self.edit,
            "send_file": self.send_file,
            "share_file": self.share_file,
            "revoke_share": self.revoke_share,
            "task_memory_append": self.task_memory_append,
            "narrate": self.narrate,
            "list_tools": self.list_tools,
        }
        for definition in BUILTIN_TOOLS:
            handlers.add(definition, own[definition.name])
        return handlers

    # -- P1: reply, react, edit ---------------------------------------------

    def _target(self, call: ToolCall) -> str:
        target = call.text("chat_id", required=False, limit=4096)
        decision = chats.reply_target(
            call.scope.origin_chat_id,
            target,
            tool=call.tool,
            own_threads=frozenset(call.state.own_threads),
        )
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)
        chat = target or call.scope.origin_chat_id
        assert chat
        return chat

    async def _deliver(self, call: ToolCall, message: OutboundMessage) -> JSONObject:
        try:
            receipt = await self.outbox.deliver(call.scope, message)
        except CellgateError as exc:
            if isinstance(exc, BridgeError | PolicyDenied):
                raise
            raise BridgeError("delivery_failed", str(exc)) from exc
        return {"message_id": receipt.platform_message_id, "chat_id": message.chat_id}

    def _message(self, call: ToolCall, chat: str, kind: OutboundKind, **kw: Any) -> OutboundMessage:
        thread = call.text("thread_id", required=False, limit=256) or call.scope.origin_thread_id
        return OutboundMessage(
            channel=call.scope.channel,
            chat_id=chat,
            outbound_key=call.outbound_key(),
            kind=kind,
            thread_id=thread,
            **kw,
        )

    async def reply(self, call: ToolCall) -> JSONObject:
        chat = self._target(call)
        text = call.required("text")
        reply_to = call.text("reply_to", required=False, limit=256)
        return await self._deliver(
            call, self._message(call, chat, OutboundKind.REPLY, text=text, reply_to=reply_to)
        )

    async def react(self, call: ToolCall) -> JSONObject:
        chat = self._target(call)
        emoji = call.required("emoji", limit=64)
        target = call.required("message_id", limit=256)
        return await self._deliver(
            call,
            self._message(call, chat, OutboundKind.REACT, text=emoji, target_message_id=target),
        )

    async def edit(self, call: ToolCall) -> JSONObject:
        chat = self._target(call)
        target = call.required("message_id", limit=256)
        text = call.required("text")
        return await self._deliver(
            call,
            self._message(call, chat, OutboundKind.EDIT, text=text, target_message_id=target),
        )

    # -- P5/P6: files and shares --------------------------------------------

    def _open(self, call: ToolCall) -> safefiles.SafeFile:
        return safefiles.open_media_file(
            call.scope.paths.media_dir,
            call.required("path", limit=4096),
            call.scope.media_dir_in_sandbox,
            max_size=self.max_file_bytes,
        )

    async def send_file(self, call: ToolCall) -> JSONObject:
        chat = self._target(call)
        caption = call.text("caption", required=False) or ""
        # R3: one bounded copy, refused if sparse or too large
        spooled = await self.spool.copy(call.scope.conversation_id, lambda: self._open(call))
        with spooled:  # removed once delivered, failed or cancelled (the turn ended)
            path, name = str(spooled.path), spooled.name
            message = self._message(
                call, chat, OutboundKind.FILE, text=caption, file_path=path, file_name=name
            )
            out = await self._deliver(call, message)
        return {**out, "name": spooled.name, "size": spooled.size}

    async def share_file(self, call: ToolCall) -> JSONObject:
        def check() -> tuple[str, int]:
            with self._open(call) as f:
                return f.rel, f.size

        rel, size = await asyncio.to_thread(check)
        try:
            share, token = await asyncio.to_thread(
                self.store.create_share, call.scope.session_id, rel
            )
        except NotFound as exc:
            raise BridgeError(
                "no_session", "this session is not recorded by the gateway; shares need one"
            ) from exc
        return {"share_id": share.id, "token": token, "path": rel, "size": size}

    def _find_share(self, ref: str) -> Share | None:
        if ref.startswith("sh_"):
            found = self.store.get_share(ShareId(ref))
            if found is not None:
                return found
        return self.store.get_share_by_token(ref, include_revoked=True)

    async def revoke_share(self, call: ToolCall) -> JSONObject:
        ref = call.text("share", required=False, limit=256)
        ref = ref or call.text("token", required=False, limit=256)
        ref = ref or call.required("share_id", limit=256)
        share = await asyncio.to_thread(self._find_share, ref)
        if share is None:
            raise BridgeError("not_found", "no such share")
        decision = shares.revoke_share(share.session_id, call.scope.session_id, False)
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)
        try:
            done = await asyncio.to_thread(
                self.store.revoke_share, share.id, revoked_by=f"session:{call.scope.session_id}"
            )
        except StateConflict as exc:
            raise BridgeError("conflict", f"share {share.id} is already revoked") from exc
        return {"share_id": done.id, "revoked": True}

    # -- M6/M8: memory --------------------------------------------------------

    async def task_memory_append(self, call: ToolCall) -> JSONObject:
        target = call.text("target", required=False, limit=4096)
        decision = memory.memory_target(target)
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)
        name = memory.memory_file_for(target)
        assert name is not None
        text = call.required("text", limit=MAX_MEMORY_CHARS)
        content = memory.memory_content(text)
        if not content:
            raise PolicyDenied(content.rule, content.reason)
        written = await asyncio.to_thread(
            safefiles.append_memory, call.scope.paths.chat_dir, name, text
        )
        return {"file": name, "bytes": written}

    # -- T4: narrate ----------------------------------------------------------

    async def narrate(self, call: ToolCall) -> JSONObject:
        target = call.text("conversation", required=False, limit=256)
        decision = tool_policy.narrate_target(call.scope.conversation_id, target, via_bridge=True)
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)
        chat = call.scope.origin_chat_id
        if not chat:
            refused = chats.reply_target(chat, None, tool="narrate")
            raise PolicyDenied(refused.rule, refused.reason)
        text = call.required("text")
        message = OutboundMessage(
            channel=call.scope.channel,
            chat_id=chat,
            outbound_key=call.outbound_key(),
            kind=OutboundKind.REPLY,
            text=text,
            thread_id=call.scope.origin_thread_id,
            extra={"narrate": "1"},
        )
        return await self._deliver(call, message)

    # -- T1/T2: what is offered -------------------------------------------------

    async def list_tools(self, call: ToolCall) -> JSONObject:
        assert self._handlers is not None
        return {"tools": [s.describe() for s in self._handlers.offered(call.scope)]}
