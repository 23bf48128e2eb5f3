#!/usr/bin/env python3
"""cellgate-mcp: an MCP stdio server offering the gateway's bridge tools.

    cellgate-mcp                 serve MCP on stdin/stdout

Every tool call goes over the same socket as `cellgate-tool` ($CELLGATE_BRIDGE,
else /run/cellgate/bridge.sock); the tool list is what the gateway offers this
session (`list_tools`). With the official `mcp` SDK importable it is used;
otherwise (most images) a small standard-library server speaks the stdio
subset an agent needs: initialize, ping, tools/list, tools/call.
Set CELLGATE_MCP_IMPL=stdlib or =sdk to choose.

Standard library only (the SDK is optional); runs on Python 3.8 and later.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["Bridge", "choose", "handle", "main", "serve_sdk", "serve_stdlib"]

SERVER_NAME = "cellgate"
SERVER_VERSION = "0.1.0"
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
_CLIENT_NAMES = ("cellgate_tool.py", "cellgate-tool")


def _load_client() -> ModuleType:
    """The protocol client beside this file (`cellgate-tool` in a bridge directory)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _CLIENT_NAMES:
        path = os.path.join(here, name)
        if os.path.isfile(path):
            loader = importlib.machinery.SourceFileLoader("cellgate_tool", path)
            spec = importlib.util.spec_from_loader("cellgate_tool", loader)
            if spec is None:
                continue
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
    raise SystemExit(f"cellgate-mcp: no cellgate-tool beside {here}")


class Bridge:
    """The bridge seen as MCP tools: list them, call one, shape the answer."""

    def __init__(self, client: ModuleType) -> None:
        self._client = client

    def _call(self, tool: str, args: dict[str, Any] | None) -> dict[str, Any]:
        doc: dict[str, Any] = self._client.call(tool, args)
        return doc

    def tools(self) -> list[dict[str, Any]]:
        doc = self._call("list_tools", {})
        if not doc.get("ok"):
            raise RuntimeError(self._client.describe_error(doc))
        out: list[dict[str, Any]] = []
        for t in doc["result"]["tools"]:
            out.append(
                {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "inputSchema": t.get("input_schema") or {"type": "object"},
                }
            )
        return out

    def call(self, name: str, arguments: dict[str, Any] | None) -> tuple[str, bool]:
        """The text to show and whether it is an error (a refusal names its rule)."""
        try:
            doc = self._call(name, arguments or {})
        except self._client.BridgeUnavailable as exc:
            return f"bridge unavailable: {exc}", True
        if doc.get("ok"):
            return json.dumps(doc.get("result"), ensure_ascii=False), False
        return f"{name} {self._client.describe_error(doc)}", True


# -- the standard-library server ----------------------------------------------


def _response(msg_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "result": result}


def _failure(msg_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


def handle(bridge: Bridge, msg: Any) -> dict[str, Any] | None:
    """One JSON-RPC message in, its response out (None for a notification)."""
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
        return _failure(None, -32600, "not a JSON-RPC 2.0 message")
    method = msg.get("method")
    msg_id = msg.get("id")
    is_request = "id" in msg
    if not isinstance(method, str):
        return None if not is_request else _failure(msg_id, -32600, "no method")
    params = msg.get("params") or {}
    if not is_request:
        return None  # notifications/initialized, notifications/cancelled, ...
    if method == "initialize":
        asked = params.get("protocolVersion") if isinstance(params, dict) else None
        version = asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]
        return _response(
            msg_id,
            {
                "protocolVersion": version,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": SERVER_NAME, "version": SERVER_VERSION},
            },
        )
    if method == "ping":
        return _response(msg_id, {})
    if method == "tools/list":
        try:
            return _response(msg_id, {"tools": bridge.tools()})
        except Exception as exc:  # the bridge is down: say so, keep serving
            return _failure(msg_id, -32603, f"cannot list tools: {exc}")
    if method == "tools/call":
        if not isinstance(params, dict) or not isinstance(params.get("name"), str):
            return _failure(msg_id, -32602, "tools/call needs params.name")
        arguments = params.get("arguments")
        if arguments is not None and not isinstance(arguments, dict):
            return _failure(msg_id, -32602, "params.arguments must be an object")
        text, is_error = bridge.call(params["name"], arguments)
        return _response(msg_id, {"content": [{"type": "text", "text": text}], "isError": is_error})
    return _failure(msg_id, -32601, f"method {method!r} is not supported")


def serve_stdlib(bridge: Bridge, stdin: Any = None, stdout: Any = None) -> None:
    src = stdin or sys.stdin
    out = stdout or sys.stdout
    for line in src:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError as exc:
            reply: dict[str, Any] | None = _failure(None, -32700, f"parse error: {exc}")
        else:
            reply = handle(bridge, msg)
        if reply is not None:
            out.write(json.dumps(reply, ensure_ascii=False) + "\n")
            out.flush()


# -- the SDK server -------------------------------------------------------------


def serve_sdk(bridge: Bridge) -> None:
    import anyio
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        listed = await anyio.to_thread.run_sync(bridge.tools)
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t["name"], description=t["description"], input_schema=t["inputSchema"]
                )
                for t in listed
            ]
        )

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        text, is_error = await anyio.to_thread.run_sync(
            bridge.call, params.name, dict(params.arguments or {})
        )
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], is_error=is_error
        )

    server: Server[Any] = Server(
        SERVER_NAME, version=SERVER_VERSION, on_list_tools=list_tools, on_call_tool=call_tool
    )

    async def main() -> None:
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())

    anyio.run(main)


def _sdk_available() -> bool:
    try:
        return importlib.util.find_spec("mcp.server.lowlevel") is not None
    except (ImportError, ValueError):
        return False


def choose(env: str | None) -> str:
    if env in ("stdlib", "sdk"):
        return env
    return "sdk" if _sdk_available() else "stdlib"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        sys.stderr.write((__doc__ or "") + "\n")
        return 0
    bridge = Bridge(_load_client())
    if choose(os.environ.get("CELLGATE_MCP_IMPL")) == "sdk":
        serve_sdk(bridge)
    else:
        serve_stdlib(bridge)
    return 0


if __name__ == "__main__":
    sys.exit(main())
