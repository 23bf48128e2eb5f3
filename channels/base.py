"""cellgate's own message models and the one channel contract.

Library objects (`telegram.Update`, `discord.Message`, LINE events) never leave
`channels/`; the rest of the code sees these frozen models.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Protocol

from cellgate.errors import CellgateError
from cellgate.models import DeliveryReceipt, InboundMessage, OutboundMessage

InboundHandler = Callable[[InboundMessage], Awaitable[None]]


class PostedParts(Protocol):
    """The store's ledger of posted parts (W4): a reply part is posted once, ever."""

    def posted_part(self, outbound_key: str, part: int) -> str | None: ...

    def record_posted_part(
        self,
        outbound_key: str,
        part: int,
        *,
        agent: str,
        channel: str,
        chat_id: str,
        platform_message_id: str,
    ) -> None: ...


class ChannelStore(PostedParts, Protocol):
    """The ledger, the bot's own messages and blocked chats, as a channel uses them (W4)."""

    def bot_message_known(
        self, agent: str, channel: str, chat_id: str, platform_message_id: str
    ) -> bool: ...

    def block_chat(self, agent: str, channel: str, chat_id: str, reason: str) -> None: ...

    def unblock_chat(self, agent: str, channel: str, chat_id: str) -> bool: ...

    def chat_blocked(self, agent: str, channel: str, chat_id: str) -> bool: ...


class ChatBlocked(CellgateError):
    """The platform refuses to deliver into this chat (the user blocked the bot, W4).

    Recorded in the store; a delivery into a blocked chat is not retried.
    """

    def __init__(self, channel: str, chat_id: str, reason: str) -> None:
        self.channel = channel
        self.chat_id = chat_id
        self.reason = reason
        super().__init__(f"{channel} chat {chat_id} does not accept messages: {reason}")


class ChannelFailed(CellgateError):
    """The platform refused or failed a delivery or download (not a block, not a rate limit)."""

    def __init__(self, channel: str, reason: str) -> None:
        self.channel = channel
        self.reason = reason
        super().__init__(f"{channel}: {reason}")


class Channel(abc.ABC):
    """start(handler) / stop / send: one contract per platform, for one agent."""

    name: str
    agent: str

    @abc.abstractmethod
    async def start(self, on_message: InboundHandler) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def send(self, message: OutboundMessage) -> DeliveryReceipt: ...

    async def typing(self, chat_id: str) -> None:  # noqa: B027 - optional hook
        """Show that a turn is running in this chat (W4); a platform without it does nothing."""
