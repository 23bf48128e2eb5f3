"""LINE end to end: the real SDK, a real gateway over HTTP, a real engine (W1-W6, P1, P2, P5, T1).

The stand-in plays LINE: it posts signed webhooks to the gateway as LINE does
and records what the bot posts. The agent runs the shell harness, so a
chat's message is a shell command in that chat's sandbox: the tests act as a
hostile stranger from inside.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cellgate.models import ConversationKey
from orchestrator.config import read_config_document, write_config_document
from orchestrator.gateway import Gateway
from orchestrator.store import conversation_id
from sandbox.backends.docker import DockerBackend
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.fakes.line_standin import LineStandin, sign
from tests.support.served import free_port, served_gateway

pytestmark = pytest.mark.docker

APP = "linee2e"
AGENT = f"{APP}-bot"
SECRET_ENV = "CELLGATE_TEST_LINE_SECRET"
TOKEN_ENV = "CELLGATE_TEST_LINE_TOKEN"
SECRET = "e2eLineChannelSecret0123456789ab"
TOKEN = "e2eLineAccessTokenValueXYZ0123456789abcdefgh"
# built in the sandbox from two halves, so no command text ever holds the whole token
NEEDLE_SH = "N=\"$(printf '%s' 'e2eLineAccessToken')ValueXYZ\""
TOOL = "python3 /run/cellgate/cellgate-tool"
PNG = b"\x89PNG\r\n\x1a\n" + b"standin-png-body"


@dataclass
class World:
    line: LineStandin
    gw: Gateway
    url: str

    @property
    def hook(self) -> str:
        return f"{self.url}/v1/line/{AGENT}/webhook"

    def send(self, event: dict[str, Any]) -> dict[str, Any]:
        r = self.line.post_webhook(self.hook, [event])
        assert r.status_code == 200, r.text
        return event

    def say(self, source: dict[str, Any], text: str) -> dict[str, Any]:
        return self.send(self.line.text_event(source, text))

    def answers(self, chat: str, n: int = 1, timeout: float = 120) -> list[str]:
        wait_for(lambda: len(self.line.texts(chat)) >= n, timeout, f"{n} answers in {chat}")
        return self.line.texts(chat)

    def messages_of(self, chat: str) -> int:
        conv = conversation_id(ConversationKey(AGENT, "line", chat))
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
    saved = {k: os.environ.get(k) for k in (SECRET_ENV, TOKEN_ENV)}
    os.environ[SECRET_ENV] = SECRET
    os.environ[TOKEN_ENV] = TOKEN
    try:
        with LineStandin(TOKEN, SECRET) as line:
            doc = read_config_document(config_path)
            doc["agents"][0]["channels"] = {
                "line": {
                    "channelSecretEnv": SECRET_ENV,
                    "accessTokenEnv": TOKEN_ENV,
                    "apiBaseUrl": line.base_url,
                    "dataApiBaseUrl": line.base_url,
                    "publicUrl": f"http://127.0.0.1:{port}",
                }
            }
            write_config_document(config_path, doc)
            with served_gateway(config_path, DockerBackend.from_env, port=port, start=True) as (
                url,
                gw,
            ):
                yield World(line, gw, url)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        remove_app_containers(docker_client, APP)


def _result_of(reply: str) -> dict[str, Any]:
    line = next(ln for ln in reply.splitlines() if ln.startswith("{"))
    doc: dict[str, Any] = json.loads(line)
    return doc


def test_W5_two_chats_two_sandboxes_each_answered_in_its_own_chat(world: World) -> None:
    a, b = "Ue2eUserAlpha0001", "Ce2eGroupBravo0002"
    world.say(world.line.user(a), "hostname; echo alpha-note-A > $HOME/a-note.txt; echo wrote-a")
    first_a = world.answers(a)[0]
    world.say(
        world.line.group(b, "Umember77"),
        "hostname; cat $HOME/a-note.txt 2>&1; "
        'grep -rls "alpha-note-$(echo A)" /workspace /home /tmp /run 2>/dev/null; echo scanned-b',
    )
    first_b = world.answers(b)[0]
    assert "wrote-a" in first_a and "scanned-b" in first_b
    assert "alpha-note-A" not in first_b, "chat B's shell found chat A's file"
    assert first_a.splitlines()[0] != first_b.splitlines()[0], "two different sandboxes"
    assert all("scanned-b" not in t for t in world.line.texts(a))
    assert all("wrote-a" not in t for t in world.line.texts(b))
    assert [p.via for p in world.line.messages(a)] == ["reply"], "a fresh token is replied with"
    sandboxes = {s.conversation_id: s.name for s in world.gw.store.sandboxes(APP)}
    conv_a = conversation_id(ConversationKey(AGENT, "line", a))
    conv_b = conversation_id(ConversationKey(AGENT, "line", b))
    assert sandboxes[conv_a] != sandboxes[conv_b]


def test_W2_unsigned_wrongly_signed_or_reserialised_webhooks_are_refused_nothing_stored(
    world: World,
) -> None:
    chat = "Ue2eForged0003"
    event = world.line.text_event(world.line.user(chat), "echo should-never-run")
    raw = world.line.body([event])
    good = sign(SECRET, raw)
    assert world.line.post_webhook(world.hook, raw=raw, signature=None).status_code == 403
    assert world.line.post_webhook(world.hook, raw=raw, signature="").status_code == 403
    assert world.line.post_webhook(world.hook, raw=raw, signature="d3Jvbmc=").status_code == 403
    wrong_key = sign("not-the-channel-secret", raw)
    assert world.line.post_webhook(world.hook, raw=raw, signature=wrong_key).status_code == 403
    # the same content, other bytes: the signature is over the bytes, not the JSON
    for other in (
        json.dumps(json.loads(raw), indent=2).encode(),
        json.dumps(json.loads(raw), separators=(",", ":")).encode(),
        json.dumps(json.loads(raw), sort_keys=True).encode(),
    ):
        assert other != raw and json.loads(other) == json.loads(raw)
        r = world.line.post_webhook(world.hook, raw=other, signature=good)
        assert r.status_code == 403, r.text
    # a good signature for another agent's route: refused too (the route reveals nothing)
    r = world.line.post_webhook(f"{world.url}/v1/line/no-such-agent/webhook", raw=raw)
    assert r.status_code == 403
    big = b'{"events": [], "pad": "' + b"x" * (1024 * 1024) + b'"}'
    assert world.line.post_webhook(world.hook, raw=big).status_code == 413
    signed_junk = b"not json"
    assert world.line.post_webhook(world.hook, raw=signed_junk).status_code == 400
    time.sleep(1.0)
    assert world.messages_of(chat) == 0
    assert world.line.texts(chat) == []
    conv = conversation_id(ConversationKey(AGENT, "line", chat))
    assert world.gw.store.get_conversation(conv) is None
    # LINE's "Verify" button posts an empty event list: acknowledged
    assert world.line.post_webhook(world.hook, []).status_code == 200


def test_W3_a_replayed_event_is_answered_once(world: World) -> None:
    chat = "Ue2eReplay0004"
    event = world.line.text_event(world.line.user(chat), "echo once-only")
    raw = world.line.body([event])
    for _ in range(3):
        assert world.line.post_webhook(world.hook, raw=raw).status_code == 200
    world.answers(chat)
    redelivered = {**event, "deliveryContext": {"isRedelivery": True}}
    assert world.line.post_webhook(world.hook, [redelivered]).status_code == 200
    time.sleep(2.0)
    assert world.line.texts(chat) == ["once-only\n[exit 0]"]
    assert world.messages_of(chat) == 1


def test_W4_an_expired_reply_token_falls_back_to_push_and_a_lost_push_posts_once(
    world: World,
) -> None:
    chat = "Ue2eExpired0005"
    world.line.token_seconds = 0.0  # every token is stale when the answer is ready
    world.line.lose_push_answers(1)  # and LINE's answer to the push is lost: retried
    try:
        world.say(world.line.user(chat), "echo late-answer")
        assert world.answers(chat) == ["late-answer\n[exit 0]"]
    finally:
        world.line.token_seconds = 60.0
    time.sleep(1.0)
    [posted] = world.line.messages(chat)
    assert posted.via == "push" and posted.retry_key
    refused = [c for c in world.line.calls_of("/v2/bot/message/reply") if c.status == 400]
    assert refused, "the expired token was tried and refused"

    def pushes_of() -> list[Any]:
        return [c for c in world.line.calls_of("/v2/bot/message/push") if c.body["to"] == chat]

    wait_for(lambda: len(pushes_of()) >= 2, 30, "the retried push")
    time.sleep(1.0)
    pushes = pushes_of()
    assert world.line.texts(chat) == ["late-answer\n[exit 0]"]
    assert [c.status for c in pushes] == [500, 409], "one post; the retry got LINE's 409"
    assert {c.headers["x-line-retry-key"] for c in pushes} == {posted.retry_key}


def test_W4_a_long_answer_is_split_at_5000_and_arrives_in_order(world: World) -> None:
    chat = "Ue2eLong0006"
    script = (
        "python3 -c \"import sys; sys.stdout.write(''.join('%05d %s\\n' % (i, 'q' * 93) "
        'for i in range(120)))"'
    )
    world.say(world.line.user(chat), script)
    expected = "".join(f"{i:05d} {'q' * 93}\n" for i in range(120)) + "[exit 0]"
    world.answers(chat, 3)
    time.sleep(1.0)
    parts = world.line.texts(chat)
    assert len(parts) == 3 and all(len(p) <= 5000 for p in parts)
    assert "".join(parts) == expected


def test_T1_a_line_session_is_offered_the_line_module_only(world: World) -> None:
    chat = "Ue2eTools0007"
    names_only = (
        ' | python3 -c "import json,sys; '
        "print(' '.join(t['name'] for t in json.load(sys.stdin)['tools']))\""
    )
    world.say(world.line.user(chat), f"{TOOL} list_tools{names_only}")
    names = set(world.answers(chat)[0].split("\n")[0].split())
    assert {"line_reply", "line_image", "line_download_content"} <= names
    assert not any(n.startswith("telegram_") for n in names)
    r = httpx.post(
        f"{world.url}/v1/agents/{AGENT}/chats/api-chat-line-t1/messages",
        json={"text": f"{TOOL} list_tools{names_only}"},
        headers={"Authorization": f"Bearer {CONFIG_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert not any(n.startswith("line_") for n in r.json()["reply"].split("\n")[0].split())


def test_P1_line_reply_posts_into_this_chat_only(world: World) -> None:
    chat, other = "Ue2eReplyP1a0008", "Ue2eReplyP1b0009"
    world.say(world.line.user(other), "echo other-chat")
    world.answers(other)
    world.say(
        world.line.user(chat),
        f'{TOOL} line_reply \'{{"text": "from the tool"}}\'; '
        f'{TOOL} line_reply \'{{"text": "hijack", "chat_id": "{other}"}}\'; echo end',
    )
    wait_for(lambda: any("end" in t for t in world.line.texts(chat)), 120, "the turn's reply")
    assert "from the tool" in world.line.texts(chat)
    assert "P1" in world.line.texts(chat)[-1]
    assert world.line.texts(other) == ["other-chat\n[exit 0]"], "nothing posted into another chat"


def test_P5_line_image_refuses_symlinks_dotdot_and_outside_files_publishes_a_real_one(
    world: World,
) -> None:
    chat, other = "Ue2eImage0010", "Ue2eImageOther0011"
    media = f"/workspace/media/line-{chat}"
    world.say(world.line.user(other), "echo other")
    world.answers(other)
    world.say(
        world.line.user(chat),
        f"mkdir -p {media}; python3 -c \"open('{media}/pic.png', 'wb')"
        f".write(bytes.fromhex('{PNG.hex()}'))\"; cp {media}/pic.png /tmp/out.png; "
        f"ln -sf /etc/passwd {media}/evil.png; ln -sf /tmp/out.png {media}/out.png; "
        f"for p in evil.png out.png ../line-{other}/x.png ../../etc/passwd /tmp/out.png "
        f'/etc/hostname; do {TOOL} line_image "{{\\"path\\": \\"$p\\"}}"; echo; done; '
        "echo refusals-done",
    )
    refusals = world.answers(chat)[0]
    assert "refusals-done" in refusals
    assert refusals.count("P5") >= 6, refusals
    assert not [m for m in world.line.messages(chat) if m.message.get("type") == "image"]
    conv = conversation_id(ConversationKey(AGENT, "line", chat))
    assert sum(r.rule == "P5" for r in world.gw.store.refusals(conv)) >= 6, "audited"
    # a JPEG/PNG inside the media directory is published by a signed URL that expires
    world.say(
        world.line.user(chat), f'{TOOL} line_image \'{{"path": "pic.png", "caption": "a pic"}}\''
    )
    texts = world.answers(chat, 3)  # the refusals, the caption, the tool's answer
    assert texts[1] == "a pic", "the caption follows the picture"
    result = _result_of(texts[2])
    [img] = [m for m in world.line.messages(chat) if m.message.get("type") == "image"]
    url = str(img.message["originalContentUrl"])
    assert url.startswith(f"{world.url}/v1/line/{AGENT}/images/{result['share_id']}/")
    got = httpx.get(url)
    assert got.status_code == 200 and got.content == PNG
    share, expires, sig = url.rsplit("/", 3)[1:]
    base = url.rsplit("/", 3)[0]
    assert httpx.get(f"{base}/{share}/{int(expires) + 9999}/{sig}").status_code == 404
    assert httpx.get(f"{base}/{share}/{expires}/{sig[:-2]}AA").status_code == 404
    assert world.line.texts(other) == ["other\n[exit 0]"], "nothing into another chat"
    # the session may revoke its link (P6): LINE gets 410 from then on
    world.say(world.line.user(chat), f'{TOOL} line_image \'{{"path": "pic.png"}}\'')
    second = _result_of(world.answers(chat, 4)[3])
    [_, img2] = [m for m in world.line.messages(chat) if m.message.get("type") == "image"]
    url2 = str(img2.message["originalContentUrl"])
    assert httpx.get(url2).status_code == 200
    world.say(world.line.user(chat), f'{TOOL} revoke_share \'{{"share": "{second["share_id"]}"}}\'')
    assert "revoked" in world.answers(chat, 5)[4]
    gone = httpx.get(url2)
    assert gone.status_code == 410 and gone.json()["error"]["rule"] == "P6"
    assert httpx.get(url).status_code == 200, "the other link still works"
    # the link dies with the session: /reset ends it
    world.say(world.line.user(chat), "/reset")
    wait_for(lambda: httpx.get(url).status_code == 410, 30, "the image link revoked")


def test_W6_content_by_message_id_this_chats_only_and_the_token_never_enters(
    world: World,
) -> None:
    a, b = "Ue2eContentA0012", "Ue2eContentB0013"
    fa = world.send(world.line.file_event(world.line.user(a), b"alpha-file-bytes", "a.txt"))
    world.answers(a)  # the shell harness answers the attachment note
    mid_a = fa["message"]["id"]
    world.say(world.line.user(b), f'{TOOL} line_download_content \'{{"message_id": "{mid_a}"}}\'')
    refused = world.answers(b)[0]
    assert "W6" in refused and "alpha-file-bytes" not in refused
    fb = world.send(world.line.file_event(world.line.user(b), b"bravo-file-bytes", "b.txt"))
    world.answers(b, 2)
    mid_b = fb["message"]["id"]
    world.say(
        world.line.user(b),
        f'{TOOL} line_download_content \'{{"message_id": "{mid_b}"}}\' > /tmp/r.json;'
        " cat /tmp/r.json; cat \"$(python3 -c 'import json; "
        'print(json.load(open("/tmp/r.json"))["path"])\')"',
    )
    got = world.answers(b, 3)[2]
    assert _result_of(got)["path"].startswith(f"/workspace/media/line-{b}/")
    assert "bravo-file-bytes" in got
    world.say(
        world.line.user(b),
        f'{NEEDLE_SH}; env | grep -c "$N"; '
        'grep -rls "$N" /workspace /run/cellgate /tmp /home /etc 2>/dev/null | wc -l; '
        'cat /proc/*/environ 2>/dev/null | tr "\\0" "\\n" | grep -c "$N"; echo scan-done',
    )
    scan = world.answers(b, 4)[3]
    assert scan.split("\n")[:4] == ["0", "0", "0", "scan-done"], scan
