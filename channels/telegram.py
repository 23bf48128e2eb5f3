"""Telegram, on python-telegram-bot 22.x (W1-W6).

    channel = TelegramChannel(TelegramOptions(agent="bot", token=SecretStr(...), ...), store)
    await channel.start(on_message)         # polling task, or setWebhook
    await channel.process_update(body)      # the webhook route, after the secret check (W2)
    await channel.send(OutboundMessage(...))

Inbound (W2, W3, W5): an update is normalised into `InboundMessage` by
`telegram_inbound.normalize`; no `telegram.*` object leaves `channels/`.
One conversation per chat (a group's id is negative). Polling advances the
stored cursor only after the handler has stored the update, so a crash neither
loses nor repeats one. `/start` and `/help` are answered here; `/reset` goes
to the gateway as a command. A stranger refused by admission is told so once
per window, not per message.

Outbound (W4): text is split at 4096 characters on line boundaries; each part
is posted once under `<outbound_key>` and its part number, recorded in the
store right after Telegram accepts it; `RetryAfter` is waited out; a chat that
blocked the bot (403) is recorded and raises `ChatBlocked`, never retried.

The token lives in the `Bot` object and the URLs it builds, on the gateway
only; it is never logged and never part of what a sandbox receives (W6).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import mimetypes
import os
import re
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import SecretStr

# PTB 22 deprecates int time periods (RetryAfter.retry_after and durations) and warns on
# every read unless the process opts in to `timedelta`, which this adapter handles.
os.environ.setdefault("PTB_TIMEDELTA", "true")

from telegram import Bot, Message, ReactionTypeEmoji, Update
from telegram.error import (
    BadRequest,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.request import HTTPXRequest

from cellgate.errors import CellgateError, StoreError, Throttled
from cellgate.models import (
    DeliveryReceipt,
    OutboundKind,
    OutboundMessage,
)
from channels.base import Channel, ChannelFailed, ChannelStore, ChatBlocked, InboundHandler
from channels.notices import OncePerWindow
from channels.telegram_inbound import normalize, safe_file_name

__all__ = [
    "TELEGRAM_TEXT_LIMIT",
    "TelegramChannel",
    "TelegramOptions",
    "TelegramStore",
    "split_text",
]

logger = logging.getLogger(__name__)

_BOT_API_TOKEN = re.compile(r"bot\d+:[A-Za-z0-9_-]+")


class RedactBotTokens(logging.Filter):
    """A Bot API URL carries the token, and libraries log URLs (W6).

    httpx logs each request's URL at INFO; `telegram.Bot` logs its base URLs at
    DEBUG. A logger's filter sees only the records made on that very logger, so
    this is installed on each of them when this module is imported: no handler an
    operator adds (or `-v`) ever writes a token, only `.../bot<token>/getUpdates`.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if _BOT_API_TOKEN.search(text):
            record.msg, record.args = _BOT_API_TOKEN.sub("bot<token>", text), None
        return True


def _install_redaction(names: tuple[str, ...] = ("httpx", "telegram.Bot")) -> None:
    for name in names:
        target = logging.getLogger(name)
        if not any(isinstance(f, RedactBotTokens) for f in target.filters):
            target.addFilter(RedactBotTokens())


_install_redaction()

TELEGRAM_TEXT_LIMIT = 4096
CAPTION_LIMIT = 1024
MAX_RETRY_WAIT = 300.0
SEND_ATTEMPTS = 5
TYPING_EVERY = 4.5
_ALLOWED_UPDATES = ("message", "edited_message")
_PHOTO_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})

HELP_TEXT = (
    "Hi! Every chat with this bot has its own private workspace; nothing you send here "
    "is seen by any other chat.\n\n"
    "Send a message (text, a photo, a document or a voice note) and I will answer here.\n"
    "/reset starts a fresh session in this chat (your files stay).\n"
    "/help shows this text."
)
UNAVAILABLE_TEXT = "this bot cannot answer right now; please try again later"
RESET_TEXT = "Session reset: the next message starts a fresh session in this chat."


class TelegramStore(ChannelStore, Protocol):
    """The store as the channel uses it (W3, W4): the ledger and its polling cursor."""

    def channel_cursor(self, agent: str, channel: str) -> int | None: ...

    def set_channel_cursor(self, agent: str, channel: str, cursor: int) -> None: ...


@dataclass(frozen=True, slots=True)
class TelegramOptions:
    agent: str
    token: SecretStr
    mode: Literal["webhook", "polling"] = "polling"
    webhook_url: str | None = None
    secret_token: SecretStr | None = None
    base_url: str | None = None
    base_file_url: str | None = None
    max_download_bytes: int = 20 * 1024 * 1024
    poll_timeout: int = 25
    notice_every: float = 60.0  # one "too many messages" notice per chat per this many seconds


