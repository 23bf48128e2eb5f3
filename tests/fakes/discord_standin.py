"""A stand-in for Discord on loopback, for the real discord.py 2.7 client (pinned: its wire).

- Gateway websocket (`ws://127.0.0.1:<port>/gateway`, JSON text frames, no
  compression): HELLO, heartbeat ACK, IDENTIFY -> READY (the guild
  unavailable) then GUILD_CREATE, MESSAGE_CREATE, THREAD_CREATE, RECONNECT (op
  7) and RESUME -> the missed events replayed, then RESUMED. An IDENTIFY with
  the wrong token is closed with 4004, as Discord does; without the
  MESSAGE_CONTENT intent the messages arrive with empty content, as on Discord.
- REST v10 (`http://127.0.0.1:<port>/api/v10`), what discord.py sends: GET
  users/@me, GET oauth2/applications/@me, POST channels/{id}/messages (JSON or
  multipart with payload_json and files[n]), PATCH a message, PUT a reaction,
  POST typing, POST channels/{id}/threads (and THREAD_CREATE on the gateway).
  A 429 carries `retry_after` in its JSON body and a `Via` header, as Discord's.
- A CDN (`https://127.0.0.1:<cdn_port>`), TLS with a certificate for
  cdn.discordapp.com and media.discordapp.net from a test CA
  (`client_ssl` trusts it): attachments, a redirect elsewhere, a big stream.

    with DiscordStandin(token) as dc:
        dc.api_base_url, dc.gateway_url          # for DiscordOptions / the config
        chan = dc.add_text_channel("general")
        dc.user_says(chan, "hi")                 # MESSAGE_CREATE on the gateway
        dc.rate_limit("messages", retry_after=1.5)
        dc.texts(chan)                           # what the bot posted there
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

GUILD_ID = 900000000000000001
BOT_ID = 900000000000000002
APP_ID = 900000000000000003
OWNER_ID = 900000000000000004
MESSAGE_CONTENT = 1 << 15
CDN_NAMES = ("cdn.discordapp.com", "media.discordapp.net")
_EPOCH_MS = 1420070400000


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """JSON as Discord sends it: discord.py parses a body only under exactly this type."""
    return web.Response(
        body=json.dumps(data).encode(),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def _user(uid: int, name: str, *, bot: bool = False) -> dict[str, Any]:
    return {
        "id": str(uid),
        "username": name,
        "discriminator": "0",
        "global_name": name,
        "avatar": None,
        "bot": bot,
        "public_flags": 0,
    }


@dataclass
class Call:
    method: str
    path: str
    body: Any
    at: float


@dataclass
class Posted:
    channel_id: int
    message_id: int
    content: str
    files: list[tuple[str, bytes]] = field(default_factory=list)
    reply_to: int | None = None
    edits: list[str] = field(default_factory=list)
    reactions: list[str] = field(default_factory=list)
    at: float = field(default_factory=time.time)  # when Discord accepted it


@dataclass
class TestTLS:
    """A test CA and a server certificate for the CDN names; `client` trusts only the CA."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def make(cls, folder: Path) -> TestTLS:
        def key() -> ec.EllipticCurvePrivateKey:
            return ec.generate_private_key(ec.SECP256R1())

        now = dt.datetime.now(dt.UTC)
        ca_key, leaf_key = key(), key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cellgate test CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CDN_NAMES[0])]))
            .issuer_name(ca_name)
            .public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in CDN_NAMES]), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
        (folder / "leaf.pem").write_bytes(leaf.public_bytes(pem))
        (folder / "leaf.key").write_bytes(
            leaf_key.private_bytes(
                pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(folder / "leaf.pem", folder / "leaf.key")
        client = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        return cls(server, client)


class DiscordStandin:
    def __init__(self, token: str) -> None:
        self.token = token
        self.port = 0
        self.cdn_port = 0
        self.calls: list[Call] = []
        self.posted: list[Posted] = []
        self.channels: dict[int, dict[str, Any]] = {}
        self.cdn_files: dict[str, tuple[int, bytes | None]] = {}  # path -> (size, data)
        self.cdn_redirects: dict[str, str] = {}
        self.cdn_hits: list[str] = []
        self.identified_intents: int | None = None
        self.identifies = 0
        self.resumes = 0
        self._ids = itertools.count(int(time.time() * 1000 - _EPOCH_MS) << 22)
        self._limits: dict[str, list[float]] = {}
        self._events: list[dict[str, Any]] = []  # every dispatch, for RESUME
        self._session = ""
        self._ws: web.WebSocketResponse | None = None
        self._muted = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="dc-standin-")
        self.tls = TestTLS.make(Path(self._tmp.name))

    # -- lifecycle --------------------------------------------------------------

    def __enter__(self) -> DiscordStandin:
        ready = threading.Event()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            api = web.Application(client_max_size=64 * 1024 * 1024)
            api.router.add_get("/gateway/", self._gateway)
            api.router.add_get("/gateway", self._gateway)
            api.router.add_route("*", "/api/v10/{path:.*}", self._rest)
            cdn = web.Application()
            cdn.router.add_get("/{path:.*}", self._cdn)
            runners = [web.AppRunner(api), web.AppRunner(cdn)]
            for r in runners:
                await r.setup()
            site = web.TCPSite(runners[0], "127.0.0.1", 0)
            cdn_site = web.TCPSite(runners[1], "127.0.0.1", 0, ssl_context=self.tls.server)
            await site.start()
            await cdn_site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.cdn_port = cdn_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            await self._stop.wait()
            if self._ws is not None:
                await self._ws.close()
            for r in runners:
                await r.cleanup()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        assert ready.wait(10), "stand-in did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)
        self._tmp.cleanup()

    def _run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (a coroutine factory) on the stand-in's loop, from a test thread."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(10)

    # -- what tests use -----------------------------------------------------------

    @property
    def api_base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v10"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/gateway"

    @property
    def cdn_pins(self) -> dict[str, tuple[str, int]]:
        return {CDN_NAMES[0]: ("127.0.0.1", self.cdn_port)}

    @property
    def client_ssl(self) -> ssl.SSLContext:
        return self.tls.client

    def new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _channel_payload(self, cid: int) -> dict[str, Any]:
        c = self.channels[cid]
        base: dict[str, Any] = {
            "id": str(cid),
            "type": c["type"],
            "name": c["name"],
            "last_message_id": None,
            "rate_limit_per_user": 0,
            "flags": 0,
        }
        if c["type"] == 1:
            return {**base, "recipients": [_user(c["user"], f"user{c['user']}")]}
        base["guild_id"] = str(GUILD_ID)
        if c["type"] == 0:
            return {
                **base,
                "position": 0,
                "permission_overwrites": [],
                "parent_id": None,
                "nsfw": False,
                "topic": None,
            }
        return {
            **base,
            "parent_id": str(c["parent"]),
            "owner_id": str(c["owner"]),
            "message_count": 0,
            "member_count": 1,
            "thread_metadata": {
                "archived": False,
                "auto_archive_duration": 1440,
                "archive_timestamp": _now_iso(),
                "locked": False,
            },
        }

    def add_text_channel(self, name: str) -> int:
        cid = self.new_id()
        self.channels[cid] = {"type": 0, "name": name}
        return cid

    def add_dm(self, user_id: int) -> int:
        cid = self.new_id()
        self.channels[cid] = {"type": 1, "name": "", "user": user_id}
        return cid

    def add_thread(self, parent: int, name: str, owner: int = OWNER_ID) -> int:
        """A thread a user opened under `parent`: THREAD_CREATE on the gateway."""
        cid = self.new_id()
        self.channels[cid] = {"type": 11, "name": name, "parent": parent, "owner": owner}
        payload = {**self._channel_payload(cid), "newly_created": True}
        self._run(lambda: self._dispatch("THREAD_CREATE", payload))
        return cid

    def user_says(
        self,
        channel: int,
        text: str,
        user_id: int = 700000000000000001,
        *,
        attachments: list[tuple[str, int]] | None = None,
        message_id: int | None = None,
    ) -> int:
        """A user posts `text` in `channel`: MESSAGE_CREATE on the gateway; its id."""
        mid = message_id or self.new_id()
        c = self.channels[channel]
        content = text if (self.identified_intents or 0) & MESSAGE_CONTENT else ""
        data: dict[str, Any] = {
            "id": str(mid),
            "channel_id": str(channel),
            "author": _user(user_id, f"user{user_id}"),
            "content": content,
            "timestamp": _now_iso(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [],
            "mention_roles": [],
            "embeds": [],
            "pinned": False,
            "type": 0,
            "flags": 0,
            "attachments": [
                {
                    "id": str(self.new_id()),
                    "filename": url.split("?", 1)[0].rsplit("/", 1)[-1],
                    "size": size,
                    "url": url,
                    "proxy_url": url,
                    "content_type": "text/plain",
                }
                for url, size in (attachments or [])
            ],
        }
        if c["type"] != 1:
            data["guild_id"] = str(GUILD_ID)
            data["member"] = {
                "roles": [],
                "joined_at": _now_iso(),
                "deaf": False,
                "mute": False,
                "flags": 0,
            }
        self._run(lambda: self._dispatch("MESSAGE_CREATE", data))
        return mid

    def replay(self, event_index: int) -> None:
        """Send an already dispatched event again under a new sequence (a redelivery)."""
        ev = self._events[event_index]
        self._run(lambda: self._dispatch(ev["t"], ev["d"]))

    def force_reconnect(self) -> None:
        """Op 7: the client closes and RESUMEs; events sent meanwhile are replayed."""

        async def go() -> None:
            ws = self._ws
            if ws is not None and not ws.closed:
                await ws.send_json({"op": 7, "d": None})

        self._run(go)

    def drop_connection(self) -> None:
        """Stop sending on the socket: dispatches are only logged until the client resumes."""
        self._muted = True

    def rate_limit(self, kind: str, retry_after: float) -> None:
        """The next REST call whose path ends with `kind` gets a 429."""
        with self._lock:
            self._limits.setdefault(kind, []).append(retry_after)

    def add_cdn_file(self, data: bytes, name: str, host: str = CDN_NAMES[0]) -> str:
        path = f"/attachments/{self.new_id()}/{self.new_id()}/{name}"
        self.cdn_files[path] = (len(data), data)
        return f"https://{host}{path}?ex=1&is=2&hm=abc"

    def add_cdn_stream(self, size: int, name: str) -> str:
        """A file served chunked, without Content-Length."""
        path = f"/attachments/{self.new_id()}/{self.new_id()}/{name}"
        self.cdn_files[path] = (size, None)
        return f"https://{CDN_NAMES[0]}{path}"

    def add_cdn_redirect(self, location: str) -> str:
        path = f"/attachments/{self.new_id()}/{self.new_id()}/moved.txt"
        self.cdn_redirects[path] = location
        return f"https://{CDN_NAMES[0]}{path}"

    def messages(self, channel: int | None = None) -> list[Posted]:
        with self._lock:
            return [p for p in self.posted if channel is None or p.channel_id == channel]

    def texts(self, channel: int) -> list[str]:
        return [p.content for p in self.messages(channel)]

    def calls_to(self, method: str, suffix: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == method and c.path.endswith(suffix)]

    # -- gateway ------------------------------------------------------------------

    async def _send(self, payload: dict[str, Any]) -> None:
        if self._ws is not None and not self._ws.closed and not self._muted:
            await self._ws.send_str(json.dumps(payload))

    async def _dispatch(self, event: str, data: dict[str, Any]) -> None:
        ev = {"op": 0, "t": event, "s": len(self._events) + 1, "d": data}
        self._events.append(ev)
        await self._send(ev)

    def _guild(self) -> dict[str, Any]:
        everyone = {
            "id": str(GUILD_ID),
            "name": "@everyone",
            "permissions": "2248473465835073",
            "position": 0,
            "color": 0,
            "hoist": False,
            "managed": False,
            "mentionable": False,
            "flags": 0,
        }
        chans = [self._channel_payload(c) for c, v in self.channels.items() if v["type"] == 0]
        threads = [self._channel_payload(c) for c, v in self.channels.items() if v["type"] == 11]
        return {
            "id": str(GUILD_ID),
            "name": "standin guild",
            "icon": None,
            "owner_id": str(OWNER_ID),
            "afk_timeout": 300,
            "verification_level": 0,
            "default_message_notifications": 0,
            "explicit_content_filter": 0,
            "roles": [everyone],
            "emojis": [],
            "stickers": [],
            "features": [],
            "mfa_level": 0,
            "system_channel_flags": 0,
            "premium_tier": 0,
            "preferred_locale": "en-US",
            "nsfw_level": 0,
            "member_count": 2,
            "large": False,
            "channels": chans,
            "threads": threads,
            "members": [],
            "voice_states": [],
            "presences": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
            "unavailable": False,
            "joined_at": _now_iso(),
        }

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        await ws.send_json({"op": 10, "d": {"heartbeat_interval": 41250}})
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            frame = json.loads(msg.data)
            op, d = frame.get("op"), frame.get("d")
            if op == 1:
                await ws.send_json({"op": 11})
            elif op == 2:
                if d.get("token") != self.token:
                    await ws.close(code=4004, message=b"Authentication failed.")
                    break
                self.identifies += 1
                self.identified_intents = int(d.get("intents", 0))
                self._session = f"session-{self.new_id()}"
                self._ws = ws
                await self._dispatch(
                    "READY",
                    {
                        "v": 10,
                        "user": _user(BOT_ID, "cellgate-bot", bot=True),
                        "guilds": [{"id": str(GUILD_ID), "unavailable": True}],
                        "session_id": self._session,
                        "resume_gateway_url": self.gateway_url,
                        "application": {"id": str(APP_ID), "flags": 0},
                        "private_channels": [],
                    },
                )
                await self._dispatch("GUILD_CREATE", self._guild())
            elif op == 6:
                if d.get("token") != self.token or d.get("session_id") != self._session:
                    await ws.send_json({"op": 9, "d": False})
                    continue
                self.resumes += 1
                self._ws, self._muted = ws, False
                seen = int(d.get("seq") or 0)
                for ev in self._events[seen:]:
                    await ws.send_str(json.dumps(ev))
                await self._dispatch("RESUMED", {})
        if self._ws is ws:
            self._ws = None
        return ws

    # -- REST -----------------------------------------------------------------------

    def _message(self, cid: int, mid: int, content: str, **extra: Any) -> dict[str, Any]:
        data = {
            "id": str(mid),
            "channel_id": str(cid),
            "author": _user(BOT_ID, "cellgate-bot", bot=True),
            "content": content,
            "timestamp": _now_iso(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [],
            "mention_roles": [],
            "attachments": [],
            "embeds": [],
            "pinned": False,
            "type": 0,
            "flags": 0,
            **extra,
        }
        if self.channels.get(cid, {}).get("type") != 1:
            data["guild_id"] = str(GUILD_ID)
        return data

    async def _rest(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["path"]
        body: Any = None
        files: list[tuple[str, bytes]] = []
        if request.content_type == "application/json":
            body = await request.json()
        elif request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            async for part in reader:
                if part.name == "payload_json":  # type: ignore[union-attr]
                    body = json.loads(await part.text())  # type: ignore[union-attr]
                else:
                    files.append((part.filename or "", bytes(await part.read())))  # type: ignore[union-attr]
        with self._lock:
            self.calls.append(Call(request.method, path, body, time.monotonic()))
            limit = next((k for k in self._limits if path.endswith(k) and self._limits[k]), None)
            wait = self._limits[limit].pop(0) if limit is not None else None
        if request.headers.get("Authorization") != f"Bot {self.token}":
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        if wait is not None:
            return _json(
                {"message": "You are being rate limited.", "retry_after": wait, "global": False},
                status=429,
                headers={"Via": "1.1 google", "Retry-After": str(int(wait) + 1)},
            )
        return await self._route(request.method, path, body, files)

    async def _route(
        self, method: str, path: str, body: Any, files: list[tuple[str, bytes]]
    ) -> web.StreamResponse:
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/users/@me":
            return _json(_user(BOT_ID, "cellgate-bot", bot=True))
        if method == "GET" and path == "/oauth2/applications/@me":
            return _json(
                {
                    "id": str(APP_ID),
                    "name": "cellgate",
                    "icon": None,
                    "description": "",
                    "rpc_origins": [],
                    "bot_public": True,
                    "bot_require_code_grant": False,
                    "owner": _user(OWNER_ID, "owner"),
                    "summary": "",
                    "verify_key": "00",
                    "flags": 0,
                }
            )
        if parts[0] != "channels" or len(parts) < 3 or not parts[1].isdigit():
            return _json({"message": "404: Not Found", "code": 0}, status=404)
        cid = int(parts[1])
        if cid not in self.channels:
            return _json({"message": "Unknown Channel", "code": 10003}, status=404)
        if method == "POST" and parts[2:] == ["typing"]:
            return web.Response(status=204)
        if method == "POST" and parts[2:] == ["messages"]:
            mid = self.new_id()
            ref = (body or {}).get("message_reference") or {}
            reply_to = int(ref["message_id"]) if ref.get("message_id") else None
            with self._lock:
                self.posted.append(
                    Posted(cid, mid, (body or {}).get("content") or "", files, reply_to)
                )
            return _json(self._message(cid, mid, (body or {}).get("content") or ""))
        if method == "POST" and parts[2:] == ["threads"]:
            tid = self.new_id()
            self.channels[tid] = {"type": 11, "name": body["name"], "parent": cid, "owner": BOT_ID}
            payload = self._channel_payload(tid)
            await self._dispatch("THREAD_CREATE", {**payload, "newly_created": True})
            return _json(payload, status=201)
        if len(parts) >= 4 and parts[2] == "messages" and parts[3].isdigit():
            mid = int(parts[3])
            with self._lock:
                found = next((p for p in self.posted if p.message_id == mid), None)
            if found is None or found.channel_id != cid:
                return _json({"message": "Unknown Message", "code": 10008}, status=404)
            if method == "PATCH" and len(parts) == 4:
                found.edits.append(body.get("content") or "")
                return _json(self._message(cid, mid, found.edits[-1]))
            if method == "PUT" and len(parts) == 7 and parts[4] == "reactions":
                found.reactions.append(parts[5])
                return web.Response(status=204)
        return _json({"message": "405: Method Not Allowed", "code": 0}, status=405)

    # -- CDN --------------------------------------------------------------------------

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.cdn_hits.append(f"{request.host}{path}")
        if path in self.cdn_redirects:
            raise web.HTTPFound(self.cdn_redirects[path])
        got = self.cdn_files.get(path)
        if got is None:
            return web.Response(status=404)
        size, data = got
        if data is not None:
            return web.Response(body=data, content_type="application/octet-stream")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        sent = 0
        chunk = b"z" * 65536
        try:
            while sent < size:
                await resp.write(chunk[: size - sent])
                sent += min(len(chunk), size - sent)
        except (ConnectionResetError, RuntimeError):
            return resp
        await resp.write_eof()
        return resp
