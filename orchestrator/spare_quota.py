"""Quota images made and mounted ahead (F1): a new conversation's first turn skips
`mkfs` and the loop mount.

`SparedQuota` is the app's `LoopQuota` with a few formatted images kept beside
the conversations' (`<agent>/spare-<random>.img`, same size, same inodes), each
already mounted at its `spare-<random>.mnt` with the quota's flags. A spare
is made under a pending name and only named `spare-*` once it is mounted, so
a spare image is always a mounted one (until a reboot: then the next refill
mounts it again). A conversation without an image yet takes a spare, under
the agent's spares lock (two claims never share one; `_adopt`, under the
conversation's lock in `LoopQuota.ensure`): the image is renamed
into place (the loop device follows the rename); then, under the conversation's
lock alone, its mount is bound onto the conversation's `<digest>.mnt` and the
spare mount detached (a few milliseconds each in a burst, so never under the
agent's lock; a gateway stopped between the rename and the move leaves the
spare's mount, which the next refill detaches); then `LoopQuota.ensure` finds
the image mounted and binds its subdirs as ever (R2 unchanged: the image is
one the quota code made, with this app's limits). `refill` makes spares up to `count`, in a
worker thread.

A take does not list the agent's directory (it also holds every conversation's
image, mount and lock: a listing grows with the conversations, F3): the names
of spares this process listed or made are kept, taken from the front, and the
directory is listed again only when they run out. A kept name that is gone or
no longer fits is skipped, as a listed one would be. The host worker
(`orchestrator.host_worker`), whose quota object makes no spares, is sent the
gateway's names with each request (`known`, `hint`) and skips those it tried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from cellgate.errors import QuotaError
from sandbox.mounts import MS_BIND, MS_MOVE, MountError, detach, mount
from sandbox.quota import (
    MARKERS,
    LoopQuota,
    keep_spare_inodes,
    locked,
    loop_backing_file,
    make_image,
    mount_image,
)

logger = logging.getLogger(__name__)

SPARE = re.compile(r"spare-[0-9a-f]{16}\.img")
PENDING = re.compile(r"pending-[0-9a-f]{16}\.img")
LOCK = "spares.lock"
LIMITS = "limits"  # in the spare's markers dir: the limits it was made for
STALE_PENDING = 600.0  # seconds: a pending spare this old was left by a crash
TRIED_KEPT = 4096  # spare names tried, not offered again by a `hint`
DELETED = " (deleted)"  # how the kernel names a loop device's backing file once unlinked


def _mounted(image: Path, mnt: Path) -> bool:
    """Is `image` what is mounted at `mnt` (through its loop device)?"""
    try:
        st, parent = os.lstat(mnt), os.lstat(mnt.parent)
    except FileNotFoundError:
        return False
    return st.st_dev != parent.st_dev and loop_backing_file(st.st_dev) == str(image)


def _read_record(path: Path) -> str:
    """A spare's limits record (root's own file in a root-only image, never a sandbox's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 64).decode("ascii", "replace")
    finally:
        os.close(fd)


def _mnt(image: Path) -> Path:
    return image.with_suffix(".mnt")


