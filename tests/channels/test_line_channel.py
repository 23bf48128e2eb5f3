"""The LINE adapter over the real line-bot-sdk against the loopback stand-in (W1-W6).

No engine here: a real store in a temp dir, the real SDK clients, and a
recording inbound handler in place of the gateway.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from cellgate.errors import ConfigError, Throttled
from cellgate.models import InboundMessage, OutboundKind, OutboundMessage
from channels.base import ChannelFailed
from channels.line import LineChannel, LineOptions, retry_key, signature_of
from orchestrator.channel_hub import build_channels
from orchestrator.config import parse_config
from orchestrator.store import Store
from tests.fakes.line_standin import LineStandin, sign

TOKEN = "standinAccessTokenValue0123456789ABCDEFG"
SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def line() -> Iterator[LineStandin]:
    with LineStandin(TOKEN, SECRET) as standin:
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


class KilledAfterPost:
    """The store of a gateway killed right after LINE accepted a post, before it recorded it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.kills = 1

    def posted_part(self, outbound_key: str, part: int) -> str | None:
        return self.store.posted_part(outbound_key, part)

    def record_posted_part(self, outbound_key: str, part: int, **kw: Any) -> None:
        if self.kills:
            self.kills -= 1
            raise RuntimeError("killed before the store recorded the post")
        self.store.record_posted_part(outbound_key, part, **kw)


async def _no_sleep(_: float) -> None:
    return None


def make_channel(line: LineStandin, store: Any, **kw: Any) -> LineChannel:
    options = LineOptions(
        agent="bot",
        channel_secret=SecretStr(SECRET),
        access_token=SecretStr(TOKEN),
        api_base_url=line.base_url,
        data_api_base_url=line.base_url,
        public_url="https://bot.example.test",
        **kw,
    )
    return LineChannel(options, store, sleep=_no_sleep)


@pytest.fixture
async def channel(line: LineStandin, store: Store) -> AsyncIterator[tuple[LineChannel, Inbox]]:
    ch = make_channel(line, store)
    inbox = Inbox()
    await ch.start(inbox)
    yield ch, inbox
    await ch.stop()


async def _deliver(ch: LineChannel, line: LineStandin, events: list[dict[str, Any]]) -> int:
    raw = line.body(events)
    return await ch.process_body(raw, sign(SECRET, raw))


def _reply(chat: str, key: str, text: str) -> OutboundMessage:
    return OutboundMessage(channel="line", chat_id=chat, outbound_key=key, text=text)


# -- W2: the signature over the exact bytes ------------------------------------------


