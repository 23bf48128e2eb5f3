"""A conversation's transcript and harness session id, kept in its own directory (D3).

`chats/<conversation>/transcript.jsonl` gets one line per message and reply;
`chats/<conversation>/session.json` holds the harness session id, so a
restarted gateway resumes instead of starting cold. The sandbox can write this
directory, so the gateway treats what it reads back as untrusted: it never
follows a symlink there, caps what it reads, and validates the session id.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRANSCRIPT = "transcript.jsonl"
SESSION = "session.json"
MAX_SESSION_BYTES = 4096
_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@contextlib.contextmanager
def _dir_fd(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def append_transcript(chat_dir: Path, entries: list[dict[str, Any]]) -> None:
    """Append entries; a symlink or non-file planted at the name is refused (OSError)."""
    data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()
    with _dir_fd(chat_dir) as dfd:
        fd = os.open(
            TRANSCRIPT,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            0o644,
            dir_fd=dfd,
        )
        try:
            if not _is_regular(fd):
                raise OSError(f"{chat_dir / TRANSCRIPT} is not a regular file")
            os.write(fd, data)
        finally:
            os.close(fd)


def save_session_id(chat_dir: Path, session_id: str, harness_session_id: str | None) -> None:
    doc = json.dumps({"session": session_id, "harness_session_id": harness_session_id}).encode()
    with _dir_fd(chat_dir) as dfd:
        tmp = f".{SESSION}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=dfd,
        )
        try:
            os.write(fd, doc)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, SESSION, src_dir_fd=dfd, dst_dir_fd=dfd)


def load_session_id(chat_dir: Path) -> str | None:
    """The saved harness session id, or None when absent, unreadable or not plausible."""
    try:
        with _dir_fd(chat_dir) as dfd:
            fd = os.open(
                SESSION, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
            try:
                if not _is_regular(fd):
                    return None
                raw = os.read(fd, MAX_SESSION_BYTES + 1)
            finally:
                os.close(fd)
    except OSError:
        return None
    if len(raw) > MAX_SESSION_BYTES:
        return None
    try:
        value = json.loads(raw).get("harness_session_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and _SESSION_ID_RE.fullmatch(value) else None


def recent_history(chat_dir: Path, limit: int = 40, cap: int = 256 * 1024) -> list[dict[str, str]]:
    """The last user/assistant texts of the transcript, for a harness resuming cold (D3)."""
    try:
        with _dir_fd(chat_dir) as dfd:
            fd = os.open(
                TRANSCRIPT, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
            try:
                if not _is_regular(fd):
                    return []
                size = os.fstat(fd).st_size
                os.lseek(fd, max(0, size - cap), os.SEEK_SET)
                raw = os.read(fd, cap)
            finally:
                os.close(fd)
    except OSError:
        return []
    out: list[dict[str, str]] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(entry, dict)
            and entry.get("role") in ("user", "assistant")
            and isinstance(entry.get("text"), str)
        ):
            out.append({"role": entry["role"], "text": entry["text"]})
    return out[-limit:]


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)
