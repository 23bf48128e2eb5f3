"""Discord, on discord.py 2.7 over the gateway websocket and REST v10 (W1-W6).

    channel = DiscordChannel(DiscordOptions(agent="bot", token=SecretStr(...)), store)
    await channel.start(on_message)          # login, then the gateway in a task
    await channel.send(OutboundMessage(...))
    thread_id = await channel.create_thread(parent, "name", key)   # P2's own thread
    got = await channel.download(url)        # P4: Discord's CDN only (discord_cdn)

Inbound (W3, W5): the gateway pushes each message; `discord_inbound.normalize`
turns it into an `InboundMessage` (a DM, a guild text channel and each thread
are their own chats). The store is idempotent on the message id, so an event
the gateway replays after a RESUME is answered once. Intents: guilds, guild
messages, direct messages and message content (privileged: switch it on in
the developer portal). `/help` is answered here, `/reset` goes to the gateway.
The gateway has no redelivery: a message the store could not take is logged.

Outbound (W4): text is split at 2000 characters on line boundaries; each part
is posted once under `<outbound_key>` and its part number, recorded in the
store right after Discord accepts it. A 429 is waited out for `retry_after`
(by discord.py for short waits, here for long ones); a 403 into a DM that
refuses the bot is recorded as a blocked chat, never retried. Nothing the bot
posts can ping anyone (`AllowedMentions.none()`): a sandbox cannot @everyone.

The API base URL and the gateway URL default to Discord's own; both can point
at a stand-in (`apiBaseUrl`, `gatewayUrl`). The token stays in the client on
the gateway only: never logged, never in anything a sandbox receives (W6).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

with warnings.catch_warnings():  # discord.py's voice support imports audioop (3.13)
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord
from discord.gateway import DiscordWebSocket
from discord.http import HTTPClient, Route
from pydantic import SecretStr

from cellgate.errors import CellgateError, StoreError, Throttled
from cellgate.models import DeliveryReceipt, InboundMessage, OutboundKind, OutboundMessage
from channels.base import Channel, ChannelFailed, ChannelStore, ChatBlocked, InboundHandler
from channels.discord_cdn import CdnFetcher, Downloaded
from channels.discord_inbound import normalize
from channels.notices import OncePerWindow
from channels.telegram import UNAVAILABLE_TEXT, split_text

__all__ = [
    "DISCORD_API_BASE",
    "DISCORD_GATEWAY",
    "DISCORD_TEXT_LIMIT",
    "DiscordChannel",
    "DiscordOptions",
    "DiscordStore",
]

logger = logging.getLogger(__name__)

DISCORD_TEXT_LIMIT = 2000
DISCORD_API_BASE = Route.BASE  # https://discord.com/api/v10
DISCORD_GATEWAY = str(DiscordWebSocket.DEFAULT_GATEWAY)  # wss://gateway.discord.gg/
MAX_RETRY_WAIT = 300.0
LIBRARY_WAIT = 30.0  # discord.py sleeps out a 429 up to this itself; longer ones come here
SEND_ATTEMPTS = 5
THREAD_ARCHIVE_MINUTES: Literal[1440] = 1440

HELP_TEXT = (
    "Hi! Every DM, channel and thread with this bot has its own private workspace; nothing "
    "you send here is seen by any other chat.\n\n"
    "Send a message (text or files) and I will answer here.\n"
    "`!reset` (or `/reset`) starts a fresh session in this chat (your files stay).\n"
    "`!help` shows this text."
)


DiscordStore = ChannelStore  # the store as the channel uses it (W4)


@dataclass(frozen=True, slots=True)
class DiscordOptions:
    agent: str
    token: SecretStr
    api_base_url: str = DISCORD_API_BASE
    gateway_url: str = DISCORD_GATEWAY
    require_mention: bool = False
    max_download_bytes: int = 25 * 1024 * 1024
    notice_every: float = 60.0


def intents() -> discord.Intents:
    """Guilds (channels and threads), guild messages, DMs, and the messages' content."""
    wanted = discord.Intents.none()
    wanted.guilds = True
    wanted.guild_messages = True
    wanted.dm_messages = True
    wanted.message_content = True
    return wanted


def _snowflake(value: str | None, what: str) -> int:
    if value is None or not value.isdigit() or len(value) > 20:
        raise ChannelFailed("discord", f"{what} must be a Discord id (digits), not {value!r}")
    return int(value)


