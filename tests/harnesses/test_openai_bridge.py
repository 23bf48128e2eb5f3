"""The OpenAI-compatible harness's bridge tools (H2, P1, M6, M8, T4) end to end.

The model (a loopback stand-in) calls `reply`, `task_memory_append` and
`narrate`; the harness runs the real `cellgate-tool` client inside the real
sandbox, which reaches the gateway's real bridge server over the
conversation's socket, mounted read-only at /run/cellgate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from orchestrator.bridge import (
    BridgeScope,
    BridgeServer,
    BuiltinTools,
    PendingOutbox,
    StoreRefusals,
    ToolHandlers,
    install_client,
)
from orchestrator.harnesses.base import TurnRequest
from orchestrator.harnesses.openai import SANDBOX_TOOLS, OpenAIHarness
from orchestrator.store import SessionId, Store
from sandbox.backends.docker import DockerBackend
from tests.fakes.openai_standin import OpenAIStandin, calls, final, tool_results
from tests.harnesses.conftest import Sandboxed

pytestmark = pytest.mark.docker

KEY = "sk-bridgeKEY-0123456789abcdef"


@pytest.fixture
def ai() -> Iterator[OpenAIStandin]:
    with OpenAIStandin(key=KEY) as server:
        yield server


async def test_H2_bridge_tools_go_through_the_conversations_own_socket(
    ai: OpenAIStandin,
    sandboxes: Callable[[str], Sandboxed],
    backend: DockerBackend,
    tmp_path: Path,
) -> None:
    sb = sandboxes("openai-bridge")
    paths = sb.prepared.paths
    store = Store.open(tmp_path)
    outbox = PendingOutbox()
    handlers = BuiltinTools(outbox, store, tmp_path / "spool").install(
        ToolHandlers(refusals=StoreRefusals(store))
    )
    server = BridgeServer(handlers)
    conv = store.upsert_conversation(sb.key)
    store.open_session(conv.id, "openai", session_id=SessionId(sb.session_id))
    install_client(paths.bridge_dir)
    scope = BridgeScope.for_conversation(sb.key, sb.session_id, paths)
    await server.open(scope)
    try:
        ai.script(
            calls(
                ("reply", {"text": "working on it"}),
                ("reply", {"text": "psst", "chat_id": "someone-else"}),
                ("task_memory_append", {"text": "likes green tea", "target": "USER.md"}),
                ("task_memory_append", {"text": "note", "target": "memory/notes.md"}),
                ("task_memory_append", {"text": "password: hunter2-hunter2"}),
                ("narrate", {"text": "thinking"}),
            ),
            final("done"),
        )
        harness = OpenAIHarness(base_url=ai.base_url, model="m", api_key=SecretStr(KEY))
        tools = handlers.definitions(scope)  # what the gateway hands a turn (H1)
        result = await harness.dispatch(sb.ctx(backend), TurnRequest("hello", tools=tools))
        assert result.ok, result
        offered = [t["function"]["name"] for t in ai.requests[0].body["tools"]]
        assert offered == [t.name for t in (*SANDBOX_TOOLS, *tools)]
        assert {"reply", "task_memory_append", "narrate"} <= set(offered)
        r = tool_results(ai.requests[1].body)
        assert r[0].rstrip().endswith("[exit 0]"), r[0]
        assert "P1" in r[1] and "[exit 1]" in r[1]  # another chat: refused by the gateway
        assert r[2].rstrip().endswith("[exit 0]"), r[2]
        assert "M6" in r[3] and "[exit 1]" in r[3]
        assert "M8" in r[4] and "[exit 1]" in r[4]
        assert r[5].rstrip().endswith("[exit 0]"), r[5]
        sent = [(m.chat_id, m.text) for m in outbox.take(scope.conversation_id)]
        assert ("openai-bridge", "working on it") in sent
        assert all(chat == "openai-bridge" for chat, _ in sent)
        assert "likes green tea" in (paths.chat_dir / "USER.md").read_text()
        assert "hunter2" not in (paths.chat_dir / "MEMORY.md").read_text()
        assert not (paths.chat_dir / "memory").exists()
    finally:
        await server.close_all()
        store.close()
