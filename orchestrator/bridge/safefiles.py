"""Opening files a sandbox controls, from a gateway that runs as root (P5, M6).

The sandbox can write its media and chat directories, so it can plant a
symlink, a hard link, a FIFO or a socket there, and swap one for a regular
file at any moment. Nothing here resolves a path string: every component is
opened with `O_NOFOLLOW` relative to the descriptor of the one before, the
decision is taken on `fstat` of the opened descriptor, and the bytes are read
from that same descriptor, so a swap between check and use cannot leak
anything (the swap is either seen, and refused, or too late to matter).

- `open_media_file`: a regular file inside the session's media directory,
  decided by `policies.paths.decide` on facts from the descriptor (P5).
- `append_memory`: append to MEMORY.md or USER.md of the conversation's chat
  directory with `O_APPEND|O_NOFOLLOW`; a symlink, hard link or non-regular
  file planted under that name is refused and left untouched (M6).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from cellgate.errors import BridgeError, PolicyDenied
from policies.memory import MemoryFile
from policies.paths import FileFacts, FileKind, decide, normalize_request

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "SafeFile",
    "append_memory",
    "open_media_file",
]

DEFAULT_MAX_FILE_BYTES = 50 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CHUNK = 1024 * 1024


def _kind(mode: int) -> FileKind:
    if stat.S_ISREG(mode):
        return "regular"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def _fd_path(fd: int) -> str | None:
    """Where the kernel says an open descriptor is; None when it cannot tell."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") and not target.endswith(" (deleted)") else None


