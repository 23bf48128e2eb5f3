"""Discord end to end: the real discord.py client, a real gateway, a real engine (W1-W6, P1-P5, T1).

The stand-in plays Discord: its gateway websocket pushes what users post,
its REST records what the bot posts, its CDN (TLS, under Discord's CDN
names) serves attachments. The agent runs the shell harness, so a chat's
message is a shell command in that chat's sandbox: the tests act as a
hostile stranger from inside, calling the bridge tools with cellgate-tool.

P4 test hook: the channel's CDN fetcher gets a resolver (the DNS answer
tests choose), one pin (cdn.discordapp.com -> the stand-in's loopback port,
the only name whose address is not checked) and the test CA. Every other
check is production's: a URL, a redirect or a DNS answer it refuses here it
refuses in production.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cellgate.models import ConversationKey
from channels.discord import DiscordChannel
from channels.discord_cdn import CdnFetcher
from orchestrator.config import read_config_document, write_config_document
from orchestrator.gateway import Gateway
from orchestrator.store import conversation_id
from sandbox.backends.docker import DockerBackend
from tests.e2e.conftest import install_test_app, remove_app_containers
from tests.fakes.discord_standin import DiscordStandin
from tests.support.served import free_port, served_gateway

pytestmark = pytest.mark.docker

APP = "dce2e"
AGENT = f"{APP}-bot"
TOKEN_ENV = "CELLGATE_TEST_DC_TOKEN"
TOKEN = "MTAwMDAwMDAw.e2e.dcTokenSecretValueXYZ0123456789abcdefgh"
NEEDLE_SH = "N=\"$(printf '%s' 'dcTokenSecret')ValueXYZ\""
TOOL = "python3 /run/cellgate/cellgate-tool"
CAP = 64 * 1024


@dataclass
class Dns:
    """What the fetcher's resolver answers (the part of P4 an attacker controls)."""

    answers: dict[str, list[str]] = field(default_factory=dict)

    async def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.answers:
            raise OSError(f"test DNS: no answer for {host}")
        return list(self.answers[host])


@dataclass
class World:
    dc: DiscordStandin
    gw: Gateway
    url: str
    dns: Dns

    def say(self, chat: int, text: str, *user: int, **kw: Any) -> int:
        return self.dc.user_says(chat, text, *user, **kw)

    def answers(self, chat: int, n: int = 1, timeout: float = 120) -> list[str]:
        wait_for(lambda: len(self.dc.texts(chat)) >= n, timeout, f"{n} answers in {chat}")
        return self.dc.texts(chat)

    def messages_of(self, chat: int) -> int:
        conv = conversation_id(ConversationKey(AGENT, "discord", str(chat)))
        with self.gw.store._db.read() as c:
            row = c.execute(
                "SELECT count(*) FROM messages WHERE conversation_id = ?", (conv,)
            ).fetchone()
        return int(row[0])

    def refusals(self, chat: int) -> list[str]:
        conv = conversation_id(ConversationKey(AGENT, "discord", str(chat)))
        return [r.rule for r in self.gw.store.refusals(conv)]


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[World]:
    config_path = install_test_app(
        tmp_path_factory.mktemp(APP), docker_client, base_image, APP, {"limits": {"pids": 64}}
    )
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN
    try:
        with DiscordStandin(TOKEN) as dc:
            doc = read_config_document(config_path)
            doc["agents"][0]["channels"] = {
                "discord": {
                    "tokenEnv": TOKEN_ENV,
                    "apiBaseUrl": dc.api_base_url,
                    "gatewayUrl": dc.gateway_url,
                    "maxDownloadBytes": CAP,
                }
            }
            write_config_document(config_path, doc)
            with served_gateway(
                config_path, DockerBackend.from_env, port=free_port(), start=True
            ) as (url, gw):
                channel = gw.channels[(AGENT, "discord")]
                assert isinstance(channel, DiscordChannel)
                wait_for(channel.client.is_ready, 30, "the Discord gateway's READY")
                dns = Dns()
                channel.cdn = CdnFetcher(
                    max_bytes=channel.options.max_download_bytes,
                    resolver=dns,
                    pins=dc.cdn_pins,
                    ssl_context=dc.client_ssl,
                )
                yield World(dc, gw, url, dns)
    finally:
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved
        remove_app_containers(docker_client, APP)


