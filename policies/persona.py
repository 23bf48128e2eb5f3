"""Persona files are operator-only (L6).

No conversation may change AGENTS.md, SOUL.md or IDENTITY.md; for an isolated
agent CLAUDE.md and HEARTBEAT.md are shared by every conversation too, so they
are refused as well. Names are compared case-insensitively (the refusal errs
on the side of a case-insensitive filesystem), after dropping `.` and empty
components; absolute paths, `..` and NUL bytes are refused outright.
"""

from __future__ import annotations

from policies.base import Decision, allow, deny

__all__ = ["ISOLATED_SHARED_FILES", "PERSONA_FILES", "persona_write"]

PERSONA_FILES = frozenset({"AGENTS.MD", "SOUL.MD", "IDENTITY.MD"})
ISOLATED_SHARED_FILES = frozenset({"CLAUDE.MD", "HEARTBEAT.MD"})


def persona_write(path_rel_to_workspace: str, *, isolated: bool) -> Decision:
    """L6: may a conversation write `path_rel_to_workspace`?"""
    path = path_rel_to_workspace
    if not path or "\0" in path or path.startswith("/") or ".." in path.split("/"):
        return deny(
            "L6",
            f"{path[:120]!r} is not a plain path inside the workspace; give it relative to "
            "the workspace, without '..'",
        )
    parts = [p for p in path.split("/") if p not in ("", ".")]
    name = parts[0].upper() if len(parts) == 1 else ""
    if name in PERSONA_FILES or (isolated and name in ISOLATED_SHARED_FILES):
        return deny(
            "L6",
            f"{parts[0]} is the agent's persona, set by the operator only; decline name or "
            "persona changes and keep notes in this conversation's MEMORY.md instead",
        )
    return allow("L6")
