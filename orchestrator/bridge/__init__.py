"""The orchestration bridge: tool calls from a sandbox, identified by the socket they arrive on.

    handlers = BuiltinTools(outbox, store, spool_dir).install(
        ToolHandlers(refusals=StoreRefusals(store)))
    server = BridgeServer(handlers)
    install_client(paths.bridge_dir)                 # cellgate-tool, cellgate-mcp
    await server.open(BridgeScope.for_conversation(key, session_id, paths))
    ...                                              # the sandbox calls /run/cellgate/bridge.sock
    await server.close(scope.scope_key)              # when the sandbox is removed

Modules: `scope` (what a socket stands for), `server` (the socket and its
protocol), `catalogue` (every tool's name, description and schema), `tools`
(the registry and the standard tools), `outbox` (where messages go),
`safefiles` (opening sandbox-controlled files as root), `install`.
"""

from orchestrator.bridge.catalogue import BUILTIN_TOOLS, ToolDef
from orchestrator.bridge.install import install_client
from orchestrator.bridge.outbox import ChannelOutbox, Outbox, PendingOutbox, outbound_key
from orchestrator.bridge.scope import BridgeScope, ScopeState
from orchestrator.bridge.server import SOCKET_NAME, BridgeLimits, BridgeServer
from orchestrator.bridge.tools import (
    BridgeRefusal,
    BuiltinTools,
    Handler,
    RefusalSink,
    StoreRefusals,
    ToolCall,
    ToolHandlers,
    ToolSpec,
)

__all__ = [
    "BUILTIN_TOOLS",
    "SOCKET_NAME",
    "BridgeLimits",
    "BridgeRefusal",
    "BridgeScope",
    "BridgeServer",
    "BuiltinTools",
    "ChannelOutbox",
    "Handler",
    "Outbox",
    "PendingOutbox",
    "RefusalSink",
    "ScopeState",
    "StoreRefusals",
    "ToolCall",
    "ToolDef",
    "ToolHandlers",
    "ToolSpec",
    "install_client",
    "outbound_key",
]
