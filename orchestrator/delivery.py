"""Where answers go: bridge deliveries during a turn, and the final reply after it.

- `GatewayOutbox` is the bridge's outbox: the `api` channel keeps deliveries
  for the HTTP answer (`PendingOutbox`); every other channel sends at once.
- `ReplyDelivery` is the turn loop's delivery of a stored reply into its chat
  under the reply's durable outbound key; the `api` channel's caller reads the
  stored reply instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from cellgate.errors import AgentUnavailable, BridgeError
from cellgate.models import DeliveryReceipt, OutboundMessage
from channels.base import Channel, ChatBlocked
from orchestrator.bridge import BridgeScope, ChannelOutbox, PendingOutbox
from orchestrator.store import Conversation, Reply

logger = logging.getLogger(__name__)

ChannelMap = Mapping[tuple[str, str], Channel]  # (agent, channel) -> its running adapter


class GatewayOutbox:
    """Bridge deliveries: the `api` channel keeps them for the HTTP answer; others send."""

    def __init__(self, channels: ChannelMap) -> None:
        self.pending = PendingOutbox()
        self.channels = ChannelOutbox(channels)

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        if message.channel == "api":
            return await self.pending.deliver(scope, message)
        try:
            return await self.channels.deliver(scope, message)
        except ChatBlocked as exc:
            raise BridgeError("chat_blocked", "this chat has blocked the bot") from exc


def read_from_store(conv: Conversation) -> bool:
    """Whether the conversation's caller reads its replies from the store (the `api`
    channel): storing a reply delivers it."""
    return conv.channel == "api"


class ReplyDelivery:
    """Sends a stored reply into its chat on the conversation's channel."""

    def __init__(self, channels: ChannelMap) -> None:
        self._channels = channels

    async def __call__(self, conv: Conversation, reply: Reply) -> None:
        if read_from_store(conv):
            return  # the API caller reads the stored reply
        channel = self._channels.get((conv.agent, conv.channel))
        if channel is None:
            raise AgentUnavailable(conv.agent, f"channel {conv.channel!r} is not running")
        try:
            await channel.send(
                OutboundMessage(
                    channel=conv.channel,
                    chat_id=conv.chat_id,
                    outbound_key=reply.outbound_key,
                    text=reply.text,
                )
            )
        except ChatBlocked:
            # W4: recorded by the channel; retrying would only be refused again
            logger.info("reply %s not delivered: the chat blocked the bot", reply.outbound_key)