@dataclass(slots=True)
class SafeFile:
    """An open, checked regular file; read it with `read()`, then `close()` (or use `with`).

    `rel` is the path relative to the media directory; `size` is from `fstat`.
    """

    fd: int
    rel: str
    name: str
    size: int
    max_size: int

    def read(self) -> bytes:
        """All bytes, from the checked descriptor; refuses a file that grew past the cap."""
        chunks: list[bytes] = []
        total = 0
        os.lseek(self.fd, 0, os.SEEK_SET)
        while True:
            chunk = os.read(self.fd, _CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > self.max_size:
                raise PolicyDenied(
                    "P5", f"{self.rel!r} grew past the limit of {self.max_size} bytes while read"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def copy_to(self, dest: Path) -> int:
        """Write the bytes into `dest` (created, mode 0600, never through a link); returns size."""
        data = self.read()
        fd = os.open(
            dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _facts(
    rel: str,
    media: str,
    kind: FileKind,
    *,
    symlink: bool = False,
    max_size: int,
    parent: int | None = None,
) -> FileFacts:
    """Facts for a file that is not opened (the decision is always a refusal).

    `parent` is the descriptor of the directory holding it, when it was reached.
    """
    resolved = None
    if parent is not None and kind not in ("missing", "symlink"):
        where = _fd_path(parent)
        resolved = f"{where}/{rel.rsplit('/', 1)[-1]}" if where else None
    return FileFacts(
        requested=rel,
        media_dir=media,
        resolved=resolved,
        kind=kind,
        nlink=0,
        symlink_in_path=symlink,
        size=0,
        max_size=max_size,
    )


def _refuse(facts: FileFacts) -> PolicyDenied:
    decision = decide(facts)
    if decision.allowed:  # facts of a failed open never allow; keep it a refusal regardless
        return PolicyDenied("P5", f"{facts.requested!r} could not be opened safely")
    return PolicyDenied(decision.rule, decision.reason)


def _open_failed(exc: OSError, name: str, parent: int, rel: str, media: str, cap: int) -> NoReturn:
    """Turn a failed O_NOFOLLOW open into the P5 refusal it stands for; always raises."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        raise _refuse(_facts(rel, media, "missing", max_size=cap)) from exc
    except OSError as inner:
        raise _refuse(_facts(rel, media, "missing", max_size=cap)) from inner
    kind = _kind(st.st_mode)
    if kind == "regular" and exc.errno == errno.ENOTDIR:
        kind = "missing"  # a file where a directory was named: nothing by that path
    elif kind == "regular":
        raise BridgeError("internal", f"could not open {rel!r}: {exc.strerror}") from exc
    facts = _facts(rel, media, kind, symlink=kind == "symlink", max_size=cap, parent=parent)
    raise _refuse(facts) from exc


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
    parts = rel.split("/")
    try:
        top = os.open(media_dir, _DIR_FLAGS)
    except OSError as exc:
        raise BridgeError(
            "internal", f"this conversation's media directory cannot be opened: {exc.strerror}"
        ) from exc
    media = _fd_path(top) or str(media_dir)
    held = [top]
    try:
        for part in parts[:-1]:
            try:
                held.append(os.open(part, _DIR_FLAGS, dir_fd=held[-1]))
            except OSError as exc:
                _open_failed(exc, part, held[-1], rel, media, max_size)
        name = parts[-1]
        try:
            before = os.stat(name, dir_fd=held[-1], follow_symlinks=False)
        except FileNotFoundError as exc:
            raise _refuse(_facts(rel, media, "missing", max_size=max_size)) from exc
        if not stat.S_ISREG(before.st_mode):
            # never open a device, FIFO or socket: an open alone can have effects
            kind = _kind(before.st_mode)
            symlink = kind == "symlink"
            facts = _facts(rel, media, kind, symlink=symlink, max_size=max_size, parent=held[-1])
            raise _refuse(facts)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=held[-1])
        except OSError as exc:
            _open_failed(exc, name, held[-1], rel, media, max_size)
    finally:
        for d in held:
            os.close(d)
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise PolicyDenied(
                "P5", f"{rel!r} was replaced while it was being opened; send it again"
            )
        facts = FileFacts(
            requested=rel,
            media_dir=media,
            resolved=_fd_path(fd),
            kind=kind,
            nlink=st.st_nlink,
            symlink_in_path=False,
            size=st.st_size,
            max_size=max_size,
        )
        decision = decide(facts)
        if not decision.allowed:
            raise PolicyDenied(decision.rule, decision.reason)
        return SafeFile(fd=fd, rel=rel, name=parts[-1], size=st.st_size, max_size=max_size)
    except BaseException:
        os.close(fd)
        raise


_MEMORY_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def append_memory(chat_dir: Path, name: MemoryFile, text: str) -> int:
    """M6: append `text` (plus a newline if it lacks one) to `chat_dir/name`; returns bytes written.

    The file is opened relative to an `O_NOFOLLOW` descriptor of the chat
    directory, never through a link; a missing file is created owned like the
    directory, so the sandbox can keep writing it.
    """
    data = (text if text.endswith("\n") else text + "\n").encode("utf-8")
    try:
        dfd = os.open(chat_dir, _DIR_FLAGS)
    except OSError as exc:
        raise BridgeError(
            "internal", f"this conversation's chat directory cannot be opened: {exc.strerror}"
        ) from exc
    try:
        dst = os.fstat(dfd)
        created = False
        try:
            pre = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            pre = None
        if pre is not None and not stat.S_ISREG(pre.st_mode):
            _memory_refused(OSError(errno.EINVAL, "not a regular file"), name, dfd)
        try:
            fd = os.open(name, _MEMORY_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            fd = os.open(name, _MEMORY_FLAGS | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            created = True
        except OSError as exc:
            _memory_refused(exc, name, dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PolicyDenied(
                    "M6", f"{name} is {_kind(st.st_mode)}, not a regular file; nothing was written"
                )
            if st.st_nlink != 1:
                raise PolicyDenied(
                    "M6",
                    f"{name} is a hard link shared with another path; nothing was written. "
                    f"Remove it and write again to start a fresh {name}",
                )
            if created and os.geteuid() == 0:
                os.fchown(fd, dst.st_uid, dst.st_gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    return len(data)


def _memory_refused(exc: OSError, name: str, dfd: int) -> NoReturn:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        raise BridgeError("internal", f"could not open {name}: {exc.strerror}") from exc
    kind = _kind(st.st_mode)
    if kind == "symlink":
        raise PolicyDenied(
            "M6",
            f"{name} in this conversation's directory is a symbolic link; it is not followed and "
            f"nothing was written. Remove the link and write again to start a fresh {name}",
        ) from exc
    if kind != "regular":
        raise PolicyDenied(
            "M6", f"{name} is {kind}, not a regular file; nothing was written"
        ) from exc
    raise BridgeError("internal", f"could not open {name}: {exc.strerror}") from exc