def test_W5_two_discord_chats_two_sandboxes_each_answered_in_its_own_chat(world: World) -> None:
    a = world.dc.add_text_channel("chat-a")
    b = world.dc.add_dm(700000000000000077)
    world.say(a, "hostname; echo alpha-note-A > $HOME/a-note.txt; echo wrote-a")
    first_a = world.answers(a)[0]
    world.say(
        b,
        "hostname; cat $HOME/a-note.txt 2>&1; "
        'grep -rls "alpha-note-$(echo A)" /workspace /home /tmp /run 2>/dev/null; echo scanned-b',
        700000000000000077,
    )
    first_b = world.answers(b)[0]
    assert "wrote-a" in first_a and "scanned-b" in first_b
    assert "alpha-note-A" not in first_b, "chat B's shell found chat A's file"
    assert first_a.splitlines()[0] != first_b.splitlines()[0], "two different sandboxes"
    assert all("scanned-b" not in t for t in world.dc.texts(a))
    assert all("wrote-a" not in t for t in world.dc.texts(b))
    sandboxes = {s.conversation_id: s.name for s in world.gw.store.sandboxes(APP)}
    conv_a = conversation_id(ConversationKey(AGENT, "discord", str(a)))
    conv_b = conversation_id(ConversationKey(AGENT, "discord", str(b)))
    assert sandboxes[conv_a] != sandboxes[conv_b]


def test_W3_a_redelivered_message_is_answered_once(world: World) -> None:
    chat = world.dc.add_text_channel("once")
    mid = world.say(chat, "echo once-only")
    world.say(chat, "echo once-only", message_id=mid)
    world.answers(chat)
    world.say(chat, "echo once-only", message_id=mid)  # after the answer, too
    time.sleep(2.0)
    assert world.dc.texts(chat) == ["once-only\n[exit 0]"]
    assert world.messages_of(chat) == 1


def test_W4_a_5000_char_reply_arrives_in_ordered_parts_of_at_most_2000(world: World) -> None:
    chat = world.dc.add_text_channel("long")
    world.say(
        chat,
        "python3 -c \"import sys; sys.stdout.write(''.join('%04d %s\\n' % (i, 'q' * 44) "
        'for i in range(100)))"',
    )
    expected = "".join(f"{i:04d} {'q' * 44}\n" for i in range(100)) + "[exit 0]"
    world.answers(chat, 3)
    time.sleep(1.0)
    parts = world.dc.texts(chat)
    assert len(parts) == 3 and all(len(p) <= 2000 for p in parts)
    assert "".join(parts) == expected


def test_P1_P2_a_session_posts_only_in_its_chat_and_threads_it_opened(world: World) -> None:
    home = world.dc.add_text_channel("home")
    other = world.dc.add_text_channel("other")
    theirs = world.dc.add_thread(home, "a user's thread under home")
    world.say(
        home,
        f'{TOOL} discord_reply \'{{"text": "into other", "chat_id": "{other}"}}\'; '
        f'{TOOL} discord_reply \'{{"text": "into their thread", "chat_id": "{theirs}"}}\'; '
        f'{TOOL} discord_create_thread \'{{"name": "my work"}}\' > /tmp/t.json; cat /tmp/t.json; '
        'T=$(python3 -c \'import json; print(json.load(open("/tmp/t.json"))["thread_id"])\'); '
        f'{TOOL} discord_reply "{{\\"text\\": \\"into my thread\\", \\"chat_id\\": \\"$T\\"}}"; '
        f'{TOOL} discord_reply \'{{"text": "at home"}}\'; echo p2-done',
    )
    wait_for(lambda: any("p2-done" in t for t in world.dc.texts(home)), 120, "the turn's reply")
    final = world.dc.texts(home)[-1]
    assert "at home" in world.dc.texts(home)
    assert world.dc.texts(other) == [], "nothing posted into another channel"
    assert world.dc.texts(theirs) == [], "nothing posted into a thread it did not open"
    assert "P1" in final and "P2" in final
    created = json.loads(next(ln for ln in final.splitlines() if ln.startswith("{")))
    mine = int(created["thread_id"])
    assert world.dc.channels[mine]["parent"] == home
    assert world.dc.texts(mine) == ["into my thread"], "its own thread is accepted"
    assert {"P1", "P2"} <= set(world.refusals(home)), "refusals audited"
    # durable: the store, not the socket's memory, says whose thread it is
    [session] = world.gw.store.live_sessions(
        conversation=conversation_id(ConversationKey(AGENT, "discord", str(home)))
    )
    assert world.gw.store.own_threads(session.id) == frozenset({str(mine)})
    # another chat's session may not post into the thread this session opened
    world.say(
        other,
        f'{TOOL} discord_reply \'{{"text": "hijack", "chat_id": "{mine}"}}\'; echo other-done',
    )
    wait_for(lambda: any("other-done" in t for t in world.dc.texts(other)), 120, "other's reply")
    assert "P1" in world.dc.texts(other)[-1]
    assert world.dc.texts(mine) == ["into my thread"]
    # the store, not the socket's memory: forget what the socket learnt, still its own
    home_conv = conversation_id(ConversationKey(AGENT, "discord", str(home)))
    state = world.gw.bridge.state(home_conv)
    assert state is not None and str(mine) in state.own_threads
    state.own_threads.clear()
    world.say(
        home, f'{TOOL} discord_reply \'{{"text": "still mine", "chat_id": "{mine}"}}\'; echo again'
    )
    wait_for(lambda: "again" in world.dc.texts(home)[-1], 120, "the second turn")
    assert world.dc.texts(mine) == ["into my thread", "still mine"]
    # a reset starts a new session: it does not inherit the old one's threads
    world.say(home, "!reset")
    wait_for(lambda: "reset" in world.dc.texts(home)[-1].lower(), 60, "the reset")
    world.say(
        home,
        f'{TOOL} discord_reply \'{{"text": "after reset", "chat_id": "{mine}"}}\'; echo reset-done',
    )
    wait_for(lambda: "reset-done" in world.dc.texts(home)[-1], 120, "the turn after the reset")
    assert "P2" in world.dc.texts(home)[-1], "a thread under its channel, not its own any more"
    assert world.dc.texts(mine) == ["into my thread", "still mine"]


