"""Telegram updates as cellgate's own messages: normalised at the edge (W5, W6).

`normalize(agent, update, bot_id, bot_username)` turns one `telegram.Update`
into an `InboundMessage`, or None for an update cellgate does not answer (a
service message). No `telegram.*` object leaves `channels/`. One conversation
per chat (a group's id is negative); the sender is the user id. Text or a
caption; photos (the largest size), documents, voice, audio and video as
attachments by file_id (the bytes are fetched only by the gateway's download
tool); a sticker as a description; an edit as its own message id
(`<id>.e<edit_date>`); a reply to the bot and an edit noted on trailing `#`
lines; `/start`, `/help`, `/reset` (or `/reset@ThisBot`) as commands.
"""

from __future__ import annotations

import re

from telegram import Message, Update

from cellgate.models import Attachment, InboundMessage

__all__ = ["normalize", "safe_file_name"]

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def _describe_sticker(message: Message) -> str:
    sticker = message.sticker
    assert sticker is not None
    emoji = sticker.emoji or ""
    where = f" from set {sticker.set_name}" if sticker.set_name else ""
    return f"[sticker {emoji}{where}]".replace("  ", " ")


def normalize(
    agent: str, update: Update, bot_id: int | None, bot_username: str | None
) -> InboundMessage | None:
    """One update as cellgate's message, or None for an update cellgate does not answer."""
    edited = update.edited_message is not None
    message = update.message or update.edited_message
    if message is None:
        return None
    chat_id = str(message.chat.id)
    sender = str(message.from_user.id) if message.from_user else chat_id
    text = message.text or message.caption or ""
    attachments: list[Attachment] = []
    if message.photo:
        best = max(message.photo, key=lambda p: (p.width * p.height, p.file_size or 0))
        attachments.append(Attachment("photo", best.file_id, "", best.file_size))
    if message.document is not None:
        d = message.document
        attachments.append(Attachment("document", d.file_id, d.file_name or "", d.file_size))
    if message.voice is not None:
        v = message.voice
        attachments.append(Attachment("voice", v.file_id, "", v.file_size))
    if message.audio is not None:
        a = message.audio
        attachments.append(Attachment("audio", a.file_id, a.file_name or "", a.file_size))
    if message.video is not None:
        vd = message.video
        attachments.append(Attachment("video", vd.file_id, vd.file_name or "", vd.file_size))
    if message.sticker is not None:
        text = _describe_sticker(message)
    if not text and not attachments:
        return None  # a service message (member joined, pinned, ...): nothing to answer
    platform_id = str(message.message_id)
    if edited:
        stamp = int(message.edit_date.timestamp()) if message.edit_date else update.update_id
        platform_id = f"{message.message_id}.e{stamp}"
    command: str | None = None
    if not edited and message.text and message.text.startswith("/"):
        command = _command(message.text, bot_username)
    reply = message.reply_to_message
    reply_to = None
    if reply is not None and reply.from_user is not None and reply.from_user.id == bot_id:
        reply_to = str(reply.message_id)
    return InboundMessage(
        agent=agent,
        channel="telegram",
        chat_id=chat_id,
        message_id=platform_id,
        text=_with_context(text, edited=edited, reply_to=reply_to),
        sender=sender,
        attachments=tuple(attachments),
        command=command,
    )


def _command(text: str, username: str | None) -> str | None:
    """`/reset` or `/reset@ThisBot` -> "reset"; a command for another bot -> None."""
    word = text.split(maxsplit=1)[0][1:]
    name, _, target = word.partition("@")
    if target and (username is None or target.lower() != username.lower()):
        return None
    name = name.lower()
    return name if name in ("start", "help", "reset") else None


def _with_context(text: str, *, edited: bool, reply_to: str | None) -> str:
    """What the harness reads: the text, and, as trailing `#` lines, how it arrived."""
    notes: list[str] = []
    if edited:
        notes.append("# (the user edited an earlier message; this is its new text)")
    if reply_to:
        notes.append(f"# (in reply to the bot's message {reply_to})")
    return "\n".join([text, *notes]) if notes else text


def safe_file_name(file_path: str, file_unique_id: str) -> str:
    """A plain file name for a download: from Telegram's path, or the file's unique id."""
    base = file_path.rsplit("/", 1)[-1]
    base = _SAFE_NAME.sub("_", base).lstrip(".")[:100]
    return base or _SAFE_NAME.sub("_", file_unique_id)[:64] or "file"
