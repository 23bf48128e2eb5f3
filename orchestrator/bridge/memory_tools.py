"""`memory_search` and `memory_get` (A1): the memory archive as bridge tools.

Offered only to a non-isolated agent whose archive is on (`policies.tools`:
T2, A2); each handler asks `policies.memory.archive_index` again before it
reads anything, so a refused scope never opens kb.sqlite. `memory_search`
reads the agent's kb.sqlite (kept up to date at session spawn);
`memory_get` reads a bounded excerpt of one memory file, traversal-guarded
(`archive.excerpt`: `../`, other paths and symlinks are refused).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from cellgate.errors import BridgeError, PolicyDenied
from orchestrator.archive import excerpt, search
from orchestrator.bridge.catalogue import MEMORY_TOOLS
from orchestrator.bridge.tools import Handler, JSONObject, ToolCall, ToolHandlers
from policies.memory import archive_index

__all__ = ["MemoryTools"]

MAX_HITS = 20


def _int(call: ToolCall, name: str, default: int, low: int, high: int) -> int:
    value = call.args.get(name, default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BridgeError("bad_request", f"{call.tool}: {name!r} must be a whole number")
    return max(low, min(value, high))


class MemoryTools:
    def __init__(self, kb_for: Callable[[str], Path]) -> None:
        self.kb_for = kb_for

    def install(self, handlers: ToolHandlers) -> ToolHandlers:
        own: dict[str, Handler] = {
            "memory_search": self.memory_search,
            "memory_get": self.memory_get,
        }
        for definition in MEMORY_TOOLS:
            handlers.add(definition, own[definition.name])
        return handlers

    @staticmethod
    def _check(call: ToolCall) -> None:
        decision = archive_index(call.scope.isolated, not call.scope.archive_enabled)
        if not decision:
            raise PolicyDenied(decision.rule, decision.reason)

    async def memory_search(self, call: ToolCall) -> JSONObject:
        self._check(call)
        query = call.required("query", limit=500)
        limit = _int(call, "limit", 8, 1, MAX_HITS)
        hits = await asyncio.to_thread(search, self.kb_for(call.scope.key.agent), query, limit)
        return {
            "hits": [
                {"file": h.file, "line": h.line, "snippet": h.snippet, "score": round(h.score, 4)}
                for h in hits
            ]
        }

    async def memory_get(self, call: ToolCall) -> JSONObject:
        self._check(call)
        path = call.required("file", limit=300)
        start = _int(call, "line", 1, 1, 10_000_000)
        lines = _int(call, "lines", 60, 1, 200)
        try:
            got = await asyncio.to_thread(excerpt, call.scope.paths.workspace, path, start, lines)
        except FileNotFoundError as exc:
            raise BridgeError("not_found", f"no memory file {path[:100]!r}") from exc
        return {
            "file": got.file,
            "line": got.start,
            "end": got.end,
            "total_lines": got.total_lines,
            "text": got.text,
            "truncated": got.truncated,
        }
