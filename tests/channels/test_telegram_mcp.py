"""T1 for every harness: a Claude Code or Codex session is offered the bridge's MCP server only.

The presets start the CLI with `cellgate-mcp` as its one MCP server (Claude
Code: `--mcp-config` and `--strict-mcp-config`; Codex: `-c mcp_servers...`).
A scripted stand-in CLI in a real sandbox reads that configuration, starts the
server over stdio as the real CLIs do, and lists its tools: a Telegram
session sees exactly what the T1 policy offers it, the `telegram` module
included; an API session on the same sandbox's socket sees no `telegram_*`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cellgate.models import ConversationKey
from orchestrator.bridge import (
    BridgeScope,
    BridgeServer,
    BuiltinTools,
    PendingOutbox,
    StoreRefusals,
    ToolHandlers,
    install_client,
)
from orchestrator.bridge.telegram_tools import TelegramTools
from orchestrator.harnesses.base import TurnRequest
from orchestrator.harnesses.command import CommandHarness
from orchestrator.store import Store
from sandbox.backends.docker import DockerBackend
from tests.harnesses.conftest import (  # noqa: F401 - the harness suite's fixtures
    Sandboxed,
    backend,
    fake_cli_image,
    sandboxes,
)

pytestmark = pytest.mark.docker

TELEGRAM_TOOLS = {
    "telegram_reply",
    "telegram_react",
    "telegram_edit",
    "telegram_send_file",
    "telegram_download_attachment",
}


def _listed(reply: str) -> dict[str, Any]:
    facts: dict[str, Any] = json.loads(reply)
    return facts["mcp"]


@pytest.mark.parametrize("preset", ["claude", "codex"])
async def test_T1_preset_cli_sessions_get_only_the_bridge_mcp_server_and_the_t1_tools(
    preset: str,
    sandboxes: Callable[[str], Sandboxed],  # noqa: F811
    backend: DockerBackend,  # noqa: F811
    tmp_path: Path,
) -> None:
    sb = sandboxes(f"mcp-{preset}")
    paths = sb.prepared.paths
    store = Store.open(tmp_path)
    builtin = BuiltinTools(PendingOutbox(), store, tmp_path / "spool")
    handlers = builtin.install(ToolHandlers(refusals=StoreRefusals(store)))
    handlers = TelegramTools(builtin, {}).install(handlers)
    server = BridgeServer(handlers)
    install_client(paths.bridge_dir)
    harness = CommandHarness.preset(preset)  # type: ignore[arg-type]
    tg_scope = BridgeScope.for_conversation(sb.key, sb.session_id, paths)
    await server.open(tg_scope)
    try:
        result = await harness.dispatch(sb.ctx(backend), TurnRequest("mcp:tools"))
        mcp = _listed(result.reply)
        assert list(mcp["servers"]) == ["cellgate"], "no operator server, no connector"
        assert mcp["servers"]["cellgate"]["args"] == ["/run/cellgate/cellgate-mcp"]
        if preset == "claude":
            assert mcp["strict"] is True
        listed = mcp["tools"]["cellgate"]
        assert isinstance(listed, list), listed
        assert set(listed) == {s.name for s in handlers.offered(tg_scope)}
        assert set(listed) >= TELEGRAM_TOOLS
    finally:
        await server.close(tg_scope.scope_key)
    api_key = ConversationKey(sb.key.agent, "api", f"api-{preset}")
    api_scope = BridgeScope.for_conversation(api_key, sb.session_id, paths)
    await server.open(api_scope)
    try:
        fresh = CommandHarness.preset(preset)  # type: ignore[arg-type]
        listed = _listed((await fresh.dispatch(sb.ctx(backend), TurnRequest("mcp:tools"))).reply)
        names = set(listed["tools"]["cellgate"])
        assert names == {s.name for s in handlers.offered(api_scope)}
        assert not names & TELEGRAM_TOOLS, "an API session is not offered the telegram module"
        assert "reply" in names
    finally:
        await server.close(api_scope.scope_key)
        store.close()
