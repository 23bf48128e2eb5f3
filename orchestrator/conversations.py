"""Conversations: `(agent, channel, chat_id)` to a stable key and safe directory names (M1-M3).

A conversation's directory name is safe for any chat id: negative Telegram ids,
LINE ids, arbitrary API ids, `../`, NUL or 4 KB strings. The readable part is
a sanitised, truncated slug; the hash over the full `(channel, chat_id)` keeps
two different chats apart even when their slugs agree.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import ConversationError
from cellgate.models import ConversationKey


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


def _mkdir_nofollow(path: Path, mode: int = 0o755) -> None:
    """Create `path` (one level) and refuse if what is there is not a real directory."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConversationError(f"{path} exists and is not a directory (symlinks are refused)")


def _mkdirs_nofollow(base: Path, target: Path) -> None:
    rel = target.relative_to(base)
    current = base
    for part in rel.parts:
        current = current / part
        _mkdir_nofollow(current)


def ensure_conversation(
    paths: ConversationPaths, owner_uid: int | None, owner_gid: int | None
) -> None:
    """Create the conversation's directories; USER.md and MEMORY.md start empty (M3).

    Never seeded from the workspace-root USER.md/MEMORY.md. When the gateway
    runs as root the writable directories are handed to the sandbox user.
    """
    agent_root = paths.home_dir.parent.parent
    _mkdirs_nofollow(paths.workspace, paths.chat_dir)
    _mkdirs_nofollow(paths.workspace, paths.media_dir)
    _mkdirs_nofollow(agent_root, paths.home_dir)
    _mkdirs_nofollow(agent_root, paths.bridge_dir)
    for name in ("USER.md", "MEMORY.md"):
        fd = os.open(
            paths.chat_dir / name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        os.close(fd)
    writable = [paths.chat_dir, paths.media_dir, paths.home_dir]
    writable += [paths.chat_dir / "USER.md", paths.chat_dir / "MEMORY.md"]
    for p in writable:
        if owner_uid is not None and os.geteuid() == 0:
            os.chown(
                p,
                owner_uid,
                owner_gid if owner_gid is not None else owner_uid,
                follow_symlinks=False,
            )
        elif owner_uid is not None and owner_uid != os.geteuid():
            os.chmod(p, 0o777 if p.is_dir() else 0o666)
