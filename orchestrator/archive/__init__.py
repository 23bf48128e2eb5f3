"""The memory archive (A1, A2, T2): `kb.sqlite` over an agent's memory files.

`index` builds and searches it, `excerpt` reads a bounded piece of one
memory file; the bridge tools `memory_search` and `memory_get` are in
`orchestrator.bridge.memory_tools`. Whether any of it runs for an agent is
`policies.memory.archive_index`.
"""

from orchestrator.archive.excerpt import Excerpt, excerpt
from orchestrator.archive.index import (
    KB_FILE,
    Hit,
    RefreshStats,
    kb_path,
    refresh,
    refresh_at_spawn,
    search,
)

__all__ = [
    "KB_FILE",
    "Excerpt",
    "Hit",
    "RefreshStats",
    "excerpt",
    "kb_path",
    "refresh",
    "refresh_at_spawn",
    "search",
]
