"""The `discord` MCP module: tools offered only to a Discord-origin session (T1).

    discord_reply                 P1 P2  text into this chat or a thread it opened
    discord_react                 P1 P2  an emoji reaction on a message there
    discord_edit                  P1 P2  edit a message the bot sent there
    discord_send_file             P5     a file from the media directory
    discord_create_thread         P1 P2  open a thread under this chat; it becomes the
                                         session's own (recorded in the store)
    discord_download_attachment   P4 W6  a Discord CDN file, into the media directory

P2: a Discord thread is its own chat. Where a call may post is decided by
`policies.chats.reply_target` on facts the gateway gathers: the chat the
socket serves, the threads this session opened (the store's `own_threads`,
durable across restarts) and, for a thread discord.py has seen, its parent
channel (so a thread under this session's own channel is refused by P2 with
a reason that says why). Nothing the sandbox sends changes those facts.

P4: a download names a URL; `channels.discord_cdn` fetches it only from
Discord's CDN (`policies.cdn`), and the bytes are written into the session's
media directory without following anything the sandbox planted there.
"""

from __future__ import annotations

import asyncio
import errno
from collections import OrderedDict
from collections.abc import Mapping

from cellgate.errors import BridgeError, PolicyDenied
from channels.base import Channel, ChannelFailed
from channels.discord import DiscordChannel
from orchestrator.bridge.catalogue import object_schema
from orchestrator.bridge.telegram_tools import _still_there, write_new_media_file
from orchestrator.bridge.tools import BuiltinTools, JSONObject, ToolCall, ToolHandlers
from orchestrator.store.threads import OWN_THREADS_MAX
from policies import chats

__all__ = ["DiscordTools"]

MODULE = "discord"
_DOWNLOADS_KEPT = 4096
_CHAT = "omit: this chat; or a thread this session opened with discord_create_thread"


