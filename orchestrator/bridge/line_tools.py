"""The `line` MCP module: tools offered only to a LINE-origin session (T1).

    line_reply              P1     text into this chat (split at 5000, 5 per call)
    line_image              P1 P5  a JPEG or PNG of the media directory, as a picture
    line_download_content   W6     a message's content by id, into the media directory

`line_reply` is the standard `reply` under the module's name: the chat is the
socket's (P1). LINE takes a picture only as a public HTTPS URL, so
`line_image` opens the file safely inside the session's media directory
(P5: a symlink, `..`, a path outside, a FIFO or a swap is refused), checks it
is a JPEG or PNG of at most 10 MB, records a share owned by this session (the
session may revoke it, P6) and sends LINE an image message whose URL is
signed by the channel and expires (`imageUrlSeconds`); the gateway serves it
only while the session is live (`orchestrator.api.line`). A download accepts
only a message id delivered in this chat (the ledger binds it to the chat;
an id is valid for the whole channel); the gateway fetches it with the
access token, caps its size and writes it into the media directory without
following anything the sandbox planted there.
"""

from __future__ import annotations

import asyncio
import errno
from collections import OrderedDict
from collections.abc import Mapping

from cellgate.errors import BridgeError, CellgateError, NotFound, PolicyDenied
from cellgate.models import OutboundKind, OutboundMessage
from channels.base import Channel, ChannelFailed
from channels.line import LineChannel
from orchestrator.bridge import safefiles
from orchestrator.bridge.catalogue import object_schema
from orchestrator.bridge.telegram_tools import _still_there, write_new_media_file
from orchestrator.bridge.tools import BuiltinTools, JSONObject, ToolCall, ToolHandlers
from policies import chats

__all__ = ["MAX_IMAGE_BYTES", "LineTools"]

MODULE = "line"
MAX_IMAGE_BYTES = 10 * 1024 * 1024  # LINE's limit for an image message's original
_DOWNLOADS_KEPT = 4096
_CHAT = "omit: this conversation's chat (the only one allowed)"
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"))


