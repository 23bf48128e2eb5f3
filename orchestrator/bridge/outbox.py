"""Where allowed reply, react, edit, file and narrate calls go: one small contract.

`Outbox.deliver(scope, message)` sends one `OutboundMessage` into the scope's
chat and returns the platform's receipt. The message's `outbound_key` is
derived from the call (`outbound_key`), so a retried call delivers once.

- `ChannelOutbox`: hands each message to the `Channel` of its agent and channel name.
- `PendingOutbox`: keeps messages per conversation until the gateway takes
  them, e.g. to return them with an HTTP API turn (the `api` channel).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

from cellgate.errors import BridgeError
from cellgate.models import DeliveryReceipt, OutboundMessage
from channels.base import Channel
from orchestrator.bridge.scope import BridgeScope

__all__ = ["ChannelOutbox", "Outbox", "PendingOutbox", "outbound_key"]

_SEEN_MAX = 4096


class Outbox(Protocol):
    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt: ...


def outbound_key(scope: BridgeScope, call_id: str, tool: str, args: Mapping[str, Any]) -> str:
    """`bridge:<hash>` over conversation, session, call id, tool and arguments.

    The same call sent again (a client retry) gets the same key; a different
    call that reuses an id does not, because its arguments differ.
    """
    doc = [scope.conversation_id, scope.session_id, call_id, tool, args]
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "bridge:" + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class _Seen:
    """The receipts of the last few thousand outbound keys: a retry gets the first receipt."""

    def __init__(self, size: int = _SEEN_MAX) -> None:
        self._size = size
        self._items: OrderedDict[str, DeliveryReceipt] = OrderedDict()

    def get(self, key: str) -> DeliveryReceipt | None:
        return self._items.get(key)

    def put(self, key: str, receipt: DeliveryReceipt) -> None:
        self._items[key] = receipt
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)


class ChannelOutbox:
    """Routes a message to the channel it names; a retried outbound key is sent once."""

    def __init__(self, channels: Mapping[tuple[str, str], Channel]) -> None:
        self._channels = channels  # keyed by (agent, channel)
        self._seen = _Seen()

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        known = self._seen.get(message.outbound_key)
        if known is not None:
            return known
        channel = self._channels.get((scope.key.agent, message.channel))
        if channel is None:
            raise BridgeError(
                "delivery_failed", f"channel {message.channel!r} is not running on this gateway"
            )
        receipt = await channel.send(message)
        self._seen.put(message.outbound_key, receipt)
        return receipt


class PendingOutbox:
    """Keeps delivered messages per conversation until `take`; an outbound key is kept once."""

    def __init__(self) -> None:
        self._pending: dict[str, list[OutboundMessage]] = {}
        self._seen = _Seen()

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        known = self._seen.get(message.outbound_key)
        if known is not None:
            return known
        receipt = DeliveryReceipt(platform_message_id=message.outbound_key)
        self._pending.setdefault(scope.conversation_id, []).append(message)
        self._seen.put(message.outbound_key, receipt)
        return receipt

    def take(self, conversation_id: str) -> list[OutboundMessage]:
        """The messages delivered into this conversation since the last take, oldest first."""
        return self._pending.pop(conversation_id, [])
