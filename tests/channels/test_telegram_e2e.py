"""Telegram end to end: the real library, a real gateway over HTTP, a real engine (W1-W6, P3, T1).

The stand-in plays Telegram: it posts updates to the gateway's webhook as
Telegram does and records what the bot posts. The agent runs the shell
harness, so a chat's message is a shell command in that chat's sandbox: the
tests act as a hostile stranger from inside.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cellgate.models import ConversationKey
from channels.telegram import RESET_TEXT, TYPING_EVERY
from orchestrator.config import read_config_document, write_config_document
from orchestrator.gateway import Gateway
from orchestrator.store import conversation_id
from sandbox.backends.docker import DockerBackend
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.fakes.telegram_standin import TelegramStandin
from tests.support.served import free_port, served_gateway

pytestmark = pytest.mark.docker

APP = "tge2e"
AGENT = f"{APP}-bot"
TOKEN_ENV = "CELLGATE_TEST_TG_TOKEN"
TOKEN = "424242:e2eTokenSecretValueXYZ0123456789abcdefgh"
# built in the sandbox from two halves, so no command text ever holds the whole token
NEEDLE_SH = "N=\"$(printf '%s' 'e2eTokenSecret')ValueXYZ\""
TOOL = "python3 /run/cellgate/cellgate-tool"
TYPING_EVERY_S = TYPING_EVERY


@dataclass
class World:
    tg: TelegramStandin
    gw: Gateway
    url: str
    state: Path

    def say(self, chat: int, text: str | None = None, **kw: Any) -> dict[str, Any]:
        update = self.tg.user_update(chat, text, **kw)
        r = self.tg.post_to_webhook(update)
        assert r.status_code == 200, r.text
        return update

    def answers(self, chat: int, n: int = 1, timeout: float = 120) -> list[str]:
        wait_for(lambda: len(self.tg.texts(chat)) >= n, timeout, f"{n} answers in chat {chat}")
        return self.tg.texts(chat)

    def messages_of(self, chat: int) -> int:
        conv = conversation_id(ConversationKey(AGENT, "telegram", str(chat)))
        with self.gw.store._db.read() as c:
            row = c.execute(
                "SELECT count(*) FROM messages WHERE conversation_id = ?", (conv,)
            ).fetchone()
        return int(row[0])


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
    port = free_port()
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN
    try:
        with TelegramStandin(TOKEN) as tg:
            doc = read_config_document(config_path)
            doc["agents"][0]["channels"] = {
                "telegram": {
                    "tokenEnv": TOKEN_ENV,
                    "mode": "webhook",
                    "webhookUrl": f"http://127.0.0.1:{port}/v1/telegram/{AGENT}/webhook",
                    "baseUrl": tg.base_url,
                    "baseFileUrl": tg.base_file_url,
                }
            }
            write_config_document(config_path, doc)
            with served_gateway(config_path, DockerBackend.from_env, port=port, start=True) as (
                url,
                gw,
            ):
                yield World(tg, gw, url, config_path.parent)
    finally:
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved
        remove_app_containers(docker_client, APP)


def test_W1_W2_start_registers_the_webhook_with_a_generated_secret(world: World) -> None:
    assert world.tg.webhook_url == f"{world.url}/v1/telegram/{AGENT}/webhook"
    secret = world.tg.webhook_secret
    assert secret and len(secret) >= 32
    stored = world.state / "telegram" / f"{AGENT}.secret"
    assert stored.read_text().strip() == secret
    assert stored.stat().st_mode & 0o077 == 0, "the secret file is private (0600)"


def test_W5_two_chats_two_sandboxes_each_answered_in_its_own_chat(world: World) -> None:
    a, b = 910001, -100910002  # a private chat and a group
    world.say(a, "hostname; echo alpha-note-A > $HOME/a-note.txt; echo wrote-a")
    first_a = world.answers(a)[0]
    world.say(
        b,
        "hostname; cat $HOME/a-note.txt 2>&1; "
        'grep -rls "alpha-note-$(echo A)" /workspace /home /tmp /run 2>/dev/null; echo scanned-b',
        user_id=77,
    )
    first_b = world.answers(b)[0]
    assert "wrote-a" in first_a and "scanned-b" in first_b
    assert "alpha-note-A" not in first_b, "chat B's shell found chat A's file"
    assert first_a.splitlines()[0] != first_b.splitlines()[0], "two different sandboxes"
    assert all("scanned-b" not in t for t in world.tg.texts(a))
    assert all("wrote-a" not in t for t in world.tg.texts(b))
    sandboxes = {s.conversation_id: s.name for s in world.gw.store.sandboxes(APP)}
    conv_a = conversation_id(ConversationKey(AGENT, "telegram", str(a)))
    conv_b = conversation_id(ConversationKey(AGENT, "telegram", str(b)))
    assert sandboxes[conv_a] != sandboxes[conv_b]


def test_W2_forged_webhooks_get_403_and_nothing_is_stored_or_run(world: World) -> None:
    chat = 910003
    update = world.tg.user_update(chat, "echo should-never-run")
    assert world.tg.post_to_webhook(update, secret=None).status_code == 403
    assert world.tg.post_to_webhook(update, secret="wrong-secret").status_code == 403
    assert (
        world.tg.post_to_webhook(update, secret=str(world.tg.webhook_secret)[:-1] + "x").status_code
        == 403
    )
    # the right body for another agent's route: refused too (the route reveals nothing)
    r = httpx.post(
        f"{world.url}/v1/telegram/no-such-agent/webhook",
        json=update,
        headers={"X-Telegram-Bot-Api-Secret-Token": str(world.tg.webhook_secret)},
    )
    assert r.status_code == 403
    time.sleep(1.0)
    assert world.messages_of(chat) == 0
    assert world.tg.texts(chat) == []
    conv = conversation_id(ConversationKey(AGENT, "telegram", str(chat)))
    assert world.gw.store.get_conversation(conv) is None


def test_W3_a_redelivered_update_is_answered_once(world: World) -> None:
    chat = 910004
    update = world.tg.user_update(chat, "echo once-only")
    for _ in range(3):
        assert world.tg.post_to_webhook(update).status_code == 200
    world.answers(chat)
    assert world.tg.post_to_webhook(update).status_code == 200  # after the answer, too
    time.sleep(2.0)
    assert world.tg.texts(chat) == ["once-only\n[exit 0]"]
    assert world.messages_of(chat) == 1


def test_W4_a_10000_char_reply_arrives_as_ordered_parts_under_4096(world: World) -> None:
    chat = 910005
    script = (
        "python3 -c \"import sys; sys.stdout.write(''.join('%04d %s\\n' % (i, 'q' * 44) "
        'for i in range(200)))"'
    )
    world.say(chat, script)
    expected = "".join(f"{i:04d} {'q' * 44}\n" for i in range(200)) + "[exit 0]"
    assert len(expected) > 10_000
    world.answers(chat, 3)
    time.sleep(1.0)
    parts = world.tg.texts(chat)
    assert len(parts) == 3
    assert all(len(p) < 4096 for p in parts)
    assert "".join(parts) == expected, "in order, nothing lost"


def test_W4_a_429_is_waited_out_and_the_reply_arrives_once(world: World) -> None:
    chat = 910006
    world.tg.rate_limit("sendMessage", retry_after=2)
    world.say(chat, "echo after-the-flood-wait")
    world.answers(chat)
    time.sleep(3.0)
    assert world.tg.texts(chat) == ["after-the-flood-wait\n[exit 0]"]
    tries = [c for c in world.tg.calls_of("sendMessage") if c.params.get("chat_id") == str(chat)]
    assert len(tries) == 2, "one 429, then the one post"
    assert tries[1].at - tries[0].at >= 1.9


def _result_of(reply: str) -> dict[str, Any]:
    line = next(ln for ln in reply.splitlines() if ln.startswith("{"))
    doc: dict[str, Any] = json.loads(line)
    return doc


def test_P3_W6_downloads_only_this_chats_files_and_the_token_never_enters(
    world: World,
) -> None:
    a, b = 910007, 910008
    fa = world.tg.add_file(b"alpha-file-bytes", "a.txt")
    world.say(a, document=(fa, "a.txt"), caption="echo got-a")
    assert "got-a" in world.answers(a)[0]
    # chat B names chat A's file_id: valid for the bot, not delivered in B
    world.say(b, f'{TOOL} telegram_download_attachment \'{{"file_id": "{fa}"}}\'; echo tried')
    refused = world.answers(b)[0]
    assert "P3" in refused and "alpha-file-bytes" not in refused
    conv_b = conversation_id(ConversationKey(AGENT, "telegram", str(b)))
    assert any(r.rule == "P3" for r in world.gw.store.refusals(conv_b)), "audited"
    # its own file lands in its media directory
    fb = world.tg.add_file(b"bravo-file-bytes", "b.txt")
    world.say(
        b,
        document=(fb, "b.txt"),
        caption=f'{TOOL} telegram_download_attachment \'{{"file_id": "{fb}"}}\' > /tmp/r.json;'
        " cat /tmp/r.json; cat \"$(python3 -c 'import json; "
        'print(json.load(open("/tmp/r.json"))["path"])\')"',
    )
    got = world.answers(b, 2)[1]
    result = _result_of(got)
    assert result["path"].startswith(f"/workspace/media/telegram-{b}/")
    assert "bravo-file-bytes" in got
    assert TOKEN not in got and "e2eTokenSecret" not in result["path"]
    # asked again, the same copy: a repeated call cannot fill the disk
    fetched = len(world.tg.calls_of("getFile"))
    world.say(b, f'{TOOL} telegram_download_attachment \'{{"file_id": "{fb}"}}\'')
    assert _result_of(world.answers(b, 3)[2])["path"] == result["path"]
    assert len(world.tg.calls_of("getFile")) == fetched
    # the token is nowhere in the sandbox: environment, files, processes
    world.say(
        b,
        f'{NEEDLE_SH}; env | grep -c "$N"; '
        'grep -rls "$N" /workspace /run/cellgate /tmp /home /etc 2>/dev/null | wc -l; '
        'cat /proc/*/environ 2>/dev/null | tr "\\0" "\\n" | grep -c "$N"; echo scan-done',
    )
    scan = world.answers(b, 4)[3]
    assert scan.split("\n")[:4] == ["0", "0", "0", "scan-done"], scan


def test_T1_a_telegram_session_is_offered_the_telegram_module_an_api_session_is_not(
    world: World,
) -> None:
    chat = 910009
    names_only = (
        ' | python3 -c "import json,sys; '
        "print(' '.join(t['name'] for t in json.load(sys.stdin)['tools']))\""
    )
    world.say(chat, f"{TOOL} list_tools{names_only}")
    names = set(world.answers(chat)[0].split("\n")[0].split())
    assert {
        "telegram_reply",
        "telegram_react",
        "telegram_edit",
        "telegram_send_file",
        "telegram_download_attachment",
    } <= names
    r = httpx.post(
        f"{world.url}/v1/agents/{AGENT}/chats/api-chat-t1/messages",
        json={"text": f"{TOOL} list_tools{names_only}"},
        headers={"Authorization": f"Bearer {CONFIG_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    api_names = set(r.json()["reply"].split("\n")[0].split())
    assert not any(n.startswith("telegram_") for n in api_names)
    assert "reply" in api_names


def test_P1_P5_bridge_tools_post_into_this_chat_only(world: World) -> None:
    chat, other = 910010, 910011
    world.say(other, "echo other-chat")
    world.answers(other)
    world.say(
        chat,
        "echo pic > /workspace/media/telegram-910010/pic.png; "
        f'{TOOL} telegram_reply \'{{"text": "from the tool"}}\'; '
        f'{TOOL} telegram_reply \'{{"text": "hijack", "chat_id": "{other}"}}\'; '
        f'{TOOL} telegram_send_file \'{{"path": "pic.png", "caption": "a pic"}}\'; '
        f'{TOOL} telegram_send_file \'{{"path": "/etc/passwd"}}\'; echo end',
    )
    wait_for(lambda: any("end" in t for t in world.tg.texts(chat)), 120, "the turn's reply")
    texts = world.tg.texts(chat)
    assert "from the tool" in texts
    assert world.tg.texts(other) == ["other-chat\n[exit 0]"], "nothing posted into another chat"
    final = texts[-1]
    assert "P1" in final and "P5" in final
    files = [m for m in world.tg.messages(chat) if m.kind == "photo"]
    assert [(f.data, f.text) for f in files] == [(b"pic\n", "a pic")]


def test_W2_a_right_secret_with_a_bad_body_is_refused_and_nothing_stored(world: World) -> None:
    hook = str(world.tg.webhook_url)
    secret = {"X-Telegram-Bot-Api-Secret-Token": str(world.tg.webhook_secret)}
    assert httpx.post(hook, content=b"not json", headers=secret).status_code == 400
    assert httpx.post(hook, json={"message": {}}, headers=secret).status_code == 400
    assert httpx.post(hook, json=[1, 2], headers=secret).status_code == 400
    big = b'{"update_id": 1, "pad": "' + b"x" * (1024 * 1024) + b'"}'
    assert httpx.post(hook, content=big, headers=secret).status_code == 413
    # an update the bot does not answer (a member joined): acknowledged, nothing stored
    service = {"update_id": 999001, "message": {"message_id": 1, "date": 1,
               "chat": {"id": 910012, "type": "group", "title": "g"},
               "new_chat_members": [{"id": 5, "is_bot": False, "first_name": "x"}]}}  # fmt: skip
    assert world.tg.post_to_webhook(service).status_code == 200
    time.sleep(0.5)
    assert world.messages_of(910012) == 0


def test_W4_typing_shows_while_the_turn_runs(world: World) -> None:
    chat = 910013
    world.say(chat, "sleep 6; echo slept")
    assert world.answers(chat)[0].startswith("slept")
    typing = [
        c
        for c in world.tg.calls_of("sendChatAction")
        if c.params.get("chat_id") == str(chat) and c.params.get("action") == "typing"
    ]
    assert len(typing) >= 2, "repeated while the turn ran"
    time.sleep(TYPING_EVERY_S + 1)
    again = [c for c in world.tg.calls_of("sendChatAction") if c.params.get("chat_id") == str(chat)]
    assert len(again) == len(typing), "and stopped once it was answered"


def test_reset_ends_this_chats_session_only(world: World) -> None:
    x, y = 910014, 910015
    world.say(x, "echo x1")
    world.say(y, "echo y1")
    world.answers(x)
    world.answers(y)
    conv_x = conversation_id(ConversationKey(AGENT, "telegram", str(x)))
    conv_y = conversation_id(ConversationKey(AGENT, "telegram", str(y)))
    [sx] = world.gw.store.live_sessions(conversation=conv_x)
    [sy] = world.gw.store.live_sessions(conversation=conv_y)
    world.say(x, "/reset")
    assert world.answers(x, 2)[1] == RESET_TEXT
    assert world.gw.store.live_sessions(conversation=conv_x) == []
    assert [s.id for s in world.gw.store.live_sessions(conversation=conv_y)] == [sy.id]
    world.say(x, "echo x2")
    assert world.answers(x, 3)[2].startswith("x2")
    [new] = world.gw.store.live_sessions(conversation=conv_x)
    assert new.id != sx.id
