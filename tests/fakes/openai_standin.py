"""A stand-in for an OpenAI-compatible Chat Completions server, on loopback, real HTTP.

`POST /v1/chat/completions` checks what the real API checks (a bearer key;
roles; every assistant `tool_calls` answered by `tool` messages with those
ids; `tools[]` as functions), records every request, and answers with the
next step of a script. A step is a tool-call message, a final message, or a
function of the request body returning one (so a step can quote what an
earlier tool returned).

    with OpenAIStandin(key="sk-test") as ai:
        ai.script(call("shell", command="echo hi"), lambda body: final("done"))
        ... post to f"{ai.base_url}/chat/completions" ...
        ai.requests[0].headers["authorization"]
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

Message = dict[str, Any]
Step = Message | Callable[[dict[str, Any]], Message | Awaitable[Message]]
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def call(name: str, /, **arguments: Any) -> Message:
    """An assistant message calling one tool."""
    return calls((name, arguments))


def calls(*pairs: tuple[str, dict[str, Any]]) -> Message:
    """An assistant message calling several tools at once."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:10]}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a)},
            }
            for n, a in pairs
        ],
    }


def final(text: str) -> Message:
    return {"role": "assistant", "content": text}


def sleep_then(seconds: float, msg: Message) -> Step:
    async def step(_: dict[str, Any]) -> Message:
        await asyncio.sleep(seconds)
        return msg

    return step


def tool_results(body: dict[str, Any]) -> list[str]:
    """The contents of the `tool` messages in a request, in order."""
    return [m["content"] for m in body["messages"] if m.get("role") == "tool"]


@dataclass(frozen=True)
class Recorded:
    headers: dict[str, str]
    body: dict[str, Any]


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": None}}, status)


def _invalid(body: Any) -> str | None:
    """Why the real API would answer 400, or None."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return "you must provide a model parameter"
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "'messages' must be a non-empty array"
    for t in body.get("tools", []):
        fn = t.get("function", {}) if isinstance(t, dict) else {}
        if t.get("type") != "function" or not _NAME.match(str(fn.get("name", ""))):
            return f"invalid tool: {t!r}"
        if fn.get("parameters", {}).get("type") != "object":
            return f"tool {fn.get('name')}: parameters must be a JSON schema object"
    pending: set[str] = set()
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            return f"messages[{i}].role {role!r} is not valid"
        if role != "tool" and pending:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'. Missing: {sorted(pending)}"
            )
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid not in pending:
                return f"messages[{i}]: tool message answers no pending tool call ({tid!r})"
            if not isinstance(m.get("content"), str):
                return f"messages[{i}].content must be a string"
            pending.discard(tid)
        elif role == "assistant":
            tcs = m.get("tool_calls") or []
            if m.get("content") is None and not tcs:
                return f"messages[{i}]: assistant message needs content or tool_calls"
            for tc in tcs:
                if tc.get("type") != "function" or not isinstance(
                    tc.get("function", {}).get("arguments"), str
                ):
                    return f"messages[{i}]: malformed tool call {tc!r}"
                pending.add(tc["id"])
        elif not isinstance(m.get("content"), str):
            return f"messages[{i}].content must be a string"
    if pending:
        return f"tool calls without a tool message: {sorted(pending)}"
    return None


class OpenAIStandin:
    def __init__(self, key: str | None = "sk-standin-key") -> None:
        self.key = key
        self.requests: list[Recorded] = []
        self._script: deque[Step] = deque()
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(
            routes=[Route("/v1/chat/completions", self._complete, methods=["POST"])]
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *steps: Step) -> None:
        self._script.extend(steps)

    async def _complete(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(
                400, "We could not parse the JSON body of your request.", "invalid_request_error"
            )
        self.requests.append(Recorded(dict(request.headers), body))
        if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
            return _error(401, "Incorrect API key provided.", "invalid_request_error")
        why = _invalid(body)
        if why is not None:
            return _error(400, why, "invalid_request_error")
        if not self._script:
            return _error(500, "the stand-in's script is used up", "server_error")
        step = self._script.popleft()
        if callable(step):
            out = step(body)
            msg = await out if asyncio.iscoroutine(out) else out
        else:
            msg = step
        assert isinstance(msg, dict)
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": msg,
                        "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    def __enter__(self) -> OpenAIStandin:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the OpenAI stand-in did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(10)