class _Http(HTTPClient):
    """discord.py's REST client, sent to `api_base` and `gateway` instead of Discord's own."""

    def __init__(self, api_base: str, gateway: str) -> None:
        super().__init__(discord.utils.MISSING, max_ratelimit_timeout=LIBRARY_WAIT)
        self._api_base = api_base.rstrip("/")
        self._gateway = gateway

    async def request(self, route: Route, **kwargs: Any) -> Any:
        if self._api_base != DISCORD_API_BASE and route.url.startswith(DISCORD_API_BASE):
            route.url = self._api_base + route.url[len(DISCORD_API_BASE) :]
        return await super().request(route, **kwargs)

    async def ws_connect(self, url: str, *, compress: int = 0) -> aiohttp.ClientWebSocketResponse:
        if self._gateway != DISCORD_GATEWAY and url.startswith(DISCORD_GATEWAY):
            url = self._gateway.rstrip("/") + "/" + url[len(DISCORD_GATEWAY) :]
        return await super().ws_connect(url, compress=compress)


class _Client(discord.Client):
    def __init__(self, http: _Http, on_message: Callable[[discord.Message], Awaitable[None]]):
        super().__init__(intents=intents(), chunk_guilds_at_startup=False, max_messages=None)
        self.http = http
        self._connection.http = http
        self._forward = on_message

    async def on_message(self, message: discord.Message) -> None:
        await self._forward(message)


