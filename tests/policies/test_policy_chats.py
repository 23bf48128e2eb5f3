"""P1/P2: replies, reactions, edits and threads go only to the session's own chat."""

from __future__ import annotations

import pytest

from policies.chats import ChatFacts, decide, reply_target

NONE: frozenset[str] = frozenset()


@pytest.mark.parametrize(
    ("origin", "target", "allowed"),
    [
        ("42", "42", True),
        ("42", None, True),  # omitted target means the origin
        ("42", "", True),  # an empty target is omitted too: it means the origin
        ("42", "43", False),
        ("-100123", "123", False),  # no numeric normalisation
        ("42", " 42", False),  # no trimming
        ("42", "42\n", False),
        ("abc", "ABC", False),  # no case folding
        (None, "42", False),  # unknown origin refuses everything
        (None, None, False),
        ("", None, False),
        ("", "", False),
        ("", "42", False),
    ],
)
def test_P1_reply_target_table(origin: str | None, target: str | None, allowed: bool) -> None:
    d = reply_target(origin, target, tool="telegram_reply")
    assert d.allowed is allowed
    assert d.rule == "P1"
    assert "telegram_reply" in d.reason


def test_P1_refusal_tells_how_to_reply_here() -> None:
    d = reply_target("42", "43", tool="telegram_react")
    assert "'43'" in d.reason
    assert "omit the chat id" in d.reason


def test_P1_refusal_cuts_a_huge_chat_id_short() -> None:
    d = reply_target("42", "9" * 5000)
    assert not d.allowed
    assert len(d.reason) < 400


def test_P1_unknown_origin_refuses_even_own_threads() -> None:
    d = reply_target(None, "t1", own_threads=frozenset({"t1"}))
    assert not d.allowed
    assert "unknown" in d.reason


@pytest.mark.parametrize(
    ("origin", "target", "own", "parent", "allowed", "rule"),
    [
        ("chan", "t1", frozenset({"t1"}), "chan", True, "P2"),  # thread it opened itself
        ("chan", "t1", frozenset({"t1"}), None, True, "P2"),
        ("chan", "t2", frozenset({"t1"}), "chan", False, "P2"),  # other thread, same channel
        ("chan", "t2", NONE, "chan", False, "P2"),
        ("chan", "t2", NONE, "other", False, "P1"),  # thread under another channel
        ("chan", "t2", NONE, None, False, "P1"),
        ("t1", "chan", NONE, None, False, "P1"),  # a thread session may not post in its parent
        ("t1", "t1", NONE, "chan", True, "P1"),  # a session serving a thread: its own chat
        ("chan", "chan", frozenset({"t1"}), None, True, "P1"),
    ],
)
def test_P2_discord_thread_table(
    origin: str,
    target: str,
    own: frozenset[str],
    parent: str | None,
    allowed: bool,
    rule: str,
) -> None:
    facts = ChatFacts(
        tool="discord_reply",
        origin_chat_id=origin,
        target_chat_id=target,
        own_threads=own,
        target_parent_channel=parent,
    )
    d = decide(facts)
    assert (d.allowed, d.rule) == (allowed, rule)


def test_P2_refusal_names_discord_create_thread() -> None:
    d = reply_target("chan", "t2", target_parent_channel="chan")
    assert "discord_create_thread" in d.reason
    assert "its own chat" in d.reason
