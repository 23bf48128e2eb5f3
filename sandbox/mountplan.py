"""The mount plan of one conversation's sandbox (S3).

`scan_workspace` reads the workspace tree once, without following symlinks;
`plan_mounts` is a pure function of that snapshot and the conversation's own
paths. What is not in the plan is not mounted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath

PERSONA_FILES = ("CLAUDE.md", "AGENTS.md", "SOUL.md", "IDENTITY.md", "HEARTBEAT.md")
EXCLUDED_DIRS = frozenset({"chats", "memory", "media"})
CLAUDE_DIR_ENTRIES = frozenset({"skills", "commands", "agents"})
CLAUDE_FILE_ENTRIES = frozenset({"settings.json"})

WORKSPACE = PurePosixPath("/workspace")
HOME = PurePosixPath("/home/agent")
BRIDGE = PurePosixPath("/run/cellgate")


class EntryKind(StrEnum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Entry:
    """One directory entry, as `lstat` saw it."""

    name: str
    kind: EntryKind
    dev: int
    ino: int


@dataclass(frozen=True, slots=True)
class WorkspaceSnapshot:
    """The workspace's root entries and its `.claude/` entries, at one moment."""

    root: Path
    entries: tuple[Entry, ...]
    claude_entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class PlannedMount:
    source: str
    target: str
    read_only: bool
    kind: EntryKind
    dev: int
    ino: int


@dataclass(frozen=True, slots=True)
class MountPlan:
    mounts: tuple[PlannedMount, ...]

    def by_target(self) -> dict[str, PlannedMount]:
        return {m.target: m for m in self.mounts}

    def writable_targets(self) -> tuple[str, ...]:
        return tuple(m.target for m in self.mounts if not m.read_only)


def _kind(mode: int) -> EntryKind:
    if stat.S_ISLNK(mode):
        return EntryKind.SYMLINK
    if stat.S_ISDIR(mode):
        return EntryKind.DIR
    if stat.S_ISREG(mode):
        return EntryKind.FILE
    return EntryKind.OTHER


def _scan_dir(path: Path) -> tuple[Entry, ...]:
    out: list[Entry] = []
    with os.scandir(path) as it:
        for de in it:
            st = de.stat(follow_symlinks=False)
            out.append(Entry(de.name, _kind(st.st_mode), st.st_dev, st.st_ino))
    return tuple(sorted(out, key=lambda e: e.name))


def scan_workspace(root: Path) -> WorkspaceSnapshot:
    """Read the workspace root and `.claude/` (only if it is a real directory)."""
    entries = _scan_dir(root)
    claude = next((e for e in entries if e.name == ".claude"), None)
    claude_entries = _scan_dir(root / ".claude") if claude and claude.kind is EntryKind.DIR else ()
    return WorkspaceSnapshot(root=root, entries=entries, claude_entries=claude_entries)


def identity(path: Path) -> tuple[EntryKind, int, int]:
    st = os.lstat(path)
    return _kind(st.st_mode), st.st_dev, st.st_ino


def _readonly_workspace_mounts(snap: WorkspaceSnapshot) -> Iterable[PlannedMount]:
    for e in snap.entries:
        persona = e.kind is EntryKind.FILE and e.name in PERSONA_FILES
        shared_dir = (
            e.kind is EntryKind.DIR and not e.name.startswith(".") and e.name not in EXCLUDED_DIRS
        )
        if persona or shared_dir:
            yield PlannedMount(
                str(snap.root / e.name), str(WORKSPACE / e.name), True, e.kind, e.dev, e.ino
            )
    for e in snap.claude_entries:
        wanted = (e.kind is EntryKind.DIR and e.name in CLAUDE_DIR_ENTRIES) or (
            e.kind is EntryKind.FILE and e.name in CLAUDE_FILE_ENTRIES
        )
        if wanted:
            yield PlannedMount(
                str(snap.root / ".claude" / e.name),
                str(WORKSPACE / ".claude" / e.name),
                True,
                e.kind,
                e.dev,
                e.ino,
            )


@dataclass(frozen=True, slots=True)
class OwnDirs:
    """The conversation's own directories with their identities at plan time."""

    chat_dir: Path
    chat_id: tuple[EntryKind, int, int]
    media_dir: Path
    media_id: tuple[EntryKind, int, int]
    home_dir: Path
    home_id: tuple[EntryKind, int, int]
    bridge_dir: Path
    bridge_id: tuple[EntryKind, int, int]


def plan_mounts(snap: WorkspaceSnapshot, own: OwnDirs) -> MountPlan:
    """Every mount the sandbox gets, and nothing else (S3)."""
    ws = snap.root
    chat_rel = own.chat_dir.relative_to(ws)
    media_rel = own.media_dir.relative_to(ws)
    rw = [
        PlannedMount(str(own.chat_dir), str(WORKSPACE / chat_rel.as_posix()), False, *own.chat_id),
        PlannedMount(
            str(own.media_dir), str(WORKSPACE / media_rel.as_posix()), False, *own.media_id
        ),
        PlannedMount(str(own.home_dir), str(HOME / ".claude"), False, *own.home_id),
        PlannedMount(str(own.bridge_dir), str(BRIDGE), True, *own.bridge_id),
    ]
    for m in rw:
        if m.kind is not EntryKind.DIR:
            raise ValueError(f"{m.source} is not a real directory ({m.kind})")
    mounts = (*_readonly_workspace_mounts(snap), *rw)
    return MountPlan(tuple(sorted(mounts, key=lambda m: m.target)))


def own_dirs(chat_dir: Path, media_dir: Path, home_dir: Path, bridge_dir: Path) -> OwnDirs:
    return OwnDirs(
        chat_dir,
        identity(chat_dir),
        media_dir,
        identity(media_dir),
        home_dir,
        identity(home_dir),
        bridge_dir,
        identity(bridge_dir),
    )


def plan_shared_mounts(workspace: Path, home_dir: Path, bridge_root: Path) -> MountPlan:
    """S6: the one app container of an agent without isolate mode.

    The whole agent workspace read-write at `/workspace` (as the app container
    of the seed has it: root MEMORY.md and USER.md, every chat's directory,
    memory/, media/), one `~/.claude` for the agent, and the agent's bridge
    directory (every conversation's socket below it) read-only. Everything is
    shared between the agent's chats; nothing else of the host is mounted.
    """
    mounts = (
        PlannedMount(str(workspace), str(WORKSPACE), False, *identity(workspace)),
        PlannedMount(str(home_dir), str(HOME / ".claude"), False, *identity(home_dir)),
        PlannedMount(str(bridge_root), str(BRIDGE), True, *identity(bridge_root)),
    )
    for m in mounts:
        if m.kind is not EntryKind.DIR:
            raise ValueError(f"{m.source} is not a real directory ({m.kind})")
    return MountPlan(tuple(sorted(mounts, key=lambda m: m.target)))
