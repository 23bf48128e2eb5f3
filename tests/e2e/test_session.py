"""A session through the whole gateway: composed memory (M5, M3), the bridge (P1, T4, M6), D3."""

from __future__ import annotations

import json

import pytest

from cellgate.models import ConversationKey
from tests.e2e.conftest import LiveGateway

pytestmark = pytest.mark.docker

TOOL = "python3 /run/cellgate/cellgate-tool"


def test_M5_composed_claude_md_holds_persona_and_own_memory_only(live: LiveGateway) -> None:
    live.run("carol", "cd chats/*/ && echo 'carol prefers short answers' >> MEMORY.md")
    text = live.run("carol", "cat $HOME/.claude/CLAUDE.md")
    assert "demo-bot" in text  # AGENTS.md / IDENTITY.md are shared
    assert "carol prefers short answers" in text  # its own memory, composed at spawn
    assert "Operator note" not in text  # never the workspace-root MEMORY.md (M3)
    own = ConversationKey(live.agent, "api", "carol").dir_name
    assert f"/workspace/chats/{own}" in text  # the memory rule names its own files
    other = live.run("dave", "cat $HOME/.claude/CLAUDE.md")
    assert "carol prefers" not in other


def test_P1_T4_bridge_reply_reaches_only_the_origin_chat(live: LiveGateway) -> None:
    r = live.say(
        "erin",
        f'{TOOL} reply \'{{"text": "hello from erin"}}\' && '
        f'{TOOL} narrate \'{{"text": "thinking"}}\' && '
        f'{TOOL} reply \'{{"text": "sneaky", "chat_id": "frank"}}\'; echo status=$?',
    )
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [m["text"] for m in body["meta"].get("messages", [])]
    assert texts == ["hello from erin", "thinking"]
    assert "status=1" in body["reply"] and "P1" in body["reply"]
    refusals = live.gateway.store.refusals()
    assert any(f.rule == "P1" and f.action == "reply" for f in refusals)


def test_M6_memory_append_lands_in_own_files_only(live: LiveGateway) -> None:
    reply = live.run(
        "gina",
        f'{TOOL} task_memory_append \'{{"text": "gina likes jazz"}}\'; '
        f'{TOOL} task_memory_append \'{{"text": "x", "target": "memory/gina.md"}}\'; '
        "echo status=$?; cat chats/*/MEMORY.md",
    )
    assert "status=1" in reply and "M6" in reply
    assert "gina likes jazz" in reply
    ws = live.state_dir / "agents" / live.agent / "workspace"
    assert not (ws / "memory").exists()


def test_D3_transcript_and_session_kept_in_the_conversation_dir(live: LiveGateway) -> None:
    live.run("hana", "echo first")
    live.run("hana", "echo second")
    chat = live.state_dir / "agents" / live.agent / "workspace" / "chats"
    chat = chat / ConversationKey(live.agent, "api", "hana").dir_name
    lines = [json.loads(x) for x in (chat / "transcript.jsonl").read_text().splitlines()]
    assert [x["role"] for x in lines] == ["user", "assistant", "user", "assistant"]
    assert lines[3]["text"].startswith("second")
    assert json.loads((chat / "session.json").read_text())["session"]


def test_M2_memory_is_keyed_by_chat_even_for_one_account(live: LiveGateway) -> None:
    live.run("family-parent-1", "cd chats/*/ && echo 'parent one note' >> MEMORY.md")
    reply = live.run("family-parent-2", "cat chats/*/MEMORY.md; echo /workspace/chats/*")
    assert "parent one note" not in reply
    one = ConversationKey(live.agent, "api", "family-parent-1").dir_name
    assert one not in reply
