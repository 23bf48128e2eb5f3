"""cellgate's own models: conversation keys and the messages channels carry.

Library objects (`telegram.Update`, `discord.Message`, LINE events) never leave
`channels/`; the orchestrator and every adapter see these frozen models. A
conversation's directory name is safe for any chat id: negative Telegram ids,
LINE ids, arbitrary API ids, `../`, NUL or 4 KB strings. The readable part is a
sanitised, truncated slug; the hash over the full `(channel, chat_id)` keeps two
different chats apart even when their slugs agree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from enum import StrEnum

from cellgate.errors import ConversationError

CHANNEL_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_LITERAL_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SESSION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SLUG_MAX = 40
CHAT_ID_MAX = 4096
HEARTBEAT_CHAT = "__heartbeat__"


@dataclass(frozen=True, slots=True)
class ConversationKey:
    """One chat on one channel of one agent."""

    agent: str
    channel: str
    chat_id: str

    def __post_init__(self) -> None:
        if not CHANNEL_RE.fullmatch(self.channel):
            raise ConversationError(
                f"channel name {self.channel!r} is not usable: use 1-16 lowercase letters "
                "or digits, starting with a letter"
            )
        if not self.chat_id:
            raise ConversationError("chat id is empty: every conversation needs a chat id")
        if len(self.chat_id.encode("utf-8", "surrogatepass")) > CHAT_ID_MAX:
            raise ConversationError(f"chat id is longer than {CHAT_ID_MAX} bytes")

    @property
    def digest(self) -> str:
        """A stable hash of `(channel, chat_id)`; the agent is implied by the workspace."""
        raw = f"{self.channel}\0{self.chat_id}".encode("utf-8", "surrogatepass")
        return hashlib.sha256(raw).hexdigest()[:16]

    @property
    def dir_name(self) -> str:
        """`<channel>-<chatId>-<hash>`, the name under `chats/` (M1)."""
        slug = _SLUG_UNSAFE.sub("_", self.chat_id)[:SLUG_MAX] or "_"
        return f"{self.channel}-{slug}-{self.digest}"

    def media_dir_name(self, session_id: str) -> str:
        """`media/<channel>-<chatId>` for a channel chat, `media/api-<session>` for the API.

        A chat id that is not plainly safe is replaced by `h.<hash>`; the dot
        cannot occur in a literal id, so the mapping stays one-to-one.
        """
        if self.channel == "api":
            if not SESSION_RE.fullmatch(session_id):
                raise ConversationError(f"session id {session_id!r} is not a safe name")
            return f"api-{session_id}"
        if _LITERAL_SAFE.fullmatch(self.chat_id):
            return f"{self.channel}-{self.chat_id}"
        return f"{self.channel}-h.{self.digest}"


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
    command: str | None = None  # a channel command for the gateway itself, e.g. "reset"


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
