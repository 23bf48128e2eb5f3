"""The Discord adapter over the real discord.py client against the loopback stand-in (W1-W5).

No engine here: a real store in a temp dir, the real `discord.Client` on a
real websocket and real HTTP, and a recording inbound handler in place of the
gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from cellgate.models import InboundMessage, OutboundKind, OutboundMessage
from channels.base import ChannelFailed
from channels.discord import DISCORD_TEXT_LIMIT, DiscordChannel, DiscordOptions
from orchestrator.store import Store
from tests.fakes.discord_standin import BOT_ID, DiscordStandin

TOKEN = "MTAwMDAw.standin.DiscordTokenValueXYZ0123456789"


@pytest.fixture
def dc() -> Iterator[DiscordStandin]:
    with DiscordStandin(TOKEN) as standin:
        yield standin


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state")
    yield s
    s.close()


class Inbox:
    def __init__(self) -> None:
        self.got: list[InboundMessage] = []

    async def __call__(self, message: InboundMessage) -> None:
        self.got.append(message)

    async def wait(self, n: int, within: float = 10.0) -> list[InboundMessage]:
        deadline = time.monotonic() + within
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"{n} messages did not arrive: {self.got}"
            await asyncio.sleep(0.02)
        return self.got


def options(dc: DiscordStandin, token: str = TOKEN, **kw: object) -> DiscordOptions:
    return DiscordOptions(
        agent="bot",
        token=SecretStr(token),
        api_base_url=dc.api_base_url,
        gateway_url=dc.gateway_url,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
async def channel(dc: DiscordStandin, store: Store) -> AsyncIterator[tuple[DiscordChannel, Inbox]]:
    ch = DiscordChannel(options(dc), store)
    inbox = Inbox()
    await ch.start(inbox)
    async with asyncio.timeout(20):
        await ch.wait_ready()
    yield ch, inbox
    await ch.stop()


def reply(chat: int | str, key: str, text: str, **kw: object) -> OutboundMessage:
    return OutboundMessage(
        channel="discord",
        chat_id=str(chat),
        outbound_key=key,
        text=text,
        **kw,  # type: ignore[arg-type]
    )


async def in_thread(fn: object, *args: object) -> object:
    """The stand-in's helpers block on its own loop: call them off this one."""
    return await asyncio.to_thread(fn, *args)  # type: ignore[arg-type]


