"""A hard quota on one conversation's writable storage: a loop-mounted ext4 image (R2).

A conversation writes to three host directories (its chat dir, its media dir(s)
and its home). Each conversation gets one fixed-size filesystem image, so one
budget of bytes and inodes covers all three, and a `dd` or a file flood in the
sandbox stops with ENOSPC inside its own image; the host's disk only ever pays
for what was written, at most the image's size (the file is sparse).

Layout under the quota root (`<stateDir>/quota/`), all root-only (0700):

    <agent>/<digest>.img      sparse ext4 image, `bytes` big, at least `inodes` inodes
    <agent>/<digest>.lock     flock: one ensure at a time per conversation
    <agent>/<digest>.mnt/     the image, mounted nosuid,nodev (and noexec)
        chat/  home/  media/<name>/   bind-mounted onto the conversation's host dirs
        .cellgate/migrated-<target>   the pre-quota copy ran (never seen by a sandbox)

`LoopQuota.ensure` is idempotent and cheap when all is in place: it checks, by
device and inode and with `/proc/self/mountinfo`, that every host dir is the
image's subdir with the right flags; after a reboot or an unmount it mounts
again, reusing a loop device still attached to the same image so that one
image is never mounted through two devices. Data a host dir held before the
quota is copied into the image once, bounded by the image's bytes and inodes
(no-follow; FIFOs, sockets and devices left out), then removed from under the
mount when the copy was complete.

`probe` checks once per filesystem that the mechanism works here (root, loop
devices, mkfs.ext4, mount) by making, mounting and removing a small image.
XFS project quotas and btrfs qgroups are not used: the loop image needs only
what every Linux host has, and is what the tests prove.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cellgate.errors import QuotaError
from sandbox.mounts import (
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MountError,
    attach_copy,
    bind,
    detach,
    flags_of,
    mount,
    remount_bind,
)

logger = logging.getLogger(__name__)

TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
COMMAND_TIMEOUT = 60.0
MARKERS = ".cellgate"
MAX_DEPTH = 64
SPARE_INODES = 16  # held back for the gateway's own files (CLAUDE.md, transcript)
FIXED_TARGETS = ("chat", "home")
READER_WAIT = 10.0  # seconds a reader outside a turn waits for a conversation's image


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """One conversation's budget: bytes and inodes of its image, and whether exec is allowed."""

    bytes: int
    inodes: int
    exec_allowed: bool = False

    def mount_flags(self) -> tuple[str, ...]:
        return ("nosuid", "nodev", "exec" if self.exec_allowed else "noexec")

    def ms_flags(self) -> int:
        """The same as mount(2) flags (read-write), as `sandbox.mounts.flags_of` reports them."""
        return MS_NOSUID | MS_NODEV | (0 if self.exec_allowed else MS_NOEXEC)


@dataclass(frozen=True, slots=True)
class QuotaTarget:
    """A host dir the sandbox writes to, and the image subdir that backs it.

    `name` is `chat`, `home` or `media/<dir name>`; `base` is a directory the
    gateway owns that `path` lies under (created below it without following
    symlinks).
    """

    name: str
    base: Path
    path: Path

    def __post_init__(self) -> None:
        parts = self.name.split("/")
        ok = self.name in FIXED_TARGETS or (
            len(parts) == 2 and parts[0] == "media" and parts[1] not in ("", ".", "..")
        )
        if not ok:
            raise ValueError(f"quota target {self.name!r} is not chat, home or media/<name>")


@dataclass(frozen=True, slots=True)
class QuotaSupport:
    """Whether the loop-image quota works on this host, and why not."""

    ok: bool
    mechanism: str
    reason: str


# -- the kernel's view: mountinfo and loop devices ---------------------------


@dataclass(frozen=True, slots=True)
class MountEntry:
    dev: int
    root: str
    mount_point: str
    options: frozenset[str]
    fstype: str


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def mountinfo() -> list[MountEntry]:
    """This process's mounts, in the kernel's order (a later entry is mounted on top)."""
    out: list[MountEntry] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            major, minor = (int(x) for x in fields[2].split(":"))
            out.append(
                MountEntry(
                    dev=os.makedev(major, minor),
                    root=_unescape(fields[3]),
                    mount_point=_unescape(fields[4]),
                    options=frozenset(fields[5].split(",")),
                    fstype=fields[sep + 1],
                )
            )
    return out


