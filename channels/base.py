"""cellgate's own message models and the one channel contract.

Library objects (`telegram.Update`, `discord.Message`, LINE events) never leave
`channels/`; the rest of the code sees these frozen models.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class Attachment:
    kind: str  # "photo", "document", "audio", ...
    ref: str  # platform file id or URL
    name: str = ""
    size: int | None = None


@dataclass(frozen=True, slots=True)
class InboundMessage:
    agent: str
    channel: str
    chat_id: str
    message_id: str
    text: str
    sender: str = ""
    thread_id: str | None = None
    attachments: tuple[Attachment, ...] = ()


class OutboundKind(StrEnum):
    REPLY = "reply"
    REACT = "react"
    EDIT = "edit"
    FILE = "file"


@dataclass(frozen=True, slots=True)
class OutboundMessage:
    """Something the gateway delivers into one chat, keyed for idempotency."""

    channel: str
    chat_id: str
    outbound_key: str
    kind: OutboundKind = OutboundKind.REPLY
    text: str = ""
    thread_id: str | None = None
    reply_to: str | None = None
    target_message_id: str | None = None
    file_path: str | None = None
    file_name: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeliveryReceipt:
    platform_message_id: str


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
