"""LINE webhook events as cellgate's own messages: normalised at the edge (W3, W5, W6).

`normalize(agent, event)` turns one line-bot-sdk webhook event into an
`InboundMessage`, or None for an event cellgate does not answer (follow,
unfollow, join, postback, ...). No `linebot.*` object leaves `channels/`.

- W5: the conversation is the source: a user's 1:1 chat (`userId`), a group
  (`groupId`) or a multi-person room (`roomId`); a group is one conversation,
  its members are senders.
- W3: the message id is the event's `webhookEventId`, the id LINE keeps on a
  redelivery, so intake stores a redelivered event once.
- W6: image, video, audio and file messages arrive as attachments by LINE
  message id; their bytes are fetched only by the gateway's
  `line_download_content` tool (the content API needs the access token).
"""

from __future__ import annotations

from linebot.v3.webhooks import (
    AudioMessageContent,
    FileMessageContent,
    GroupSource,
    ImageMessageContent,
    LocationMessageContent,
    MessageEvent,
    RoomSource,
    StickerMessageContent,
    TextMessageContent,
    UserSource,
    VideoMessageContent,
)

from cellgate.models import Attachment, InboundMessage

__all__ = ["chat_of", "normalize"]


def chat_of(source: object) -> tuple[str, str] | None:
    """W5: (chat id, sender) of an event source; None for a source without one."""
    if isinstance(source, GroupSource):
        return source.group_id, source.user_id or source.group_id
    if isinstance(source, RoomSource):
        return source.room_id, source.user_id or source.room_id
    if isinstance(source, UserSource) and source.user_id:
        return source.user_id, source.user_id
    return None


def normalize(agent: str, event: object) -> InboundMessage | None:
    """One webhook event as cellgate's message, or None for an event cellgate does not answer."""
    if not isinstance(event, MessageEvent):
        return None
    where = chat_of(event.source)
    if where is None:
        return None
    chat_id, sender = where
    content = event.message
    text = ""
    attachments: list[Attachment] = []
    if isinstance(content, TextMessageContent):
        text = content.text
    elif isinstance(content, ImageMessageContent):
        attachments.append(Attachment("image", content.id))
    elif isinstance(content, VideoMessageContent):
        attachments.append(Attachment("video", content.id))
    elif isinstance(content, AudioMessageContent):
        attachments.append(Attachment("audio", content.id))
    elif isinstance(content, FileMessageContent):
        attachments.append(Attachment("file", content.id, content.file_name, content.file_size))
    elif isinstance(content, StickerMessageContent):
        text = f"[sticker {content.package_id}/{content.sticker_id}]"
    elif isinstance(content, LocationMessageContent):
        title = f"{content.title}: " if content.title else ""
        text = (
            f"[location {title}{content.address or ''} ({content.latitude}, {content.longitude})]"
        )
    if not text and not attachments:
        return None
    command = "reset" if text.strip().lower() == "/reset" else None
    return InboundMessage(
        agent=agent,
        channel="line",
        chat_id=chat_id,
        message_id=event.webhook_event_id,
        text=text,
        sender=sender,
        attachments=tuple(attachments),
        command=command,
    )
