"""Late-bound mounts: a conversation's plan bound into a sandbox started ahead (F1, S3).

A pooled sandbox is created with three bind mounts of its own, empty slot
directories, with `rslave` propagation (host to sandbox only):

    <root>/slots/<slot>/ws      -> /workspace            (read-only)
    <root>/slots/<slot>/home    -> /home/agent/.claude   (read-only)
    <root>/slots/<slot>/bridge  -> /run/cellgate         (read-only)

`<root>/slots` is a bind of itself made `shared`, so a mount the host makes
under a slot appears inside that slot's sandbox, and nowhere else: another
sandbox's bind starts at its own slot directory, which does not contain this
one. A slot is made with the mountpoints every claim of its app needs (its
`skeleton`: the persona files' and shared dirs' places and the parents of
the conversation's own dirs), so that a claim creates almost nothing on the
host's filesystem (F3: an inode made there is the dearest part of a claim on
a busy filesystem); what a claim's plan does not need is removed before it
binds. The app's read-only mounts (its persona files and shared dirs, the same
for each of its conversations: `bound_ahead`) are bound into a slot when it is
made, so that a claim binds only the conversation's own dirs (F3: half a
claim's mount calls). At claim, `bind_plan` first detaches every mount bound
ahead that is not exactly in the conversation's plan (the same source, target,
kind, device and inode: a persona file replaced or removed since), then binds
every planned mount not already bound (S3) onto its place in the slot.

Each bind, ahead or at claim, opens the source `O_PATH|O_NOFOLLOW` and checks
it by device and inode against the plan first, then binds from that
descriptor (a symlink swapped in after the plan is never followed) as a
detached copy (`open_tree`), set read-only when the plan says so, and only
then attached in the slot (`move_mount`), so the sandbox never sees a
read-only mount as writable. A kernel without those calls (before 5.12) gets the same through
a bind in the private `<root>/stage`, remounted there, then moved.

A pooled sandbox waits for its claim as a single process: its init (the
engine's own tini, copied into the slot's bridge directory) is exec'ed by
that process only when it is claimed, so an idle pooled sandbox costs what a
plain `sleep` container does (F1).

`release` detaches every mount under a slot and removes its empty mountpoints
(never recursing into anything still mounted: conversation data is never
deleted through a slot). Needs root (CAP_SYS_ADMIN); `probe` says whether it
works here.
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
from pathlib import Path, PurePosixPath

from cellgate.errors import SandboxError
from sandbox.mountplan import BRIDGE, HOME, WORKSPACE, EntryKind, MountPlan, PlannedMount
from sandbox.mounts import (
    MS_BIND,
    MS_MOVE,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REMOUNT,
    MS_SHARED,
    MountError,
    attach_copy,
    detach,
    mount,
    noexec,
)

SLOT_TARGETS: tuple[tuple[str, PurePosixPath], ...] = (
    ("ws", WORKSPACE),
    ("home", HOME / ".claude"),
    ("bridge", BRIDGE),
)
MAX_DEPTH = 32
_UNMOUNTED = (0, errno.EINVAL, errno.ENOENT)  # detached now, or nothing mounted there
logger = logging.getLogger(__name__)
# In the slot's bridge directory: the pooled sandbox's first process waits on it
# (zero CPU) until the claim is complete, then starts the resident runner (F2).
CLAIM_FIFO = ".claim"
# In the slot's bridge directory when the pool gives its sandboxes their init itself
# (a copy of the engine's own): a pooled sandbox waits for its claim as one process,
# and becomes the init `--init` would have run only then.
INIT_NAME = ".init"
MAX_INIT_SIZE = 16 << 20


class LateBindError(SandboxError):
    """A mount could not be bound into a slot; the claim falls back to a cold start."""


def _mount(source: str | None, target: str, flags: int) -> None:
    try:
        mount(source, target, flags)
    except MountError as exc:
        raise LateBindError(str(exc)) from exc


def mountpoints() -> list[str]:
    """Every mountpoint of this process's mount namespace (unescaped)."""
    out: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) > 4:
                out.append(unescape(fields[4]))
    return out


def unescape(field: str) -> str:
    """mountinfo's octal escapes (space, tab, newline, backslash)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _self_bind(path: Path, propagation: int) -> None:
    """`path` as a mount of itself with the given propagation (idempotent)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if str(path) not in mountpoints():
        _mount(str(path), str(path), MS_BIND)
        # out of the host's peer group first (a bind inside a shared mount joins it):
        # what is bound here then propagates to this mount's own slaves, and nowhere else
        _mount(None, str(path), MS_PRIVATE)
    _mount(None, str(path), propagation)


