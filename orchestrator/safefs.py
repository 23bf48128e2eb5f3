"""Every host-side touch of a path a sandbox can write (P5, M6, D3, R3).

A sandbox can write its chat directory (`workspace/chats/<conv>/`), its media
directory (`workspace/media/<dir>/`) and its home (`sandbox-homes/<conv>/`),
so anything under them may at any moment be a symlink, a hard link, a FIFO, a
socket, a device, a directory or a huge sparse file, and may be swapped for
another between two system calls. The gateway runs as root on the host; this
module is the one place that opens, reads and writes there.

- `SafeDir.open(path)` opens such a directory with `O_NOFOLLOW` (its parent
  belongs to the gateway); everything below is reached relative to that
  descriptor, one component at a time, each with `O_NOFOLLOW`. A path is a
  plain relative path: absolute paths, `..`, NUL and empty names are refused
  before any system call.
- Files are opened `O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC|O_NOCTTY` only after an
  `lstat` said "regular file" (an open alone of a device can have effects),
  and the decision is taken again on `fstat` of the opened descriptor (same
  inode, regular, one link): a swap is seen and refused, or too late to matter,
  because the bytes come from the checked descriptor. Nothing ever waits on a
  FIFO.
- Reads are bounded per call (`cap`): a 1 TB sparse file is never read whole;
  a copy is refused for a sparse file or one over its cap before a byte is
  copied.
- Writes: `write_atomic` (temporary file in the same directory via its
  descriptor, fsync, rename between descriptors), `append` (`O_APPEND`, never
  through a link), `ensure_file`, `mkdirs`.

What is refused raises `cellgate.errors.UnsafePath(rel, kind, reason)`; its
text names the path relative to the directory, never a host path. A missing
file is not unsafe: it raises `FileNotFoundError` (or reads as `None`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Protocol

from cellgate.errors import CellgateError, UnsafePath

__all__ = [
    "READ_CAP_BYTES",
    "LeftOut",
    "RefusalRecorder",
    "SafeDir",
    "SafeFile",
    "audit_left_out",
    "fd_path",
    "kind_of",
    "left_out",
    "split_rel",
]

logger = logging.getLogger(__name__)

READ_CAP_BYTES = 256 * 1024
"""The default cap of one read: no call reads more than its cap, whatever the file's size."""
SPARSE_SLACK_BYTES = 64 * 1024
"""A file whose allocated blocks fall short of its size by more than this is sparse."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_CHUNK = 1024 * 1024


def kind_of(mode: int) -> str:
    """`regular`, `dir`, `symlink`, `fifo`, `socket` or `device` for an `st_mode`."""
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


_SHOWN = {
    "symlink": "a symbolic link (never followed)",
    "dir": "a directory",
    "fifo": "a named pipe",
    "socket": "a socket",
    "device": "a device",
}


def _not_regular(rel: str, kind: str) -> UnsafePath:
    return UnsafePath(rel, kind, f"is {_SHOWN.get(kind, kind)}, not a regular file")


def _raise_open_failed(rel: str, name: str, dir_fd: int, exc: OSError) -> NoReturn:
    """Raise why opening `name`, a regular file when stat'ed a moment ago, failed.

    A path flipped to a symlink and back between that stat, the open and this
    look is regular again: a swap. A regular file the sandbox keeps from being
    opened (a lease: EWOULDBLOCK; no permission) is refused as `unopenable`;
    only the gateway's own shortage (no descriptors or memory left) is raised
    as it is.
    """
    kind = kind_of(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    if kind != "regular":
        raise _not_regular(rel, kind) from exc
    if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
        raise UnsafePath(rel, "swapped", "was replaced while it was being opened") from exc
    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        raise exc
    raise UnsafePath(rel, "unopenable", f"cannot be opened: {exc.strerror or exc}") from exc


def split_rel(rel: str) -> list[str]:
    """The components of a plain relative path; `UnsafePath(kind="escape")` otherwise."""
    if not rel or "\0" in rel:
        raise UnsafePath(rel.replace("\0", "\\0"), "escape", "is empty or contains a NUL byte")
    if rel.startswith("/"):
        raise UnsafePath(rel, "escape", "is absolute; only a path inside the directory is used")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(rel, "escape", "contains '..'; only a path inside the directory is used")
    if not parts:
        raise UnsafePath(rel, "escape", "names the directory itself, not a file in it")
    return parts


def fd_path(fd: int) -> str | None:
    """Where the kernel says an open descriptor is; None when it cannot tell."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") and not target.endswith(" (deleted)") else None


