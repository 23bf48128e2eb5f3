"""The Telegram adapter over the real library against the loopback stand-in (W1-W5, D1).

No engine here: a real store in a temp dir, the real `telegram.Bot`, and a
recording inbound handler in place of the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from cellgate.errors import Throttled
from cellgate.models import InboundMessage, OutboundKind, OutboundMessage
from channels.base import ChannelFailed, ChatBlocked
from channels.telegram import HELP_TEXT, TelegramChannel, TelegramOptions, split_text
from orchestrator.store import Store
from tests.fakes.telegram_standin import TelegramStandin

TOKEN = "123456:standinTOKENabcdefghijklmnopqrstuvwxyz"


@pytest.fixture
def tg() -> Iterator[TelegramStandin]:
    with TelegramStandin(TOKEN) as standin:
        yield standin


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state")
    yield s
    s.close()


class Inbox:
    def __init__(self) -> None:
        self.got: list[InboundMessage] = []
        self.throttle = False

    async def __call__(self, message: InboundMessage) -> None:
        if self.throttle:
            raise Throttled("R4", "chat rate")
        self.got.append(message)


def make_channel(tg: TelegramStandin, store: Store, **kw: object) -> TelegramChannel:
    options = TelegramOptions(
        agent="bot",
        token=SecretStr(TOKEN),
        base_url=tg.base_url,
        base_file_url=tg.base_file_url,
        poll_timeout=0,
        **kw,  # type: ignore[arg-type]
    )
    return TelegramChannel(options, store)


@pytest.fixture
async def channel(
    tg: TelegramStandin, store: Store
) -> AsyncIterator[tuple[TelegramChannel, Inbox]]:
    ch = make_channel(tg, store)
    inbox = Inbox()
    ch._on_message = inbox  # no poll task here: the tests call poll_once themselves
    yield ch, inbox
    await ch.stop()


def reply(chat: str, key: str, text: str) -> OutboundMessage:
    return OutboundMessage(channel="telegram", chat_id=chat, outbound_key=key, text=text)


# -- W4: splitting ---------------------------------------------------------------


def test_W4_split_text_keeps_order_lines_and_limit() -> None:
    text = "\n".join(f"line {i:05d} " + "x" * (i % 70) for i in range(400))
    parts = split_text(text)
    assert "".join(parts) == text
    assert all(0 < len(p) <= 4096 for p in parts)
    assert all(p.endswith("\n") for p in parts[:-1]), "cut at line ends"
    long_line = "y" * 9000
    assert [len(p) for p in split_text(long_line)] == [4096, 4096, 808]
    assert split_text("") == ["(no text)"]


async def test_W4_10000_char_reply_arrives_as_ordered_parts_under_4096(
    tg: TelegramStandin, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, _ = channel
    text = "".join(f"{i:04d} {'z' * 44}\n" for i in range(200))  # 10,000 characters
    assert len(text) == 10_000
    receipt = await ch.send(reply("5001", "reply:1", text))
    posted = tg.messages(5001)
    assert len(posted) == 3
    assert all(len(p.text) < 4096 for p in posted)
    assert "".join(p.text for p in posted) == text
    assert receipt.platform_message_id == str(posted[0].message_id)


async def test_W4_retry_after_is_waited_out_and_posted_once(
    tg: TelegramStandin, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, _ = channel
    tg.rate_limit("sendMessage", retry_after=1)
    t0 = time.monotonic()
    await ch.send(reply("5002", "reply:2", "after the flood wait"))
    assert time.monotonic() - t0 >= 0.9, "the 429's retry_after was waited out"
    assert tg.texts(5002) == ["after the flood wait"]
    assert len(tg.calls_of("sendMessage")) == 2


async def test_W4_D1_outbound_key_posts_once_even_across_a_restart(
    tg: TelegramStandin, store: Store, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, _ = channel
    text = "a" * 5000
    await ch.send(reply("5003", "reply:3", text))
    await ch.send(reply("5003", "reply:3", text))  # a retry of the same delivery
    again = make_channel(tg, store)  # a restarted gateway, same store
    try:
        await again.send(reply("5003", "reply:3", text))
    finally:
        await again.stop()
    assert len(tg.messages(5003)) == 2, "two parts, each posted once"
    # a crash after part 0 was posted and recorded: the retry posts only part 1
    store.record_posted_part(
        "reply:4", 0, agent="bot", channel="telegram", chat_id="5004", platform_message_id="77"
    )
    await ch.send(reply("5004", "reply:4", text))
    assert [len(t) for t in tg.texts(5004)] == [5000 - 4096]


async def test_W4_a_chat_that_blocked_the_bot_is_recorded_and_not_retried(
    tg: TelegramStandin, store: Store, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, inbox = channel
    tg.block(5005)
    with pytest.raises(ChatBlocked):
        await ch.send(reply("5005", "reply:5", "hello?"))
    assert store.chat_blocked("bot", "telegram", "5005")
    calls = len(tg.calls_of("sendMessage"))
    with pytest.raises(ChatBlocked):
        await ch.send(reply("5005", "reply:5", "hello?"))
    assert len(tg.calls_of("sendMessage")) == calls, "a blocked chat is not tried again"
    # the user unblocks and writes again: the chat is answered again
    tg.blocked.clear()
    tg.user_says(5005, "back")
    await ch.poll_once(wait=0)
    assert not store.chat_blocked("bot", "telegram", "5005")
    assert [m.text for m in inbox.got] == ["back"]


async def test_R3_a_help_the_bot_cannot_post_never_jams_polling(
    tg: TelegramStandin, store: Store, channel: tuple[TelegramChannel, Inbox]
) -> None:
    """A stranger's `/help` in a chat the bot may not write to (blocked, or a group that
    mutes it) is acknowledged: the updates behind it, any chat's, still arrive. A
    `/help` flood is answered once per window."""
    ch, inbox = channel
    tg.block(6006)
    tg.user_says(6006, "/help")
    tg.user_says(6007, "after the help")
    await ch.poll_once(wait=0)
    assert [m.text for m in inbox.got] == ["after the help"]
    assert await ch.poll_once(wait=0) == 0, "the cursor moved past the /help"
    tg.blocked.clear()
    for _ in range(5):
        tg.user_says(6008, "/start")
    await ch.poll_once(wait=0)
    assert tg.texts(6008) == [HELP_TEXT]


# -- W3: polling, stored before acknowledged --------------------------------------------


async def test_W3_polling_cursor_persisted_no_update_lost_or_repeated(
    tg: TelegramStandin, store: Store, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, inbox = channel
    tg.user_says(6001, "one")
    tg.user_says(6002, "two")
    assert await ch.poll_once(wait=0) == 2
    assert [(m.chat_id, m.text) for m in inbox.got] == [("6001", "one"), ("6002", "two")]
    cursor = store.channel_cursor("bot", "telegram")
    assert cursor is not None
    # a restarted channel asks from the stored cursor: nothing is delivered twice
    again = make_channel(tg, store)
    inbox2 = Inbox()
    again._on_message = inbox2
    try:
        tg.user_says(6001, "three")
        await again.poll_once(wait=0)
    finally:
        await again.stop()
    assert [m.text for m in inbox2.got] == ["three"]


async def test_W3_a_handler_that_fails_leaves_the_update_to_be_fetched_again(
    tg: TelegramStandin, store: Store, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, inbox = channel

    async def broken(message: InboundMessage) -> None:
        raise OSError("the store is down")

    ch._on_message = broken
    tg.user_says(6101, "keep me")
    with pytest.raises(OSError):
        await ch.poll_once(wait=0)
    ch._on_message = inbox
    await ch.poll_once(wait=0)
    assert [m.text for m in inbox.got] == ["keep me"]


# -- normalisation at the edge (W5, W6) ----------------------------------------------


async def test_W5_normalised_text_media_sticker_group_edit_and_commands(
    tg: TelegramStandin, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, inbox = channel
    photo = tg.add_file(b"\xff\xd8jpeg", "p.jpg")
    doc = tg.add_file(b"%PDF", "report.pdf")
    tg.user_says(7001, photo=photo, caption="look")
    tg.user_says(-100777, "hello group", user_id=42)
    tg.user_says(7001, document=(doc, "report.pdf"))
    tg.user_says(7001, sticker="😀")
    tg.user_says(7001, "fixed text", message_id=1, edited=True)
    tg.user_says(7001, "/reset")
    tg.user_says(7001, "/start")
    tg.user_says(7001, "/reset@some_other_bot")
    await ch.poll_once(wait=0)
    got = inbox.got
    assert all(type(m) is InboundMessage for m in got), "no telegram.* object leaves channels/"
    assert got[0].text == "look" and got[0].attachments[0].kind == "photo"
    assert got[0].attachments[0].ref == photo
    assert (got[1].chat_id, got[1].sender, got[1].text) == ("-100777", "42", "hello group")
    assert got[2].attachments[0].name == "report.pdf"
    assert got[3].text == "[sticker 😀 from set standin_set]"
    assert got[4].message_id.startswith("1.e") and got[4].text.startswith("fixed text")
    assert got[5].command == "reset"
    assert got[6].command is None and got[6].text == "/reset@some_other_bot"
    assert len(got) == 7, "/start is answered by the channel, not a turn"
    assert tg.texts(7001) == [HELP_TEXT]


async def test_R4_a_throttled_chat_is_told_once_not_per_message(
    tg: TelegramStandin, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, inbox = channel
    inbox.throttle = True
    for i in range(5):
        tg.user_says(7101, f"flood {i}")
    await ch.poll_once(wait=0)
    assert len(tg.texts(7101)) == 1
    assert "too many messages" in tg.texts(7101)[0]


# -- edits and reactions ------------------------------------------------------------


async def test_P1_edit_only_the_bots_own_message_in_this_chat(
    tg: TelegramStandin, channel: tuple[TelegramChannel, Inbox]
) -> None:
    ch, _ = channel
    sent = await ch.send(reply("7201", "reply:7201", "draft"))
    edit = OutboundMessage(
        channel="telegram",
        chat_id="7201",
        outbound_key="bridge:e1",
        kind=OutboundKind.EDIT,
        text="final",
        target_message_id=sent.platform_message_id,
    )
    await ch.send(edit)
    assert tg.messages(7201)[0].edits == ["final"]
    await ch.send(reply("7202", "reply:7202", "other chat"))
    foreign = OutboundMessage(
        channel="telegram",
        chat_id="7201",
        outbound_key="bridge:e2",
        kind=OutboundKind.EDIT,
        text="hijack",
        target_message_id="999",
    )
    with pytest.raises(ChannelFailed):
        await ch.send(foreign)
    react = OutboundMessage(
        channel="telegram",
        chat_id="7201",
        outbound_key="bridge:r1",
        kind=OutboundKind.REACT,
        text="👍",
        target_message_id=sent.platform_message_id,
    )
    await ch.send(react)
    assert tg.messages(7201)[0].reactions == ["👍"]


async def test_W6_download_is_capped_and_the_error_never_carries_the_token(
    tg: TelegramStandin, store: Store
) -> None:
    ch = make_channel(tg, store, max_download_bytes=10)
    try:
        small = tg.add_file(b"0123456789", "ok.bin")
        big = tg.add_file(b"x" * 11, "big.bin")
        got = await ch.download(small)
        assert got.data == b"0123456789" and got.name.endswith("ok.bin")
        with pytest.raises(ChannelFailed) as exc:
            await ch.download(big)
        assert "cap" in str(exc.value)
        with pytest.raises(ChannelFailed) as bad:
            await ch.download("no-such-file")
        assert TOKEN not in str(bad.value)
    finally:
        await ch.stop()
    assert TOKEN not in repr(ch)


async def test_W1_polling_start_deletes_a_webhook_and_a_running_poller_stores_updates(
    tg: TelegramStandin, store: Store
) -> None:
    ch = make_channel(tg, store)
    inbox = Inbox()
    tg.webhook_url = "http://127.0.0.1:1/old"
    await ch.start(inbox)
    try:
        assert tg.webhook_url is None
        tg.user_says(7301, "via the poller")
        for _ in range(100):
            if inbox.got:
                break
            await asyncio.sleep(0.05)
    finally:
        await ch.stop()
    assert [m.text for m in inbox.got] == ["via the poller"]


async def test_W1_a_refused_token_stops_start_up_an_unreachable_telegram_does_not(
    tg: TelegramStandin, store: Store
) -> None:
    wrong = TelegramChannel(
        TelegramOptions(
            agent="bot",
            token=SecretStr("111:wrongTokenValue"),
            base_url=tg.base_url,
            base_file_url=tg.base_file_url,
        ),
        store,
    )
    try:
        with pytest.raises(ChannelFailed) as exc:
            await wrong.start(Inbox())
        assert "tokenEnv" in str(exc.value) and "wrongTokenValue" not in str(exc.value)
    finally:
        await wrong.stop()
    down = TelegramChannel(
        TelegramOptions(
            agent="bot",
            token=SecretStr(TOKEN),
            base_url="http://127.0.0.1:9/bot",
            base_file_url="http://127.0.0.1:9/file/bot",
        ),
        store,
    )
    try:
        await down.start(Inbox())  # returns: registering goes on in the background
        assert down._poller is not None and not down._poller.done()
    finally:
        await down.stop()


async def test_W6_no_log_record_ever_carries_the_token_httpx_lines_are_redacted(
    tg: TelegramStandin, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs each Bot API URL at INFO; the token in it must never reach a handler."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="httpx")  # the CLI holds it at WARNING (any test's)
    ch = make_channel(tg, store)
    try:
        await ch.ready()
        await ch.send(reply("7401", "w6-log", "hello"))
        with pytest.raises(ChannelFailed):
            await ch.download("no-such-file")
    finally:
        await ch.stop()
    lines = [caplog.handler.format(r) for r in caplog.records]
    httpx_lines = [line for line in lines if "HTTP Request" in line]
    assert any("/bot<token>/sendMessage" in line for line in httpx_lines), lines
    assert any("Set Bot API URL" in line and "/bot<token>" in line for line in lines), lines
    assert not [line for line in lines if TOKEN in line or TOKEN.split(":")[1] in line]