class DiscordChannel(Channel):
    name = "discord"

    def __init__(
        self,
        options: DiscordOptions,
        store: DiscordStore,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        cdn: CdnFetcher | None = None,
    ) -> None:
        self.options = options
        self.agent = options.agent
        self.store = store
        self._sleep = sleep
        self._clock = clock
        # P4: replaced only by tests (a resolver and pins for the stand-in), never by config
        self.cdn = cdn or CdnFetcher(max_bytes=options.max_download_bytes)
        self.client = _Client(_Http(options.api_base_url, options.gateway_url), self._received)
        self._on_message: InboundHandler | None = None
        self._runner: asyncio.Task[None] | None = None
        self._notices = OncePerWindow()
        self._helped = OncePerWindow()  # /start, /help

    def __repr__(self) -> str:  # never the token
        return f"DiscordChannel(agent={self.agent!r})"

    def _redact(self, text: str) -> str:
        return text.replace(self.options.token.get_secret_value(), "<token>")

    def _failed(self, reason: str) -> ChannelFailed:
        return ChannelFailed(self.name, self._redact(reason))

    @property
    def bot_id(self) -> int | None:
        user = self.client.user
        return None if user is None else user.id

    # -- lifecycle -------------------------------------------------------------

    async def start(self, on_message: InboundHandler) -> None:
        """Log in (a refused token stops start-up), then run the gateway in a task.

        A Discord that cannot be reached does not stop start-up: logging in is
        retried in the background while the gateway serves its other channels.
        """
        self._on_message = on_message
        if self._runner is not None:
            return
        try:
            logged_in = await self._login()
        except ChannelFailed:
            await self.client.close()
            raise
        self._runner = asyncio.create_task(self._run(logged_in), name=f"discord-{self.agent}")

    async def _login(self) -> bool:
        try:
            await self.client.login(self.options.token.get_secret_value())
        except discord.LoginFailure as exc:
            raise self._failed(
                f"Discord refuses the bot token of agent {self.agent}: check its tokenEnv or "
                "tokenFile (the token of the bot in the developer portal)"
            ) from exc
        except (OSError, aiohttp.ClientError, discord.HTTPException) as exc:
            logger.warning(
                "discord not reachable for agent %s, retrying: %s",
                self.agent,
                self._redact(str(exc)),
            )
            return False
        logger.info("discord logged in for agent %s", self.agent)
        return True

    async def _run(self, logged_in: bool) -> None:
        backoff = 1.0
        while not logged_in:
            await self._sleep(backoff)
            backoff = min(backoff * 2, 60.0)
            try:
                logged_in = await self._login()
            except ChannelFailed:
                logger.exception("discord channel of agent %s stopped", self.agent)
                return
        try:
            await self.client.connect(reconnect=True)
        except asyncio.CancelledError:
            raise
        except discord.PrivilegedIntentsRequired:
            logger.error(
                "discord refuses agent %s the message content intent: switch on MESSAGE "
                "CONTENT INTENT under Bot in the developer portal",
                self.agent,
            )
        except Exception:  # the gateway gave up (bad token, closed): logged, not fatal
            logger.exception("discord gateway of agent %s stopped", self.agent)

    async def wait_ready(self) -> None:
        """Wait until the gateway's READY (and its guilds) arrived."""
        await self.client.wait_until_ready()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.close()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
            self._runner = None

    # -- inbound ---------------------------------------------------------------

    async def _received(self, message: discord.Message) -> None:
        got = normalize(
            self.agent, message, self.bot_id, require_mention=self.options.require_mention
        )
        if got is None:
            return
        await self.handle(got)

    async def handle(self, message: InboundMessage) -> None:
        """One normalised message: a command answered here, else handed to the gateway."""
        chat = message.chat_id
        if await asyncio.to_thread(self.store.chat_blocked, self.agent, self.name, chat):
            await asyncio.to_thread(self.store.unblock_chat, self.agent, self.name, chat)
        if message.command in ("start", "help"):  # best effort, once per window, never waited on
            await self._notice(chat, HELP_TEXT, icon="", seen=self._helped)
            return
        assert self._on_message is not None, "start() the channel before messages arrive"
        try:
            await self._on_message(message)
        except Throttled as exc:
            await self._notice(chat, exc.public)
        except StoreError:
            logger.exception(
                "discord message %s of agent %s not stored", message.message_id, self.agent
            )
        except CellgateError as exc:
            logger.warning("discord message for agent %s not taken: %s", self.agent, exc)
            await self._notice(chat, exc.public or UNAVAILABLE_TEXT)

    async def _notice(
        self,
        chat_id: str,
        text: str,
        *,
        icon: str = "⏳ ",
        seen: OncePerWindow | None = None,
    ) -> None:
        """R4: tell a flooding chat once per window; the flood itself is not stored. `seen`:
        another window (the help text's: a `/help` flood is answered once)."""
        window = self._notices if seen is None else seen
        if not window.due(chat_id, self._clock(), self.options.notice_every):
            return
        with contextlib.suppress(discord.DiscordException, OSError, aiohttp.ClientError):
            await self._partial(chat_id).send(f"{icon}{text}"[:DISCORD_TEXT_LIMIT])

    # -- what the bridge asks --------------------------------------------------

    def parent_of(self, chat_id: str) -> str | None:
        """The parent channel of a thread discord.py has seen (P2's reason), else None."""
        if not chat_id.isdigit() or len(chat_id) > 20:
            return None
        found = self.client.get_channel(int(chat_id))
        if isinstance(found, discord.Thread) and found.parent_id is not None:
            return str(found.parent_id)
        return None

    async def create_thread(self, parent: str, name: str, key: str) -> str:
        """Open a public thread under `parent` once per `key`; its id (P2 records it)."""
        channel = _snowflake(parent, "the channel")

        async def post() -> Any:
            return await self.client.http.start_thread_without_message(
                channel,
                name=name[:100] or "thread",
                auto_archive_duration=THREAD_ARCHIVE_MINUTES,
                type=discord.ChannelType.public_thread.value,
            )

        return await self._once(key, 0, parent, post)

    async def download(self, url: str) -> Downloaded:
        """P4: the file at a Discord CDN URL, size-capped; refusals raise `PolicyDenied`."""
        return await self.cdn.fetch(url)

    # -- outbound --------------------------------------------------------------

    def _partial(self, chat_id: str) -> discord.PartialMessageable:
        return self.client.get_partial_messageable(_snowflake(chat_id, "the chat"))

    async def typing(self, chat_id: str) -> None:
        with contextlib.suppress(discord.DiscordException, OSError, aiohttp.ClientError):
            await self.client.http.send_typing(_snowflake(chat_id, "the chat"))

    async def send(self, message: OutboundMessage) -> DeliveryReceipt:
        chat = message.chat_id
        _snowflake(chat, "the chat")
        if await asyncio.to_thread(self.store.chat_blocked, self.agent, self.name, chat):
            raise ChatBlocked(self.name, chat, "the chat refused the bot earlier")
        if message.kind is OutboundKind.REPLY:
            ref = message.reply_to or ""
            reply_to = int(ref) if ref.isdigit() and len(ref) <= 20 else None
            return await self._post_text(chat, message.outbound_key, message.text, reply_to)
        if message.kind is OutboundKind.REACT:
            return await self._react(message)
        if message.kind is OutboundKind.EDIT:
            return await self._edit(message)
        return await self._send_file(message)

    async def _once(
        self, key: str, part: int, chat: str, post: Callable[[], Awaitable[Any]]
    ) -> str:
        """Post one part unless the store says it was posted; record it right after."""
        known = await asyncio.to_thread(self.store.posted_part, key, part)
        if known is not None:
            return known
        result = await self._call(chat, post)
        if isinstance(result, discord.Message):
            platform_id = str(result.id)
        elif isinstance(result, dict) and "id" in result:
            platform_id = str(result["id"])
        else:
            platform_id = "ok"
        await asyncio.to_thread(
            self.store.record_posted_part,
            key,
            part,
            agent=self.agent,
            channel=self.name,
            chat_id=chat,
            platform_message_id=platform_id,
        )
        return platform_id

    async def _call(self, chat: str, post: Callable[[], Awaitable[Any]]) -> Any:
        """One REST call: a long 429 waited out, a refusing DM recorded, the rest translated."""
        for attempt in range(SEND_ATTEMPTS):
            try:
                return await post()
            except discord.RateLimited as exc:  # longer than discord.py waits by itself
                wait = min(float(exc.retry_after), MAX_RETRY_WAIT)
                logger.info("discord asks to wait %.0f s (chat %s)", wait, chat)
                await self._sleep(wait)
            except discord.Forbidden as exc:
                reason = self._redact(exc.text or "forbidden")
                if exc.code == 50007:  # "Cannot send messages to this user": a DM that refuses
                    await asyncio.to_thread(
                        self.store.block_chat, self.agent, self.name, chat, reason
                    )
                    raise ChatBlocked(self.name, chat, reason) from exc
                raise self._failed(f"Discord refused: {reason}") from exc
            except discord.HTTPException as exc:
                if exc.status >= 500 and attempt < SEND_ATTEMPTS - 1:
                    await self._sleep(min(2.0**attempt, 30.0))
                    continue
                raise self._failed(f"Discord refused the request: {exc.status} {exc.text}") from exc
            except (OSError, aiohttp.ClientError) as exc:
                if attempt == SEND_ATTEMPTS - 1:
                    raise self._failed(f"Discord unreachable: {exc}") from exc
                await self._sleep(min(2.0**attempt, 30.0))
        raise ChannelFailed(self.name, f"still rate limited after {SEND_ATTEMPTS} waits")

    async def _post_text(
        self, chat: str, key: str, text: str, reply_to: int | None
    ) -> DeliveryReceipt:
        target = self._partial(chat)
        first = ""
        for i, part in enumerate(split_text(text, DISCORD_TEXT_LIMIT)):

            async def post(part: str = part, i: int = i) -> discord.Message:
                quiet = discord.AllowedMentions.none()
                if i == 0 and reply_to is not None:
                    ref = discord.MessageReference(
                        message_id=reply_to, channel_id=target.id, fail_if_not_exists=False
                    )
                    return await target.send(part, reference=ref, allowed_mentions=quiet)
                return await target.send(part, allowed_mentions=quiet)

            sent = await self._once(key, i, chat, post)
            first = first or sent
        return DeliveryReceipt(platform_message_id=first)

    async def _react(self, message: OutboundMessage) -> DeliveryReceipt:
        target = _snowflake(message.target_message_id, "the message to react to")
        partial = self._partial(message.chat_id).get_partial_message(target)
        await self._once(
            message.outbound_key, 0, message.chat_id, lambda: partial.add_reaction(message.text)
        )
        return DeliveryReceipt(platform_message_id=str(target))

    async def _edit(self, message: OutboundMessage) -> DeliveryReceipt:
        target = message.target_message_id or ""
        own = (
            target.isdigit()
            and len(target) <= 20
            and await asyncio.to_thread(
                self.store.bot_message_known, self.agent, self.name, message.chat_id, target
            )
        )
        if not own:
            raise ChannelFailed(
                self.name, f"message {target[:40]} is not one this bot sent in this chat"
            )
        text = split_text(message.text, DISCORD_TEXT_LIMIT)[0]
        partial = self._partial(message.chat_id).get_partial_message(int(target))
        await self._once(
            message.outbound_key,
            0,
            message.chat_id,
            lambda: partial.edit(content=text, allowed_mentions=discord.AllowedMentions.none()),
        )
        return DeliveryReceipt(platform_message_id=target)

    async def _send_file(self, message: OutboundMessage) -> DeliveryReceipt:
        assert message.file_path is not None
        path = Path(message.file_path)
        name = message.file_name or path.name
        caption = message.text[:DISCORD_TEXT_LIMIT] or None
        target = self._partial(message.chat_id)

        async def post() -> discord.Message:
            data = await asyncio.to_thread(path.read_bytes)
            return await target.send(
                caption,
                file=discord.File(io.BytesIO(data), filename=name),
                allowed_mentions=discord.AllowedMentions.none(),
            )

        try:
            sent = await self._once(message.outbound_key, 0, message.chat_id, post)
        finally:
            # the spool copy belongs to the channel once handed over (bridge/tools.py)
            await asyncio.to_thread(_remove_spool, path)
        return DeliveryReceipt(platform_message_id=sent)


def _remove_spool(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
        path.parent.rmdir()