class DiscordTools:
    """Registers the `discord` module over the standard tools and the Discord channels."""

    def __init__(self, builtin: BuiltinTools, channels: Mapping[tuple[str, str], Channel]) -> None:
        self.builtin = builtin
        self.channels = channels
        self._saved: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()

    def install(self, handlers: ToolHandlers) -> ToolHandlers:
        reg = handlers.register
        reg(
            "discord_reply",
            self.reply,
            module=MODULE,
            description="Send a text message into this Discord chat, or into a thread this "
            "session opened (long text is split at 2000 characters).",
            input_schema=object_schema(
                ("text",), text="the message", reply_to="message id to reply to", chat_id=_CHAT
            ),
        )
        reg(
            "discord_react",
            self.react,
            module=MODULE,
            description="React with one emoji to a message in this Discord chat.",
            input_schema=object_schema(
                ("emoji", "message_id"),
                emoji="a unicode emoji, or a custom one as name:id",
                message_id="the message to react to",
                chat_id=_CHAT,
            ),
        )
        reg(
            "discord_edit",
            self.edit,
            module=MODULE,
            description="Edit a message the bot sent in this Discord chat.",
            input_schema=object_schema(
                ("message_id", "text"),
                message_id="the bot's message",
                text="the new text",
                chat_id=_CHAT,
            ),
        )
        reg(
            "discord_send_file",
            self.send_file,
            module=MODULE,
            description="Send a file from the media directory into this Discord chat.",
            input_schema=object_schema(
                ("path",),
                path="a file in the media directory (absolute /workspace/media/... or "
                "relative to it)",
                caption="optional",
                chat_id=_CHAT,
            ),
        )
        reg(
            "discord_create_thread",
            self.create_thread,
            module=MODULE,
            description="Open a public thread under this Discord channel; this session may "
            "then post into it (pass its id as chat_id).",
            input_schema=object_schema(("name",), name="the thread's name (up to 100)"),
        )
        reg(
            "discord_download_attachment",
            self.download_attachment,
            module=MODULE,
            description="Download a Discord attachment (its https://cdn.discordapp.com/... "
            "URL) into the media directory; returns its path.",
            input_schema=object_schema(("url",), url="the attachment's Discord CDN URL"),
        )
        return handlers

    # -- facts -------------------------------------------------------------------

    @staticmethod
    def _discord_only(call: ToolCall) -> None:
        """T1/P1: whatever the module policy says, these act only on a Discord chat."""
        if call.scope.channel != MODULE:
            raise PolicyDenied(
                "T1", f"{call.tool} serves Discord chats only; this conversation is not one"
            )

    def _channel(self, call: ToolCall) -> DiscordChannel:
        channel = self.channels.get((call.scope.key.agent, MODULE))
        if not isinstance(channel, DiscordChannel):
            raise BridgeError("delivery_failed", "the Discord channel is not running")
        return channel

    async def _own_threads(self, call: ToolCall) -> frozenset[str]:
        stored = await asyncio.to_thread(self.builtin.store.own_threads, call.scope.session_id)
        return stored | frozenset(call.state.own_threads)

    async def _allow_target(self, call: ToolCall) -> None:
        """P1/P2: refuse any chat but this one and the threads this session opened."""
        self._discord_only(call)
        target = call.text("chat_id", required=False, limit=4096)
        own = await self._own_threads(call)
        parent = self._channel(call).parent_of(target) if target else None
        decision = chats.reply_target(
            call.scope.origin_chat_id,
            target,
            tool=call.tool,
            own_threads=own,
            target_parent_channel=parent,
        )
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)
        call.state.own_threads.update(own)  # the standard tool's own check agrees

    # -- tools -------------------------------------------------------------------

    async def reply(self, call: ToolCall) -> JSONObject:
        await self._allow_target(call)
        return await self.builtin.reply(call)

    async def react(self, call: ToolCall) -> JSONObject:
        await self._allow_target(call)
        return await self.builtin.react(call)

    async def edit(self, call: ToolCall) -> JSONObject:
        await self._allow_target(call)
        return await self.builtin.edit(call)

    async def send_file(self, call: ToolCall) -> JSONObject:
        await self._allow_target(call)
        return await self.builtin.send_file(call)

    async def create_thread(self, call: ToolCall) -> JSONObject:
        self._discord_only(call)
        origin = call.scope.origin_chat_id
        decision = chats.reply_target(origin, None, tool=call.tool)
        if not decision or not origin:
            raise PolicyDenied(decision.rule, decision.reason)
        name = call.required("name", limit=100)
        session = call.scope.session_id
        count = await asyncio.to_thread(self.builtin.store.own_thread_count, session)
        if count >= OWN_THREADS_MAX:
            raise PolicyDenied(
                "P2", f"this session already opened {count} threads (at most {OWN_THREADS_MAX})"
            )
        channel = self._channel(call)
        try:
            thread = await channel.create_thread(origin, name, call.outbound_key())
        except ChannelFailed as exc:
            raise BridgeError("delivery_failed", exc.reason) from exc
        await asyncio.to_thread(
            self.builtin.store.record_own_thread,
            session,
            thread,
            conversation=call.scope.conversation_id,
            parent_chat_id=origin,
        )
        call.state.own_threads.add(thread)
        return {"thread_id": thread, "chat_id": thread, "parent": origin}

    async def download_attachment(self, call: ToolCall) -> JSONObject:
        self._discord_only(call)
        url = call.required("url", limit=4096)
        media = call.scope.paths.media_dir
        key = (call.scope.conversation_id, url)
        saved = self._saved.get(key)
        if saved is not None and await asyncio.to_thread(_still_there, media, *saved):
            name, size = saved
            return {"path": f"{call.scope.media_dir_in_sandbox}/{name}", "name": name, "size": size}
        channel = self._channel(call)
        try:
            got = await channel.download(url)  # PolicyDenied (P4) passes through, recorded
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
