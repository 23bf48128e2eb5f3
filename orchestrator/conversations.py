"""Conversations: `(agent, channel, chat_id)` to a stable key and safe directory names (M1-M3).

A conversation's directory name is safe for any chat id: negative Telegram ids,
LINE ids, arbitrary API ids, `../`, NUL or 4 KB strings. The readable part is
a sanitised, truncated slug; the hash over the full `(channel, chat_id)` keeps
two different chats apart even when their slugs agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import ConversationError, UnsafePath
from cellgate.models import ConversationKey
from orchestrator.safefs import LeftOut, SafeDir, left_out


@dataclass(frozen=True, slots=True)
class ConversationPaths:
    """Where one conversation's files live on the host."""

    workspace: Path
    chat_dir: Path
    media_dir: Path
    home_dir: Path
    bridge_dir: Path


def conversation_paths(
    agent_root: Path, workspace: Path, key: ConversationKey, session_id: str
) -> ConversationPaths:
    return ConversationPaths(
        workspace=workspace,
        chat_dir=workspace / "chats" / key.dir_name,
        media_dir=workspace / "media" / key.media_dir_name(session_id),
        home_dir=agent_root / "sandbox-homes" / key.dir_name,
        bridge_dir=agent_root / "bridge" / key.digest,
    )


def _mkdirs(base: SafeDir, rel: Path) -> SafeDir:
    """`mkdir -p` below `base` without following a link; the opened directory."""
    try:
        return base.subdir(rel.as_posix(), create=True)
    except UnsafePath as exc:
        raise ConversationError(
            f"{exc.rel} exists and is not a directory (symlinks are refused); "
            "remove it and send the message again"
        ) from exc


def ensure_conversation(
    paths: ConversationPaths,
    owner_uid: int | None,
    owner_gid: int | None,
    *,
    report: LeftOut | None = None,
) -> None:
    """Create the conversation's directories; USER.md and MEMORY.md start empty (M3).

    Never seeded from the workspace-root USER.md/MEMORY.md. When the gateway
    runs as root the writable directories are handed to the sandbox user.
    Everything below the workspace and the agent root goes through
    `orchestrator.safefs`: a planted symlink on the way raises
    `ConversationError`; a symlink, FIFO, device or hard link planted as
    USER.md or MEMORY.md is left untouched (never opened for writing, never
    waited on) and logged, and the sandbox's own memory stays empty.
    """
    agent_root = paths.home_dir.parent.parent
    owner = (
        None if owner_uid is None else (owner_uid, owner_uid if owner_gid is None else owner_gid)
    )
    with SafeDir.trusted(paths.workspace) as ws, SafeDir.trusted(agent_root) as root:
        with _mkdirs(ws, paths.chat_dir.relative_to(paths.workspace)) as chat:
            for name in ("USER.md", "MEMORY.md"):
                try:
                    chat.ensure_file(name, owner=owner)
                except UnsafePath as exc:
                    left_out(paths.chat_dir.name, name, exc, report)
            chat.hand_over(owner)
        with _mkdirs(ws, paths.media_dir.relative_to(paths.workspace)) as media:
            media.hand_over(owner)
        with _mkdirs(root, paths.home_dir.relative_to(agent_root)) as home:
            home.hand_over(owner)
        _mkdirs(root, paths.bridge_dir.relative_to(agent_root)).close()
