"""The direct OpenAI-compatible harness (H2): the model loop runs in the gateway.

The gateway posts to `<baseUrl>/chat/completions` with the key in an
`Authorization: Bearer` header; the key never enters the sandbox (K1). Every
tool the model calls runs inside the conversation's sandbox through
`ctx.backend.exec`, with the session's environment:

- `shell`: `/bin/sh -c COMMAND`;
- `read_file` / `write_file`: only under this conversation's chat directory
  (`/workspace/chats/<dir>`) and its media directory; any other path is
  refused before anything runs, and the I/O itself is done by `head` / `cat`
  in the sandbox, so the sandbox's own mounts decide the rest (P5, S3, L6);
- the bridge tools the turn is offered (`TurnRequest.tools`: the scope's
  tools from the bridge's catalogue, T1, T2, with their names, descriptions
  and schemas as the catalogue writes them), run as
  `python3 /run/cellgate/cellgate-tool NAME -` with the JSON arguments on
  stdin; the gateway decides them by the socket the call arrives on (P1, P5,
  M6, T4). `bridge_tools=False` offers none of them.

A turn: the system prompt (the composed CLAUDE.md, `TurnRequest.system_prompt`),
the session's history and the new message go to the model; tool calls run
and their results go back, until the model answers without a tool call or
`max_steps` requests were made. The history is kept per session in memory;
after a restart, `TurnRequest.history` (user/assistant texts from the
conversation's transcript) seeds it and `TurnRequest.resume_id` restores the
session id (D3).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import httpx
from pydantic import SecretStr

from orchestrator import config
from orchestrator.bounded import LruMap
from orchestrator.bridge.catalogue import ToolDef
from orchestrator.harnesses.base import (
    Harness,
    HistoryEntry,
    ModelDetail,
    SessionContext,
    TurnRequest,
    TurnResult,
)
from orchestrator.harnesses.command import valid_session_id
from sandbox.backends.base import ExecResult
from sandbox.mountplan import BRIDGE

__all__ = [
    "BRIDGE_CLIENT",
    "SANDBOX_TOOLS",
    "OpenAIHarness",
    "writable_roots",
]

logger = logging.getLogger(__name__)

# Sessions this process remembers (a cache: the id and history are saved per chat, D3).
SESSION_CACHE_MAX = 1024

MAX_TOOL_RESULT_CHARS = 16_000
MAX_READ_BYTES = 256 * 1024
BRIDGE_CLIENT = str(BRIDGE / "cellgate-tool")


def _object(props: Mapping[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": dict(props),
        "required": list(required),
        "additionalProperties": False,
    }


_STR = {"type": "string"}

SANDBOX_TOOLS: tuple[ToolDef, ...] = (
    ToolDef(
        "shell",
        "Run a shell command (/bin/sh -c) in your sandbox; returns its output and exit status.",
        _object({"command": {**_STR, "description": "the command line"}}, ["command"]),
    ),
    ToolDef(
        "read_file",
        "Read a text file from this conversation's directory or its media directory.",
        _object(
            {"path": {**_STR, "description": "absolute, or relative to the chat dir"}}, ["path"]
        ),
    ),
    ToolDef(
        "write_file",
        "Write (replace) a text file in this conversation's directory or its media directory.",
        _object(
            {
                "path": {**_STR, "description": "absolute, or relative to the chat dir"},
                "content": {**_STR, "description": "the whole new content"},
            },
            ["path", "content"],
        ),
    ),
)


def writable_roots(ctx: SessionContext) -> tuple[PurePosixPath, PurePosixPath]:
    """The chat and media directories of the session, as the sandbox sees them."""
    key = ctx.conversation
    return (
        ctx.shown_workspace / "chats" / key.dir_name,
        ctx.shown_workspace / "media" / key.media_dir_name(ctx.session_key),
    )


def _cap(text: str) -> str:
    if len(text) > MAX_TOOL_RESULT_CHARS:
        return text[:MAX_TOOL_RESULT_CHARS] + "\n[output truncated]"
    return text


def _output(result: ExecResult) -> str:
    out = (result.stdout + result.stderr).decode("utf-8", "replace")
    status = "timed out" if result.timed_out else f"exit {result.exit_code}"
    return _cap(f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}[{status}]")


class _Refused(Exception):
    """A tool call refused before it ran; the model reads the reason."""


class _ModelFailed(Exception):
    """The model endpoint gave no usable answer; the turn ends."""


@dataclass
class _Session:
    session_id: str
    messages: list[dict[str, Any]]
    started: bool = False


class OpenAIHarness(Harness):
    """A model behind an OpenAI-compatible Chat Completions endpoint, tools in the sandbox."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: SecretStr | None = None,
        api_key_env: str | None = None,
        max_steps: int = 8,
        request_timeout_seconds: float = 60.0,
        tool_timeout_seconds: float = 60.0,
        bridge_tools: bool = True,
        temperature: float | None = None,
        max_history_messages: int = 200,
        system_prompt: str = "",
        environ: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if api_key is not None and api_key_env is not None:
            raise ValueError("give the key or the name of the variable that holds it, not both")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._api_key = api_key
        self._api_key_env = api_key_env
        self._environ = environ if environ is not None else os.environ
        self.max_steps = max_steps
        self.request_timeout = request_timeout_seconds
        self.tool_timeout = tool_timeout_seconds
        self.temperature = temperature
        self.max_history = max_history_messages
        self.system_prompt = system_prompt
        self._transport = transport
        self.bridge_tools = bridge_tools
        self._sessions: LruMap[Any, _Session] = LruMap(SESSION_CACHE_MAX)
        self._reset: LruMap[Any, bool] = LruMap(SESSION_CACHE_MAX)
        self._handlers: dict[str, Callable[[SessionContext, dict[str, Any]], Any]] = {
            "shell": self._shell,
            "read_file": self._read_file,
            "write_file": self._write_file,
        }

    @classmethod
    def from_config(cls, cfg: config.OpenAIHarness) -> OpenAIHarness:
        """From `agents[].harness` (`type: openai`)."""
        return cls(
            base_url=cfg.base_url,
            model=cfg.model,
            api_key=cfg.api_key,
            api_key_env=cfg.api_key_env,
            max_steps=cfg.max_steps,
            request_timeout_seconds=cfg.request_timeout_seconds,
            tool_timeout_seconds=cfg.tool_timeout_seconds,
            bridge_tools=cfg.bridge_tools,
            temperature=cfg.temperature,
            max_history_messages=cfg.max_history_messages,
        )

    # -- session state -----------------------------------------------------

    def _key(self, ctx: SessionContext) -> Any:
        return (ctx.conversation, ctx.session_key)

    def _session(self, ctx: SessionContext) -> _Session:
        key = self._key(ctx)
        s = self._sessions.get(key)
        if s is None:
            s = _Session(uuid.uuid4().hex, [])
            self._sessions.put(key, s)
        return s

    def _start(self, ctx: SessionContext, request: TurnRequest) -> _Session:
        """The session for this turn; its first turn adopts a saved id and history (D3)."""
        s = self._session(ctx)
        if not s.started:
            s.started = True
            if self._key(ctx) not in self._reset:
                s.session_id = valid_session_id(request.resume_id) or s.session_id
                s.messages = _seed_history(request.history)
            self._reset.pop(self._key(ctx))
        return s

    async def ensure_session(self, ctx: SessionContext) -> str:
        return self._session(ctx).session_id

    async def reset_session(self, ctx: SessionContext) -> None:
        """Forget the history and id; the next turn ignores a saved `resume_id` and `history`."""
        self._sessions.pop(self._key(ctx))
        self._reset.put(self._key(ctx), True)

    def history(self, ctx: SessionContext) -> list[dict[str, Any]]:
        """A copy of the session's messages (no system prompt), e.g. for persisting."""
        s = self._sessions.get(self._key(ctx))
        return [dict(m) for m in s.messages] if s else []

    # -- the model loop ----------------------------------------------------

    def _key_value(self) -> str | None:
        if self._api_key is not None:
            return self._api_key.get_secret_value()
        if self._api_key_env is not None:
            return self._environ.get(self._api_key_env) or None
        return None

    def _redact(self, text: str) -> str:
        key = self._key_value()
        return text.replace(key, "[key]") if key else text

    def tools_for(self, request: TurnRequest) -> tuple[ToolDef, ...]:
        """The functions offered to the model in this turn: the sandbox's, then the bridge's."""
        if not self.bridge_tools:
            return SANDBOX_TOOLS
        own = {t.name for t in SANDBOX_TOOLS}
        return (*SANDBOX_TOOLS, *(t for t in request.tools if t.name not in own))

    async def dispatch(self, ctx: SessionContext, request: TurnRequest) -> TurnResult:
        turn_id = uuid.uuid4().hex
        message = request.prompt
        session = self._start(ctx, request)
        system = request.system_prompt
        system = system if system is not None else self.system_prompt
        tools = self.tools_for(request)
        schemas = [t.as_openai() for t in tools]
        bridge = frozenset(t.name for t in tools[len(SANDBOX_TOOLS) :])
        headers = {"Content-Type": "application/json"}
        key = self._key_value()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        elif self._api_key_env is not None:
            return self._failed(
                turn_id, session, f"the gateway has no {self._api_key_env} set for this model", 0
            )
        turn: list[dict[str, Any]] = [{"role": "user", "content": message}]
        tools_called: list[str] = []
        timeout = httpx.Timeout(self.request_timeout)
        async with httpx.AsyncClient(timeout=timeout, transport=self._transport) as client:
            for step in range(1, self.max_steps + 1):
                body: dict[str, Any] = {
                    "model": self.model,
                    "messages": [
                        *([{"role": "system", "content": system}] if system else []),
                        *session.messages,
                        *turn,
                    ],
                    "tools": schemas,
                    "tool_choice": "auto",
                }
                if self.temperature is not None:
                    body["temperature"] = self.temperature
                try:
                    answer = await self._complete(client, headers, body)
                except _ModelFailed as exc:
                    return self._failed(turn_id, session, str(exc), step, tools_called)
                calls = answer.get("tool_calls") or []
                assistant: dict[str, Any] = {"role": "assistant", "content": answer.get("content")}
                if calls:
                    assistant["tool_calls"] = calls
                turn.append(assistant)
                if not calls:
                    self._commit(session, turn)
                    content = answer.get("content")
                    return TurnResult(
                        ok=True,
                        reply=content if isinstance(content, str) else "",
                        turn_id=turn_id,
                        harness_session_id=session.session_id,
                        detail=self._detail(step, tools_called),
                    )
                for call in calls:
                    name = call["function"]["name"]
                    tools_called.append(name)
                    result = await self._call_tool(ctx, name, call["function"]["arguments"], bridge)
                    turn.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        self._commit(session, turn)
        return TurnResult(
            ok=False,
            reply=f"I stopped after {self.max_steps} steps without a final answer.",
            turn_id=turn_id,
            harness_session_id=session.session_id,
            detail=self._detail(self.max_steps, tools_called, max_steps_reached=True),
        )

    async def _complete(
        self, client: httpx.AsyncClient, headers: Mapping[str, str], body: dict[str, Any]
    ) -> dict[str, Any]:
        """One Chat Completions request; the assistant message, normalised."""
        try:
            resp = await client.post(self.url, headers=dict(headers), json=body)
        except httpx.TimeoutException as exc:
            raise _ModelFailed(
                f"the model did not answer within {self.request_timeout:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            logger.warning("model endpoint %s unreachable: %s", self.url, type(exc).__name__)
            raise _ModelFailed("the model endpoint could not be reached") from exc
        if resp.status_code != 200:
            logger.warning(
                "model endpoint %s answered %s: %s",
                self.url,
                resp.status_code,
                self._redact(resp.text[:500]),
            )
            raise _ModelFailed(f"the model endpoint answered HTTP {resp.status_code}")
        try:
            msg = resp.json()["choices"][0]["message"]
            if not isinstance(msg, dict):
                raise TypeError("message is not an object")
            calls = []
            for c in msg.get("tool_calls") or []:
                fn = c["function"]
                args = fn.get("arguments") or ""
                calls.append(
                    {
                        "id": str(c["id"]),
                        "type": "function",
                        "function": {
                            "name": str(fn["name"]),
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _ModelFailed(
                "the model endpoint answered something that is not a completion"
            ) from exc
        content = msg.get("content")
        return {"content": content if isinstance(content, str) else None, "tool_calls": calls}

    def _commit(self, session: _Session, turn: list[dict[str, Any]]) -> None:
        session.messages.extend(turn)
        session.messages[:] = _trim(session.messages, self.max_history)

    def _detail(
        self,
        steps: int,
        tools: list[str],
        *,
        max_steps_reached: bool = False,
        error: str | None = None,
    ) -> ModelDetail:
        return ModelDetail(self.model, steps, tuple(tools), max_steps_reached, error)

    def _failed(
        self,
        turn_id: str,
        session: _Session,
        reason: str,
        steps: int,
        tools: list[str] | None = None,
    ) -> TurnResult:
        return TurnResult(
            ok=False,
            reply=f"The model could not answer: {reason}.",
            turn_id=turn_id,
            harness_session_id=session.session_id,
            detail=self._detail(steps, tools or [], error=reason),
        )

    # -- tools -------------------------------------------------------------

    async def _call_tool(
        self, ctx: SessionContext, name: str, arguments: str, bridge: frozenset[str]
    ) -> str:
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return f"error: the arguments of {name} are not valid JSON"
        if not isinstance(args, dict):
            return f"error: the arguments of {name} must be a JSON object"
        try:
            if name in self._handlers:
                return str(await self._handlers[name](ctx, args))
            if name in bridge:
                return await self._bridge_call(ctx, name, args)
        except _Refused as exc:
            return f"refused: {exc}"
        return f"error: there is no tool named {name!r}"

    async def _exec(
        self, ctx: SessionContext, argv: list[str], stdin: bytes | None = None
    ) -> ExecResult:
        return await ctx.backend.exec(
            ctx.sandbox,
            argv,
            env=ctx.env,
            stdin=stdin,
            timeout=self.tool_timeout,
            workdir=ctx.workdir,
        )

    async def _shell(self, ctx: SessionContext, args: dict[str, Any]) -> str:
        command = _str_arg(args, "command")
        return _output(await self._exec(ctx, ["/bin/sh", "-c", command]))

    async def _read_file(self, ctx: SessionContext, args: dict[str, Any]) -> str:
        path = _confine(ctx, _str_arg(args, "path"))
        result = await self._exec(ctx, ["head", "-c", str(MAX_READ_BYTES + 1), "--", path])
        if result.exit_code != 0 or result.timed_out:
            return f"error: cannot read {path}: " + _output(result)
        data = result.stdout
        text = data[:MAX_READ_BYTES].decode("utf-8", "replace")
        if len(data) > MAX_READ_BYTES:
            text += f"\n[file longer than {MAX_READ_BYTES} bytes: truncated]"
        return _cap(text)

    async def _write_file(self, ctx: SessionContext, args: dict[str, Any]) -> str:
        path = _confine(ctx, _str_arg(args, "path"))
        data = _str_arg(args, "content").encode("utf-8")
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = await self._exec(ctx, ["/bin/sh", "-c", script, "write_file", path], data)
        if result.exit_code != 0 or result.timed_out:
            return f"error: cannot write {path}: " + _output(result)
        return f"wrote {len(data)} bytes to {path}"

    async def _bridge_call(self, ctx: SessionContext, name: str, args: dict[str, Any]) -> str:
        data = json.dumps(args, ensure_ascii=False).encode("utf-8")
        result = await self._exec(ctx, [*ctx.bridge_argv, name, "-"], data)
        return _output(result)


def _str_arg(args: Mapping[str, Any], name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise _Refused(f"argument {name!r} must be a string")
    return value


def _confine(ctx: SessionContext, path: str) -> str:
    """The normalised sandbox path, if it lies under the chat or media directory."""
    chat, media = writable_roots(ctx)
    if not path or "\0" in path:
        raise _Refused("give a file path")
    joined = path if path.startswith("/") else posixpath.join(str(chat), path)
    norm = posixpath.normpath(joined)
    for root in (chat, media):
        if norm.startswith(str(root) + "/"):
            return norm
    raise _Refused(
        f"{path[:200]!r} is outside this conversation's files; read_file and write_file reach "
        f"only {chat}/ and {media}/ (use shell to look elsewhere; persona files are read-only)"
    )


def _seed_history(history: tuple[HistoryEntry, ...]) -> list[dict[str, Any]]:
    """Chat Completions messages from the saved user/assistant texts."""
    return [{"role": h.role, "content": h.text} for h in history]


def _trim(messages: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The newest messages, at most `limit`, starting at a user message (whole turns only)."""
    if len(messages) <= limit:
        return messages
    tail = messages[-limit:]
    for i, m in enumerate(tail):
        if m.get("role") == "user":
            return tail[i:]
    return []