Skeleton = tuple[tuple[str, EntryKind], ...]


def skeleton(plan: MountPlan) -> Skeleton:
    """The mountpoints a slot can have ready before its claim: every planned target's
    parent directories under its slot dir, and the read-only targets themselves (the
    app's, the same for each of its conversations); never a conversation's own dir."""
    out: dict[str, EntryKind] = {}
    for m in plan.mounts:
        base = next((str(b) for _, b in SLOT_TARGETS if m.target.startswith(f"{b}/")), None)
        if base is None:
            continue  # a slot dir itself: nothing to make
        parts = m.target[len(base) + 1 :].split("/")
        for i in range(1, len(parts)):
            out[f"{base}/{'/'.join(parts[:i])}"] = EntryKind.DIR
        if m.read_only:
            out[m.target] = m.kind
    return tuple(sorted(out.items()))


def bound_ahead(plan: MountPlan) -> tuple[PlannedMount, ...]:
    """The planned mounts a slot can have bound before its claim: the read-only ones
    below a slot dir (the app's persona files and shared dirs); never a conversation's
    own dir, nor its bridge dir (a slot dir itself)."""
    bases = {str(b) for _, b in SLOT_TARGETS}
    return tuple(m for m in plan.mounts if m.read_only and m.target not in bases)