@dataclass(frozen=True, slots=True)
class Downloaded:
    name: str
    data: bytes


def split_text(text: str, limit: int = TELEGRAM_TEXT_LIMIT) -> list[str]:
    """W4: parts of at most `limit` characters, cut at line ends where a line allows it.

    Joining the parts gives the text back (a cut line keeps its newline in the
    part before); an empty text is one placeholder part, since Telegram refuses
    an empty message.
    """
    if not text:
        return ["(no text)"]
    parts: list[str] = []
    current = ""
    for line in text.splitlines(keepends=True):
        while len(line) > limit:  # a single line longer than a message: cut it hard
            if current:
                parts.append(current)
                current = ""
            parts.append(line[:limit])
            line = line[limit:]
        if len(current) + len(line) > limit:
            parts.append(current)
            current = ""
        current += line
    if current:
        parts.append(current)
    # a part that is only whitespace would be refused by Telegram
    return [p if p.strip() else "." for p in parts]


def _remove_spool(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
        path.parent.rmdir()


def _seconds(value: int | float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def retry_after_seconds(exc: RetryAfter) -> float:
    """`RetryAfter.retry_after` without PTB's int-or-timedelta deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = exc.retry_after
    return _seconds(value)


class TelegramChannel(Channel):
    name = "telegram"

    def __init__(
        self,
        options: TelegramOptions,
        store: TelegramStore,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.agent = options.agent
        self.store = store
        self._sleep = sleep
        self._clock = clock
        token = options.token.get_secret_value()
        kwargs: dict[str, Any] = {}
        if options.base_url:
            kwargs["base_url"] = options.base_url
        if options.base_file_url:
            kwargs["base_file_url"] = options.base_file_url
        self._requests = (
            HTTPXRequest(connection_pool_size=16, read_timeout=30.0),
            HTTPXRequest(connection_pool_size=2, read_timeout=float(options.poll_timeout + 15)),
        )
        self.bot = Bot(
            token, request=self._requests[0], get_updates_request=self._requests[1], **kwargs
        )
        self._on_message: InboundHandler | None = None
        self._poller: asyncio.Task[None] | None = None
        self._notices = OncePerWindow()
        self._helped = OncePerWindow()  # /start, /help
        self._started = False
        self._ready_lock = asyncio.Lock()

    def _redact(self, text: str) -> str:
        """A library message may quote a URL, and a Bot API URL carries the token (W6)."""
        return text.replace(self.options.token.get_secret_value(), "<token>")

    def _failed(self, reason: str) -> ChannelFailed:
        return ChannelFailed(self.name, self._redact(reason))

    def __repr__(self) -> str:  # never the token
        return f"TelegramChannel(agent={self.agent!r}, mode={self.options.mode!r})"

    # -- lifecycle -------------------------------------------------------------

    async def ready(self) -> None:
        """Initialise the bot once (getMe: its id and username)."""
        async with self._ready_lock:
            if not self._started:
                await self.bot.initialize()
                self._started = True

    async def start(self, on_message: InboundHandler) -> None:
        """Register with Telegram (setWebhook, or deleteWebhook then poll).

        A token Telegram refuses stops start-up (`ChannelFailed`); a Telegram
        that cannot be reached does not: registering is retried in the
        background, and the gateway serves its other channels meanwhile.
        """
        self._on_message = on_message
        if self._poller is not None:
            return
        registered = await self._register()
        self._poller = asyncio.create_task(self._run(registered), name=f"tg-{self.agent}")

    async def _register(self) -> bool:
        try:
            await self.ready()
            if self.options.mode == "webhook":
                assert self.options.webhook_url and self.options.secret_token
                await self.bot.set_webhook(
                    self.options.webhook_url,
                    secret_token=self.options.secret_token.get_secret_value(),
                    allowed_updates=list(_ALLOWED_UPDATES),
                )
                logger.info("telegram webhook set for agent %s", self.agent)
            else:
                await self.bot.delete_webhook()
                logger.info("telegram polling for agent %s", self.agent)
        except InvalidToken as exc:
            raise self._failed(
                f"Telegram refuses the bot token of agent {self.agent}: check its tokenEnv or "
                "tokenFile (the token BotFather gave)"
            ) from exc
        except (NetworkError, RetryAfter, TimedOut) as exc:
            logger.warning(
                "telegram not reachable for agent %s, retrying: %s",
                self.agent,
                self._redact(str(exc)),
            )
            return False
        return True

    async def _run(self, registered: bool) -> None:
        backoff = 1.0
        while not registered:
            await self._sleep(backoff)
            backoff = min(backoff * 2, 60.0)
            try:
                registered = await self._register()
            except ChannelFailed:
                logger.exception("telegram channel of agent %s stopped", self.agent)
                return
        if self.options.mode == "polling":
            await self._poll_forever()

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        if self._started:
            self._started = False
            with contextlib.suppress(TelegramError):
                await self.bot.shutdown()
        for request in self._requests:  # closed also when the bot never initialised
            await request.shutdown()

    # -- inbound ---------------------------------------------------------------

    def secret_matches(self, header: str | None) -> bool:
        """W2: the webhook's `X-Telegram-Bot-Api-Secret-Token`, compared in constant time."""
        expected = self.options.secret_token
        if expected is None or header is None:
            return False
        return hmac.compare_digest(
            header.encode("utf-8", "surrogatepass"), expected.get_secret_value().encode()
        )

    async def process_update(self, data: dict[str, Any]) -> None:
        """One webhook body, after the secret check; returns once it is stored (W3)."""
        await self.ready()
        update = Update.de_json(data, self.bot)
        await self._handle(update)

    async def _poll_forever(self) -> None:
        backoff = 1.0
        while True:
            try:
                await self.poll_once()
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except RetryAfter as exc:
                await self._sleep(min(retry_after_seconds(exc), MAX_RETRY_WAIT))
            except Exception:  # a poll that failed is logged and tried again, never fatal
                logger.exception("telegram polling failed for agent %s", self.agent)
                await self._sleep(backoff)
                backoff = min(backoff * 2, 60.0)

    async def poll_once(self, wait: int | None = None) -> int:
        """One getUpdates; each update stored before the cursor moves past it (W3)."""
        await self.ready()
        cursor = await asyncio.to_thread(self.store.channel_cursor, self.agent, self.name)
        updates = await self.bot.get_updates(
            offset=cursor,
            timeout=self.options.poll_timeout if wait is None else wait,
            allowed_updates=list(_ALLOWED_UPDATES),
        )
        for update in updates:
            await self._handle(update)
            await asyncio.to_thread(
                self.store.set_channel_cursor, self.agent, self.name, update.update_id + 1
            )
        return len(updates)

    async def _handle(self, update: Update) -> None:
        if self._started:
            message = normalize(self.agent, update, self.bot.id, self.bot.username)
        else:
            message = normalize(self.agent, update, None, None)
        if message is None:
            return
        chat = message.chat_id
        if await asyncio.to_thread(self.store.chat_blocked, self.agent, self.name, chat):
            await asyncio.to_thread(self.store.unblock_chat, self.agent, self.name, chat)
            logger.info("telegram chat %s writes again: unblocked", chat)
        if message.command in ("start", "help"):  # best effort, once per window, never waited on
            await self._notice(message.chat_id, HELP_TEXT, icon="", seen=self._helped)
            return
        assert self._on_message is not None, "start() the channel before updates arrive"
        try:
            await self._on_message(message)
        except Throttled as exc:
            await self._notice(message.chat_id, exc.public)
        except StoreError:
            raise  # not stored: not acknowledged either, so Telegram sends it again
        except CellgateError as exc:
            # the agent cannot take it (e.g. not installed): say so once, acknowledge it
            logger.warning("telegram update for agent %s not taken: %s", self.agent, exc)
            await self._notice(message.chat_id, exc.public or UNAVAILABLE_TEXT)

    async def _notice(
        self,
        chat_id: str,
        text: str,
        *,
        icon: str = "⏳ ",
        seen: OncePerWindow | None = None,
    ) -> None:
        """R4: tell a flooding chat once per window; the flood itself is not stored. `seen`:
        another window (the help text's: a chat where the bot may not post, or a `/help`
        flood, must never hold up the updates behind it)."""
        window = self._notices if seen is None else seen
        if not window.due(chat_id, self._clock(), self.options.notice_every):
            return
        # best effort and never waiting: a flood must not hold up the updates behind it
        with contextlib.suppress(TelegramError):
            await self.bot.send_message(int(chat_id), f"{icon}{text}")

    # -- outbound --------------------------------------------------------------

    async def typing(self, chat_id: str) -> None:
        with contextlib.suppress(TelegramError):
            await self.bot.send_chat_action(int(chat_id), "typing")

    async def send(self, message: OutboundMessage) -> DeliveryReceipt:
        await self.ready()
        chat = message.chat_id
        if await asyncio.to_thread(self.store.chat_blocked, self.agent, self.name, chat):
            raise ChatBlocked(self.name, chat, "the chat blocked the bot earlier")
        if message.kind is OutboundKind.REPLY:
            ref = message.reply_to or ""
            reply_to = int(ref) if ref.isdigit() else None
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
        platform_id = str(result.message_id) if isinstance(result, Message) else "ok"
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
        """One Bot API call: RetryAfter waited out, a block recorded, the rest translated."""
        for attempt in range(SEND_ATTEMPTS):
            try:
                return await post()
            except RetryAfter as exc:
                wait = min(retry_after_seconds(exc), MAX_RETRY_WAIT)
                logger.info("telegram asks to wait %.0f s (chat %s)", wait, chat)
                await self._sleep(wait)
            except Forbidden as exc:
                await asyncio.to_thread(
                    self.store.block_chat, self.agent, self.name, chat, self._redact(exc.message)
                )
                logger.info("telegram chat %s blocked the bot: recorded", chat)
                raise ChatBlocked(self.name, chat, self._redact(exc.message)) from exc
            except BadRequest as exc:
                raise self._failed(f"Telegram refused the request: {exc.message}") from exc
            except NetworkError as exc:
                if attempt == SEND_ATTEMPTS - 1:
                    raise self._failed(f"Telegram unreachable: {exc.message}") from exc
                await self._sleep(min(2.0**attempt, 30.0))
            except TelegramError as exc:
                raise self._failed(exc.message) from exc
        raise ChannelFailed(self.name, f"still rate limited after {SEND_ATTEMPTS} waits")

    async def _post_text(
        self, chat: str, key: str, text: str, reply_to: int | None
    ) -> DeliveryReceipt:
        first = ""
        for i, part in enumerate(split_text(text)):

            def post(part: str = part, i: int = i) -> Awaitable[Message]:
                return self.bot.send_message(
                    int(chat), part, reply_to_message_id=reply_to if i == 0 else None
                )

            sent = await self._once(key, i, chat, post)
            first = first or sent
        return DeliveryReceipt(platform_message_id=first)

    async def _react(self, message: OutboundMessage) -> DeliveryReceipt:
        target = message.target_message_id or ""
        if not target.isdigit():
            raise ChannelFailed(self.name, "react needs a numeric Telegram message id")
        await self._once(
            message.outbound_key,
            0,
            message.chat_id,
            lambda: self.bot.set_message_reaction(
                int(message.chat_id), int(target), reaction=[ReactionTypeEmoji(message.text)]
            ),
        )
        return DeliveryReceipt(platform_message_id=target)

    async def _edit(self, message: OutboundMessage) -> DeliveryReceipt:
        target = message.target_message_id or ""
        own = target.isdigit() and await asyncio.to_thread(
            self.store.bot_message_known, self.agent, self.name, message.chat_id, target
        )
        if not own:
            raise ChannelFailed(
                self.name, f"message {target} is not one this bot sent in this chat"
            )
        text = split_text(message.text)[0]
        await self._once(
            message.outbound_key,
            0,
            message.chat_id,
            lambda: self.bot.edit_message_text(text, int(message.chat_id), int(target)),
        )
        return DeliveryReceipt(platform_message_id=target)

    async def _send_file(self, message: OutboundMessage) -> DeliveryReceipt:
        assert message.file_path is not None
        path = Path(message.file_path)
        name = message.file_name or path.name
        caption = message.text[:CAPTION_LIMIT] or None
        chat = int(message.chat_id)

        async def post() -> Message:
            data = await asyncio.to_thread(path.read_bytes)
            if path.suffix.lower() in _PHOTO_SUFFIXES:
                return await self.bot.send_photo(chat, data, caption=caption, filename=name)
            return await self.bot.send_document(chat, data, caption=caption, filename=name)

        try:
            sent = await self._once(message.outbound_key, 0, message.chat_id, post)
        finally:
            # the spool copy belongs to the channel once handed over (bridge/tools.py)
            await asyncio.to_thread(_remove_spool, path)
        return DeliveryReceipt(platform_message_id=sent)

    # -- downloads (P3, W6) ----------------------------------------------------

    async def download(self, file_id: str) -> Downloaded:
        """Fetch a file by id through the gateway, size-capped; the token never leaves here."""
        cap = self.options.max_download_bytes
        await self.ready()
        try:
            file = await self.bot.get_file(file_id)
            if file.file_size is not None and file.file_size > cap:
                raise ChannelFailed(
                    self.name, f"the file is {file.file_size} bytes, over the cap of {cap}"
                )
            data = bytes(await file.download_as_bytearray())
        except TelegramError as exc:
            raise self._failed(f"download failed: {exc.message}") from exc
        if len(data) > cap:
            raise ChannelFailed(self.name, f"the file is over the cap of {cap} bytes")
        name = safe_file_name(file.file_path or "", file.file_unique_id)
        if "." not in name:
            guessed = mimetypes.guess_extension(getattr(file, "mime_type", "") or "") or ""
            name += guessed
        return Downloaded(name=name, data=data)