LeftOut = Callable[[UnsafePath], None]
"""Told of each file left out (e.g. to record an audit row); it must not raise."""


def left_out(where: str, what: str, exc: UnsafePath, report: LeftOut | None = None) -> None:
    """Log a file left out (`where` is a conversation's directory name, never a host path).

    Then tell `report`, which a caller holding the store uses to record an audit row.
    """
    logger.warning(
        "%s of %s left out: %r is %s",
        what,
        where,
        exc.rel,
        exc.kind,
        extra={"conversation": where, "kind": exc.kind},
    )
    if report is not None:
        report(exc)


class RefusalRecorder(Protocol):
    """The part of the store that records an audit row (`Store.record_refusal`)."""

    def record_refusal(
        self,
        *,
        rule: str,
        action: str,
        reason: str,
        conversation: Any = None,
        session_id: Any = None,
        detail: Mapping[str, Any] | None = None,
    ) -> object: ...


def audit_left_out(store: RefusalRecorder, conversation: str, rule: str) -> LeftOut:
    """A `LeftOut` that records each file left out as an audit row of `conversation`.

    `rule` names the requirement the file served (`D3` transcript, `M5`
    composed memory, `M3` a new conversation's files). The row holds the
    path relative to the conversation's directory and the kind found, never
    a host path. A failing store is logged, never raised into the turn.
    """

    def report(exc: UnsafePath) -> None:
        try:
            store.record_refusal(
                rule=rule,
                action="file_left_out",
                reason=f"{exc.rel!r} {exc.reason}; left out",
                conversation=conversation,
                detail={"path": exc.rel, "kind": exc.kind},
            )
        except CellgateError as err:
            logger.warning("audit row for a file left out not recorded: %s", err)

    return report


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(slots=True)
class SafeFile:
    """An open, checked regular file: read it by `read`/`pread`, then `close` (or use `with`).

    `rel` is its path relative to the directory it was opened in; `size` and
    `allocated` (bytes of disk it uses) are from `fstat` of this descriptor.
    """

    fd: int
    rel: str
    name: str
    size: int
    allocated: int
    max_size: int
    nlink: int = 1

    def where(self) -> str | None:
        """The file's host path by its descriptor (for policy facts; never shown to a user)."""
        return fd_path(self.fd)

    @property
    def sparse(self) -> bool:
        """Holes worth more than `SPARSE_SLACK_BYTES`: a copy would cost the host real bytes.

        Both facts are needed: fewer blocks than bytes (which a compressing
        filesystem shows too) and a hole before the end (`SEEK_HOLE`).
        """
        if self.allocated + SPARSE_SLACK_BYTES >= self.size:
            return False
        try:
            return os.lseek(self.fd, 0, os.SEEK_HOLE) < self.size
        except OSError:  # no SEEK_HOLE here: trust the block count
            return True

    def read(self, cap: int | None = None) -> bytes:
        """With `cap`: at most `cap` bytes from the start, silently truncated.

        Without: every byte, up to `max_size`; a file that grew past it is refused.
        """
        limit = self.max_size if cap is None else cap
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.pread(self.fd, min(_CHUNK, limit + 1 - total), total)
            if not chunk:
                break
            total += len(chunk)
            chunks.append(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            if cap is None:
                raise UnsafePath(
                    self.rel, "too_large", f"grew past the limit of {self.max_size} bytes"
                )
            data = data[:limit]
        return data

    def pread(self, size: int, offset: int) -> bytes:
        """Up to `size` bytes (at most 1 MiB a call) at `offset` of the checked descriptor."""
        return os.pread(self.fd, max(0, min(size, _CHUNK)), offset)

    def read_tail(self, cap: int) -> bytes:
        """The last `cap` bytes (or fewer), by `fstat` now; never more than `cap`."""
        size = os.fstat(self.fd).st_size
        start = max(0, size - cap)
        chunks: list[bytes] = []
        got = 0
        while got < cap:
            chunk = os.pread(self.fd, min(_CHUNK, cap - got), start + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def copy_into(self, directory: SafeDir, name: str, *, mode: int = 0o600) -> int:
        """Copy this file into `directory/name` (new file, never through a link); returns bytes.

        Refused before a byte is copied: a sparse file (its holes would cost
        the host real bytes) or one over `max_size`. At most the checked
        `size` is copied: a file that grows meanwhile is refused and the
        partial copy removed.
        """
        if self.sparse:
            raise UnsafePath(
                self.rel,
                "sparse",
                f"is sparse ({self.size} bytes, {self.allocated} on disk); "
                "write the file's bytes out in full and send that",
            )
        if self.size > self.max_size:
            raise UnsafePath(
                self.rel, "too_large", f"is {self.size} bytes, over the limit of {self.max_size}"
            )
        _plain_name(name)
        limit = self.size
        fd = os.open(name, _CREATE, mode, dir_fd=directory.fd)
        try:
            total = 0
            while True:
                chunk = os.pread(self.fd, min(_CHUNK, limit + 1 - total), total)
                if not chunk:
                    break
                total += len(chunk)
                if total > limit:
                    raise UnsafePath(
                        self.rel, "swapped", "grew while it was being copied; send it again"
                    )
                _write_all(fd, chunk)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=directory.fd)
            raise
        os.close(fd)
        return total

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


def _plain_name(name: str) -> str:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise UnsafePath(name.replace("\0", "\\0"), "escape", "is not a plain file name")
    return name


class SafeDir:
    """An open directory a sandbox may write; every path below it is walked without links.

    `rel` is how messages name it (relative, e.g. `chats/<conv>`), never a host path.
    """

    __slots__ = ("fd", "rel")

    def __init__(self, fd: int, rel: str) -> None:
        self.fd = fd
        self.rel = rel

    @classmethod
    def open(cls, path: Path | str, *, rel: str | None = None) -> SafeDir:
        """Open the directory `path`; its last component is not followed.

        Its parents belong to the gateway (the sandbox cannot replace them);
        a symlink or non-directory at `path` raises `UnsafePath`, a missing
        one `FileNotFoundError`.
        """
        shown = rel if rel is not None else Path(path).name
        try:
            return cls(os.open(path, _DIR), shown)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    kind = kind_of(os.lstat(path).st_mode)
                except OSError:
                    kind = "symlink" if exc.errno == errno.ELOOP else "not_dir"
                raise UnsafePath(shown, kind, "is not a plain directory; it is not used") from exc
            raise

    @classmethod
    def trusted(cls, path: Path | str, *, rel: str = "") -> SafeDir:
        """Open a directory that belongs to the gateway (links in its path are the operator's).

        Only what is walked below it is untrusted; use it for the workspace or
        the agent root, never for a directory a sandbox can write.
        """
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), rel)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def where(self) -> str | None:
        """The directory's host path by its descriptor (for policy facts; never shown)."""
        return fd_path(self.fd)

    def _show(self, rel: str) -> str:
        return f"{self.rel}/{rel}" if self.rel else rel

    def lstat(self, rel: str) -> os.stat_result | None:
        """`lstat` of `rel` (walked without links); None if it is missing."""
        parts = split_rel(rel)
        try:
            with self._walk(parts[:-1], rel) as parent:
                return os.stat(parts[-1], dir_fd=parent.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _walk(
        self, parts: list[str], rel: str, *, create: bool = False, mode: int = 0o755
    ) -> SafeDir:
        """The directory `parts` below this one, each component opened `O_NOFOLLOW`.

        Returns a new `SafeDir` the caller closes (a `with` works); with no
        parts, a duplicate of this one.
        """
        fd = os.dup(self.fd)
        try:
            for i, part in enumerate(parts):
                try:
                    nxt = self._open_part(fd, parts, i, rel, create)
                except FileNotFoundError:
                    if not create:
                        raise
                    # made only when missing (F3: a name that is there costs one call)
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, mode, dir_fd=fd)
                    nxt = self._open_part(fd, parts, i, rel, create)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return SafeDir(fd, self._show("/".join(parts)) if parts else self.rel)

    def _open_part(self, fd: int, parts: list[str], i: int, rel: str, create: bool) -> int:
        """`parts[i]` opened below `fd` without following it; anything but a directory
        there raises `UnsafePath` (a missing one `FileNotFoundError`)."""
        part = parts[i]
        try:
            return os.open(part, _DIR, dir_fd=fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            where = "/".join(parts[: i + 1])
            try:
                kind = kind_of(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                raise exc from None
            if kind == "regular" and exc.errno == errno.ENOTDIR and not create:
                raise FileNotFoundError(errno.ENOENT, "not a directory", rel) from exc
            raise UnsafePath(
                self._show(where), kind, f"is {_SHOWN.get(kind, kind)}, not a directory"
            ) from exc

    def subdir(self, rel: str, *, create: bool = False, mode: int = 0o755) -> SafeDir:
        """Open (with `create`, make missing components of) the directory `rel` below this one."""
        return self._walk(split_rel(rel), rel, create=create, mode=mode)

    def mkdirs(self, rel: str, mode: int = 0o755) -> None:
        """`mkdir -p rel` without following a link; a non-directory on the way raises."""
        self.subdir(rel, create=True, mode=mode).close()

    # -- reading ----------------------------------------------------------------------

    def open_file(
        self, rel: str, *, max_size: int, allow_hardlink: bool = False, check_size: bool = True
    ) -> SafeFile:
        """Open the regular file `rel` for reading, decided on `fstat` of its descriptor.

        Refused (`UnsafePath`): a symlink on the way, anything but a regular
        file, a hard link (unless `allow_hardlink`), a file swapped while it
        was opened, and (with `check_size`) one over `max_size`.
        """
        parts = split_rel(rel)
        shown = self._show("/".join(parts))
        # a name in this directory is opened at it (F3: no duplicate descriptor to walk from)
        walked = self._walk(parts[:-1], rel) if len(parts) > 1 else None
        parent = walked or self
        try:
            name = parts[-1]
            before = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
            kind = kind_of(before.st_mode)
            if kind != "regular":
                # never open a device, FIFO or socket: an open alone can have effects
                raise _not_regular(shown, kind)
            try:
                fd = os.open(name, _READ, dir_fd=parent.fd)
            except FileNotFoundError:
                raise
            except OSError as exc:
                _raise_open_failed(shown, name, parent.fd, exc)
        finally:
            if walked is not None:
                walked.close()
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(shown, kind_of(st.st_mode))
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise UnsafePath(shown, "swapped", "was replaced while it was being opened")
            if st.st_nlink != 1 and not allow_hardlink:
                raise UnsafePath(shown, "hardlink", "is a hard link shared with another path")
            if check_size and st.st_size > max_size:
                raise UnsafePath(
                    shown, "too_large", f"is {st.st_size} bytes, over the limit of {max_size}"
                )
            return SafeFile(
                fd=fd,
                rel="/".join(parts),
                name=name,
                size=st.st_size,
                allocated=st.st_blocks * 512,
                max_size=max_size,
                nlink=st.st_nlink,
            )
        except BaseException:
            os.close(fd)
            raise

    def read(self, rel: str, *, cap: int = READ_CAP_BYTES, tail: bool = False) -> bytes | None:
        """At most `cap` bytes of the regular file `rel` (its head, or with `tail` its end).

        None if it is missing; `UnsafePath` if it is anything but a regular
        file with one link. A file of any size is fine: only `cap` is read.
        """
        try:
            f = self.open_file(rel, max_size=cap, check_size=False)
        except FileNotFoundError:
            return None
        with f:
            if tail:
                return f.read_tail(cap)
            return f.read(cap)

    # -- writing ----------------------------------------------------------------------

    def write_atomic(
        self,
        name: str,
        data: bytes,
        *,
        mode: int = 0o644,
        owner: tuple[int, int] | None = None,
        durable: bool = True,
    ) -> None:
        """Replace `name` with `data`: temp file here, fsync, rename between descriptors.

        A symlink planted at `name` is replaced, never written through; a
        directory there is refused (`UnsafePath`). `owner` (uid, gid) is set
        on the new file when the gateway runs as root. `durable=False` skips
        both fsyncs, for a file made anew at every spawn (a crash loses
        nothing: the next spawn writes it again); the rename stays atomic.
        """
        _plain_name(name)
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, _CREATE, mode, dir_fd=self.fd)
        try:
            try:
                _write_all(fd, data)
                os.fchmod(fd, mode)
                if owner is not None and os.geteuid() == 0:
                    os.fchown(fd, *owner)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except IsADirectoryError as exc:
                raise _not_regular(self._show(name), "dir") from exc
            if durable:
                os.fsync(self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def _open_for_write(self, name: str, *, create: bool, mode: int) -> tuple[int, bool]:
        """An `O_APPEND` descriptor of the regular one-link file `name`, and whether it is new."""
        shown = self._show(name)
        try:
            before: os.stat_result | None = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            before = None
        if before is not None and not stat.S_ISREG(before.st_mode):
            raise _not_regular(shown, kind_of(before.st_mode))
        created = False
        if before is None:
            if not create:
                raise FileNotFoundError(errno.ENOENT, "no such file", shown)
            try:
                fd = os.open(name, _CREATE | os.O_APPEND, mode, dir_fd=self.fd)
                created = True
            except FileExistsError:  # planted between the stat and the open: look again
                return self._open_for_write(name, create=False, mode=mode)
        else:
            try:
                fd = os.open(name, _APPEND, dir_fd=self.fd)
            except OSError as exc:
                if isinstance(exc, FileNotFoundError):
                    raise
                _raise_open_failed(shown, name, self.fd, exc)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(shown, kind_of(st.st_mode))
            if before is not None and (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise UnsafePath(shown, "swapped", "was replaced while it was being opened")
            if st.st_nlink != 1:
                raise UnsafePath(shown, "hardlink", "is a hard link shared with another path")
        except BaseException:
            os.close(fd)
            raise
        return fd, created

    def append(self, name: str, data: bytes, *, mode: int = 0o644, create: bool = True) -> int:
        """Append `data` to `name` with `O_APPEND`, never through a link; returns bytes written.

        A file this call creates is owned like the directory (so the sandbox
        can keep writing it) when the gateway runs as root.
        """
        _plain_name(name)
        fd, created = self._open_for_write(name, create=create, mode=mode)
        try:
            if created and os.geteuid() == 0:
                dst = os.fstat(self.fd)
                os.fchown(fd, dst.st_uid, dst.st_gid)
            _write_all(fd, data)
        finally:
            os.close(fd)
        return len(data)

    def ensure_file(
        self, name: str, *, mode: int = 0o644, owner: tuple[int, int] | None = None
    ) -> None:
        """Create `name` empty if it is missing; a regular file there is kept (and chowned).

        Anything else there (symlink, FIFO, device, directory, hard link) raises
        `UnsafePath` and is left untouched.
        """
        _plain_name(name)
        fd, _ = self._open_for_write(name, create=True, mode=mode)
        try:
            if owner is not None and os.geteuid() == 0:
                os.fchown(fd, *owner)
            elif owner is not None and owner[0] != os.geteuid():
                os.fchmod(fd, 0o666)
        finally:
            os.close(fd)

    def hand_over(self, owner: tuple[int, int] | None) -> None:
        """Give this directory to the sandbox's user (`chown` as root, else world-writable)."""
        if owner is None:
            return
        if os.geteuid() == 0:
            os.fchown(self.fd, *owner)
        elif owner[0] != os.geteuid():
            os.fchmod(self.fd, 0o777)

    def remove(self, name: str) -> None:
        """Unlink `name` (a file or link, never followed); missing is fine."""
        _plain_name(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)