async def test_W1_identifies_with_the_intents_and_logs_in_with_the_token(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    ch, _ = channel
    assert ch.bot_id == BOT_ID
    intents = dc.identified_intents or 0
    for bit, what in (
        (1 << 0, "guilds"),
        (1 << 9, "guild messages"),
        (1 << 12, "direct messages"),
        (1 << 15, "message content"),
    ):
        assert intents & bit, f"the {what} intent is asked for"
    assert "standin" not in repr(ch) and TOKEN not in repr(ch)


async def test_W1_a_token_discord_refuses_stops_start_up(dc: DiscordStandin, store: Store) -> None:
    ch = DiscordChannel(options(dc, token="wrong.token.value"), store)
    with pytest.raises(ChannelFailed, match="refuses the bot token") as err:
        await ch.start(Inbox())
    assert "wrong.token.value" not in str(err.value)
    await ch.stop()


async def test_W5_a_dm_a_guild_channel_and_each_thread_are_their_own_chats(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    _, inbox = channel
    general = dc.add_text_channel("general")
    dm = dc.add_dm(700000000000000009)
    thread = await in_thread(dc.add_thread, general, "a thread")
    await in_thread(dc.user_says, general, "in general")
    await in_thread(dc.user_says, dm, "in a dm", 700000000000000009)
    await in_thread(dc.user_says, thread, "in the thread")
    got = await inbox.wait(3)
    by_text = {m.text: m for m in got}
    assert by_text["in general"].chat_id == str(general)
    assert by_text["in a dm"].chat_id == str(dm)
    assert by_text["in the thread"].chat_id == str(thread), "a thread is not its parent"
    assert by_text["in a dm"].sender == "700000000000000009"
    assert {m.channel for m in got} == {"discord"}


async def test_W5_the_bots_own_messages_and_empty_ones_are_not_answered(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    _, inbox = channel
    general = dc.add_text_channel("general")
    await in_thread(dc.user_says, general, "from the bot itself", BOT_ID)
    await in_thread(dc.user_says, general, "")
    await in_thread(dc.user_says, general, "a person")
    got = await inbox.wait(1)
    await asyncio.sleep(0.3)
    assert [m.text for m in got] == ["a person"]


async def test_W4_a_long_reply_is_split_under_2000_in_order_and_posted_once(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin, store: Store
) -> None:
    ch, _ = channel
    chat = dc.add_text_channel("long")
    text = "".join(f"{i:04d} {'w' * 60}\n" for i in range(100))
    assert len(text) > 3 * DISCORD_TEXT_LIMIT
    receipt = await ch.send(reply(chat, "reply:long", text))
    parts = dc.texts(chat)
    assert len(parts) == 4 and all(len(p) <= DISCORD_TEXT_LIMIT for p in parts)
    assert "".join(parts) == text
    assert receipt.platform_message_id == str(dc.messages(chat)[0].message_id)
    # a crash and retry of the same delivery posts nothing twice (durable keys)
    await ch.send(reply(chat, "reply:long", text))
    assert len(dc.texts(chat)) == 4


async def test_W4_a_crash_between_parts_resumes_after_the_last_recorded_one(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin, store: Store
) -> None:
    ch, _ = channel
    chat = dc.add_text_channel("crash")
    text = "a" * 1999 + "\n" + "b" * 1999 + "\n" + "c" * 10
    dc.rate_limit("/messages", 0.0)  # harmless: shows a 429 is retried, not dropped
    # part 0 went out and was recorded before the crash
    store.record_posted_part(
        "reply:crash",
        0,
        agent="bot",
        channel="discord",
        chat_id=str(chat),
        platform_message_id="1",
    )
    await ch.send(reply(chat, "reply:crash", text))
    assert dc.texts(chat) == ["b" * 1999 + "\n", "c" * 10]


async def test_W4_a_429_is_waited_out_for_retry_after_and_posted_once(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    ch, _ = channel
    chat = dc.add_text_channel("limited")
    dc.rate_limit(f"/channels/{chat}/messages", 1.5)
    await ch.send(reply(chat, "reply:limited", "after the wait"))
    tries = dc.calls_to("POST", f"/channels/{chat}/messages")
    assert len(tries) == 2
    assert tries[1].at - tries[0].at >= 1.4, "retry_after honoured"
    assert dc.texts(chat) == ["after the wait"]


async def test_W4_a_long_429_is_waited_out_by_the_channel(dc: DiscordStandin, store: Store) -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    ch = DiscordChannel(options(dc), store, sleep=sleep)
    await ch.start(Inbox())
    try:
        chat = dc.add_text_channel("long-limit")
        dc.rate_limit(f"/channels/{chat}/messages", 120.0)  # over what discord.py sleeps
        await ch.send(reply(chat, "reply:long-limit", "posted after two minutes"))
        assert slept == [120.0]
        assert dc.texts(chat) == ["posted after two minutes"]
    finally:
        await ch.stop()


async def test_P1_edit_only_the_bots_own_messages_and_react(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    ch, _ = channel
    chat = dc.add_text_channel("edits")
    sent = await ch.send(reply(chat, "k1", "first"))
    await ch.send(
        reply(
            chat, "k2", "second", kind=OutboundKind.EDIT, target_message_id=sent.platform_message_id
        )
    )
    await ch.send(
        reply(chat, "k3", "👍", kind=OutboundKind.REACT, target_message_id=sent.platform_message_id)
    )
    [posted] = dc.messages(chat)
    assert posted.edits == ["second"] and posted.reactions == ["👍"]
    user_msg = await in_thread(dc.user_says, chat, "a user's message")
    with pytest.raises(ChannelFailed, match="not one this bot sent"):
        await ch.send(
            reply(chat, "k4", "hijacked", kind=OutboundKind.EDIT, target_message_id=str(user_msg))
        )


async def test_W3_a_resume_replays_what_was_missed_once(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    _, inbox = channel
    chat = dc.add_text_channel("resume")
    dc.drop_connection()  # the next event is not delivered on the old socket
    await in_thread(dc.user_says, chat, "sent while away")
    await in_thread(dc.force_reconnect)
    got = await inbox.wait(1, within=20)
    await asyncio.sleep(0.5)  # a second copy would arrive by now
    assert dc.resumes >= 1 and dc.identifies == 1, "resumed, not identified again"
    assert [m.text for m in got] == ["sent while away"]


async def test_P2_create_thread_and_the_threads_parent_is_known(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    ch, _ = channel
    parent = dc.add_text_channel("parent")
    tid = await ch.create_thread(str(parent), "work", "thread-key")
    assert await ch.create_thread(str(parent), "work", "thread-key") == tid, "once per key"
    assert len(dc.calls_to("POST", f"/channels/{parent}/threads")) == 1
    for _ in range(100):
        if ch.parent_of(tid) is not None:
            break
        await asyncio.sleep(0.05)
    assert ch.parent_of(tid) == str(parent)
    await ch.send(reply(tid, "in-thread", "hello thread"))
    assert dc.texts(int(tid)) == ["hello thread"]


async def test_W5_require_mention_answers_guild_messages_only_when_mentioned(
    dc: DiscordStandin, store: Store
) -> None:
    ch = DiscordChannel(options(dc, require_mention=True), store)
    inbox = Inbox()
    await ch.start(inbox)
    try:
        async with asyncio.timeout(20):
            await ch.wait_ready()
        general = dc.add_text_channel("general")
        dm = dc.add_dm(700000000000000005)
        await in_thread(dc.user_says, general, "not for the bot")
        await in_thread(dc.user_says, general, f"<@{BOT_ID}> echo hi")
        await in_thread(dc.user_says, dm, "a dm needs no mention", 700000000000000005)
        got = await inbox.wait(2)
        await asyncio.sleep(0.3)
        assert sorted(m.text for m in got) == ["a dm needs no mention", "echo hi"]
    finally:
        await ch.stop()


async def test_W6_attachments_are_named_by_their_cdn_url_not_fetched(
    channel: tuple[DiscordChannel, Inbox], dc: DiscordStandin
) -> None:
    _, inbox = channel
    chat = dc.add_text_channel("files")
    url = dc.add_cdn_file(b"abc", "a.txt")
    await asyncio.to_thread(lambda: dc.user_says(chat, "see file", attachments=[(url, 3)]))
    [msg] = await inbox.wait(1)
    assert [(a.ref, a.name, a.size) for a in msg.attachments] == [(url, "a.txt", 3)]
    assert dc.cdn_hits == [], "nothing is downloaded until a tool asks"