class SparedQuota(LoopQuota):
    def __init__(self, quota: LoopQuota, count: int) -> None:
        super().__init__(quota.root, quota.limits)
        self.count = count
        self._known: dict[str, deque[str]] = {}  # agent -> spare names, oldest first
        self._known_lock = threading.Lock()
        self._tried: deque[str] = deque(maxlen=TRIED_KEPT)  # names this process tried

    def _adopt(self, agent: str, digest: str, wait: float | None) -> bool:
        """Under the conversation's lock (`LoopQuota.ensure`), the spares' lock while a
        spare is renamed into place: no image of its own can appear meanwhile, and no
        other claim, refill or release sees that spare again. Its mount moves under the
        conversation's lock alone (the kernel's mount work, milliseconds under a burst,
        is not serialized across the agent's claims, F3)."""
        agent_dir = self.agent_dir(agent, digest)
        with locked(agent_dir / LOCK, timeout=wait):
            taken = self._take_spare(agent, digest)
        if taken is not None:
            self._move_mount(taken, self.mount_dir(agent, digest))
        return self.image(agent, digest).exists()

    def spares(self, agent: str) -> int:
        """How many spares are ready for `agent`."""
        return len(self._spares(agent))

    def _spares(self, agent: str) -> list[str]:
        try:
            with os.scandir(self.root / agent) as it:
                names = sorted(
                    e.name
                    for e in it
                    if SPARE.fullmatch(e.name) and e.is_file(follow_symlinks=False)
                )
        except FileNotFoundError:
            names = []
        with self._known_lock:
            self._known[agent] = deque(names)
        return names

    def known(self, agent: str) -> tuple[str, ...]:
        """The names of `agent`'s spares this process made or listed and has not taken."""
        with self._known_lock:
            return tuple(self._known.get(agent, ()))

    def hint(self, agent: str, names: Iterable[str]) -> None:
        """Spare names another process knows of (the gateway's `known`, in the host worker),
        kept to try before the directory is listed, but none this process tried already (F3:
        the worker's takes do not list the agent's directory, which grows with its
        conversations, every time its own names run out)."""
        with self._known_lock:
            known = self._known.setdefault(agent, deque())
            skip = set(known).union(self._tried)
            known.extend(n for n in names if n not in skip)

    def _candidates(self, agent: str) -> Iterator[str]:
        """Spare names to try, from the kept ones; the directory once they run out."""
        listed = False
        while True:
            with self._known_lock:
                known = self._known.get(agent)
                name = known.popleft() if known else None
                if name is not None:
                    self._tried.append(name)
            if name is not None:
                yield name
            elif listed:
                return
            else:
                self._spares(agent)
                listed = True

    def _kept(self, agent: str, name: str) -> None:
        with self._known_lock:
            self._known.setdefault(agent, deque()).append(name)

    def _take_spare(self, agent: str, digest: str) -> Path | None:
        """Rename a spare image into the conversation's place (under the spares' lock);
        returns the spare's mount dir to move when it was mounted, else None."""
        image = self.image(agent, digest)
        if image.exists():
            return None
        d = self.root / agent
        for name in self._candidates(agent):
            spare = d / name
            premounted = _mounted(spare, _mnt(spare))
            if not self._fits(spare, premounted):
                continue  # made before the limits changed: the next refill drops it
            try:
                os.rename(spare, image)  # the loop device's backing file follows
            except FileNotFoundError:
                continue
            return _mnt(spare) if premounted else None
        return None

    @staticmethod
    def _move_mount(spare_mnt: Path, mnt: Path) -> None:
        """The taken spare's mount moved onto the conversation's mount dir (no spare lists
        it any more: its image has the conversation's name), keeping its flags.

        One `MS_MOVE` (F3: an unmount costs the kernel far more); where the quota dir's
        mount is shared, which refuses a move (EINVAL), a bind there, then the spare's
        own detached. On failure `LoopQuota.ensure` mounts the image itself."""
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(mnt, 0o700)
            try:
                mount(str(spare_mnt), str(mnt), MS_MOVE)
            except MountError:
                mount(str(spare_mnt), str(mnt), MS_BIND)
                detach(str(spare_mnt))
        except (MountError, OSError) as exc:
            logger.warning("quota (R2): could not move a spare's mount: %s", exc)
            detach(str(spare_mnt))
        with contextlib.suppress(OSError):
            os.rmdir(spare_mnt)

    def _fits(self, spare: Path, mounted: bool | None = None) -> bool:
        """Was the spare made for the limits in force now? Its size says the bytes; once
        mounted, its own record says both (mkfs rounds `-N` to whole groups, so the
        image's inode count cannot be compared with the limit)."""
        try:
            if os.stat(spare, follow_symlinks=False).st_size != self.limits.bytes:
                return False
            if _mounted(spare, _mnt(spare)) if mounted is None else mounted:
                return _read_record(_mnt(spare) / MARKERS / LIMITS) == self._record()
        except OSError:
            return False
        return True

    def _record(self) -> str:
        return f"{self.limits.bytes} {self.limits.inodes}\n"

    def refill(
        self, agent: str, count: int | None = None, stop: threading.Event | None = None
    ) -> int:
        """Make spares up to `count` (default: the one given at creation); how many were made.

        `stop` set (the gateway is shutting down) ends it before the next spare."""
        count = self.count if count is None else count
        d = self.agent_dir(agent, "spares")  # checks the agent's name
        self._remount_spares(agent)
        made = 0
        for _ in range(count - len(self._spares(agent))):
            if stop is not None and stop.is_set():
                break
            self._kept(agent, self._make_spare(d))
            made += 1
        return made

    def _make_spare(self, d: Path) -> str:
        """A new image, formatted and mounted under a pending name, then named a spare."""
        token = secrets.token_hex(8)
        pending, spare = d / f"pending-{token}.img", d / f"spare-{token}.img"
        make_image(pending, self.limits)
        try:
            self._mount_spare(pending, _mnt(spare), fresh=True)
            os.rename(pending, spare)
            return spare.name
        except BaseException:
            detach(str(_mnt(spare)))
            with contextlib.suppress(OSError):
                os.rmdir(_mnt(spare))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pending)
            raise

    def _mount_spare(self, image: Path, mnt: Path, *, fresh: bool = False) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(mnt, 0o700)
        mount_image(str(image), mnt, self.limits, fresh=fresh)
        if not _mounted(image, mnt):
            raise QuotaError(f"{image} did not show up mounted at {mnt}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(mnt / MARKERS, 0o700)
        keep_spare_inodes(mnt, mnt / MARKERS / "spare")
        if fresh:  # only a new image gets a record: a remounted one keeps its own, or none
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(mnt / MARKERS / LIMITS, flags, 0o600)
            try:
                os.write(fd, self._record().encode())
            finally:
                os.close(fd)

    @staticmethod
    def _orphan_mounts(d: Path) -> None:
        """The mount of a spare whose image is gone: a take renamed the image into a
        conversation's place, and the gateway stopped before it moved the mount. It is
        detached under that conversation's lock, tried once (a take holds it from its
        rename until its move is done: a busy one is left for the next refill; never
        waited for, as a take waits for the spares' lock under it). The conversation's
        `ensure` then mounts its image again, on the same loop device. A mount of
        anything but an image of this directory is left alone."""
        for e in os.scandir(d):
            mnt = Path(e.path)
            if mnt.suffix != ".mnt" or not SPARE.fullmatch(mnt.with_suffix(".img").name):
                continue
            if mnt.with_suffix(".img").exists():
                continue  # a spare's own
            if (d / mnt.name.replace("spare-", "pending-", 1)).with_suffix(".img").exists():
                continue  # a refill is making that spare now
            try:
                dev = os.lstat(mnt).st_dev
                if dev == os.lstat(d).st_dev:  # nothing mounted: an empty dir a crash left
                    os.rmdir(mnt)
                    continue
            except OSError:
                continue
            back = loop_backing_file(dev) or "/"
            if back.endswith(DELETED) and Path(back.removesuffix(DELETED)).parent == d:
                detach(str(mnt))  # its conversation's image was deleted since: nobody's
                with contextlib.suppress(OSError):
                    os.rmdir(mnt)
                continue
            image = Path(back)
            if image.parent != d or image.suffix != ".img" or not image.stem.isalnum():
                continue
            try:
                with locked(d / f"{image.stem}.lock", timeout=0):
                    if _mounted(image, mnt):
                        detach(str(mnt))
                        logger.info("quota (R2): %s, left by a take, detached", mnt.name)
                    with contextlib.suppress(OSError):
                        os.rmdir(mnt)
            except QuotaError:
                continue  # a take of it is moving the mount now

    def release_spares(self, agent: str) -> None:
        """Detach every spare's mount (its agent is gone or no longer pooled); the image
        files stay, and `refill` mounts them again if the agent comes back."""
        d = self.root / agent
        if not d.is_dir():
            return
        with locked(d / LOCK):
            for name in self._spares(agent):
                spare = d / name
                if _mounted(spare, _mnt(spare)):
                    detach(str(_mnt(spare)))

    def _remount_spares(self, agent: str) -> None:
        """Mount spares that are not (after a reboot); drop pending ones a crash left,
        and the mounts of spares a crash left taken but not moved (`_orphan_mounts`)."""
        d = self.root / agent
        with locked(d / LOCK):
            self._orphan_mounts(d)
            for name in self._spares(agent):
                spare = d / name
                if not self._fits(spare):
                    logger.info("quota (R2): spare %s has other limits; removed", name)
                    detach(str(_mnt(spare)))
                    with contextlib.suppress(OSError):
                        os.rmdir(_mnt(spare))
                    os.unlink(spare)
                    continue
                if not _mounted(spare, _mnt(spare)):
                    try:
                        self._mount_spare(spare, _mnt(spare))
                    except QuotaError as exc:
                        logger.warning("quota (R2): spare %s unusable, removed: %s", name, exc)
                        os.unlink(spare)
            now = time.time()
            for e in os.scandir(d):
                if not (PENDING.fullmatch(e.name) and e.is_file(follow_symlinks=False)):
                    continue
                if now - e.stat(follow_symlinks=False).st_mtime < STALE_PENDING:
                    continue  # another refill's, still being made
                spare_mnt = d / e.name.replace("pending-", "spare-", 1).replace(".img", ".mnt")
                if _mounted(Path(e.path), spare_mnt):
                    detach(str(spare_mnt))
                with contextlib.suppress(OSError):
                    os.rmdir(spare_mnt)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
