"""The P5 and M6 policies over files a sandbox controls; the I/O is `orchestrator.safefs`.

The sandbox can write its media and chat directories, so it can plant a
symlink, a hard link, a FIFO or a socket there, and swap one for a regular
file at any moment. `orchestrator.safefs` opens every component with
`O_NOFOLLOW` relative to the one before and decides on `fstat` of the opened
descriptor; this module turns what it finds into the policy's answer.

- `open_media_file`: a regular file inside the session's media directory,
  decided by `policies.paths.decide` on facts from the descriptor (P5).
- `append_memory`: append to MEMORY.md or USER.md of the conversation's chat
  directory with `O_APPEND|O_NOFOLLOW`; a symlink, hard link or non-regular
  file planted under that name is refused and left untouched (M6).
- `refused_file`: a `safefs.UnsafePath` met while using an opened file (it
  grew past its cap, it is sparse) as the P5 refusal it stands for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from cellgate.errors import BridgeError, PolicyDenied, UnsafePath
from orchestrator.safefs import SafeDir, SafeFile
from policies.memory import MemoryFile
from policies.paths import FileFacts, FileKind, decide, normalize_request

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "SafeFile",
    "append_memory",
    "open_media_file",
    "refused_file",
]

DEFAULT_MAX_FILE_BYTES = 50 * 1024 * 1024
_POLICY_KINDS = ("dir", "symlink", "fifo", "socket", "device")


def _refuse(rel: str, media: str, kind: FileKind, max_size: int) -> PolicyDenied:
    """P5's refusal for a file that was not opened (the facts never allow)."""
    facts = FileFacts(
        requested=rel,
        media_dir=media,
        resolved=None if kind in ("missing", "symlink") else f"{media}/{rel}",
        kind=kind,
        nlink=0,
        symlink_in_path=kind == "symlink",
        size=0,
        max_size=max_size,
    )
    decision = decide(facts)
    if decision.allowed:  # keep it a refusal regardless
        return PolicyDenied("P5", f"{rel!r} could not be opened safely")
    return PolicyDenied(decision.rule, decision.reason)


def refused_file(exc: UnsafePath) -> PolicyDenied:
    """P5: an unsafe file met while it was opened or used, as the refusal the caller sees."""
    if exc.kind == "swapped":
        return PolicyDenied(
            "P5", f"{exc.rel!r} was replaced while it was being opened; send it again"
        )
    return PolicyDenied("P5", f"{exc.rel!r} {exc.reason}; save a regular file and send that")


def open_media_file(
    media_dir: Path,
    requested: str,
    media_dir_in_sandbox: str,
    *,
    max_size: int = DEFAULT_MAX_FILE_BYTES,
) -> SafeFile:
    """P5: open `requested` (as the sandbox wrote it) inside `media_dir`, or raise PolicyDenied.

    `media_dir` is the host path of the session's media directory;
    `media_dir_in_sandbox` is where the sandbox sees it (`/workspace/media/<dir>`).
    """
    rel = normalize_request(requested, media_dir_in_sandbox)
    if not isinstance(rel, str):
        raise PolicyDenied(rel.rule, rel.reason)
    try:
        top = SafeDir.open(media_dir, rel="")
    except (OSError, UnsafePath) as exc:
        raise BridgeError(
            "internal", "this conversation's media directory cannot be opened"
        ) from exc
    with top:
        media = top.where() or os.path.abspath(media_dir)
        try:
            f = top.open_file(rel, max_size=max_size, allow_hardlink=True, check_size=False)
        except FileNotFoundError as exc:
            raise _refuse(rel, media, "missing", max_size) from exc
        except UnsafePath as exc:
            if exc.kind in _POLICY_KINDS:
                raise _refuse(rel, media, cast(FileKind, exc.kind), max_size) from exc
            raise refused_file(exc) from exc
    try:
        facts = FileFacts(
            requested=rel,
            media_dir=media,
            resolved=f.where(),
            kind="regular",
            nlink=f.nlink,
            symlink_in_path=False,
            size=f.size,
            max_size=max_size,
        )
        decision = decide(facts)
        if not decision.allowed:
            raise PolicyDenied(decision.rule, decision.reason)
        return f
    except BaseException:
        f.close()
        raise


def append_memory(chat_dir: Path, name: MemoryFile, text: str) -> int:
    """M6: append `text` (plus a newline if it lacks one) to `chat_dir/name`; returns bytes written.

    The file is opened relative to an `O_NOFOLLOW` descriptor of the chat
    directory, never through a link; a missing file is created owned like the
    directory, so the sandbox can keep writing it.
    """
    data = (text if text.endswith("\n") else text + "\n").encode("utf-8")
    try:
        chat = SafeDir.open(chat_dir, rel="")
    except (OSError, UnsafePath) as exc:
        raise BridgeError(
            "internal", "this conversation's chat directory cannot be opened"
        ) from exc
    with chat:
        try:
            return chat.append(name, data)
        except UnsafePath as exc:
            raise _memory_refused(name, exc) from exc


def _memory_refused(name: str, exc: UnsafePath) -> PolicyDenied:
    if exc.kind == "symlink":
        return PolicyDenied(
            "M6",
            f"{name} in this conversation's directory is a symbolic link; it is not followed and "
            f"nothing was written. Remove the link and write again to start a fresh {name}",
        )
    if exc.kind == "hardlink":
        return PolicyDenied(
            "M6",
            f"{name} is a hard link shared with another path; nothing was written. "
            f"Remove it and write again to start a fresh {name}",
        )
    shown = {"fifo": "a named pipe", "dir": "a directory", "socket": "a socket"}
    what = shown.get(exc.kind, exc.kind)
    return PolicyDenied("M6", f"{name} is {what}, not a regular file; nothing was written")
