"""Discord messages as cellgate's own messages: normalised at the edge (W5, W6).

`normalize(agent, message, bot_id, require_mention)` turns one
`discord.Message` into an `InboundMessage`, or None for a message cellgate
does not answer (its own, another bot's, a system message, an empty one, or
in a guild channel without a mention when mentions are required). No
`discord.*` object leaves `channels/`.

W5: the conversation is the channel the message was posted in: a DM, a guild
text channel, or a thread (a thread's id is its own chat, never its
parent's). The message id is the platform id the store is idempotent on (W3).
Attachments are named by their CDN URL; the bytes are fetched only by
`discord_download_attachment` through the gateway (P4, W6). `/reset` and
`/help` (or `!reset`, `!help`) are commands.
"""

from __future__ import annotations

import re
import warnings

with warnings.catch_warnings():  # discord.py's voice support imports audioop (3.13)
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

from cellgate.models import Attachment, InboundMessage

__all__ = ["normalize"]

_COMMANDS = ("start", "help", "reset")
_MAX_ATTACHMENTS = 10


def _kind(content_type: str | None) -> str:
    major = (content_type or "").split("/", 1)[0]
    return {"image": "photo", "video": "video", "audio": "audio"}.get(major, "document")


def _without_mention(text: str, bot_id: int | None) -> tuple[str, bool]:
    if bot_id is None:
        return text, False
    pattern = re.compile(rf"<@!?{bot_id}>")
    stripped, n = pattern.subn("", text)
    return stripped.strip() if n else text, n > 0


def normalize(
    agent: str, message: discord.Message, bot_id: int | None, *, require_mention: bool = False
) -> InboundMessage | None:
    """One message as cellgate's message, or None for one cellgate does not answer."""
    author = message.author
    if author.bot or (bot_id is not None and author.id == bot_id):
        return None  # never answer a bot: two bots would talk forever
    if message.type not in (discord.MessageType.default, discord.MessageType.reply):
        return None
    in_guild = message.guild is not None
    text, mentioned = _without_mention(message.content or "", bot_id)
    if in_guild and require_mention and not mentioned:
        return None
    attachments = tuple(
        Attachment(_kind(a.content_type), a.url, a.filename, a.size)
        for a in message.attachments[:_MAX_ATTACHMENTS]
    )
    if not text and not attachments:
        return None
    command = None
    if text[:1] in ("/", "!"):
        word = text[1:].split(maxsplit=1)[0].lower() if len(text) > 1 else ""
        command = word if word in _COMMANDS else None
    reply_note = ""
    ref = message.reference
    if ref is not None and ref.message_id is not None and ref.channel_id == message.channel.id:
        resolved = ref.resolved
        if isinstance(resolved, discord.Message) and bot_id and resolved.author.id == bot_id:
            reply_note = f"\n# (in reply to the bot's message {ref.message_id})"
    return InboundMessage(
        agent=agent,
        channel="discord",
        chat_id=str(message.channel.id),
        message_id=str(message.id),
        text=text + reply_note if text else text,
        sender=str(author.id),
        attachments=attachments,
        command=command,
    )