def _top(entries: Sequence[MountEntry], mount_point: str) -> MountEntry | None:
    found = [e for e in entries if e.mount_point == mount_point]
    return found[-1] if found else None


def loop_backing_file(dev: int) -> str | None:
    """The file behind a loop block device, or None if `dev` is not one."""
    p = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/loop/backing_file"
    try:  # three system calls (F3: twice in a spare's take), not a buffered file's seven
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 8192)
        finally:
            os.close(fd)
    except OSError:
        return None
    return raw.decode("utf-8", "surrogateescape").rstrip("\n")


def _attached_loop(image: str) -> str | None:
    """A loop device already backed by `image` (still held by a container, say)."""
    for d in sorted(Path("/sys/block").glob("loop*")):
        try:
            back = (d / "loop" / "backing_file").read_text(encoding="utf-8").rstrip("\n")
        except OSError:
            continue
        if back == image:
            return f"/dev/{d.name}"
    return None


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in TOOL_DIRS:
        p = Path(d) / name
        if os.access(p, os.X_OK):
            return str(p)
    return None


def _run(argv: Sequence[str], what: str) -> None:
    tool = _tool(argv[0])
    if tool is None:
        raise QuotaError(
            f"{argv[0]} is not installed; run `sudo bash scripts/setup-quota.sh` "
            "(installs e2fsprogs and util-linux mount)"
        )
    try:
        proc = subprocess.run(
            [tool, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
            env={"PATH": ":".join(TOOL_DIRS), "LC_ALL": "C"},
        )
    except subprocess.TimeoutExpired as exc:
        raise QuotaError(f"{what}: `{argv[0]}` did not finish in {COMMAND_TIMEOUT:g} s") from exc
    except OSError as exc:  # could not start it (no memory for a fork, too many processes)
        raise QuotaError(f"{what}: `{argv[0]}` could not start: {exc.strerror}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()[:500]
        raise QuotaError(f"{what}: `{' '.join(argv)}` failed ({proc.returncode}): {detail}")


# -- images and mounts ------------------------------------------------------


def root_reserve_percent(size: int) -> str:
    """Blocks only root (the gateway) may use: 1/64 of the image, 1 MiB to 1/8."""
    reserve = min(max(size // 64, 1 << 20), size // 8)
    return f"{reserve * 100 / size:.3f}"


def make_image(image: Path, limits: QuotaLimits) -> None:
    """A sparse file of `limits.bytes` with a fresh ext4 (journal, a small root reserve).

    The sandbox never runs as root, so the reserve keeps room for the gateway's
    own writes (the session's CLAUDE.md, the transcript) when a sandbox has
    filled the rest: a full conversation can still take the turn that cleans it.
    """
    tmp = image.with_name(f".{image.name}.new")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, limits.bytes)
    finally:
        os.close(fd)
    try:
        # the file is a fresh hole: its journal and inode tables already read as zeros, so
        # mkfs does not write 8 MiB of journal zeros (real disk, per conversation) and the
        # mount (`noinit_itable`) skips the kernel's background zeroing of the inode tables
        # (loop-device writes that land on the CPU of the next turns, F3)
        _run(
            ["mkfs.ext4", "-q", "-F", "-m", root_reserve_percent(limits.bytes),
             "-N", str(limits.inodes + SPARE_INODES), "-E", "lazy_journal_init=1",
             "-L", "cellgate", str(tmp)],
            f"making the quota image {image}",
        )  # fmt: skip
        os.replace(tmp, image)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def mount_image(image: str, mnt: Path, limits: QuotaLimits, *, fresh: bool = False) -> None:
    """Mount `image` at `mnt`. An image made just now (`fresh`) is on no loop device yet:
    the search of every attached one (a walk over `/sys/block`, as long as the host has
    mounted conversations) is skipped."""
    opts = ",".join((*limits.mount_flags(), "noinit_itable"))  # see make_image
    dev = None if fresh else _attached_loop(image)
    if dev is not None:
        _run(["mount", "-t", "ext4", "-o", opts, dev, str(mnt)], f"mounting {image} ({dev})")
    else:
        _run(["mount", "-t", "ext4", "-o", f"loop,{opts}", image, str(mnt)], f"mounting {image}")


def _remount(path: str, limits: QuotaLimits) -> None:
    opts = ",".join(("remount", "rw", *limits.mount_flags()))
    _run(["mount", "-o", opts, path], f"setting nosuid,nodev on {path}")


def unmount(path: str) -> None:
    """Unmount `path`; lazily when busy (a sandbox may still hold it)."""
    try:
        _run(["umount", path], f"unmounting {path}")
    except QuotaError:
        _run(["umount", "-l", path], f"unmounting {path} lazily")


def release_all(root: Path) -> list[str]:
    """Unmount every mount of an image under `root` (binds first); the paths unmounted.

    Touches nothing else: a mount counts only if its device is a loop device
    backed by a file under `root`, or it is mounted under `root`.
    """
    base = os.path.realpath(root)
    done: list[str] = []
    for _ in range(8):
        entries = mountinfo()
        ours = [
            e
            for e in entries
            if _under(e.mount_point, base) or _under(loop_backing_file(e.dev) or "", base)
        ]
        if not ours:
            break
        for e in reversed(ours):
            with contextlib.suppress(QuotaError):
                unmount(e.mount_point)
                done.append(e.mount_point)
    return done


def _under(path: str, base: str) -> bool:
    return bool(path) and (path == base or path.startswith(base.rstrip("/") + "/"))


# -- a pre-quota host dir copied in once -------------------------------------


@dataclass
class _Budget:
    bytes: int
    entries: int
    copied_files: int = 0
    copied_bytes: int = 0
    left_out: list[str] = field(default_factory=list)


def _owner(st: os.stat_result, fd: int | None = None, path: Path | None = None) -> None:
    if os.geteuid() != 0:
        return
    if fd is not None:
        os.fchown(fd, st.st_uid, st.st_gid)
    elif path is not None:
        os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _copy_file(src_dir: int, name: str, dst: Path, st: os.stat_result) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    sfd = os.open(name, flags, dir_fd=src_dir)
    try:
        if not stat.S_ISREG(os.fstat(sfd).st_mode):
            raise OSError(f"{dst.name} changed kind while copying")
        dfd = os.open(
            dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            left = st.st_size
            while left > 0:
                chunk = os.read(sfd, min(left, 1 << 20))
                if not chunk:
                    break
                os.write(dfd, chunk)
                left -= len(chunk)
            os.fchmod(dfd, stat.S_IMODE(st.st_mode) & 0o777)
            _owner(st, fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return st.st_size


def _copy_tree(src: int, label: Path, dst: Path, budget: _Budget, depth: int = 0) -> None:
    """Copy the directory open at `src` into `dst`, every step relative to an open fd.

    A directory swapped for a symlink mid-copy fails its O_NOFOLLOW open; nothing
    outside the host dir is ever read.
    """
    if depth > MAX_DEPTH:
        budget.left_out.append(f"{label} (deeper than {MAX_DEPTH})")
        return
    with os.scandir(src) as it:
        for de in it:
            budget.entries -= 1
            if budget.entries < 0:
                budget.left_out.append(f"{label} (more entries than the image's inodes)")
                return
            d = dst / de.name
            st = os.stat(de.name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(d, 0o700)
                sub = os.open(de.name, _DIR_FLAGS, dir_fd=src)
                try:
                    _copy_tree(sub, label / de.name, d, budget, depth + 1)
                finally:
                    os.close(sub)
                os.chmod(d, stat.S_IMODE(st.st_mode) & 0o777)
                _owner(st, path=d)
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > budget.bytes:
                    budget.left_out.append(f"{label / de.name} ({st.st_size} bytes, over quota)")
                    continue
                n = _copy_file(src, de.name, d, st)
                budget.bytes -= n
                budget.copied_bytes += n
                budget.copied_files += 1
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(de.name, dir_fd=src), d)
                _owner(st, path=d)
            else:
                budget.left_out.append(f"{label / de.name} (not a file, directory or symlink)")


def _migrate(target: QuotaTarget, sub: Path, limits: QuotaLimits) -> None:
    """Copy what the host dir held before the quota into the image, once, bounded."""
    try:
        if not _has_entries(str(target.path)):
            return
    except OSError as exc:
        raise QuotaError(f"cannot read {target.path}: {exc.strerror}") from exc
    free = os.statvfs(sub)
    budget = _Budget(bytes=free.f_bavail * free.f_frsize, entries=min(free.f_favail, limits.inodes))
    complete = True
    try:
        top = os.open(target.path, _DIR_FLAGS)
        try:
            _copy_tree(top, target.path, sub, budget)
        finally:
            os.close(top)
    except OSError as exc:
        complete = False
        budget.left_out.append(f"copy stopped: {exc}")
    complete = complete and not budget.left_out
    if complete:
        try:
            for de in os.scandir(target.path):
                p = target.path / de.name
                if de.is_dir(follow_symlinks=False):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
        except OSError as exc:
            complete = False
            budget.left_out.append(f"removing the originals stopped: {exc}")
    log = logger.info if complete else logger.warning
    log(
        "quota (R2): copied %d files (%d bytes) from %s into its quota image%s",
        budget.copied_files,
        budget.copied_bytes,
        target.path,
        "" if complete else "; left under the mount on the host: " + "; ".join(budget.left_out[:5]),
    )


# -- the per-conversation quota ----------------------------------------------


def _relative(base: Path, target: Path) -> str:
    """`target`'s path below `base`, checked to be plain names ("" for `base` itself)."""
    current, rel = str(base), str(target)
    if rel == current:
        return ""
    prefix = current.rstrip("/") + "/"
    if not rel.startswith(prefix):
        raise QuotaError(f"{target} is not inside {base}")
    rel = rel[len(prefix) :]
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise QuotaError(f"{target} is not a plain path inside {base}")
    return rel


def _mkdirs_nofollow(base: Path, target: Path, mode: int = 0o755) -> bool:
    """`target` and the directories between `base` and it, none of them a link (on
    strings: three per new conversation's first turn, F3); whether `target` was made
    now (then it is empty). A name that existed is checked to be a directory, not a
    link; one made here is one (`mkdir` never follows a link at the last name)."""
    current, rel = str(base).rstrip("/"), _relative(base, target)
    made = False
    for part in rel.split("/") if rel else ():
        current = f"{current}/{part}"
        try:
            os.mkdir(current, mode)
            made = True
            continue
        except FileExistsError:
            made = False
        if not stat.S_ISDIR(os.lstat(current).st_mode):
            raise QuotaError(f"{current} exists and is not a directory (symlinks are refused)")
    return made


@functools.lru_cache(maxsize=64)
def _real_path(base: Path) -> str:
    """A target base's real path (an app's workspace or agent root: a few per app),
    resolved once rather than a `lstat` per name at every conversation's first turn."""
    return os.path.realpath(base)


def _mark(marker: Path) -> None:
    """Leave the (empty) marker file; it may be there already."""
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))


def _has_entries(path: str) -> bool:
    """Does the directory hold anything (read no further than its first entry)?"""
    with os.scandir(path) as it:
        return next(it, None) is not None


def _walk_nofollow(base: Path, target: Path) -> tuple[int, int] | None:
    """(its parent, `target`) opened O_PATH from `base` one name at a time, no link
    followed; None when a part is missing, a link or not a directory."""
    rel = os.path.relpath(target, base)
    if rel == "." or rel.startswith("..") or os.path.isabs(rel):
        return None
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        cur = os.open(base, flags)
    except OSError:
        return None
    parent = -1
    try:
        for part in rel.split("/"):
            nxt = os.open(part, flags, dir_fd=cur)
            if parent >= 0:
                os.close(parent)
            parent, cur = cur, nxt
    except OSError:
        if parent >= 0:
            os.close(parent)
        os.close(cur)
        return None
    return parent, cur


def keep_spare_inodes(mnt: Path, spare: Path) -> None:
    """ext4 reserves blocks for root but no inodes: hold a few as empty files.

    When a sandbox has used every other inode they are given back, so that the
    gateway can still write its own files for the next turn.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(spare, 0o700)
    held = sorted(os.listdir(spare))
    free = os.statvfs(mnt).f_ffree
    if free < SPARE_INODES // 2 and held:
        for name in held:
            os.unlink(spare / name)
        logger.warning(
            "quota (R2): %s is out of inodes; gave the gateway %d spare ones", mnt, len(held)
        )
    elif len(held) < SPARE_INODES and free > 2 * SPARE_INODES:
        for i in range(SPARE_INODES):
            with contextlib.suppress(FileExistsError):
                os.close(os.open(spare / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


_THREAD_LOCK = threading.Lock()


class Busy(QuotaError):
    """It would have to wait: a lock is held (`locked` with a timeout), or a quick
    `ensure` met slow work (an image to make or mount, data to move in)."""


@contextlib.contextmanager
def locked(lock_path: Path, timeout: float | None = None) -> Iterator[None]:
    """`lock_path` locked (across processes); after `timeout` seconds `Busy` (0: one try)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            deadline, pause = time.monotonic() + timeout, 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Busy(
                            f"{lock_path.name} stayed locked for {timeout:g} s; try again"
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, 0.1)
        yield
    finally:
        os.close(fd)


class LoopQuota:
    """Per-conversation images under `root`, each `limits` big."""

    def __init__(self, root: Path, limits: QuotaLimits) -> None:
        self.root = Path(os.path.realpath(root))
        self.limits = limits
        self._agent_dirs: set[str] = set()  # agents whose dir was made and checked

    def image(self, agent: str, digest: str) -> Path:
        return self.root / agent / f"{digest}.img"

    def mount_dir(self, agent: str, digest: str) -> Path:
        return self.root / agent / f"{digest}.mnt"

    def ensure(
        self,
        agent: str,
        digest: str,
        targets: Sequence[QuotaTarget],
        owner: tuple[int, int] | None,
        *,
        quick: bool = False,
    ) -> None:
        """Every target is its image subdir, mounted nosuid,nodev[,noexec]; idempotent.

        When all is in place it costs a few `lstat`/`statvfs` calls: the mount
        table is read only to set something up. `quick`: raise `Busy` instead of
        anything that may take long (its lock held, an image to make or to mount,
        a host dir's data to move in); what was done stays done, and an `ensure`
        that is not quick finishes it."""
        agent_dir = self.agent_dir(agent, digest)
        image, mnt = self.image(agent, digest), self.mount_dir(agent, digest)
        wait = 0 if quick else None  # quick: a held lock is `Busy` at once
        with locked(agent_dir / f"{digest}.lock", timeout=wait):
            adopted = not image.exists() and self._adopt(agent, digest, wait)
            fresh = not adopted and not image.exists()
            dev = None if fresh else self._mounted_dev(image, mnt)
            if dev is None:
                if quick:
                    raise Busy(f"{image.name} is to be made or mounted")
                if fresh:
                    make_image(image, self.limits)
                dev = self._mount(image, mnt, fresh=fresh)
            elif flags_of(str(mnt)) != self.limits.ms_flags():
                _remount(str(mnt), self.limits)
            markers = mnt / MARKERS
            if not adopted:  # a spare was made with both (F3: not checked again at its take)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(markers, 0o700)
                keep_spare_inodes(mnt, markers / "spare")
            for t in targets:
                self._bind(t, mnt, markers, dev, owner, quick)
            os.utime(agent_dir / f"{digest}.lock")  # used now (see `mounted`)

    def _adopt(self, agent: str, digest: str, wait: float | None) -> bool:
        """A conversation without an image yet, under its lock: give it one made ahead
        (and mounted at its mount dir) instead of a new one; whether it has one now.
        None here (`orchestrator.spare_quota.SparedQuota` keeps spares)."""
        return False

    @contextlib.contextmanager
    def held(self, agent: str, digest: str, targets: Sequence[QuotaTarget]) -> Iterator[bool]:
        """While held, the conversation's image is on the host dirs of `targets` and no
        `ensure` or `release` of it runs. False when the conversation has no image.

        For a reader or writer outside a turn (a backup, the media API, `/reset`):
        after a reboot, or once its sandbox is gone, the image is not mounted and
        those dirs are the empty directories under the mount points. A mounted
        image and its binds are left as they are. What a hold mounts stays mounted
        until `release` (the keeper's sweep, once nobody has used it for a while),
        so a flood of readers mounts it once. Nothing is made or copied: a subdir
        the image does not have, a host dir that is missing, behind a link or
        another mount, or that was never moved into the image, is left as it is.
        """
        agent_dir = self.agent_dir(agent, digest)
        image, mnt = self.image(agent, digest), self.mount_dir(agent, digest)
        lock = agent_dir / f"{digest}.lock"
        # a reader waits a bounded time (a flood of them must not hold every worker thread
        # while a turn's `ensure` moves a big dir in)
        with locked(lock, timeout=READER_WAIT):
            if not image.exists():
                yield False
                return
            dev = self._mounted_dev(image, mnt)
            if dev is None:
                dev = self._mount(image, mnt)
            for t in targets:
                self._bind_for_reader(t, mnt, dev)
            os.utime(lock)  # used now: the sweep leaves it mounted a while
            yield True

    def _bind_for_reader(self, t: QuotaTarget, mnt: Path, dev: int) -> None:
        sub = mnt / t.name
        try:
            want = os.lstat(sub)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(want.st_mode) or want.st_dev != dev:
            return
        if not (mnt / MARKERS / f"migrated-{t.name.replace('/', '-')}").exists():
            return  # the host dir may still hold what the next turn moves in: not hidden
        found = _walk_nofollow(t.base, t.path)
        if found is None:
            return
        parent, host = found
        try:
            have, up = os.fstat(host), os.fstat(parent)
            if (have.st_dev, have.st_ino) == (want.st_dev, want.st_ino):
                return  # bound already
            if have.st_dev != up.st_dev:
                logger.warning("quota (R2): %s holds another mount; not bound for a reader", t.path)
                return
            fd = os.open(sub, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_ino != want.st_ino:
                    raise QuotaError(f"the image's {t.name} changed while it was being bound")
                flags = self.limits.ms_flags()
                if not attach_copy(fd, str(t.path), flags, target_fd=host):  # flags set first
                    mount(f"/proc/self/fd/{fd}", f"/proc/self/fd/{host}", MS_BIND)
                    remount_bind(str(t.path), flags)  # the walk found no link on the way
            except MountError as exc:
                raise QuotaError(f"binding the quota image onto {t.path}: {exc}") from exc
            finally:
                os.close(fd)
        finally:
            os.close(parent)
            os.close(host)
        again = _walk_nofollow(t.base, t.path)
        if again is not None:
            got = os.fstat(again[1])
            os.close(again[0])
            os.close(again[1])
            if (got.st_dev, got.st_ino) == (want.st_dev, want.st_ino):
                logger.info("quota (R2): bound %s of %s for a reader", t.name, mnt.name)
                return
        raise QuotaError(f"{t.path} is not the quota image's {t.name} after binding it")

    def release(self, agent: str, digest: str, *, unused_since: float | None = None) -> int:
        """Unmount a conversation's image and every bind of it; how many mounts went.

        Called once its sandbox is gone (and by the keeper's sweep): the host's
        mounts and loop devices then grow with the conversations in use, not with
        every stranger ever seen (R3). The data stays in the image; the next
        `ensure` or `held` mounts it again. A mount still in use is detached
        lazily; a mount point that is not this image's is left alone.
        `unused_since`: only if nothing used it after that time (see `mounted`).
        """
        agent_dir = self.agent_dir(agent, digest)
        image, mnt = self.image(agent, digest), self.mount_dir(agent, digest)
        lock = agent_dir / f"{digest}.lock"
        with locked(lock):
            if unused_since is not None and os.stat(lock).st_mtime > unused_since:
                return 0
            dev = self._mounted_dev(image, mnt)
            return 0 if dev is None else self._release(dev)

    def mounted(self, agent: str) -> dict[str, float]:
        """The agent's conversations whose image is mounted now, each with when it was
        last used (its lock's time: a turn's `ensure` or a reader's `held`)."""
        self.agent_dir(agent, "mounted")  # checks the agent's name
        prefix = f"{self.root / agent}/"
        out: dict[str, float] = {}
        for e in mountinfo():
            p = e.mount_point
            if p.startswith(prefix) and p.endswith(".mnt") and "/" not in p[len(prefix) :]:
                digest = p[len(prefix) : -len(".mnt")]
                if digest.isalnum():
                    try:
                        out[digest] = os.stat(f"{prefix}{digest}.lock").st_mtime
                    except FileNotFoundError:
                        out[digest] = 0.0
        return out

    def _mounted_dev(self, image: Path, mnt: Path) -> int | None:
        """The device of `image` when it is what is mounted at `mnt`, else None."""
        try:
            st = os.lstat(mnt)
        except FileNotFoundError:
            return None
        if st.st_dev == os.lstat(mnt.parent).st_dev or loop_backing_file(st.st_dev) != str(image):
            return None
        return st.st_dev

    def _release(self, dev: int) -> int:
        image, gone = loop_backing_file(dev), 0
        # the binds (the conversation's host dirs, a pool slot's) were made after the
        # image's own mount, so they come later in the table: undone first
        for e in reversed([e for e in mountinfo() if e.dev == dev]):
            if detach(e.mount_point, nofollow=True) == 0:
                gone += 1
        if gone:
            logger.info("quota (R2): released %s (%d mounts)", image, gone)
        return gone

    def agent_dir(self, agent: str, digest: str) -> Path:
        """The agent's directory of images (made root-only), after checking both names."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,39}", agent) or not digest.isalnum():
            raise QuotaError(f"unusable quota name {agent!r}/{digest!r}")
        agent_dir = self.root / agent
        if agent in self._agent_dirs:  # made and checked before: is it still there?
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(agent_dir).st_mode):
                    return agent_dir
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (self.root, agent_dir):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o700)
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise QuotaError(f"{d} is not a directory")
        self._agent_dirs.add(agent)
        return agent_dir

    def _mount(self, image: Path, mnt: Path, *, fresh: bool = False) -> int:
        """The image's device, mounted at `mnt` with the right flags."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(mnt, 0o700)
        st = os.lstat(mnt)
        if not stat.S_ISDIR(st.st_mode):
            raise QuotaError(f"{mnt} is not a directory")
        if st.st_dev != os.lstat(mnt.parent).st_dev:  # something is mounted there
            if loop_backing_file(st.st_dev) != str(image):
                raise QuotaError(f"{mnt} holds another mount; unmount it (`umount {mnt}`)")
        else:
            mount_image(str(image), mnt, self.limits, fresh=fresh)
            st = os.lstat(mnt)
            if loop_backing_file(st.st_dev) != str(image):
                raise QuotaError(f"{image} did not show up mounted at {mnt}")
            logger.info("quota (R2): mounted %s at %s", image, mnt)
        if flags_of(str(mnt)) != self.limits.ms_flags():
            _remount(str(mnt), self.limits)
        return st.st_dev

    def _bind(
        self,
        t: QuotaTarget,
        mnt: Path,
        markers: Path,
        dev: int,
        owner: tuple[int, int] | None,
        quick: bool = False,
    ) -> None:
        sub = mnt / t.name
        _mkdirs_nofollow(mnt, sub)
        if owner is not None and os.geteuid() == 0:
            os.chown(sub, owner[0], owner[1], follow_symlinks=False)
        made = _mkdirs_nofollow(t.base, t.path)
        # no name below the base is a link (checked above): the base's real path and the rest
        rel = _relative(t.base, t.path)
        host = _real_path(t.base) + (f"/{rel}" if rel else "")
        have, want = os.lstat(host), os.lstat(sub)
        if (have.st_dev, have.st_ino) == (want.st_dev, want.st_ino):
            # the image's own inode on another device's path: only a bind of it shows that
            if have.st_dev != dev:
                raise QuotaError(f"{host} is the image's {t.name} but not on its device")
            if flags_of(host) != self.limits.ms_flags():
                remount_bind(host, self.limits.ms_flags())
            return
        # a mount of another device shows in `st_dev`; only then is the table read (F3:
        # it is long on a busy host). A same-device bind there is covered by ours, which
        # is checked by device and inode below. A dir made just now holds no mount.
        covered = not made and have.st_dev != os.lstat(Path(host).parent).st_dev
        top = _top(mountinfo(), host) if covered else None
        if top is not None:
            raise QuotaError(
                f"{host} is already a mount point ({top.fstype} {top.root}), not this "
                f"conversation's quota image; unmount it (`umount {host}`) and retry"
            )
        marker = markers / f"migrated-{t.name.replace('/', '-')}"
        if made:  # a dir made just now holds nothing to move in
            _mark(marker)
        elif not marker.exists():
            if quick and _has_entries(host):
                raise Busy(f"{host} has data to move into the image")
            _migrate(QuotaTarget(t.name, t.base, Path(host)), sub, self.limits)
            _mark(marker)
        fd = os.open(sub, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_ino != want.st_ino:
                raise QuotaError(f"the image's {t.name} changed while it was being bound")
            bind(f"/proc/self/fd/{fd}", host, self.limits.ms_flags())
        except MountError as exc:
            raise QuotaError(f"binding the quota image onto {host}: {exc}") from exc
        finally:
            os.close(fd)
        have = os.lstat(host)
        if (have.st_dev, have.st_ino) != (want.st_dev, want.st_ino):
            raise QuotaError(f"{host} is not the quota image's {t.name} after binding it")


# -- does it work here? --------------------------------------------------------

_PROBED: dict[tuple[int, int], QuotaSupport] = {}


def probe(root: Path) -> QuotaSupport:
    """Try the mechanism once per (user, filesystem): make, mount, write, unmount an image."""
    uid = os.geteuid()
    if uid != 0:
        return QuotaSupport(
            False,
            "",
            f"the gateway runs as uid {uid}, not root: a per-conversation disk quota "
            "loop-mounts an image, which needs root. Run the gateway as root (the sandboxes "
            'still run unprivileged), or set `gateway.quota` to "off" in the config file '
            "(then one stranger can fill this host's disk)",
        )
    missing = [t for t in ("mkfs.ext4", "mount", "umount") if _tool(t) is None]
    if missing:
        return QuotaSupport(
            False,
            "",
            f"{', '.join(missing)} not found: run `sudo bash scripts/setup-quota.sh` "
            "(installs e2fsprogs and util-linux mount)",
        )
    if not (Path("/dev/loop-control").exists() or Path("/dev/loop0").exists()):
        return QuotaSupport(
            False,
            "",
            "no loop devices (/dev/loop-control is missing): load the loop module "
            "(`modprobe loop`); in a container, give it the loop devices",
        )
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = (uid, os.stat(root).st_dev)
    except OSError as exc:
        return QuotaSupport(False, "", f"cannot create {root}: {exc.strerror}")
    with _THREAD_LOCK:
        cached = _PROBED.get(key)
        if cached is None:
            cached = _try_loop(root)
            _PROBED[key] = cached
    return cached


def _try_loop(root: Path) -> QuotaSupport:
    limits = QuotaLimits(bytes=8 << 20, inodes=256)
    with tempfile.TemporaryDirectory(dir=root, prefix=".probe-") as tmp:
        image, mnt = Path(tmp) / "probe.img", Path(tmp) / "mnt"
        mnt.mkdir()
        try:
            make_image(image, limits)
            mount_image(str(os.path.realpath(image)), mnt, limits)
            try:
                (mnt / "probe").write_bytes(b"cellgate")
                free = os.statvfs(mnt)
                if free.f_blocks * free.f_frsize > limits.bytes:
                    return QuotaSupport(False, "", "the probe image is bigger than asked")
            finally:
                unmount(str(mnt))
        except (QuotaError, OSError) as exc:
            return QuotaSupport(
                False,
                "",
                f"a loop-mounted ext4 image does not work here ({exc}); install e2fsprogs "
                "and util-linux (`sudo bash scripts/setup-quota.sh`) and give the gateway "
                "loop devices",
            )
    return QuotaSupport(True, "loop-ext4", "a loop-mounted ext4 image per conversation")
