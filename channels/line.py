"""LINE, on line-bot-sdk 3.x (W1-W6).

    channel = LineChannel(LineOptions(agent="bot", channel_secret=..., access_token=...), store)
    await channel.start(on_message)
    channel.signature_valid(raw_body, header)     # the webhook route, before parsing (W2)
    await channel.process_body(raw_body, header)  # returns once every event is stored (W3)
    await channel.send(OutboundMessage(...))

Inbound (W2, W3, W5): the only proof that a webhook is LINE's is
`X-Line-Signature`, the base64 HMAC-SHA256 of the exact raw body under the
channel secret; it is checked on the bytes as received, in constant time,
before anything is parsed. Events are normalised by `line_inbound.normalize`
(one conversation per user, group or room; the message id is the event's
`webhookEventId`, so a redelivery is stored once).

Outbound (W4): text is split at 5000 characters, at most 5 messages per API
call. The first call of a delivery uses the chat's newest reply token while
it is fresh (a token works once; it is taken before the call); an expired or
refused token falls back to push. A push carries `X-Line-Retry-Key`, a UUID
derived from the outbound key and the call's number, so a retry after a
crash or a lost answer is the same request to LINE: it answers 409 and posts
nothing again. Each call is recorded in the store right after LINE accepts
it, and skipped when a retry finds it recorded. 429 and 5xx are waited out
and retried under the same key.

Downloads (W6): content by message id from the content API, streamed with a
size cap (the SDK's blob client reads a whole body into memory). The access
token and the channel secret stay on the gateway: never logged, never in a
URL the sandbox sees.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import mimetypes
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from linebot.v3 import WebhookParser
from linebot.v3.exceptions import InvalidSignatureError
from linebot.v3.messaging import (
    ApiException,
    AsyncApiClient,
    AsyncMessagingApi,
    Configuration,
    ImageMessage,
    PushMessageRequest,
    ReplyMessageRequest,
    ShowLoadingAnimationRequest,
    TextMessage,
)
from pydantic import SecretStr

from cellgate.errors import CellgateError, StoreError
from cellgate.models import DeliveryReceipt, OutboundKind, OutboundMessage
from channels.base import Channel, ChannelFailed, InboundHandler, PostedParts
from channels.line_inbound import normalize
from channels.notices import OncePerWindow
from channels.telegram import split_text

__all__ = [
    "LINE_BATCH",
    "LINE_TEXT_LIMIT",
    "LineChannel",
    "LineOptions",
    "LineStore",
    "batches",
    "retry_key",
    "signature_of",
]

logger = logging.getLogger(__name__)

LINE_TEXT_LIMIT = 5000
LINE_BATCH = 5  # messages per reply or push call
SEND_ATTEMPTS = 5
MAX_RETRY_WAIT = 60.0
_TOKENS_KEPT = 4096
_MESSAGE_ID = re.compile(r"^[0-9]{1,32}$")
_RETRY_NAMESPACE = uuid.UUID("6f1c52a4-4a8e-4b9e-9a55-3c0b5e1f0a11")
_IMAGE_KEY_LABEL = b"cellgate line image urls v1"


LineStore = PostedParts  # the store as the channel uses it (W4)


@dataclass(frozen=True, slots=True)
class LineOptions:
    agent: str
    channel_secret: SecretStr
    access_token: SecretStr
    api_base_url: str = "https://api.line.me"
    data_api_base_url: str = "https://api-data.line.me"
    public_url: str | None = None
    max_download_bytes: int = 20 * 1024 * 1024
    image_url_seconds: int = 86400
    reply_token_seconds: float = 50.0
    notice_every: float = 60.0  # one "too many messages" notice per chat per this many seconds


@dataclass(frozen=True, slots=True)
class Downloaded:
    name: str
    data: bytes


def signature_of(secret: str, raw: bytes) -> str:
    """What LINE sends as `X-Line-Signature`: base64(HMAC-SHA256(secret, raw body))."""
    return base64.b64encode(hmac.new(secret.encode(), raw, hashlib.sha256).digest()).decode()


def retry_key(agent: str, outbound_key: str, part: int) -> str:
    """W4: the `X-Line-Retry-Key` of one push, the same on every retry and after a crash."""
    return str(uuid.uuid5(_RETRY_NAMESPACE, f"{agent}\0{outbound_key}\0{part}"))


def batches(items: list[Any], size: int = LINE_BATCH) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class LineChannel(Channel):
    name = "line"

    def __init__(
        self,
        options: LineOptions,
        store: LineStore,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.options = options
        self.agent = options.agent
        self.store = store
        self._sleep = sleep
        self._clock = clock
        self._wall = wall
        self._parser = WebhookParser(options.channel_secret.get_secret_value())
        self._client: AsyncApiClient | None = None
        self._api: AsyncMessagingApi | None = None
        self._on_message: InboundHandler | None = None
        self._tokens: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._notices = OncePerWindow(_TOKENS_KEPT)
        self._image_key = hmac.new(
            options.channel_secret.get_secret_value().encode(), _IMAGE_KEY_LABEL, hashlib.sha256
        ).digest()

    def __repr__(self) -> str:  # never a secret
        return f"LineChannel(agent={self.agent!r})"

    # -- lifecycle -------------------------------------------------------------

    def _messaging(self) -> AsyncMessagingApi:
        if self._api is None:  # aiohttp wants a running loop: made on first use
            config = Configuration(
                host=self.options.api_base_url.rstrip("/"),
                access_token=self.options.access_token.get_secret_value(),
            )
            self._client = AsyncApiClient(config)
            self._api = AsyncMessagingApi(self._client)
        return self._api

    async def start(self, on_message: InboundHandler) -> None:
        """Ready to take webhooks; LINE is configured with the webhook URL in its console."""
        self._on_message = on_message
        self._messaging()
        logger.info("line channel ready for agent %s", self.agent)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
        self._client = None
        self._api = None

    # -- inbound (W2, W3, W5) ------------------------------------------------

    def signature_valid(self, raw: bytes, header: str | None) -> bool:
        """W2: `X-Line-Signature` over these exact bytes, compared in constant time."""
        if not header:
            return False
        expected = signature_of(self.options.channel_secret.get_secret_value(), raw)
        return hmac.compare_digest(header.encode("utf-8", "surrogatepass"), expected.encode())

    async def process_body(self, raw: bytes, signature: str) -> int:
        """Every event of one webhook body, after the signature check; stored before return (W3).

        Raises `ValueError` for a body that is not a LINE webhook.
        """
        if not self.signature_valid(raw, signature):
            raise ChannelFailed(self.name, "the webhook signature does not match")
        try:
            events = self._parser.parse(raw.decode("utf-8"), signature)
        except InvalidSignatureError as exc:  # pragma: no cover - checked just above
            raise ChannelFailed(self.name, "the webhook signature does not match") from exc
        except (KeyError, TypeError) as exc:
            raise ValueError("the body is not a LINE webhook") from exc
        taken = 0
        for event in events:
            message = normalize(self.agent, event)
            if message is None:
                continue
            token = getattr(event, "reply_token", None)
            if isinstance(token, str) and token:
                self._remember_token(message.chat_id, token)
            await self._take(message, token)
            taken += 1
        return taken

    async def _take(self, message: Any, token: str | None) -> None:
        assert self._on_message is not None, "start() the channel before webhooks arrive"
        try:
            await self._on_message(message)
        except StoreError:
            raise  # not stored: not acknowledged either, so LINE may send it again
        except CellgateError as exc:
            # throttled or not taken: said with the event's own reply token (free), once
            # per chat per window (R4), never by push
            logger.info("line event for agent %s not taken: %s", self.agent, exc)
            if token and exc.public and self._notice_due(message.chat_id):
                self._tokens.pop(message.chat_id, None)
                with contextlib.suppress(ApiException, aiohttp.ClientError, TimeoutError):
                    await self._messaging().reply_message(
                        ReplyMessageRequest(
                            reply_token=token, messages=[TextMessage(text=f"⏳ {exc.public}")]
                        )
                    )

    def _notice_due(self, chat_id: str) -> bool:
        return self._notices.due(chat_id, self._clock(), self.options.notice_every)

    def _remember_token(self, chat_id: str, token: str) -> None:
        self._tokens[chat_id] = (token, self._clock())
        self._tokens.move_to_end(chat_id)
        while len(self._tokens) > _TOKENS_KEPT:
            self._tokens.popitem(last=False)

    def _take_token(self, chat_id: str) -> str | None:
        """The chat's newest reply token if it is still fresh; a token is used once."""
        got = self._tokens.pop(chat_id, None)
        if got is None:
            return None
        token, at = got
        if self._clock() - at > self.options.reply_token_seconds:
            return None
        return token

    # -- outbound (W4) ---------------------------------------------------------

    async def typing(self, chat_id: str) -> None:
        """LINE's loading animation; it exists for one-to-one chats only."""
        if not chat_id.startswith("U"):
            return
        with contextlib.suppress(ApiException, aiohttp.ClientError, TimeoutError):
            await self._messaging().show_loading_animation(
                ShowLoadingAnimationRequest(chat_id=chat_id, loading_seconds=20)
            )

    def _messages(self, message: OutboundMessage) -> list[Any]:
        if message.kind is OutboundKind.REPLY:
            return [TextMessage(text=p) for p in split_text(message.text, LINE_TEXT_LIMIT)]
        url = message.extra.get("image_url")
        if message.kind is OutboundKind.FILE and url:
            out: list[Any] = [ImageMessage(original_content_url=url, preview_image_url=url)]
            if message.text:
                out += [TextMessage(text=p) for p in split_text(message.text, LINE_TEXT_LIMIT)]
            return out
        if message.kind is OutboundKind.FILE:
            raise ChannelFailed(
                self.name, "LINE takes no uploaded files; send a .jpg or .png with line_image"
            )
        raise ChannelFailed(self.name, f"LINE has no {message.kind.value} for a bot's message")

    async def send(self, message: OutboundMessage) -> DeliveryReceipt:
        first = ""
        for part, batch in enumerate(batches(self._messages(message))):
            sent = await self._deliver(message.chat_id, message.outbound_key, part, batch)
            first = first or sent
        return DeliveryReceipt(platform_message_id=first)

    async def _deliver(self, chat: str, key: str, part: int, batch: list[Any]) -> str:
        """One API call of up to 5 messages, once: reply while a token is fresh, else push."""
        known = await asyncio.to_thread(self.store.posted_part, key, part)
        if known is not None:
            return known
        sent: str | None = None
        token = self._take_token(chat)
        if token is not None:
            sent = await self._reply(token, batch)
        if sent is None:
            sent = await self._push(chat, retry_key(self.agent, key, part), batch)
        await asyncio.to_thread(
            self.store.record_posted_part,
            key,
            part,
            agent=self.agent,
            channel=self.name,
            chat_id=chat,
            platform_message_id=sent,
        )
        return sent

    @staticmethod
    def _sent_id(result: Any, fallback: str) -> str:
        for m in getattr(result, "sent_messages", None) or []:
            if getattr(m, "id", None):
                return str(m.id)
        return fallback

    async def _reply(self, token: str, batch: list[Any]) -> str | None:
        """Reply with a token; None when LINE refuses the token (expired, used): push instead."""
        api = self._messaging()
        for attempt in range(SEND_ATTEMPTS):
            try:
                result = await api.reply_message(
                    ReplyMessageRequest(reply_token=token, messages=batch)
                )
                return self._sent_id(result, "reply")
            except ApiException as exc:
                if exc.status == 429 and attempt < SEND_ATTEMPTS - 1:
                    await self._sleep(min(2.0**attempt, MAX_RETRY_WAIT))
                    continue
                if exc.status in (400, 429) or exc.status >= 500:
                    logger.info("line reply token refused (%s): pushing instead", exc.status)
                    return None
                raise self._failed(exc) from exc
            except (aiohttp.ClientError, TimeoutError):
                logger.info("line reply failed in transit: pushing instead")
                return None
        return None  # pragma: no cover - the loop returns or raises

    async def _push(self, chat: str, key: str, batch: list[Any]) -> str:
        """Push under `X-Line-Retry-Key`: a 409 means LINE accepted this very request before."""
        api = self._messaging()
        for attempt in range(SEND_ATTEMPTS):
            try:
                result = await api.push_message(
                    PushMessageRequest(to=chat, messages=batch), x_line_retry_key=key
                )
                return self._sent_id(result, f"push:{key}")
            except ApiException as exc:
                if exc.status == 409:
                    logger.info("line push %s was accepted before: not posted again", key)
                    return f"push:{key}"
                if (exc.status == 429 or exc.status >= 500) and attempt < SEND_ATTEMPTS - 1:
                    await self._sleep(min(2.0**attempt, MAX_RETRY_WAIT))
                    continue
                raise self._failed(exc) from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                if attempt == SEND_ATTEMPTS - 1:
                    raise ChannelFailed(self.name, f"LINE unreachable: {exc}") from exc
                await self._sleep(min(2.0**attempt, MAX_RETRY_WAIT))
        raise ChannelFailed(self.name, f"LINE still refuses after {SEND_ATTEMPTS} tries")

    def _failed(self, exc: ApiException) -> ChannelFailed:
        body = str(exc.body or "")[:300].replace(self.options.access_token.get_secret_value(), "")
        return ChannelFailed(self.name, f"LINE answered {exc.status}: {body}")

    # -- images (P5) -------------------------------------------------------------

    def _image_sig(self, share_id: str, expires: int) -> str:
        raw = hmac.new(
            self._image_key, f"{self.agent}\0{share_id}\0{expires}".encode(), hashlib.sha256
        ).digest()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def image_url(self, share_id: str) -> str:
        """The public URL LINE fetches a `line_image` from; it expires (`imageUrlSeconds`)."""
        if not self.options.public_url:
            raise ChannelFailed(
                self.name,
                f"line_image needs agents[{self.agent}].channels.line.publicUrl (this "
                "gateway's public HTTPS address) so LINE can fetch the picture",
            )
        expires = int(self._wall()) + self.options.image_url_seconds
        base = self.options.public_url.rstrip("/")
        sig = self._image_sig(share_id, expires)
        return f"{base}/v1/line/{self.agent}/images/{share_id}/{expires}/{sig}"

    def image_url_valid(self, share_id: str, expires: int, sig: str) -> bool:
        """Was this URL made by this channel (constant time)? Expiry is the caller's check."""
        expected = self._image_sig(share_id, expires)
        return hmac.compare_digest(sig.encode("utf-8", "surrogatepass"), expected.encode())

    # -- downloads (W6) ----------------------------------------------------------

    async def download(self, message_id: str) -> Downloaded:
        """The content of a message by its id, through the gateway, size-capped."""
        if not _MESSAGE_ID.fullmatch(message_id):
            raise ChannelFailed(self.name, "a LINE message id is digits only")
        cap = self.options.max_download_bytes
        url = f"{self.options.data_api_base_url.rstrip('/')}/v2/bot/message/{message_id}/content"
        headers = {"Authorization": f"Bearer {self.options.access_token.get_secret_value()}"}
        chunks: list[bytes] = []
        size = 0
        try:
            async with (
                httpx.AsyncClient(timeout=60.0, follow_redirects=False) as client,
                client.stream("GET", url, headers=headers) as r,
            ):
                if r.status_code == 202:
                    raise ChannelFailed(self.name, "LINE is still preparing this content; retry")
                if r.status_code != 200:
                    raise ChannelFailed(self.name, f"LINE answered {r.status_code} for content")
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > cap:
                    raise ChannelFailed(
                        self.name, f"the content is {declared} bytes, over the cap of {cap}"
                    )
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
                    if size > cap:
                        raise ChannelFailed(
                            self.name, f"the content is over the cap of {cap} bytes"
                        )
                    chunks.append(chunk)
                mime = r.headers.get("content-type", "").split(";")[0].strip()
        except httpx.HTTPError as exc:
            raise ChannelFailed(self.name, f"download failed: {type(exc).__name__}") from exc
        ext = mimetypes.guess_extension(mime) or "" if mime else ""
        return Downloaded(name=f"line-{message_id}{ext}", data=b"".join(chunks))
