"""The `telegram` MCP module: tools offered only to a Telegram-origin session (T1).

    telegram_reply                 P1    text into this chat, optional reply-to
    telegram_react                 P1    an emoji reaction on a message of this chat
    telegram_edit                  P1    edit a message the bot sent in this chat
    telegram_send_file             P5    a photo or document from the media directory
    telegram_download_attachment   P3 W6 a file delivered in this chat, into the media dir

The first four are the standard bridge tools (`BuiltinTools`) under the
module's names, so they obey the same rules (the chat is the socket's, P1; a
file must resolve inside the media directory, P5). A download accepts only a
file_id in this chat's ledger: a file_id is valid for the whole bot, so the
ledger is the only thing that binds it to a chat. The gateway fetches the
file (the token never reaches the sandbox), caps its size, and writes it into
the session's media directory without following anything the sandbox planted
there; the tool answers with the path inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from cellgate.errors import BridgeError, PolicyDenied
from channels.base import Channel, ChannelFailed
from channels.telegram import TelegramChannel
from orchestrator.bridge.tools import BuiltinTools, JSONObject, ToolCall, ToolHandlers

__all__ = ["TelegramTools", "write_new_media_file"]

MODULE = "telegram"
_NAME_TRIES = 100
_DOWNLOADS_KEPT = 4096  # (conversation, file_id) -> the name it was saved under
_CHAT = "omit: this conversation's chat (the only one allowed)"


def _schema(required: tuple[str, ...], **props: str) -> JSONObject:
    return {
        "type": "object",
        "properties": {
            name: {"type": ["string", "integer"] if name.endswith("_id") else "string",
                   "description": text}
            for name, text in props.items()
        },
        "required": list(required),
        "additionalProperties": False,
    }  # fmt: skip


def write_new_media_file(media_dir: Path, name: str, data: bytes) -> str:
    """Create a new file in `media_dir` (never replacing or following anything); its name.

    The directory is opened with `O_NOFOLLOW`; the file with `O_CREAT|O_EXCL|
    O_NOFOLLOW` relative to it, so a symlink, FIFO or file the sandbox put
    under that name is never written through: the next free name is used.
    The file is handed to the directory's owner (the sandbox user).
    """
    dfd = os.open(media_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.fstat(dfd)
        stem, dot, ext = name.rpartition(".")
        if not dot:
            stem, ext = name, ""
        for i in range(_NAME_TRIES):
            candidate = name if i == 0 else f"{stem}-{i}{dot}{ext}"
            try:
                fd = os.open(
                    candidate,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o644,
                    dir_fd=dfd,
                )
            except FileExistsError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # pragma: no cover - O_EXCL
                    raise BridgeError("download_failed", "could not create the file")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if os.geteuid() == 0:
                    os.fchown(fd, dst.st_uid, dst.st_gid)
            finally:
                os.close(fd)
            return candidate
    finally:
        os.close(dfd)
    raise BridgeError("download_failed", f"no free name for {name!r} in the media directory")


def _still_there(media_dir: Path, name: str, size: int) -> bool:
    """Is `name` in the media directory still a regular file of `size` bytes (no link)?"""
    with contextlib.suppress(OSError):
        st = os.lstat(media_dir / name)
        return stat.S_ISREG(st.st_mode) and st.st_size == size
    return False


class TelegramTools:
    """Registers the `telegram` module over the standard tools and the Telegram channels."""

    def __init__(self, builtin: BuiltinTools, channels: Mapping[tuple[str, str], Channel]) -> None:
        self.builtin = builtin
        self.channels = channels
        # W6: a file asked for again is not fetched and written again while its copy is
        # there, so repeating a call cannot fill the disk; only new files of the chat can
        self._saved: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()

    def install(self, handlers: ToolHandlers) -> ToolHandlers:
        reg = handlers.register
        reg(
            "telegram_reply",
            self.reply,
            module=MODULE,
            description="Send a text message into this Telegram chat (long text is split).",
            input_schema=_schema(
                ("text",), text="the message", reply_to="message id to reply to", chat_id=_CHAT
            ),
        )
        reg(
            "telegram_react",
            self.react,
            module=MODULE,
            description="React with one emoji to a message in this Telegram chat.",
            input_schema=_schema(
                ("emoji", "message_id"),
                emoji="one emoji Telegram allows as a reaction",
                message_id="the message to react to",
                chat_id=_CHAT,
            ),
        )
        reg(
            "telegram_edit",
            self.edit,
            module=MODULE,
            description="Edit a message the bot sent in this Telegram chat.",
            input_schema=_schema(
                ("message_id", "text"),
                message_id="the bot's message",
                text="the new text",
                chat_id=_CHAT,
            ),
        )
        reg(
            "telegram_send_file",
            self.send_file,
            module=MODULE,
            description="Send a file from the media directory into this chat "
            "(a photo for .jpg/.png/.webp, else a document).",
            input_schema=_schema(
                ("path",),
                path="a file in the media directory (absolute /workspace/media/... or "
                "relative to it)",
                caption="optional",
                chat_id=_CHAT,
            ),
        )
        reg(
            "telegram_download_attachment",
            self.download_attachment,
            module=MODULE,
            description="Download a file sent in this chat (by its file_id) into the media "
            "directory; returns its path.",
            input_schema=_schema(("file_id",), file_id="the file_id named in the message"),
        )
        return handlers

    @staticmethod
    def _telegram_only(call: ToolCall) -> None:
        """T1/P1: whatever the module policy says, these act only on a Telegram chat."""
        if call.scope.channel != MODULE:
            raise PolicyDenied(
                "T1", f"{call.tool} serves Telegram chats only; this conversation is not one"
            )

    async def reply(self, call: ToolCall) -> JSONObject:
        self._telegram_only(call)
        return await self.builtin.reply(call)

    async def react(self, call: ToolCall) -> JSONObject:
        self._telegram_only(call)
        return await self.builtin.react(call)

    async def edit(self, call: ToolCall) -> JSONObject:
        self._telegram_only(call)
        return await self.builtin.edit(call)

    async def send_file(self, call: ToolCall) -> JSONObject:
        self._telegram_only(call)
        return await self.builtin.send_file(call)

    async def download_attachment(self, call: ToolCall) -> JSONObject:
        self._telegram_only(call)
        file_id = call.required("file_id", limit=256)
        known = await asyncio.to_thread(
            self.builtin.store.attachment_known,
            call.scope.conversation_id,
            file_id,
            platform=MODULE,
        )
        if not known:
            raise PolicyDenied(
                "P3",
                "telegram_download_attachment accepts only a file_id delivered in this chat "
                "(one of its newest 200)",
            )
        media = call.scope.paths.media_dir
        key = (call.scope.conversation_id, file_id)
        saved = self._saved.get(key)
        if saved is not None and await asyncio.to_thread(_still_there, media, *saved):
            name, size = saved
            return {"path": f"{call.scope.media_dir_in_sandbox}/{name}", "name": name, "size": size}
        channel = self.channels.get((call.scope.key.agent, MODULE))
        if not isinstance(channel, TelegramChannel):
            raise BridgeError("delivery_failed", "the Telegram channel is not running")
        try:
            got = await channel.download(file_id)
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
