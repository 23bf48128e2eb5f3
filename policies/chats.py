"""Which chat a reply, react, edit or thread tool may address (P1, P2).

P1: a session speaks only into the chat it serves (`GATEWAY_ORIGIN_CHAT_ID`,
as known to the gateway from the connection the call arrives on, never from
what the sandbox claims); an omitted target means that chat; an unknown or
empty origin refuses everything.

P2 (Discord): a thread is its own chat. A session may also use a thread it
opened itself with `discord_create_thread`, but no other thread, even one
under its own channel.

Chat ids are compared exactly: no trimming, no case folding, no numeric
normalisation (`-100123` and `123` are different Telegram chats).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Decision, allow, deny

__all__ = ["ChatFacts", "decide", "reply_target"]


@dataclass(frozen=True, slots=True)
class ChatFacts:
    """What the gateway knows about one reply/react/edit/thread tool call.

    - `tool`: the tool's name, for the reason (`telegram_reply`, ...).
    - `origin_chat_id`: the chat the session serves; None or "" when unknown.
    - `target_chat_id`: the chat the call names; None or "" when omitted.
    - `own_threads`: Discord threads this session opened with `discord_create_thread`.
    - `target_parent_channel`: when the target is a Discord thread, its parent channel.
    """

    tool: str
    origin_chat_id: str | None
    target_chat_id: str | None = None
    own_threads: frozenset[str] = frozenset()
    target_parent_channel: str | None = None


def _show(chat_id: str) -> str:
    """A chat id fit for a reason: quoted, and cut short if it is long."""
    return repr(chat_id if len(chat_id) <= 64 else chat_id[:64] + "…")


def decide(facts: ChatFacts) -> Decision:
    origin = facts.origin_chat_id
    if not origin:
        return deny(
            "P1",
            f"{facts.tool} refused: this session's chat is unknown, so it may not send, "
            "react, edit or open threads anywhere",
        )
    target = facts.target_chat_id or origin
    if target == origin:
        return allow("P1", f"{facts.tool} targets this session's own chat")
    if target in facts.own_threads:
        return allow("P2", f"{facts.tool} targets a thread this session opened itself")
    if facts.target_parent_channel is not None and facts.target_parent_channel == origin:
        return deny(
            "P2",
            f"{facts.tool} refused: thread {_show(target)} is its own chat, even though it "
            "is under this session's channel; use only this chat or a thread you opened with "
            "discord_create_thread",
        )
    return deny(
        "P1",
        f"{facts.tool} refused: chat {_show(target)} is not the chat this session serves; "
        "omit the chat id to reply in this chat",
    )


def reply_target(
    origin_chat_id: str | None,
    target_chat_id: str | None,
    *,
    tool: str = "reply",
    own_threads: frozenset[str] = frozenset(),
    target_parent_channel: str | None = None,
) -> Decision:
    """P1/P2 for one tool call; see `ChatFacts` for the meaning of each fact."""
    return decide(
        ChatFacts(
            tool=tool,
            origin_chat_id=origin_chat_id,
            target_chat_id=target_chat_id,
            own_threads=own_threads,
            target_parent_channel=target_parent_channel,
        )
    )