@dataclass(frozen=True, slots=True)
class Slot:
    """One pooled sandbox's slot directories on the host, the skeleton made in them and
    the mounts bound in them ahead of a claim."""

    root: Path
    made: Skeleton = ()
    bound: tuple[PlannedMount, ...] = ()

    @property
    def id(self) -> str:
        return self.root.name

    def open_trigger(self) -> int:
        """A descriptor on the slot's claim FIFO; a byte written to it starts the runner."""
        return os.open(self.root / "bridge" / CLAIM_FIFO, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    def dirs(self) -> dict[str, Path]:
        return {name: self.root / name for name, _ in SLOT_TARGETS}

    def slot_plan(self) -> MountPlan:
        """The pooled sandbox's own mounts: its three slot directories, read-only."""
        mounts = []
        for name, target in SLOT_TARGETS:
            st = os.lstat(self.root / name)
            mounts.append(
                PlannedMount(
                    str(self.root / name), str(target), True, EntryKind.DIR, st.st_dev, st.st_ino
                )
            )
        return MountPlan(tuple(sorted(mounts, key=lambda m: m.target)))


class LateBinder:
    """The slot and stage roots of one gateway under `root` (root-only, 0700)."""

    def __init__(
        self,
        root: Path,
        bridge_files: Mapping[str, tuple[bytes, int]] | None = None,
        find_init: Callable[[], Path | None] | None = None,
    ) -> None:
        self.root = root
        self.slots = root / "slots"
        self.stage = root / "stage"
        # written into every slot's bridge dir with their modes (the runner a pooled
        # sandbox opens before its claim, F2), removed with the slot
        self.bridge_files = dict(bridge_files or {})
        # where the init binary (tini) is, asked at setup (off the event loop); it is copied
        # into every slot's bridge dir. A copy of its own, not a link: a link count shared
        # by every slot would tell a claimed sandbox how many sandboxes of its app are live.
        self.find_init = find_init
        self._init_data = b""
        self._ready = False

    @property
    def own_init(self) -> bool:
        """Do this binder's slots hold the init their sandboxes become at claim?"""
        return bool(self._init_data)

    def setup(self) -> None:
        """Make `slots` and `stage` private mounts, and read the init; raises `LateBindError`.

        No init is placed (`own_init` False: the engine's `--init` then) when the
        slots' filesystem is mounted noexec: the sandbox could not run it."""
        if self._ready:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        _self_bind(self.stage, MS_PRIVATE)
        _self_bind(self.slots, MS_PRIVATE)
        init = self.find_init() if self.find_init is not None else None
        if init is not None:
            try:
                if noexec(self.slots):
                    raise LateBindError(f"{self.slots} is on a noexec filesystem")
                self._init_data = _read_init(init)
            except (OSError, LateBindError) as exc:
                logger.warning("pooled sandboxes get the engine's init: %s", exc)
        self._ready = True

    def new_slot(self, made: Skeleton = (), ahead: tuple[PlannedMount, ...] = ()) -> Slot:
        """A slot directory that is a shared mount of its own: its own peer group, so
        what a claim binds in it propagates to its sandbox alone, at a cost that does
        not grow with the number of pooled sandboxes (F3); with the mountpoints of
        `made` (a `skeleton`) ready in it, and the mounts of `ahead` (`bound_ahead` of
        a plan) bound, each checked as a claim checks it. One that cannot be bound now
        (its source changed or went) is left to the claim."""
        self.setup()
        slot = Slot(self.slots / secrets.token_hex(8), made)
        slot.root.mkdir(mode=0o755)
        try:
            _self_bind(slot.root, MS_SHARED)
            for d in slot.dirs().values():
                d.mkdir(mode=0o755)
            os.mkfifo(slot.root / "bridge" / CLAIM_FIFO, 0o644)
            for name, (data, mode) in self.bridge_files.items():
                _write_new(slot.root / "bridge" / name, data, mode)
            if self.own_init:
                _write_new(slot.root / "bridge" / INIT_NAME, self._init_data, 0o555)
            root = str(slot.root)
            for target, kind in made:
                _mountpoint(_slot_place(root, target), kind, root)
        except BaseException:
            detach(str(slot.root))
            raise
        bound = []
        for i, m in enumerate(ahead):
            try:
                self._bind_one(slot, m, i)
            except (LateBindError, OSError) as exc:
                logger.debug("%s not bound ahead in slot %s: %s", m.target, slot.id, exc)
                continue
            bound.append(m)
        return Slot(slot.root, made, tuple(bound))

    def bind_plan(self, slot: Slot, plan: MountPlan) -> None:
        """Bind every planned mount into `slot` (S3); on any failure undo and raise.

        First the mounts bound ahead that are not exactly in this plan are detached,
        and the mountpoints made ahead that it has no use for go (a persona file
        replaced or removed since the slot was made): the sandbox sees neither the
        old file nor a stub of it. A mount bound ahead that is in the plan stays."""
        root = str(slot.root)
        try:
            planned = set(plan.mounts)
            for m in sorted(slot.bound, key=lambda m: m.target, reverse=True):
                gone = m in planned or detach(_slot_place(root, m.target)) in _UNMOUNTED
                if not gone:
                    raise LateBindError(f"cannot detach {m.target}, bound ahead")
            if slot.made:
                _unmake(root, set(slot.made) - set(skeleton(plan)))
            ahead = planned.intersection(slot.bound)
            for i, m in enumerate(plan.mounts):
                if m not in ahead:
                    self._bind_one(slot, m, i)
        except BaseException:
            self.unbind(slot)
            raise

    def _bind_one(self, slot: Slot, m: PlannedMount, i: int) -> None:
        root = str(slot.root)
        place = _slot_place(root, m.target)
        fd = os.open(m.source, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            kind = EntryKind.DIR if stat.S_ISDIR(st.st_mode) else EntryKind.FILE
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise LateBindError(f"{m.source} is neither a file nor a directory")
            if (kind, st.st_dev, st.st_ino) != (m.kind, m.dev, m.ino):
                raise LateBindError(f"{m.source} is no longer the planned {m.kind.value}")
            _mountpoint(place, kind, root)
            flags = MS_RDONLY | MS_NOSUID | MS_NODEV if m.read_only else 0
            try:
                if attach_copy(fd, place, flags):  # read-only before it is attached
                    return
            except MountError as exc:
                raise LateBindError(str(exc)) from exc
            staged = self.stage / f"{slot.id}-{i}"
            _mountpoint(str(staged), kind, str(self.stage))
            try:
                _mount(f"/proc/self/fd/{fd}", str(staged), MS_BIND)
                if m.read_only:
                    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
                    _mount(None, str(staged), flags)
                _mount(str(staged), place, MS_MOVE)
            except BaseException:
                detach(str(staged))
                raise
            finally:
                _remove_empty(staged)
        finally:
            os.close(fd)

    def unbind(self, slot: Slot) -> None:
        """Detach every mount below the slot's three directories (not the slot itself)."""
        prefix = str(slot.root) + "/"
        for _ in range(MAX_DEPTH):
            under = [p for p in mountpoints() if p.startswith(prefix)]
            if not under:
                return
            for p in sorted(under, key=len, reverse=True):
                detach(p)
        raise LateBindError(f"mounts under {slot.root} keep coming back")

    def release(self, slot: Slot) -> bool:
        """Unbind and remove the slot's empty mountpoints; False when something stayed."""
        if not slot.root.is_relative_to(self.slots) or slot.root.parent != self.slots:
            raise ValueError(f"{slot.root} is not a slot of {self.slots}")
        try:
            self.unbind(slot)
        except LateBindError:
            return False
        detach(str(slot.root))  # the slot's own shared mount
        mounted = {p for p in mountpoints() if p.startswith(str(slot.root))}
        bridge = slot.root / "bridge"
        if str(bridge) not in mounted:
            for name in [*self.bridge_files, INIT_NAME]:  # ours: placed by `new_slot`
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(bridge / name)
        return _prune(slot.root, mounted, 0)

    def teardown(self) -> None:
        """Detach every mount under the root (slots, stage, and what they hold).

        Only once no sandbox of this gateway uses them (tests, benchmarks, uninstall)."""
        detach_under(self.root)
        self._ready = False

    def slot_ids(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.slots) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []


def detach_under(root: Path) -> None:
    """Detach every mount below `root`, deepest first (cleanup of a throwaway state dir)."""
    prefix = str(root) + "/"
    for p in sorted((p for p in mountpoints() if p.startswith(prefix)), key=len, reverse=True):
        detach(p)


def slot_path(slot: Slot, target: PurePosixPath) -> Path:
    """Where a sandbox path lives in the slot: under the slot dir whose target contains it."""
    return Path(_slot_place(str(slot.root), str(target)))


_SLOT_BASES = tuple((name, str(base)) for name, base in SLOT_TARGETS)


def _slot_place(root: str, target: str) -> str:
    """`slot_path` on strings (F3: a claim binds ten or so mounts, pathlib costs)."""
    for name, base in _SLOT_BASES:
        if target == base:
            return f"{root}/{name}"
        if target.startswith(base + "/"):
            rel = target[len(base) + 1 :]
            if any(part in ("", ".", "..") for part in rel.split("/")):
                raise LateBindError(f"{target} climbs out of {base}")
            return f"{root}/{name}/{rel}"
    raise LateBindError(f"{target} is under no slot")


def _mountpoint(place: str, kind: EntryKind, within: str) -> None:
    """Create `place` (and its parents, as directories) inside `within`, never through a link."""
    if place == within:
        return
    if not place.startswith(within + "/"):
        raise LateBindError(f"{place} is not inside {within}")
    parts = place[len(within) + 1 :].split("/")
    cur = within
    for part in parts[:-1]:
        cur = f"{cur}/{part}"
        try:
            os.mkdir(cur, 0o755)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                raise LateBindError(f"{cur} is in the way") from None
    try:
        if kind is EntryKind.DIR:
            os.mkdir(place, 0o755)
        else:
            os.close(os.open(place, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644))
    except FileExistsError:
        mode = os.lstat(place).st_mode
        if (kind is EntryKind.DIR) != stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
            raise LateBindError(f"{place} is in the way") from None


def _write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _read_init(source: Path) -> bytes:
    """The init binary's bytes (a static ELF executable, at most MAX_INIT_SIZE)."""
    with open(source, "rb") as f:
        data = f.read(MAX_INIT_SIZE + 1)
    if len(data) > MAX_INIT_SIZE or not data.startswith(b"\x7fELF"):
        raise LateBindError(f"{source} is not an init binary")
    return data


def _unmake(root: str, extra: set[tuple[str, EntryKind]]) -> None:
    """Remove the unused mountpoints `extra` made ahead in a slot, deepest first; one
    that is not empty stays (and a claim that needs its place then fails: cold start)."""
    for target, _kind in sorted(extra, key=lambda e: e[0], reverse=True):
        _remove_empty(Path(_slot_place(root, target)))


def _remove_empty(path: Path) -> None:
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
            raise


def _prune(path: Path, mounted: set[str], depth: int) -> bool:
    """Remove `path`'s tree of empty dirs and empty files bottom-up; never enter a mount."""
    if depth > MAX_DEPTH or str(path) in mounted:
        return False
    clean = True
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return True
    for e in entries:
        p = Path(e.path)
        if str(p) in mounted:
            clean = False
        elif e.is_dir(follow_symlinks=False):
            clean = _prune(p, mounted, depth + 1) and clean
        elif (e.name == CLAIM_FIFO and stat.S_ISFIFO(e.stat(follow_symlinks=False).st_mode)) or (
            e.is_file(follow_symlinks=False) and _empty(p)
        ):
            _remove_empty(p)
        else:
            clean = False
    if clean:
        try:
            os.rmdir(path)
        except OSError:
            return False
    return clean


def _empty(path: Path) -> bool:
    try:
        return os.lstat(path).st_size == 0
    except FileNotFoundError:
        return True
