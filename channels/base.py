"""cellgate's own message models and the one channel contract.

Library objects (`telegram.Update`, `discord.Message`, LINE events) never leave
`channels/`; the rest of the code sees these frozen models.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

from cellgate.models import DeliveryReceipt, InboundMessage, OutboundMessage

InboundHandler = Callable[[InboundMessage], Awaitable[None]]


class Channel(abc.ABC):
    """start(handler) / stop / send: one contract per platform."""

    name: str

    @abc.abstractmethod
    async def start(self, on_message: InboundHandler) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def send(self, message: OutboundMessage) -> DeliveryReceipt: ...
