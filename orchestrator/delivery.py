"""Where answers go: bridge deliveries during a turn, and the final reply after it.

- `GatewayOutbox` is the bridge's outbox: the `api` channel keeps deliveries
  for the HTTP answer (`PendingOutbox`); every other channel sends at once.
- `ReplyDelivery` is the turn loop's delivery of a stored reply into its chat
  under the reply's durable outbound key; the `api` channel's caller reads the
  stored reply instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from cellgate.errors import AgentUnavailable
from cellgate.models import DeliveryReceipt, OutboundMessage
from channels.base import Channel
from orchestrator.bridge import BridgeScope, ChannelOutbox, PendingOutbox
from orchestrator.store import Conversation, Reply


class GatewayOutbox:
    """Bridge deliveries: the `api` channel keeps them for the HTTP answer; others send."""

    def __init__(self, channels: Mapping[str, Channel]) -> None:
        self.pending = PendingOutbox()
        self.channels = ChannelOutbox(channels)

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        if message.channel == "api":
            return await self.pending.deliver(scope, message)
        return await self.channels.deliver(scope, message)


class ReplyDelivery:
    """Sends a stored reply into its chat on the conversation's channel."""

    def __init__(self, channels: Mapping[str, Channel]) -> None:
        self._channels = channels

    async def __call__(self, conv: Conversation, reply: Reply) -> None:
        if conv.channel == "api":
            return  # the API caller reads the stored reply
        channel = self._channels.get(conv.channel)
        if channel is None:
            raise AgentUnavailable(conv.agent, f"channel {conv.channel!r} is not running")
        await channel.send(
            OutboundMessage(
                channel=conv.channel,
                chat_id=conv.chat_id,
                outbound_key=reply.outbound_key,
                text=reply.text,
            )
        )
