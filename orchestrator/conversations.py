"""Conversations: `(agent, channel, chat_id)` to a stable key and safe directory names (M1-M3).

A conversation's directory name is safe for any chat id: negative Telegram ids,
LINE ids, arbitrary API ids, `../`, NUL or 4 KB strings. The readable part is
a sanitised, truncated slug; the hash over the full `(channel, chat_id)` keeps
two different chats apart even when their slugs agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import ConversationError

CHANNEL_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_LITERAL_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SESSION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SLUG_MAX = 40
CHAT_ID_MAX = 4096
HEARTBEAT_CHAT = "__heartbeat__"


@dataclass(frozen=True, slots=True)
class ConversationKey:
    """One chat on one channel of one agent."""

    agent: str
    channel: str
    chat_id: str

    def __post_init__(self) -> None:
        if not CHANNEL_RE.fullmatch(self.channel):
            raise ConversationError(
                f"channel name {self.channel!r} is not usable: use 1-16 lowercase letters "
                "or digits, starting with a letter"
            )
        if not self.chat_id:
            raise ConversationError("chat id is empty: every conversation needs a chat id")
        if len(self.chat_id.encode("utf-8", "surrogatepass")) > CHAT_ID_MAX:
            raise ConversationError(f"chat id is longer than {CHAT_ID_MAX} bytes")

    @property
    def digest(self) -> str:
        """A stable hash of `(channel, chat_id)`; the agent is implied by the workspace."""
        raw = f"{self.channel}\0{self.chat_id}".encode("utf-8", "surrogatepass")
        return hashlib.sha256(raw).hexdigest()[:16]

    @property
    def dir_name(self) -> str:
        """`<channel>-<chatId>-<hash>`, the name under `chats/` (M1)."""
        slug = _SLUG_UNSAFE.sub("_", self.chat_id)[:SLUG_MAX] or "_"
        return f"{self.channel}-{slug}-{self.digest}"

    def media_dir_name(self, session_id: str) -> str:
        """`media/<channel>-<chatId>` for a channel chat, `media/api-<session>` for the API.

        A chat id that is not plainly safe is replaced by `h.<hash>`; the dot
        cannot occur in a literal id, so the mapping stays one-to-one.
        """
        if self.channel == "api":
            if not SESSION_RE.fullmatch(session_id):
                raise ConversationError(f"session id {session_id!r} is not a safe name")
            return f"api-{session_id}"
        if _LITERAL_SAFE.fullmatch(self.chat_id):
            return f"{self.channel}-{self.chat_id}"
        return f"{self.channel}-h.{self.digest}"


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
