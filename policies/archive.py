"""May this member of a backup archive be restored? (`cellgate apps restore`)

A backup archive may come from anywhere (another machine, a mail attachment),
so restore treats it as hostile: only plain files and directories under the
archive's own top-level names, with relative paths that never climb (`..`),
no links of either kind, no devices, FIFOs or sockets, and sizes bounded per
member, in total and in number of members.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from policies.base import Decision, allow, deny

__all__ = ["TOP_LEVEL", "ArchiveLimits", "Kind", "MemberFacts", "member_allowed"]

RULE = "restore"  # hostile input (no SPEC id of its own)
TOP_LEVEL = ("cellgate-backup.json", "app", "workspace", "store")
"""What a cellgate backup holds at its top: its manifest, the app record, the agent
workspace and the store rows."""

Kind = Literal["file", "dir", "symlink", "hardlink", "device", "fifo", "other"]


@dataclass(frozen=True, slots=True)
class ArchiveLimits:
    max_members: int = 500_000
    max_member_bytes: int = 4 * 1024**3
    max_total_bytes: int = 64 * 1024**3
    max_name_chars: int = 1024
    max_depth: int = 48


@dataclass(frozen=True, slots=True)
class MemberFacts:
    name: str
    kind: Kind
    size: int
    index: int  # 0-based position in the archive
    total_before: int  # bytes of the members before this one


def member_allowed(m: MemberFacts, limits: ArchiveLimits) -> Decision:
    if m.index >= limits.max_members:
        return deny(RULE, f"more than {limits.max_members} members")
    if not m.name or len(m.name) > limits.max_name_chars or "\x00" in m.name:
        return deny(RULE, f"member name {m.name[:80]!r} is empty, too long or holds NUL")
    if "\\" in m.name:
        return deny(RULE, f"member {m.name[:200]!r}: a backslash in a path is refused")
    path = PurePosixPath(m.name)
    if path.is_absolute():
        return deny(RULE, f"member {m.name[:200]!r} has an absolute path")
    if ".." in path.parts:
        return deny(RULE, f"member {m.name[:200]!r} climbs out with '..'")
    parts = [p for p in path.parts if p != "."]
    if not parts or parts[0] not in TOP_LEVEL:
        return deny(RULE, f"member {m.name[:200]!r} is not part of a cellgate backup")
    if len(parts) > limits.max_depth:
        return deny(RULE, f"member {m.name[:200]!r} is nested deeper than {limits.max_depth}")
    if m.kind in ("symlink", "hardlink"):
        return deny(RULE, f"member {m.name[:200]!r} is a {m.kind}: links are never restored")
    if m.kind not in ("file", "dir"):
        return deny(RULE, f"member {m.name[:200]!r} is a {m.kind}: only files and directories")
    if m.size < 0 or m.size > limits.max_member_bytes:
        return deny(RULE, f"member {m.name[:200]!r} is {m.size} bytes, over the per-file bound")
    if m.total_before + m.size > limits.max_total_bytes:
        return deny(RULE, f"the archive unpacks to more than {limits.max_total_bytes} bytes")
    return allow(RULE)
