"""Where allowed reply, react, edit, file and narrate calls go: one small contract.

`Outbox.deliver(scope, message)` sends one `OutboundMessage` into the scope's
chat and returns the platform's receipt. The message's `outbound_key` is
derived from the call (`outbound_key`), so a retried call delivers once.

- `ChannelOutbox`: hands each message to the `Channel` of its agent and channel name.
- `PendingOutbox`: keeps messages per conversation until the gateway takes
  them, e.g. to return them with an HTTP API turn (the `api` channel). What
  waits is bounded per conversation (R3, `policies.bridge.admit_pending`: 20
  messages, 64 KiB); past that a call is answered `busy`, so a sandbox that
  calls `reply` in a loop between turns costs the gateway at most that, and
  the HTTP answer that takes them is bounded too.
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
from policies.bridge import PENDING_MAX_BYTES, PENDING_MAX_MESSAGES, PendingFacts, admit_pending

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


def message_bytes(message: OutboundMessage) -> int:
    """What a waiting message costs: its text, file name and extra values, in UTF-8 bytes."""
    parts = [message.text or "", message.file_name or "", *(message.extra or {}).values()]
    return sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)


class PendingOutbox:
    """Keeps delivered messages per conversation until `take`; an outbound key is kept once.

    At most `max_messages` messages and `max_bytes` bytes (`message_bytes`)
    wait per conversation; the next delivery raises `BridgeError("busy")` (R3).
    """

    def __init__(
        self, *, max_messages: int = PENDING_MAX_MESSAGES, max_bytes: int = PENDING_MAX_BYTES
    ) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._pending: dict[str, list[OutboundMessage]] = {}
        self._bytes: dict[str, int] = {}
        self._seen = _Seen()

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        known = self._seen.get(message.outbound_key)
        if known is not None:
            return known
        conv = scope.conversation_id
        waiting = self._pending.get(conv, [])
        size = message_bytes(message)
        facts = PendingFacts(
            len(waiting), self._bytes.get(conv, 0), size, self.max_messages, self.max_bytes
        )
        decision = admit_pending(facts)
        if not decision:
            raise BridgeError("busy", decision.reason)
        receipt = DeliveryReceipt(platform_message_id=message.outbound_key)
        self._pending.setdefault(conv, []).append(message)
        self._bytes[conv] = facts.size + size
        self._seen.put(message.outbound_key, receipt)
        return receipt

    def pending(self, conversation_id: str) -> tuple[int, int]:
        """How many messages, and how many bytes, wait for this conversation."""
        return len(self._pending.get(conversation_id, ())), self._bytes.get(conversation_id, 0)

    def take(self, conversation_id: str) -> list[OutboundMessage]:
        """The messages delivered into this conversation since the last take, oldest first.

        At most `max_messages` messages of `max_bytes` bytes in all.
        """
        self._bytes.pop(conversation_id, None)
        return self._pending.pop(conversation_id, [])
