"""A stand-in for the Telegram Bot API, on loopback, real HTTP, for the real library.

Speaks what python-telegram-bot 22 sends (`POST <base_url><token>/<method>`,
form-encoded with JSON-encoded values, or multipart with files) and answers
`{"ok": true, "result": ...}` or `{"ok": false, "error_code", "description",
"parameters"?}` as Telegram does. Methods: getMe, getUpdates (long polling,
offset confirms), setWebhook, deleteWebhook, sendMessage, sendPhoto,
sendDocument, sendChatAction, setMessageReaction, editMessageText, getFile,
and `GET /file/bot<token>/<file_path>`.

    with TelegramStandin(token) as tg:
        bot = Bot(token, base_url=tg.base_url, base_file_url=tg.base_file_url)
        tg.user_says(chat_id=111, text="hi")              # queued for getUpdates
        tg.post_to_webhook(tg.user_update(222, "hi"))     # as Telegram posts a webhook
        tg.rate_limit("sendMessage", retry_after=1)       # the next call gets 429
        tg.block(333)                                     # 403: bot was blocked by the user
        tg.messages(111)                                  # what the bot posted there
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

BOT_ID = 7000001
BOT_USERNAME = "cellgate_standin_bot"
_JSON_FIELDS = frozenset(
    {"reply_parameters", "reaction", "allowed_updates", "reply_markup", "link_preview_options"}
)


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    at: float


@dataclass
class Posted:
    chat_id: int
    message_id: int
    kind: str  # text, photo, document
    text: str = ""
    file_name: str = ""
    data: bytes = b""
    reply_to: int | None = None
    edits: list[str] = field(default_factory=list)
    reactions: list[str] = field(default_factory=list)
    at: float = field(default_factory=time.time)  # when Telegram accepted it


def _error(code: int, description: str, **parameters: Any) -> JSONResponse:
    body: dict[str, Any] = {"ok": False, "error_code": code, "description": description}
    if parameters:
        body["parameters"] = parameters
    return JSONResponse(body, status_code=code)


def _ok(result: Any) -> JSONResponse:
    return JSONResponse({"ok": True, "result": result})


class TelegramStandin:
    def __init__(self, token: str) -> None:
        self.token = token
        self.port = 0
        self.calls: list[Call] = []
        self.posted: list[Posted] = []
        self.webhook_url: str | None = None
        self.webhook_secret: str | None = None
        self.files: dict[str, tuple[str, bytes]] = {}  # file_id -> (file_path, bytes)
        self.blocked: set[int] = set()
        self._limits: dict[str, list[int]] = {}
        self._updates: list[dict[str, Any]] = []
        self._confirmed = 0
        self._ids = itertools.count(1)
        self._update_ids = itertools.count(100)
        self._message_ids: dict[int, itertools.count[int]] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(
            routes=[
                Route("/bot{token}/{method}", self._method, methods=["POST", "GET"]),
                Route("/file/bot{token}/{path:path}", self._file, methods=["GET"]),
            ]
        )

    # -- what tests use ----------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bot"

    @property
    def base_file_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/file/bot"

    def add_file(self, data: bytes, name: str = "photo.jpg") -> str:
        """A file Telegram holds for this bot; its file_id (bot-scoped, not chat-scoped)."""
        n = next(self._ids)
        file_id = f"AgAC{n:06d}standinFileId"
        with self._lock:
            self.files[file_id] = (f"documents/file_{n}_{name}", data)
        return file_id

    def user_update(
        self,
        chat_id: int,
        text: str | None = None,
        *,
        user_id: int | None = None,
        message_id: int | None = None,
        photo: str | None = None,
        document: tuple[str, str] | None = None,
        caption: str | None = None,
        sticker: str | None = None,
        edited: bool = False,
        update_id: int | None = None,
    ) -> dict[str, Any]:
        """An update as Telegram sends it: a user's message in `chat_id` (negative: a group)."""
        uid = user_id if user_id is not None else abs(chat_id)
        chat: dict[str, Any] = {"id": chat_id, "type": "private" if chat_id > 0 else "group"}
        if chat_id > 0:
            chat["first_name"] = f"user{uid}"
        else:
            chat["title"] = f"group{abs(chat_id)}"
        msg: dict[str, Any] = {
            "message_id": message_id if message_id is not None else self._next_message_id(chat_id),
            "date": int(time.time()),
            "chat": chat,
            "from": {"id": uid, "is_bot": False, "first_name": f"user{uid}"},
        }
        if text is not None:
            msg["text"] = text
            if text.startswith("/"):
                word = text.split()[0]
                msg["entities"] = [{"type": "bot_command", "offset": 0, "length": len(word)}]
        if caption is not None:
            msg["caption"] = caption
        if photo is not None:
            size = len(self.files[photo][1])
            msg["photo"] = [
                {"file_id": photo, "file_unique_id": photo[-12:], "width": 90, "height": 90,
                 "file_size": size},
            ]  # fmt: skip
        if document is not None:
            file_id, name = document
            msg["document"] = {
                "file_id": file_id,
                "file_unique_id": file_id[-12:],
                "file_name": name,
                "file_size": len(self.files[file_id][1]),
            }
        if sticker is not None:
            msg["sticker"] = {
                "file_id": "CAAC-sticker",
                "file_unique_id": "sticker1",
                "type": "regular",
                "width": 512,
                "height": 512,
                "is_animated": False,
                "is_video": False,
                "emoji": sticker,
                "set_name": "standin_set",
            }
        if edited:
            msg["edit_date"] = int(time.time())
        key = "edited_message" if edited else "message"
        uid_ = update_id if update_id is not None else next(self._update_ids)
        return {"update_id": uid_, key: msg}

    def queue(self, update: dict[str, Any]) -> dict[str, Any]:
        """Offer an update to getUpdates (polling)."""
        with self._lock:
            self._updates.append(update)
        return update

    def user_says(self, chat_id: int, text: str | None = None, **kw: Any) -> dict[str, Any]:
        return self.queue(self.user_update(chat_id, text, **kw))

    def post_to_webhook(
        self, update: dict[str, Any], secret: str | bool | None = True
    ) -> httpx.Response:
        """POST an update to the webhook as Telegram does (secret True: the one it was given)."""
        assert self.webhook_url, "no webhook set"
        headers = {"Content-Type": "application/json"}
        value = self.webhook_secret if secret is True else secret
        if isinstance(value, str):
            headers["X-Telegram-Bot-Api-Secret-Token"] = value
        return httpx.post(self.webhook_url, content=json.dumps(update), headers=headers, timeout=60)

    def rate_limit(self, method: str, retry_after: int = 1, times: int = 1) -> None:
        """The next `times` calls of `method` get 429 with `parameters.retry_after`."""
        with self._lock:
            self._limits.setdefault(method, []).extend([retry_after] * times)

    def block(self, chat_id: int) -> None:
        with self._lock:
            self.blocked.add(chat_id)

    def messages(self, chat_id: int | None = None) -> list[Posted]:
        with self._lock:
            return [p for p in self.posted if chat_id is None or p.chat_id == chat_id]

    def texts(self, chat_id: int) -> list[str]:
        return [p.text for p in self.messages(chat_id)]

    def calls_of(self, method: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == method]

    def pending_updates(self) -> int:
        with self._lock:
            return sum(1 for u in self._updates if u["update_id"] >= self._confirmed)

    # -- the Bot API ---------------------------------------------------------------

    def _next_message_id(self, chat_id: int) -> int:
        with self._lock:
            counter = self._message_ids.setdefault(chat_id, itertools.count(1))
            return next(counter)

    async def _params(self, request: Request) -> tuple[dict[str, Any], dict[str, bytes]]:
        params: dict[str, Any] = {}
        files: dict[str, bytes] = {}
        if request.method == "GET":
            return dict(request.query_params), files
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            raw = await request.body()
            return (json.loads(raw) if raw else {}), files
        async with request.form() as form:
            for k, v in form.multi_items():
                if isinstance(v, UploadFile):
                    files[k] = await v.read()
                    params[k] = f"attach://{k}"
                    params[f"{k}__name"] = v.filename or ""
                elif k in _JSON_FIELDS:
                    params[k] = json.loads(v)
                else:
                    params[k] = v
        return params, files

    def _bot_user(self) -> dict[str, Any]:
        return {
            "id": BOT_ID,
            "is_bot": True,
            "first_name": "Standin",
            "username": BOT_USERNAME,
            "can_join_groups": True,
            "can_read_all_group_messages": False,
            "supports_inline_queries": False,
        }

    def _message_json(self, p: Posted) -> dict[str, Any]:
        chat_type = "private" if p.chat_id > 0 else "group"
        out: dict[str, Any] = {
            "message_id": p.message_id,
            "date": int(time.time()),
            "chat": {"id": p.chat_id, "type": chat_type},
            "from": self._bot_user(),
        }
        if p.kind == "text":
            out["text"] = p.edits[-1] if p.edits else p.text
        elif p.kind == "photo":
            out["photo"] = [{"file_id": f"sent-{p.message_id}", "file_unique_id": "u",
                             "width": 1, "height": 1}]  # fmt: skip
        else:
            out["document"] = {"file_id": f"sent-{p.message_id}", "file_unique_id": "u",
                               "file_name": p.file_name}  # fmt: skip
        if p.text and p.kind != "text":
            out["caption"] = p.text
        return out

    async def _method(self, request: Request) -> Response:
        if request.path_params["token"] != self.token:
            return _error(401, "Unauthorized")
        method = request.path_params["method"]
        params, files = await self._params(request)
        with self._lock:
            self.calls.append(Call(method, params, time.time()))
            limits = self._limits.get(method)
            if limits:
                wait = limits.pop(0)
                return _error(429, f"Too Many Requests: retry after {wait}", retry_after=wait)
        handler = getattr(self, f"_m_{method}", None)
        if handler is None:
            return _error(404, "Not Found: method not found")
        result: Response = await handler(params, files)
        return result

    async def _m_getMe(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        return _ok(self._bot_user())

    async def _m_setWebhook(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        with self._lock:
            self.webhook_url = params.get("url") or None
            self.webhook_secret = params.get("secret_token")
        return _ok(True)

    async def _m_deleteWebhook(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        with self._lock:
            self.webhook_url = None
            self.webhook_secret = None
        return _ok(True)

    async def _m_getUpdates(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        if self.webhook_url:
            return _error(409, "Conflict: can't use getUpdates method while webhook is active")
        offset = int(params.get("offset") or 0)
        timeout = min(float(params.get("timeout") or 0), 2.0)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if offset:
                    self._confirmed = max(self._confirmed, offset)
                ready = [u for u in self._updates if u["update_id"] >= self._confirmed]
            if ready or time.monotonic() >= deadline:
                return _ok(ready[:100])
            await asyncio.sleep(0.05)

    def _check_chat(self, params: dict[str, Any]) -> int | Response:
        chat_id = int(params["chat_id"])
        if chat_id in self.blocked:
            return _error(403, "Forbidden: bot was blocked by the user")
        return chat_id

    def _post(self, chat_id: int, kind: str, **kw: Any) -> Response:
        p = Posted(chat_id, self._next_message_id(chat_id), kind, **kw)
        with self._lock:
            self.posted.append(p)
        return _ok(self._message_json(p))

    async def _m_sendMessage(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        chat = self._check_chat(params)
        if isinstance(chat, Response):
            return chat
        text = str(params.get("text", ""))
        if not text.strip():
            return _error(400, "Bad Request: message text is empty")
        if len(text) > 4096:
            return _error(400, "Bad Request: message is too long")
        reply = params.get("reply_parameters")
        reply_to = int(reply["message_id"]) if isinstance(reply, dict) else None
        return self._post(chat, "text", text=text, reply_to=reply_to)

    async def _send_media(
        self, kind: str, params: dict[str, Any], files: dict[str, bytes]
    ) -> Response:
        chat = self._check_chat(params)
        if isinstance(chat, Response):
            return chat
        if kind not in files:
            return _error(400, f"Bad Request: there is no {kind} in the request")
        caption = str(params.get("caption", ""))
        return self._post(
            chat, kind, text=caption, data=files[kind], file_name=params.get(f"{kind}__name", "")
        )

    async def _m_sendPhoto(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        return await self._send_media("photo", params, files)

    async def _m_sendDocument(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        return await self._send_media("document", params, files)

    async def _m_sendChatAction(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        chat = self._check_chat(params)
        return chat if isinstance(chat, Response) else _ok(True)

    def _find(self, chat_id: int, message_id: int) -> Posted | None:
        with self._lock:
            return next(
                (p for p in self.posted if p.chat_id == chat_id and p.message_id == message_id),
                None,
            )

    async def _m_setMessageReaction(
        self, params: dict[str, Any], files: dict[str, bytes]
    ) -> Response:
        chat = self._check_chat(params)
        if isinstance(chat, Response):
            return chat
        target = self._find(chat, int(params["message_id"]))
        emojis = [r.get("emoji", "") for r in params.get("reaction") or []]
        if target is not None:
            target.reactions += emojis
        return _ok(True)

    async def _m_editMessageText(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        chat = self._check_chat(params)
        if isinstance(chat, Response):
            return chat
        target = self._find(chat, int(params["message_id"]))
        if target is None or target.kind != "text":
            return _error(400, "Bad Request: message can't be edited")
        target.edits.append(str(params["text"]))
        return _ok(self._message_json(target))

    async def _m_getFile(self, params: dict[str, Any], files: dict[str, bytes]) -> Response:
        file_id = str(params.get("file_id", ""))
        with self._lock:
            found = self.files.get(file_id)
        if found is None:
            return _error(400, "Bad Request: invalid file_id")
        path, data = found
        return _ok(
            {"file_id": file_id, "file_unique_id": file_id[-12:], "file_size": len(data),
             "file_path": path}
        )  # fmt: skip

    async def _file(self, request: Request) -> Response:
        if request.path_params["token"] != self.token:
            return Response(status_code=404)
        path = request.path_params["path"]
        with self._lock:
            data = next((d for p, d in self.files.values() if p == path), None)
        if data is None:
            return Response(status_code=404)
        return Response(data, media_type="application/octet-stream")

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> TelegramStandin:
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
                raise RuntimeError("the Telegram stand-in did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(10)