def test_P1_react_and_edit_only_the_bots_own_messages_in_this_chat(world: World) -> None:
    chat = world.dc.add_text_channel("edits")
    user_msg = world.say(chat, "echo first")
    world.answers(chat)
    bot_msg = world.dc.messages(chat)[0].message_id
    world.say(
        chat,
        f'{TOOL} discord_react \'{{"emoji": "👍", "message_id": "{user_msg}"}}\'; '
        f'{TOOL} discord_edit \'{{"message_id": "{bot_msg}", "text": "edited by the bot"}}\'; '
        f'{TOOL} discord_edit \'{{"message_id": "{user_msg}", "text": "not mine"}}\'; '
        "echo edits-done",
    )
    wait_for(lambda: "edits-done" in world.dc.texts(chat)[-1], 120, "the turn's reply")
    final = world.dc.texts(chat)[-1]
    assert world.dc.messages(chat)[0].edits == ["edited by the bot"]
    assert "not one this bot sent" in final
    reacts = world.dc.calls_to("PUT", "/@me")
    assert any(f"/messages/{user_msg}/reactions/" in c.path for c in reacts)


def test_W4_typing_shows_while_a_discord_turn_runs(world: World) -> None:
    chat = world.dc.add_text_channel("typing")
    world.say(chat, "sleep 6; echo slept")
    assert world.answers(chat)[0].startswith("slept")
    assert len(world.dc.calls_to("POST", f"/channels/{chat}/typing")) >= 2