class LineTools:
    """Registers the `line` module over the standard tools and the LINE channels."""

    def __init__(self, builtin: BuiltinTools, channels: Mapping[tuple[str, str], Channel]) -> None:
        self.builtin = builtin
        self.channels = channels
        self._saved: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()

    def install(self, handlers: ToolHandlers) -> ToolHandlers:
        reg = handlers.register
        reg(
            "line_reply",
            self.reply,
            module=MODULE,
            description="Send a text message into this LINE chat (long text is split).",
            input_schema=object_schema(("text",), text="the message", chat_id=_CHAT),
        )
        reg(
            "line_image",
            self.image,
            module=MODULE,
            description="Send a JPEG or PNG from the media directory into this LINE chat as a "
            "picture (published by a link that expires).",
            input_schema=object_schema(
                ("path",),
                path="a .jpg or .png in the media directory (absolute /workspace/media/... or "
                "relative to it)",
                caption="optional text sent after the picture",
                chat_id=_CHAT,
            ),
        )
        reg(
            "line_download_content",
            self.download_content,
            module=MODULE,
            description="Download an image, video, audio or file sent in this chat (by its "
            "message_id) into the media directory; returns its path.",
            input_schema=object_schema(
                ("message_id",), message_id="the message_id named in the message"
            ),
        )
        return handlers

    @staticmethod
    def _line_only(call: ToolCall) -> None:
        """T1/P1: whatever the module policy says, these act only on a LINE chat."""
        if call.scope.channel != MODULE:
            raise PolicyDenied(
                "T1", f"{call.tool} serves LINE chats only; this conversation is not one"
            )

    def _channel(self, call: ToolCall) -> LineChannel:
        channel = self.channels.get((call.scope.key.agent, MODULE))
        if not isinstance(channel, LineChannel):
            raise BridgeError("delivery_failed", "the LINE channel is not running")
        return channel

    async def reply(self, call: ToolCall) -> JSONObject:
        self._line_only(call)
        return await self.builtin.reply(call)

    def _checked_image(self, call: ToolCall) -> tuple[str, int]:
        """P5: a regular file inside the media directory, a JPEG or PNG, at most 10 MB."""
        with safefiles.open_media_file(
            call.scope.paths.media_dir,
            call.required("path", limit=4096),
            call.scope.media_dir_in_sandbox,
            max_size=MAX_IMAGE_BYTES,
        ) as f:
            if f.size > MAX_IMAGE_BYTES:
                raise PolicyDenied(
                    "P5", f"{f.rel!r} is {f.size} bytes; LINE takes pictures up to 10 MB"
                )
            head = f.pread(8, 0)
            if not any(head.startswith(magic) for magic, _ in _MAGIC):
                raise BridgeError("bad_request", f"{f.rel!r} is not a JPEG or PNG picture")
            return f.rel, f.size

    async def image(self, call: ToolCall) -> JSONObject:
        self._line_only(call)
        target = call.text("chat_id", required=False, limit=4096)
        decision = chats.reply_target(call.scope.origin_chat_id, target, tool=call.tool)
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)
        chat = target or call.scope.origin_chat_id
        assert chat
        caption = call.text("caption", required=False) or ""
        channel = self._channel(call)
        rel, size = await asyncio.to_thread(self._checked_image, call)
        try:
            share, _token = await asyncio.to_thread(
                self.builtin.store.create_share, call.scope.session_id, rel
            )
        except NotFound as exc:
            raise BridgeError(
                "no_session", "this session is not recorded by the gateway; pictures need one"
            ) from exc
        try:
            url = channel.image_url(share.id)
        except ChannelFailed as exc:
            raise BridgeError("delivery_failed", exc.reason) from exc
        message = OutboundMessage(
            channel=MODULE,
            chat_id=chat,
            outbound_key=call.outbound_key(),
            kind=OutboundKind.FILE,
            text=caption,
            extra={"image_url": url},
        )
        try:
            receipt = await self.builtin.outbox.deliver(call.scope, message)
        except CellgateError as exc:
            if isinstance(exc, BridgeError | PolicyDenied):
                raise
            raise BridgeError("delivery_failed", str(exc)) from exc
        return {
            "message_id": receipt.platform_message_id,
            "chat_id": chat,
            "share_id": share.id,
            "path": rel,
            "size": size,
        }

    async def download_content(self, call: ToolCall) -> JSONObject:
        self._line_only(call)
        message_id = call.required("message_id", limit=64)
        known = await asyncio.to_thread(
            self.builtin.store.attachment_known,
            call.scope.conversation_id,
            message_id,
            platform=MODULE,
        )
        if not known:
            raise PolicyDenied(
                "W6",
                "line_download_content accepts only a message_id delivered in this chat "
                "(one of its newest 200)",
            )
        media = call.scope.paths.media_dir
        key = (call.scope.conversation_id, message_id)
        saved = self._saved.get(key)
        if saved is not None and await asyncio.to_thread(_still_there, media, *saved):
            name, size = saved
            return {"path": f"{call.scope.media_dir_in_sandbox}/{name}", "name": name, "size": size}
        channel = self._channel(call)
        try:
            got = await channel.download(message_id)
        except ChannelFailed as exc:
            raise BridgeError("download_failed", exc.reason) from exc
        try:
            name = await asyncio.to_thread(write_new_media_file, media, got.name, got.data)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise BridgeError("download_failed", "the media directory is not usable") from exc
            raise BridgeError("download_failed", f"could not save: {exc.strerror}") from exc
        self._saved[key] = (name, len(got.data))
        self._saved.move_to_end(key)
        while len(self._saved) > _DOWNLOADS_KEPT:
            self._saved.popitem(last=False)
        return {
            "path": f"{call.scope.media_dir_in_sandbox}/{name}",
            "name": name,
            "size": len(got.data),
        }
