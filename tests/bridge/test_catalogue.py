"""One tool catalogue, three views that agree (H1, H2, T1).

The bridge's `list_tools`, the in-sandbox MCP server's `tools/list` (both its
implementations, over the real socket) and the functions the OpenAI-compatible
harness sends the model (over real HTTP to a stand-in) must name the same
tools with the same descriptions and schemas, and those are the catalogue's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bridge import BUILTIN_TOOLS, ToolCall
from orchestrator.bridge.catalogue import builtin
from orchestrator.harnesses.base import SessionContext, TurnRequest
from orchestrator.harnesses.openai import SANDBOX_TOOLS, OpenAIHarness
from sandbox.backends.base import SandboxHandle
from tests.bridge.conftest import Chat, World
from tests.fakes.no_engine import NoEngineBackend
from tests.fakes.openai_standin import OpenAIStandin, final

ROOT = Path(__file__).resolve().parents[2]
MCP_SERVER = ROOT / "sandbox" / "client" / "cellgate_mcp.py"
View = dict[str, tuple[str, dict[str, Any]]]


@pytest.fixture
def ai() -> Iterator[OpenAIStandin]:
    with OpenAIStandin(key=None) as server:
        yield server


async def _bridge_view(chat: Chat) -> View:
    listed = await chat.ok("list_tools")
    return {t["name"]: (t["description"], t["input_schema"]) for t in listed["tools"]}


def _mcp_stdlib(sock: Path) -> View:
    """`cellgate-mcp` (stdlib implementation) as a process, spoken to in raw JSON-RPC."""
    import subprocess

    msgs = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
    ]
    proc = subprocess.run(
        [sys.executable, str(MCP_SERVER)],
        input="".join(json.dumps(m) + "\n" for m in msgs).encode(),
        capture_output=True,
        env={
            "CELLGATE_BRIDGE": str(sock),
            "CELLGATE_MCP_IMPL": "stdlib",
            "PATH": os.environ["PATH"],
        },
        timeout=30,
        check=True,
    )
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    tools = next(a for a in answers if a.get("id") == 2)["result"]["tools"]
    return {t["name"]: (t["description"], t["inputSchema"]) for t in tools}


async def _mcp_sdk(sock: Path) -> View:
    """`cellgate-mcp` (SDK implementation) driven by the official MCP client."""
    pytest.importorskip("mcp")
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable,
        args=[str(MCP_SERVER)],
        env={"CELLGATE_BRIDGE": str(sock), "CELLGATE_MCP_IMPL": "sdk"},
    )
    with open(os.devnull, "w") as errlog:  # noqa: ASYNC230 - a sink for the child's stderr
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            listed = await session.list_tools()
    return {t.name: (t.description or "", dict(t.input_schema)) for t in listed.tools}


async def _openai_view(ai: OpenAIStandin, world: World, chat: Chat) -> View:
    """What the harness sends the model in a turn the gateway hands the scope's tools."""
    ai.script(final("ok"))
    harness = OpenAIHarness(base_url=ai.base_url, model="m")
    ctx = SessionContext(
        conversation=chat.key,
        session_key=str(chat.scope.session_id),
        backend=NoEngineBackend(),
        sandbox=SandboxHandle("none", "none", "none"),
        env={},
        workdir="/workspace",
    )
    request = TurnRequest("hi", tools=world.handlers.definitions(chat.scope))
    assert (await harness.dispatch(ctx, request)).ok
    sent = [t["function"] for t in ai.requests[-1].body["tools"]]
    assert [f["name"] for f in sent[: len(SANDBOX_TOOLS)]] == [t.name for t in SANDBOX_TOOLS]
    return {f["name"]: (f["description"], f["parameters"]) for f in sent[len(SANDBOX_TOOLS) :]}


async def test_H1_T1_bridge_mcp_and_openai_views_agree_with_the_catalogue(
    world: World, ai: OpenAIStandin
) -> None:
    async def download(call: ToolCall) -> dict[str, Any]:
        return {}

    # a channel module's own tool joins every view through the same registry
    world.handlers.register(
        "telegram_download",
        download,
        description="Fetch an attachment of this chat.",
        input_schema={"type": "object", "properties": {"file_id": {"type": "string"}}},
        module="telegram",
    )
    chat = await world.open("42", channel="telegram")

    bridge = await _bridge_view(chat)
    stdlib = await asyncio.to_thread(_mcp_stdlib, chat.socket)
    sdk = await _mcp_sdk(chat.socket)
    openai = await _openai_view(ai, world, chat)

    assert list(bridge) == list(stdlib) == list(sdk) == list(openai)
    assert bridge == stdlib == sdk == openai
    assert "telegram_download" in bridge and "reply" in bridge
    for name, (description, schema) in bridge.items():
        if name != "telegram_download":
            assert (description, schema) == (builtin(name).description, builtin(name).schema())
    # the scope decides what is offered (T1): the builtin tools in catalogue order
    assert [n for n in bridge if n != "telegram_download"] == [t.name for t in BUILTIN_TOOLS]


async def test_T1_a_scope_that_is_offered_less_sees_less_in_every_view(
    world: World, ai: OpenAIStandin
) -> None:
    async def browse(call: ToolCall) -> dict[str, Any]:
        return {}

    world.handlers.register("browser_open", browse, module="browser")  # never for isolated
    chat = await world.open("7", channel="discord", isolated=True)
    bridge = await _bridge_view(chat)
    openai = await _openai_view(ai, world, chat)
    stdlib = await asyncio.to_thread(_mcp_stdlib, chat.socket)
    assert "browser_open" not in bridge
    assert bridge == openai == stdlib


def test_H2_no_second_list_of_bridge_tools_is_written_anywhere() -> None:
    """The OpenAI harness and the MCP server name no bridge tool or description of their own."""
    harness = (ROOT / "orchestrator" / "harnesses" / "openai.py").read_text()
    mcp = MCP_SERVER.read_text()
    tools = (ROOT / "orchestrator" / "bridge" / "tools.py").read_text()
    for t in BUILTIN_TOOLS:
        for text in (harness, mcp, tools):
            assert t.description not in text, t.name
        if t.name != "list_tools":  # how the MCP server asks the bridge for the list
            assert f'"{t.name}"' not in harness and f'"{t.name}"' not in mcp, t.name


def test_H1_catalogue_entries_are_copied_out_never_shared() -> None:
    reply = builtin("reply")
    reply.schema()["properties"].clear()
    reply.as_openai()["function"]["parameters"]["required"].append("x")
    assert reply.describe()["input_schema"]["required"] == ["text"]
    assert "text" in reply.as_mcp()["inputSchema"]["properties"]
