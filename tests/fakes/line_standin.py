"""A stand-in for the LINE Messaging API, on loopback, real HTTP, for the real line-bot-sdk.

Speaks what line-bot-sdk 3 sends (JSON bodies, `Authorization: Bearer <token>`)
and answers as LINE does: `{}` / `{"sentMessages": [...]}` on success, and
`{"message": ...}` with 400, 401, 409 or 429. Endpoints:

- `POST /v2/bot/message/reply`: a reply token works once, for its chat, and
  only while fresh (`expire_tokens()` ages every token issued so far);
- `POST /v2/bot/message/push`: `X-Line-Retry-Key` must be a UUID; a key LINE
  accepted before is answered 409 with `x-line-accepted-request-id`, and
  nothing is posted again (LINE's idempotency);
- `POST /v2/bot/chat/loading/start`: the loading animation (recorded);
- `GET /v2/bot/message/{id}/content`: a message's content (the data API; the
  same server stands in for both hosts).

And a webhook sender that signs as LINE does (base64 HMAC-SHA256 of the exact
body bytes under the channel secret):

    with LineStandin(token, secret) as line:
        Configuration(host=line.base_url, access_token=token)
        event = line.text_event(line.user("U1"), "hi")
        line.post_webhook(url, [event])                      # signed
        line.post_webhook(url, [event], signature=None)      # unsigned
        line.lose_push_answers(1)    # accept the next push, then fail its answer (500)
        line.hold_push_answers(30)   # accept the next push, answer it 30 s later
        line.texts("U1")             # what the bot posted there
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import itertools
import json
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class Posted:
    chat_id: str
    via: str  # "reply" or "push"
    message: dict[str, Any]
    id: str
    retry_key: str | None = None
    at: float = field(default_factory=time.time)

    @property
    def text(self) -> str:
        return str(self.message.get("text", ""))


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    status: int
    at: float = field(default_factory=time.time)


def sign(secret: str, body: bytes) -> str:
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"message": message}, status_code=status, headers=headers)


class LineStandin:
    def __init__(self, token: str, secret: str) -> None:
        self.token = token
        self.secret = secret
        self.port = 0
        self.posted: list[Posted] = []
        self.calls: list[Call] = []
        self.contents: dict[str, tuple[str, bytes]] = {}  # message id -> (mime, bytes)
        self._tokens: dict[str, tuple[str, float]] = {}  # reply token -> (chat, issued)
        self._accepted: dict[str, str] = {}  # retry key -> request id
        self._lose_push = 0
        self._hold_push: list[float] = []
        self._closing = False
        self._limits: dict[str, int] = {}
        self.token_seconds = 60.0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(
            routes=[
                Route("/v2/bot/message/reply", self._recorded(self._reply), methods=["POST"]),
                Route("/v2/bot/message/push", self._recorded(self._push), methods=["POST"]),
                Route(
                    "/v2/bot/chat/loading/start", self._recorded(self._loading), methods=["POST"]
                ),
                Route(
                    "/v2/bot/message/{id}/content", self._recorded(self._content), methods=["GET"]
                ),
            ]
        )

    # -- what tests use ----------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def user(user_id: str) -> dict[str, Any]:
        return {"type": "user", "userId": user_id}

    @staticmethod
    def group(group_id: str, user_id: str = "Umember0001") -> dict[str, Any]:
        return {"type": "group", "groupId": group_id, "userId": user_id}

    @staticmethod
    def room(room_id: str, user_id: str = "Umember0001") -> dict[str, Any]:
        return {"type": "room", "roomId": room_id, "userId": user_id}

    @staticmethod
    def chat_of(source: dict[str, Any]) -> str:
        return str(source.get("groupId") or source.get("roomId") or source["userId"])

    def _event(self, source: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        n = next(self._ids)
        token = secrets.token_hex(16)
        with self._lock:
            self._tokens[token] = (self.chat_of(source), time.monotonic())
        return {
            "type": "message",
            "mode": "active",
            "timestamp": int(time.time() * 1000),
            "webhookEventId": f"01STANDIN{n:017d}",
            "deliveryContext": {"isRedelivery": False},
            "replyToken": token,
            "source": source,
            "message": {"id": f"{500000000 + n}", **message},
        }

    def text_event(self, source: dict[str, Any], text: str) -> dict[str, Any]:
        return self._event(source, {"type": "text", "text": text, "quoteToken": "q" * 16})

    def file_event(
        self, source: dict[str, Any], data: bytes, name: str = "doc.txt", mime: str = "text/plain"
    ) -> dict[str, Any]:
        event = self._event(source, {"type": "file", "fileName": name, "fileSize": len(data)})
        with self._lock:
            self.contents[event["message"]["id"]] = (mime, data)
        return event

    def image_event(self, source: dict[str, Any], data: bytes) -> dict[str, Any]:
        event = self._event(
            source, {"type": "image", "contentProvider": {"type": "line"}, "quoteToken": "q" * 16}
        )
        with self._lock:
            self.contents[event["message"]["id"]] = ("image/png", data)
        return event

    def body(self, events: list[dict[str, Any]]) -> bytes:
        return json.dumps({"destination": "Ustandinbot0000", "events": events}).encode()

    def post_webhook(
        self,
        url: str,
        events: list[dict[str, Any]] | None = None,
        *,
        raw: bytes | None = None,
        signature: str | bool | None = True,
    ) -> httpx.Response:
        """POST as LINE does; `signature` True signs the exact bytes sent, a str is sent as is."""
        content = raw if raw is not None else self.body(events or [])
        headers = {"Content-Type": "application/json; charset=utf-8"}
        value = sign(self.secret, content) if signature is True else signature
        if isinstance(value, str):
            headers["X-Line-Signature"] = value
        return httpx.post(url, content=content, headers=headers, timeout=60)

    def expire_tokens(self) -> None:
        """Every reply token issued so far is too old to use."""
        with self._lock:
            self._tokens = {t: (c, at - 3600) for t, (c, at) in self._tokens.items()}

    def lose_push_answers(self, times: int = 1) -> None:
        """The next pushes are accepted (and posted), but their answer is a 500."""
        with self._lock:
            self._lose_push += times

    def hold_push_answers(self, seconds: float, times: int = 1) -> None:
        """The next pushes are accepted (and posted) at once, but answered `seconds` later."""
        with self._lock:
            self._hold_push.extend([seconds] * times)

    def rate_limit(self, path: str, times: int = 1) -> None:
        with self._lock:
            self._limits[path] = self._limits.get(path, 0) + times

    def messages(self, chat_id: str | None = None) -> list[Posted]:
        with self._lock:
            return [p for p in self.posted if chat_id is None or p.chat_id == chat_id]

    def texts(self, chat_id: str) -> list[str]:
        return [p.text for p in self.messages(chat_id) if p.message.get("type") == "text"]

    def calls_of(self, path: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.path == path]

    # -- the Messaging API -----------------------------------------------------------

    def _recorded(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """Each call is recorded with the status it was answered."""

        async def run(request: Request) -> Response:
            response = await handler(request)
            call: Call | None = getattr(request.state, "call", None)
            if call is not None:
                with self._lock:
                    call.status = response.status_code
            return response

        return run

    async def _begin(self, request: Request) -> tuple[dict[str, Any], Response | None]:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        headers = {k.lower(): v for k, v in request.headers.items()}
        refusal: Response | None = None
        if headers.get("authorization") != f"Bearer {self.token}":
            refusal = _error(401, "Authentication failed. Confirm that the access token "
                             "in the authorization header is valid.")  # fmt: skip
        path = request.url.path
        with self._lock:
            if refusal is None and self._limits.get(path, 0) > 0:
                self._limits[path] -= 1
                refusal = _error(429, "The API rate limit has been exceeded. Try again later.")
            call = Call(path, body, headers, refusal.status_code if refusal else 0)
            self.calls.append(call)
        request.state.call = call
        return body, refusal

    def _check_messages(self, body: dict[str, Any]) -> Response | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not 1 <= len(messages) <= 5:
            return _error(400, "The request body has 1 error(s)")
        for m in messages:
            if m.get("type") == "text" and not 1 <= len(m.get("text", "")) <= 5000:
                return _error(400, "The request body has 1 error(s)")
            if m.get("type") == "image" and not str(m.get("originalContentUrl", "")).startswith(
                "http"
            ):
                return _error(400, "The request body has 1 error(s)")
        return None

    def _post_all(self, chat: str, via: str, body: dict[str, Any], key: str | None) -> list[str]:
        ids = []
        with self._lock:
            for m in body["messages"]:
                pid = str(700000000 + next(self._ids))
                self.posted.append(Posted(chat, via, m, pid, key))
                ids.append(pid)
        return ids

    async def _reply(self, request: Request) -> Response:
        body, refusal = await self._begin(request)
        if refusal is not None:
            return refusal
        bad = self._check_messages(body)
        if bad is not None:
            return bad
        with self._lock:
            got = self._tokens.pop(str(body.get("replyToken")), None)
        if got is None or time.monotonic() - got[1] > self.token_seconds:
            return _error(400, "Invalid reply token")
        ids = self._post_all(got[0], "reply", body, None)
        return JSONResponse({"sentMessages": [{"id": i, "quoteToken": "q" * 16} for i in ids]})

    async def _push(self, request: Request) -> Response:
        body, refusal = await self._begin(request)
        if refusal is not None:
            return refusal
        key = request.headers.get("x-line-retry-key")
        if key is not None:
            try:
                uuid.UUID(key)
            except ValueError:
                return _error(400, "The retry key must be a UUID")
            with self._lock:
                earlier = self._accepted.get(key)
            if earlier is not None:
                return _error(
                    409,
                    "The retry key is already accepted",
                    **{"x-line-accepted-request-id": earlier},
                )
        bad = self._check_messages(body)
        if bad is not None:
            return bad
        to = str(body.get("to", ""))
        if not to:
            return _error(400, "The request body has 1 error(s)")
        ids = self._post_all(to, "push", body, key)
        with self._lock:
            if key is not None:
                self._accepted[key] = secrets.token_hex(8)
            lose = self._lose_push > 0
            if lose:
                self._lose_push -= 1
            hold = self._hold_push.pop(0) if self._hold_push else 0.0
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline and not self._closing:  # noqa: ASYNC110 - a thread sets it
            await asyncio.sleep(0.05)
        if lose:
            return JSONResponse({"message": "Internal error"}, status_code=500)
        return JSONResponse({"sentMessages": [{"id": i} for i in ids]})

    async def _loading(self, request: Request) -> Response:
        _body, refusal = await self._begin(request)
        return refusal or JSONResponse({}, status_code=202)

    async def _content(self, request: Request) -> Response:
        _body, refusal = await self._begin(request)
        if refusal is not None:
            return refusal
        with self._lock:
            got = self.contents.get(request.path_params["id"])
        if got is None:
            return _error(404, "Not found")
        return Response(got[1], media_type=got[0])

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> LineStandin:
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
                raise RuntimeError("the LINE stand-in did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._closing = True
        self._server.should_exit = True
        self._thread.join(10)
