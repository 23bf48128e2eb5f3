"""Files a tool sends, shares or attaches must be inside the session's media directory (P5).

Covers share_file, line_image, image and video references, channel
attachments, `/v1/shares`, `/v1/image-artifacts` and API attachments.

The caller gathers `FileFacts` (lstat of each component, realpath, nlink,
size) from the file it has opened with O_NOFOLLOW relative to the media
directory, and uses that same descriptor afterwards, so nothing can be
swapped between this check and the use. Refused: NUL bytes, `..`
components, absolute paths outside the media directory, paths that resolve
outside it, a symlink anywhere on the path, hardlinked files (nlink > 1),
anything but a regular file, missing files, files over an optional size cap.

`normalize_request` maps what the agent wrote in its sandbox
(`/workspace/media/telegram-42/a.png`, or `a.png` relative to the media
directory) to a path relative to the media directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from policies.base import Decision, allow, deny

__all__ = ["FileFacts", "FileKind", "decide", "normalize_request"]

FileKind = Literal["regular", "dir", "symlink", "fifo", "socket", "device", "missing"]

_INSTEAD = "save a regular file (not a link) in this conversation's media directory and send that"
_KIND_NAMES: dict[str, str] = {
    "dir": "a directory",
    "fifo": "a named pipe",
    "socket": "a socket",
    "device": "a device",
}


@dataclass(frozen=True, slots=True)
class FileFacts:
    """What the caller found out about one file a tool wants to send.

    - `requested`: the path as given (relative to the media dir, or absolute).
    - `media_dir`: the session's media directory, resolved, absolute.
    - `resolved`: the file's real path, or None if it could not be resolved.
    - `kind`: lstat type of the final component.
    - `nlink`: st_nlink of the file.
    - `symlink_in_path`: whether any component (final or intermediate) is a symlink.
    - `size`: st_size in bytes.
    - `max_size`: an optional cap in bytes; None for no cap.
    """

    requested: str
    media_dir: str
    resolved: str | None
    kind: FileKind
    nlink: int
    symlink_in_path: bool
    size: int
    max_size: int | None = None


def _show(path: str) -> str:
    return repr(path if len(path) <= 120 else path[:120] + "…")


def _parts(path: str) -> list[str]:
    """Components of a POSIX path, without empty and `.` components."""
    return [p for p in path.split("/") if p not in ("", ".")]


def _inside(path: str, directory: str) -> bool:
    """Strictly below `directory` (not the directory itself), compared by components."""
    base = _parts(directory)
    parts = _parts(path)
    return len(parts) > len(base) and parts[: len(base)] == base


def _lexical(path: str, what: str) -> Decision | None:
    """The refusals that need only the string: empty, NUL, `..`."""
    if not path:
        return deny("P5", f"{what} is empty; name a file in this conversation's media directory")
    if "\0" in path:
        return deny("P5", f"{what} contains a NUL byte; name the file plainly")
    if ".." in path.split("/"):
        return deny(
            "P5",
            f"{what} {_show(path)} contains '..'; only files inside this conversation's "
            "media directory may be sent",
        )
    return None


def decide(facts: FileFacts) -> Decision:
    media = facts.media_dir
    if not media.startswith("/") or "\0" in media or ".." in media.split("/"):
        return deny("P5", "the media directory is not an absolute resolved path; nothing is sent")
    refused = _lexical(facts.requested, "the file path")
    if refused is not None:
        return refused
    shown = _show(facts.requested)
    if facts.requested.startswith("/") and not _inside(facts.requested, media):
        return deny("P5", f"{shown} is outside this conversation's media directory; {_INSTEAD}")
    if facts.kind == "symlink" or facts.symlink_in_path:
        return deny("P5", f"{shown} is or passes through a symbolic link; {_INSTEAD}")
    if facts.kind == "missing":
        return deny("P5", f"{shown} does not exist in this conversation's media directory")
    if facts.resolved is None:
        return deny("P5", f"{shown} could not be resolved; {_INSTEAD}")
    if not _inside(facts.resolved, media):
        return deny("P5", f"{shown} resolves outside this conversation's media directory")
    if facts.kind != "regular":
        what = _KIND_NAMES.get(facts.kind, repr(facts.kind))
        return deny("P5", f"{shown} is {what}, not a regular file; {_INSTEAD}")
    if facts.nlink != 1:
        return deny("P5", f"{shown} is a hard link shared with another path; {_INSTEAD}")
    if facts.size < 0:
        return deny("P5", f"{shown} reports a negative size")
    if facts.max_size is not None and facts.size > facts.max_size:
        return deny(
            "P5",
            f"{shown} is {facts.size} bytes, over the limit of {facts.max_size}; "
            "send a smaller or compressed file",
        )
    return allow("P5")


def normalize_request(path: str, media_dir_in_sandbox: str) -> str | Decision:
    """`path` as written in the sandbox, made relative to the media dir, or a refusal.

    An absolute path must lie inside `media_dir_in_sandbox`; a relative path is
    taken relative to the media directory (not the sandbox's working directory).
    """
    if not media_dir_in_sandbox.startswith("/"):
        return deny("P5", "the sandbox media directory is not absolute; nothing is sent")
    refused = _lexical(path, "the file path")
    if refused is not None:
        return refused
    parts = _parts(path)
    if path.startswith("/"):
        if not _inside(path, media_dir_in_sandbox):
            return deny(
                "P5",
                f"{_show(path)} is outside this conversation's media directory "
                f"{media_dir_in_sandbox}; save the file there and send it from there",
            )
        parts = parts[len(_parts(media_dir_in_sandbox)) :]
    if not parts:
        return deny("P5", "the path names the media directory itself; name a file inside it")
    return "/".join(parts)
