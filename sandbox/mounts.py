"""The mount system calls the gateway makes itself (root only), without a `mount` process.

One place for `mount(2)` and `umount2(2)` through libc: the late-bound slots of
the warm pool (F1) and the quota image's binds (R2) both use it. A failed
call raises `MountError` with the errno's text; nothing here follows a path
the caller did not resolve (callers pass descriptors as `/proc/self/fd/N`
where a symlink could be swapped in). `flags_of` reads a mount's flags with
`statvfs`, which is cheaper than parsing `/proc/self/mountinfo`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

from cellgate.errors import SandboxError

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

_libc: ctypes.CDLL | None = None


class MountError(SandboxError):
    """A mount system call failed (its target and the errno's text say which)."""


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def mount(source: str | None, target: str, flags: int) -> None:
    """`mount(source, target, NULL, flags, NULL)`; raises `MountError`."""
    src = source.encode() if source is not None else None
    if _lib().mount(src, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise MountError(f"mount {source} -> {target}: {os.strerror(err)}")


def detach(target: str, *, nofollow: bool = False) -> int:
    """`umount2(target, MNT_DETACH)`: 0, or the errno (the caller decides if it matters).

    `nofollow`: a symlink at `target`'s last component is not followed (EINVAL)."""
    flags = MNT_DETACH | (UMOUNT_NOFOLLOW if nofollow else 0)
    if _lib().umount2(target.encode(), flags) != 0:
        return ctypes.get_errno()
    return 0


def bind(source: str, target: str, flags: int) -> None:
    """Bind `source` onto `target`, then set exactly `flags` (of MS_RDONLY, MS_NOSUID,
    MS_NODEV, MS_NOEXEC) on the new mount; the bind is undone when that fails."""
    mount(source, target, MS_BIND)
    try:
        mount(None, target, MS_REMOUNT | MS_BIND | flags)
    except MountError:
        detach(target)
        raise


def remount_bind(target: str, flags: int) -> None:
    """Set exactly `flags` on the mount at `target` (a per-mount change, as `mount -o
    remount,bind` does)."""
    mount(None, target, MS_REMOUNT | MS_BIND | flags)


def noexec(path: Path) -> bool:
    """Is `path` (or, before it exists, its nearest existing parent) on a filesystem
    mounted noexec? Nothing placed there (a runner, an init) can be executed."""
    for p in (path, *path.parents):
        try:
            return bool(os.statvfs(p).f_flag & os.ST_NOEXEC)
        except FileNotFoundError:
            continue
    return False


def flags_of(path: str) -> int:
    """The per-mount flags (MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC) of the mount at `path`."""
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in (
        (os.ST_RDONLY, MS_RDONLY),
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
    ):
        if f & st:
            out |= ms
    return out


# -- the new mount API (Linux 5.12+): a detached copy, its flags set, then attached --------

SYS_OPEN_TREE = 428  # the same number on every architecture that has these calls
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
_ATTR = {MS_RDONLY: 0x1, MS_NOSUID: 0x2, MS_NODEV: 0x4, MS_NOEXEC: 0x8}


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


_NEW_API: list[bool] = []  # [False] once the kernel said it has no such calls


def _syscall(*args: object) -> int:
    fn = _lib().syscall
    fn.restype = ctypes.c_long
    return int(fn(*args))


def attach_copy(fd: int, target: str, flags: int, *, target_fd: int | None = None) -> bool:
    """Attach a copy of the mount tree at `fd` (non-recursive) onto `target`, with `flags`
    (MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC) set before it is attached: nobody ever
    sees it otherwise. `target_fd`: onto the directory open there instead (`target` is
    then only its name in messages; no path is walked again). False when this kernel
    lacks the calls (use `bind`); raises `MountError` on any other failure."""
    if _NEW_API:
        return False
    tree = _syscall(
        ctypes.c_long(SYS_OPEN_TREE),
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC | AT_EMPTY_PATH),
    )
    if tree < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):
            _NEW_API.append(False)
            return False
        raise MountError(f"open_tree for {target}: {os.strerror(err)}")
    try:
        # private too: the copy shares no propagation with its source's peers
        attr = _MountAttr(sum(v for k, v in _ATTR.items() if flags & k), 0, MS_PRIVATE, 0)
        if (
            _syscall(
                ctypes.c_long(SYS_MOUNT_SETATTR),
                ctypes.c_int(tree),
                ctypes.c_char_p(b""),
                ctypes.c_uint(AT_EMPTY_PATH),
                ctypes.byref(attr),
                ctypes.c_size_t(ctypes.sizeof(attr)),
            )
            < 0
        ):
            err = ctypes.get_errno()
            if err == errno.ENOSYS:
                _NEW_API.append(False)
                return False
            raise MountError(f"mount_setattr for {target}: {os.strerror(err)}")
        if (
            _syscall(
                ctypes.c_long(SYS_MOVE_MOUNT),
                ctypes.c_int(tree),
                ctypes.c_char_p(b""),
                ctypes.c_int(AT_FDCWD if target_fd is None else target_fd),
                ctypes.c_char_p(target.encode() if target_fd is None else b""),
                ctypes.c_uint(
                    MOVE_MOUNT_F_EMPTY_PATH | (0 if target_fd is None else MOVE_MOUNT_T_EMPTY_PATH)
                ),
            )
            < 0
        ):
            raise MountError(f"move_mount onto {target}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(tree)
    return True
