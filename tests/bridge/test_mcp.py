"""cellgate-mcp on the host, driven by the official `mcp` client SDK over stdio (T1, P1).

Both server implementations are run: the SDK one (the `mcp` package is
installed here) and the stdlib fallback that images without the SDK use; the
same real bridge socket answers both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bridge.conftest import World

mcp = pytest.importorskip("mcp")
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

SERVER = Path(__file__).resolve().parents[2] / "sandbox" / "client" / "cellgate_mcp.py"


async def _exchange(sock: Path, impl: str) -> tuple[list[str], Any, Any]:
    params = StdioServerParameters(
        command=sys.executable,
        args=[str(SERVER)],
        env={"CELLGATE_BRIDGE": str(sock), "CELLGATE_MCP_IMPL": impl},
    )
    with open("/dev/null", "w") as errlog:  # noqa: ASYNC230 - a sink for the child's stderr
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            listed = await session.list_tools()
            ok = await session.call_tool("reply", {"text": f"via {impl}"})
            refused = await session.call_tool("reply", {"text": "x", "chat_id": "999"})
    return [t.name for t in listed.tools], ok, refused


@pytest.mark.parametrize("impl", ["sdk", "stdlib"])
async def test_T1_mcp_server_offers_the_bridge_tools_and_keeps_P1(world: World, impl: str) -> None:
    a = await world.open("42")
    names, ok, refused = await _exchange(a.socket, impl)
    assert names[:3] == ["reply", "react", "edit"]
    assert "task_memory_append" in names and "list_tools" in names
    assert ok.is_error is False
    assert json.loads(ok.content[0].text)["chat_id"] == "42"
    assert refused.is_error is True
    assert "refused by P1" in refused.content[0].text
    assert [m.text for m in world.outbox.sent] == [f"via {impl}"]