def test_P4_only_discord_cdn_files_are_fetched(world: World) -> None:
    chat = world.dc.add_text_channel("downloads")
    dc = world.dc
    refused = {
        "http": "http://cdn.discordapp.com/attachments/1/2/a.txt",
        "other-host": "https://evil.example/attachments/1/2/a.txt",
        "suffix-host": "https://cdn.discordapp.com.evil.example/attachments/1/2/a.txt",
        "userinfo": "https://cdn.discordapp.com@evil.example/attachments/1/2/a.txt",
        "redirect": dc.add_cdn_redirect("https://evil.example/attachments/1/2/a.txt"),
        "loopback-dns": "https://media.discordapp.net/attachments/1/2/lo.txt",
        "oversized-stream": dc.add_cdn_stream(CAP * 3, "big.bin"),
        "oversized-length": dc.add_cdn_file(b"x" * (CAP + 1), "big2.bin"),
    }
    world.dns.answers["media.discordapp.net"] = ["127.0.0.1"]
    script = "; ".join(
        f'{TOOL} discord_download_attachment \'{{"url": "{url}"}}\' 2>&1 | tail -1 '
        f"| sed 's/^/{name}: /'"
        for name, url in refused.items()
    )
    world.say(chat, script + "; ls /workspace/media/; echo end")
    out = world.answers(chat)[0]
    for name in refused:
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name}: "))
        assert "P4" in line, f"{name} was not refused by P4: {line}"
    assert not any("evil" in hit for hit in dc.cdn_hits), "never reached another host"
    # the cloud metadata address, the same way
    world.dns.answers["media.discordapp.net"] = ["93.184.216.34", "169.254.169.254"]
    world.say(
        chat,
        f'{TOOL} discord_download_attachment \'{{"url": "{refused["loopback-dns"]}"}}\'',
    )
    meta = world.answers(chat, 2)[1]
    assert "P4" in meta and "169.254.169.254" in meta
    assert world.refusals(chat).count("P4") == len(refused) + 1, "every refusal audited"
    # a file on Discord's CDN lands in the media directory
    good = dc.add_cdn_file(b"discord-cdn-bytes\n", "notes.txt")
    world.say(
        chat,
        f'{TOOL} discord_download_attachment \'{{"url": "{good}"}}\' > /tmp/r.json; '
        "cat /tmp/r.json; cat \"$(python3 -c 'import json; "
        'print(json.load(open("/tmp/r.json"))["path"])\')"',
    )
    got = world.answers(chat, 3)[2]
    result = json.loads(next(ln for ln in got.splitlines() if ln.startswith("{")))
    assert result["path"] == f"/workspace/media/discord-{chat}/notes.txt"
    assert "discord-cdn-bytes" in got


def test_W6_the_discord_token_never_enters_the_sandbox(world: World) -> None:
    chat = world.dc.add_text_channel("token-scan")
    world.say(
        chat,
        f'{NEEDLE_SH}; env | grep -c "$N"; '
        'grep -rls "$N" /workspace /run/cellgate /tmp /home /etc 2>/dev/null | wc -l; '
        'cat /proc/*/environ 2>/dev/null | tr "\\0" "\\n" | grep -c "$N"; echo scan-done',
    )
    scan = world.answers(chat)[0]
    assert scan.split("\n")[:4] == ["0", "0", "0", "scan-done"], scan


def test_T1_P5_discord_tools_are_offered_and_files_come_from_the_media_dir_only(
    world: World,
) -> None:
    chat = world.dc.add_text_channel("files")
    names_only = (
        ' | python3 -c "import json,sys; '
        "print(' '.join(t['name'] for t in json.load(sys.stdin)['tools']))\""
    )
    world.say(chat, f"{TOOL} list_tools{names_only}")
    names = set(world.answers(chat)[0].split("\n")[0].split())
    assert {
        "discord_reply",
        "discord_react",
        "discord_edit",
        "discord_send_file",
        "discord_create_thread",
        "discord_download_attachment",
    } <= names
    assert not any(n.startswith("telegram_") for n in names)
    media = f"/workspace/media/discord-{chat}"
    world.say(
        chat,
        f"echo pic > {media}/pic.png; ln -s /etc/passwd {media}/link.txt; "
        f'{TOOL} discord_send_file \'{{"path": "pic.png", "caption": "a pic"}}\'; '
        f'{TOOL} discord_send_file \'{{"path": "/etc/passwd"}}\'; '
        f'{TOOL} discord_send_file \'{{"path": "link.txt"}}\'; '
        f'{TOOL} discord_send_file \'{{"path": "../x"}}\'; echo files-done',
    )
    wait_for(lambda: "files-done" in world.dc.texts(chat)[-1], 120, "the turn's reply")
    final = world.dc.texts(chat)[-1]
    assert final.count("P5") >= 3, final
    files = [m for m in world.dc.messages(chat) if m.files]
    assert [(m.files, m.content) for m in files] == [([("pic.png", b"pic\n")], "a pic")]


def test_reset_ends_this_discord_chats_session_only(world: World, tmp_path: Path) -> None:
    x = world.dc.add_text_channel("reset-x")
    y = world.dc.add_text_channel("reset-y")
    world.say(x, "echo x1")
    world.say(y, "echo y1")
    world.answers(x)
    world.answers(y)
    conv_y = conversation_id(ConversationKey(AGENT, "discord", str(y)))
    [sy] = world.gw.store.live_sessions(conversation=conv_y)
    world.say(x, "/reset")
    assert "reset" in world.answers(x, 2)[1].lower()
    conv_x = conversation_id(ConversationKey(AGENT, "discord", str(x)))
    assert world.gw.store.live_sessions(conversation=conv_x) == []
    assert [s.id for s in world.gw.store.live_sessions(conversation=conv_y)] == [sy.id]