async def test_W2_signature_is_over_the_exact_raw_bytes(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, inbox = channel
    raw = line.body([line.text_event(line.user("U1"), "hi")])
    good = sign(SECRET, raw)
    assert signature_of(SECRET, raw) == good
    assert ch.signature_valid(raw, good)
    same_content = json.dumps(json.loads(raw), indent=1).encode()
    assert json.loads(same_content) == json.loads(raw) and same_content != raw
    assert not ch.signature_valid(same_content, good), "re-serialised JSON is other bytes"
    assert not ch.signature_valid(raw, None)
    assert not ch.signature_valid(raw, "")
    assert not ch.signature_valid(raw, sign("another-secret", raw))
    assert not ch.signature_valid(raw, good[:-2] + "AA")
    with pytest.raises(ChannelFailed):
        await ch.process_body(same_content, good)
    assert inbox.got == []


# -- W3, W5: events as conversations ------------------------------------------------


async def test_W5_user_group_and_room_are_conversations_W3_id_is_webhookEventId(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, inbox = channel
    events = [
        line.text_event(line.user("Ualice"), "one"),
        line.text_event(line.group("Cgroup1", "Ubob"), "two"),
        line.text_event(line.room("Rroom1", "Ucarol"), "three"),
        line.file_event(line.user("Ualice"), b"data", "report.pdf"),
        {**line.text_event(line.user("Ualice"), "x"), "type": "follow"},
    ]
    events[4].pop("message")
    assert await _deliver(ch, line, events) == 4
    got = [(m.chat_id, m.sender, m.text) for m in inbox.got]
    assert got[:3] == [("Ualice", "Ualice", "one"), ("Cgroup1", "Ubob", "two"),
                       ("Rroom1", "Ucarol", "three")]  # fmt: skip
    assert [m.message_id for m in inbox.got] == [e["webhookEventId"] for e in events[:4]]
    [att] = inbox.got[3].attachments
    assert (att.kind, att.ref, att.name, att.size) == (
        "file",
        events[3]["message"]["id"],
        "report.pdf",
        4,
    )


async def test_reset_command(channel: tuple[LineChannel, Inbox], line: LineStandin) -> None:
    ch, inbox = channel
    await _deliver(ch, line, [line.text_event(line.user("U1"), "/reset")])
    assert inbox.got[0].command == "reset"


# -- W4: reply token, then push under a retry key ------------------------------------


async def test_W4_a_fresh_reply_token_is_used_once_then_push(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, _ = channel
    await _deliver(ch, line, [line.text_event(line.user("U1"), "hi")])
    await ch.send(_reply("U1", "k-1", "first answer"))
    await ch.send(_reply("U1", "k-2", "second answer"))
    posted = line.messages("U1")
    assert [(p.via, p.text) for p in posted] == [
        ("reply", "first answer"),
        ("push", "second answer"),
    ]
    assert posted[1].retry_key == retry_key("bot", "k-2", 0)


async def test_W4_an_expired_reply_token_falls_back_to_push(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, _ = channel
    await _deliver(ch, line, [line.text_event(line.user("U2"), "hi")])
    line.expire_tokens()
    await ch.send(_reply("U2", "k-exp", "late answer"))
    assert [(p.via, p.text) for p in line.messages("U2")] == [("push", "late answer")]
    assert [c.status for c in line.calls_of("/v2/bot/message/reply")] == [400]  # tried, refused
    refused = line.calls_of("/v2/bot/message/reply")[0]
    assert refused.body["replyToken"]


async def test_W4_a_token_older_than_replyTokenSeconds_is_not_even_tried(
    line: LineStandin, store: Store
) -> None:
    ch = make_channel(line, store, reply_token_seconds=0.0)
    await ch.start(Inbox())
    try:
        await _deliver(ch, line, [line.text_event(line.user("U3"), "hi")])
        await ch.send(_reply("U3", "k-old", "answer"))
    finally:
        await ch.stop()
    assert [p.via for p in line.messages("U3")] == ["push"]
    assert line.calls_of("/v2/bot/message/reply") == []


async def test_W4_long_text_is_5000_char_messages_5_per_call_in_order(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, _ = channel
    await _deliver(ch, line, [line.text_event(line.user("U4"), "hi")])
    text = "".join(f"{i:05d} {'z' * 93}\n" for i in range(300))  # 30,000 characters
    await ch.send(_reply("U4", "k-long", text))
    posted = line.messages("U4")
    assert len(posted) == 6 and all(len(p.text) <= 5000 for p in posted)
    assert "".join(p.text for p in posted) == text
    assert [p.via for p in posted] == ["reply"] * 5 + ["push"]
    assert len(line.calls_of("/v2/bot/message/reply")) == 1
    assert len(line.calls_of("/v2/bot/message/push")) == 1


async def test_W4_crash_after_push_accepted_then_retry_posts_once(
    line: LineStandin, store: Store
) -> None:
    crashing = KilledAfterPost(store)
    first = make_channel(line, crashing)
    await first.start(Inbox())
    with pytest.raises(RuntimeError, match="killed"):
        await first.send(_reply("U5", "k-crash", "exactly once"))
    await first.stop()
    assert line.texts("U5") == ["exactly once"], "LINE accepted it before the crash"
    restarted = make_channel(line, store)  # a new process: the same store, no tokens in memory
    await restarted.start(Inbox())
    try:
        await restarted.send(_reply("U5", "k-crash", "exactly once"))
        await restarted.send(_reply("U5", "k-crash", "exactly once"))  # recorded now: no call
    finally:
        await restarted.stop()
    assert line.texts("U5") == ["exactly once"]
    pushes = line.calls_of("/v2/bot/message/push")
    assert [c.status for c in pushes] == [200, 409], "the retry is the same request: 409"
    assert pushes[0].headers["x-line-retry-key"] == pushes[1].headers["x-line-retry-key"]
    assert store.posted_part("k-crash", 0) is not None


async def test_W4_a_lost_answer_is_retried_under_the_same_key_and_posts_once(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, _ = channel
    line.lose_push_answers(1)
    await ch.send(_reply("U6", "k-lost", "answer lost in transit"))
    assert line.texts("U6") == ["answer lost in transit"]
    keys = {c.headers["x-line-retry-key"] for c in line.calls_of("/v2/bot/message/push")}
    assert keys == {retry_key("bot", "k-lost", 0)}
    assert [c.status for c in line.calls_of("/v2/bot/message/push")] == [500, 409]


async def test_W4_429_is_waited_out(channel: tuple[LineChannel, Inbox], line: LineStandin) -> None:
    ch, _ = channel
    line.rate_limit("/v2/bot/message/push", times=2)
    await ch.send(_reply("U7", "k-429", "after the wait"))
    assert line.texts("U7") == ["after the wait"]
    assert [c.status for c in line.calls_of("/v2/bot/message/push")] == [429, 429, 200]


async def test_W4_react_edit_and_uploads_are_refused_clearly(
    channel: tuple[LineChannel, Inbox],
) -> None:
    ch, _ = channel
    for kind in (OutboundKind.REACT, OutboundKind.EDIT, OutboundKind.FILE):
        with pytest.raises(ChannelFailed):
            await ch.send(OutboundMessage("line", "U8", f"k-{kind}", kind=kind, text="x"))


async def test_W4_typing_shows_the_loading_animation_in_a_user_chat_only(
    channel: tuple[LineChannel, Inbox], line: LineStandin
) -> None:
    ch, _ = channel
    await ch.typing("U9")
    await ch.typing("Cgroup9")
    calls = line.calls_of("/v2/bot/chat/loading/start")
    assert [c.body["chatId"] for c in calls] == ["U9"]


# -- W6: content by message id, capped -------------------------------------------------


async def test_W6_content_by_message_id_capped(line: LineStandin, store: Store) -> None:
    ch = make_channel(line, store, max_download_bytes=10)
    await ch.start(Inbox())
    try:
        small = line.file_event(line.user("U1"), b"tiny", "t.txt")
        got = await ch.download(small["message"]["id"])
        assert got.data == b"tiny" and got.name.startswith("line-")
        big = line.file_event(line.user("U1"), b"x" * 11, "big.bin")
        with pytest.raises(ChannelFailed, match="cap"):
            await ch.download(big["message"]["id"])
        for bad in ("../../v2/bot/info", "1/../2", "", "12a"):
            with pytest.raises(ChannelFailed, match="digits"):
                await ch.download(bad)
        with pytest.raises(ChannelFailed, match="404"):
            await ch.download("999")
    finally:
        await ch.stop()
    assert TOKEN not in repr(ch)


# -- P5: the image URL is signed and expires ------------------------------------------------


def test_P5_image_urls_are_signed_per_share_and_expiry(line: LineStandin, store: Store) -> None:
    ch = make_channel(line, store)
    url = ch.image_url("sh_0123456789abcdef")
    share, expires, sig = url.rsplit("/", 3)[1:]
    assert url.startswith("https://bot.example.test/v1/line/bot/images/")
    assert ch.image_url_valid(share, int(expires), sig)
    assert not ch.image_url_valid(share, int(expires) + 3600, sig), "a longer life is forged"
    assert not ch.image_url_valid("sh_0123456789abcdee", int(expires), sig)
    other = LineChannel(
        LineOptions(agent="bot", channel_secret=SecretStr("x" * 32), access_token=SecretStr("t")),
        store,
    )
    assert not other.image_url_valid(share, int(expires), sig)
    with pytest.raises(ChannelFailed, match="publicUrl"):
        other.image_url(share)


# -- R4: a flood is told once per window, by the event's own reply token -------------------


class Throttling:
    async def __call__(self, message: InboundMessage) -> None:
        raise Throttled("R4", "chat rate")


async def test_R4_a_throttled_chat_is_told_once_per_window_never_by_push(
    line: LineStandin, store: Store
) -> None:
    ch = make_channel(line, store)
    await ch.start(Throttling())
    try:
        for _ in range(3):
            await _deliver(ch, line, [line.text_event(line.user("Uflood"), "spam")])
    finally:
        await ch.stop()
    posted = line.messages("Uflood")
    assert [p.via for p in posted] == ["reply"] and "too many" in posted[0].text
    assert line.calls_of("/v2/bot/message/push") == []


# -- W1: configuration ----------------------------------------------------------------


def _config(tmp_path: Path, line_cfg: dict[str, object]) -> dict[str, object]:
    return {
        "gateway": {"stateDir": str(tmp_path / "state")},
        "agents": [{"id": "bot", "channels": {"line": line_cfg}}],
    }


@pytest.mark.parametrize(
    ("line_cfg", "why"),
    [
        ({"accessTokenEnv": "T"}, "channelSecretEnv"),
        ({"channelSecretEnv": "S"}, "accessTokenEnv"),
        ({"channelSecretEnv": "S", "channelSecretFile": "/x", "accessTokenEnv": "T"}, "exactly"),
        ({"channelSecretEnv": "S", "accessTokenEnv": "T", "apiBaseUrl": "ftp://x"}, "apiBaseUrl"),
        ({"channelSecretEnv": "S", "accessTokenEnv": "T", "channelSecret": "s"}, "channelSecret"),
    ],
)
def test_W1_a_bad_line_entry_skips_the_agent_with_the_field(
    tmp_path: Path, line_cfg: dict[str, object], why: str
) -> None:
    cfg = parse_config(_config(tmp_path, line_cfg), "cfg.json")
    assert cfg.agents == ()
    assert "channels.line" in cfg.skipped_agents[0] and why in cfg.skipped_agents[0]


def test_W1_secret_and_token_from_env_or_file_defaults_are_lines_own(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("LINE_TEST_SECRET", SECRET)
    doc = _config(tmp_path, {"channelSecretEnv": "LINE_TEST_SECRET",
                             "accessTokenFile": str(token_file)})  # fmt: skip
    [(key, ch)] = build_channels(parse_config(doc, "cfg.json"), store).items()
    assert key == ("bot", "line") and isinstance(ch, LineChannel)
    assert ch.options.access_token.get_secret_value() == TOKEN
    assert ch.options.channel_secret.get_secret_value() == SECRET
    assert ch.options.api_base_url == "https://api.line.me"
    assert ch.options.data_api_base_url == "https://api-data.line.me"
    assert SECRET not in repr(ch) and TOKEN not in repr(ch)
    monkeypatch.delenv("LINE_TEST_SECRET")
    with pytest.raises(ConfigError, match=r"channels.line.channelSecretEnv"):
        build_channels(parse_config(doc, "cfg.json"), store)
