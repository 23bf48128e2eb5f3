"""F1, R2: quota images made and mounted ahead, on this host's real kernel (no engine).

A new conversation takes a spare that is already formatted and mounted; what
it gets must be exactly what `LoopQuota` would have made: its own image, its
limits, nosuid/nodev/noexec, nothing shared with another conversation, and
the spare's mount gone. Every image and mount is under the test's tmp dir.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.spare_quota import STALE_PENDING, SparedQuota
from sandbox.quota import (
    Busy,
    LoopQuota,
    QuotaLimits,
    locked,
    loop_backing_file,
    mountinfo,
    release_all,
)
from tests.sandbox.test_quota import DISK_MB, INODES, MB, OWNER, conv, fill

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")

AGENT = "agent-q"


@pytest.fixture
def spared(tmp_path: Path) -> Iterator[SparedQuota]:
    try:
        base = LoopQuota(tmp_path / "state" / "quota", QuotaLimits(DISK_MB * MB, INODES))
        yield SparedQuota(base, 2)
    finally:
        release_all(tmp_path)


def spare_mounts(q: SparedQuota) -> list[str]:
    prefix = str(q.root / AGENT / "spare-")
    return [e.mount_point for e in mountinfo() if e.mount_point.startswith(prefix)]


def test_F1_R2_refill_makes_mounted_spares_and_a_new_conversation_takes_one(
    spared: SparedQuota, tmp_path: Path
) -> None:
    assert spared.refill(AGENT) == 2
    assert spared.refill(AGENT) == 0  # idempotent
    assert len(spare_mounts(spared)) == 2
    c = conv(spared, tmp_path, "a")
    c.ensure()
    image = spared.image(AGENT, c.digest)
    mnt = spared.mount_dir(AGENT, c.digest)
    dev = os.stat(mnt).st_dev
    assert loop_backing_file(dev) == str(image)  # the loop device followed the rename
    assert len(spare_mounts(spared)) == 1  # the taken spare's own mount is gone
    for t in c.targets:
        assert os.lstat(t.path).st_dev == dev
        assert os.lstat(t.path).st_uid == OWNER[0]
        top = [e for e in mountinfo() if e.mount_point == str(t.path)][-1]
        assert {"rw", "nosuid", "nodev", "noexec"} <= top.options, top
    assert fill(c.chat / "big") <= DISK_MB * MB  # its own limit


def test_F1_R2_concurrent_new_conversations_never_share_a_spare(
    spared: SparedQuota, tmp_path: Path
) -> None:
    spared.refill(AGENT, 4)
    convs = [conv(spared, tmp_path, f"c{i}") for i in range(6)]  # more than the spares
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda c: c.ensure(), convs))
    devs = {os.stat(spared.mount_dir(AGENT, c.digest)).st_dev for c in convs}
    assert len(devs) == len(convs)
    for c in convs:
        (c.chat / "mine").write_text(c.digest)
    for c in convs:
        assert sorted(os.listdir(c.chat)) == ["mine"]
        assert (c.chat / "mine").read_text() == c.digest
    assert spare_mounts(spared) == []


def test_F1_R2_an_unmounted_spare_is_mounted_again_or_taken_as_it_is(
    spared: SparedQuota, tmp_path: Path
) -> None:
    spared.refill(AGENT, 1)
    [mp] = spare_mounts(spared)
    subprocess.run(["umount", mp], check=True)  # a reboot, in short
    assert spare_mounts(spared) == []
    spared.refill(AGENT, 1)
    assert len(spare_mounts(spared)) == 1
    subprocess.run(["umount", spare_mounts(spared)[0]], check=True)
    c = conv(spared, tmp_path, "x")
    c.ensure()  # an unmounted spare is still a good image: LoopQuota mounts it
    assert loop_backing_file(os.stat(c.chat).st_dev) == str(spared.image(AGENT, c.digest))


def test_F1_R2_an_agent_gone_has_its_spares_released_and_a_return_mounts_them(
    spared: SparedQuota,
) -> None:
    assert spared.refill(AGENT) == 2
    spared.release_spares(AGENT)  # its pool ended for good (uninstall, stop)
    assert spare_mounts(spared) == [] and spared.spares(AGENT) == 2  # the images stay
    assert spared.refill(AGENT) == 0 and len(spare_mounts(spared)) == 2  # back: mounted again


def test_F1_R2_a_pending_spare_left_by_a_crash_is_removed(
    spared: SparedQuota, tmp_path: Path
) -> None:
    d = spared.agent_dir(AGENT, "x")
    left = d / "pending-0123456789abcdef.img"
    left.write_bytes(b"")
    old = time.time() - STALE_PENDING - 5
    os.utime(left, (old, old))
    fresh = d / "pending-fedcba9876543210.img"
    fresh.write_bytes(b"")
    spared.refill(AGENT, 1)
    assert not left.exists()
    assert fresh.exists()  # another refill's, still being made


def test_F1_R2_a_spare_made_under_other_limits_is_never_handed_out(
    spared: SparedQuota, tmp_path: Path
) -> None:
    spared.refill(AGENT, 1)
    bigger = SparedQuota(LoopQuota(spared.root, QuotaLimits(2 * DISK_MB * MB, INODES)), 1)
    c = conv(bigger, tmp_path, "grown")
    c.ensure()
    assert bigger.image(AGENT, c.digest).stat().st_size == 2 * DISK_MB * MB  # made anew
    assert bigger.refill(AGENT) == 1  # the old spare dropped, one of the new size made
    [mp] = spare_mounts(bigger)
    assert os.statvfs(mp).f_blocks * os.statvfs(mp).f_frsize > DISK_MB * MB


def test_F1_R2_spares_serve_inode_counts_mkfs_rounds(tmp_path: Path) -> None:
    """mkfs.ext4 rounds `-N` to whole block groups (20 000 in 256 MiB gives 19 968):
    a spare made for the gateway's default limits is still one of those limits."""
    limits = QuotaLimits(256 * MB, 20_000)  # the defaults (diskMb, diskInodes)
    q = SparedQuota(LoopQuota(tmp_path / "state" / "quota", limits), 1)
    try:
        assert q.refill(AGENT) == 1
        [mp] = spare_mounts(q)
        assert os.statvfs(mp).f_files < 20_000  # rounded down: the case at hand
        c = conv(q, tmp_path, "r")
        c.ensure()
        assert spare_mounts(q) == []  # taken, not made anew
        assert q.refill(AGENT) == 1 and len(spare_mounts(q)) == 1  # kept, not dropped
    finally:
        release_all(tmp_path)


def test_F1_R2_a_spare_of_other_inodes_same_bytes_is_never_handed_out(
    spared: SparedQuota, tmp_path: Path
) -> None:
    spared.refill(AGENT, 1)
    [old] = spare_mounts(spared)
    more = SparedQuota(LoopQuota(spared.root, QuotaLimits(DISK_MB * MB, 2 * INODES)), 1)
    c = conv(more, tmp_path, "more-inodes")
    c.ensure()
    assert spare_mounts(more) == [old]  # not taken: made anew with its own inodes
    assert os.statvfs(c.chat).f_files >= 2 * INODES
    assert more.refill(AGENT) == 1  # the old spare dropped, one of the new limits made
    assert spare_mounts(more) != [old] and len(spare_mounts(more)) == 1


def test_F1_R2_a_refill_told_to_stop_makes_no_more_spares(spared: SparedQuota) -> None:
    """At shutdown the pool stops its refill thread: nothing is mounted after close."""
    stop = threading.Event()
    stop.set()
    assert spared.refill(AGENT, 3, stop) == 0
    assert spare_mounts(spared) == []
    assert spared.refill(AGENT, 1, threading.Event()) == 1


def test_F1_F3_R2_a_take_uses_the_spares_it_knows_and_finds_the_ones_it_does_not(
    spared: SparedQuota, tmp_path: Path
) -> None:
    """Two gateways' worth of quota on one root (a restart, say): each takes what it made
    or listed, skips a kept name another one took, and lists again only when out."""
    spared.refill(AGENT, 2)
    other = SparedQuota(LoopQuota(spared.root, spared.limits), 2)
    taken = []
    for name, q in (("a", other), ("b", spared), ("c", spared)):
        c = conv(q, tmp_path, name)
        c.ensure()
        taken.append(os.stat(c.chat).st_dev)
        assert loop_backing_file(taken[-1]) == str(q.image(AGENT, c.digest))
    assert len(set(taken)) == 3
    assert spare_mounts(spared) == []  # `a` took one, `b` the other, `c` was made anew
    made = spared.refill(AGENT, 1)  # made after the last listing: known without one
    assert made == 1
    d = conv(spared, tmp_path, "d")
    d.ensure()
    assert spare_mounts(spared) == []


def test_F1_R2_a_spare_a_crash_left_taken_but_not_moved_is_detached_at_the_next_refill(
    spared: SparedQuota, tmp_path: Path
) -> None:
    """A take renames a spare into a conversation's place, then moves its mount; a
    gateway stopped in between leaves the spare's mount behind. The next refill detaches
    it, never while a take of that conversation holds its lock, and the conversation's
    image mounts again on its own mount dir."""
    assert spared.refill(AGENT) == 2
    c = conv(spared, tmp_path, "a")
    left = spared._take_spare(AGENT, c.digest)  # the rename alone: the crash is here
    assert left is not None and str(left) in spare_mounts(spared)
    with locked(spared.root / AGENT / f"{c.digest}.lock"):  # a take moving it now
        spared.refill(AGENT)
        assert str(left) in spare_mounts(spared)
    spared.refill(AGENT)
    assert str(left) not in spare_mounts(spared) and not left.exists()
    assert len(spare_mounts(spared)) == 2  # the spares are whole again
    c.ensure()
    dev = os.stat(spared.mount_dir(AGENT, c.digest)).st_dev
    assert loop_backing_file(dev) == str(spared.image(AGENT, c.digest))


def test_F1_F3_R2_a_quick_ensure_takes_a_spare_and_is_busy_without_one(
    spared: SparedQuota, tmp_path: Path
) -> None:
    """On the turn lane (F3) an `ensure` is quick: a new conversation takes a spare made
    ahead; with none left it is `Busy` at once, makes nothing, and the caller runs it
    again off the lane, where it formats the image."""
    assert spared.refill(AGENT, 1) == 1
    a, b = conv(spared, tmp_path, "a"), conv(spared, tmp_path, "b")
    spared.ensure(AGENT, a.digest, a.targets, OWNER, quick=True)
    assert loop_backing_file(os.stat(a.chat).st_dev) == str(spared.image(AGENT, a.digest))
    with pytest.raises(Busy):
        spared.ensure(AGENT, b.digest, b.targets, OWNER, quick=True)
    assert not spared.image(AGENT, b.digest).exists()
    b.ensure()  # not quick: it makes its image
    assert loop_backing_file(os.stat(b.chat).st_dev) == str(spared.image(AGENT, b.digest))
    spared.ensure(AGENT, b.digest, b.targets, OWNER, quick=True)  # in place: quick


def _taken_whole(spared: SparedQuota, tmp_path: Path, name: str) -> None:
    """A conversation took a spare: its image alone is mounted, once, at its mount dir,
    and the spare's own mount and mount dir are gone."""
    before = set(spare_mounts(spared))
    c = conv(spared, tmp_path, name)
    c.ensure()
    mnt = spared.mount_dir(AGENT, c.digest)
    dev = os.stat(mnt).st_dev
    assert loop_backing_file(dev) == str(spared.image(AGENT, c.digest))
    (gone,) = before - set(spare_mounts(spared))
    assert not Path(gone).exists()
    on_dev = [e.mount_point for e in mountinfo() if e.dev == dev]
    assert sorted(on_dev) == sorted([str(mnt), *(str(t.path) for t in c.targets)])


def test_F1_F3_R2_a_taken_spare_mount_is_moved_whole(
    spared: SparedQuota, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A take hands the spare's mount over (a bind there, the spare's own detached): the
    conversation ends with its image mounted once at its mount dir, the spare's own mount
    and dir gone."""
    assert spared.refill(AGENT) == 2
    _taken_whole(spared, tmp_path, "a")
    assert "could not move" not in caplog.text  # taken as it was mounted, not mounted anew


def test_F1_F3_R2_a_taken_spare_mount_is_moved_whole_under_a_shared_mount_too(
    spared: SparedQuota, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the quota dir's mount is shared (a systemd host's `/` is; the kernel refuses
    to move a mount there), a take ends the same: its image mounted once, the spare's
    mount gone, and not mounted anew."""
    root = spared.root
    root.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
    subprocess.run(["mount", "--make-shared", str(root)], check=True)
    (root / "a").mkdir()
    (root / "b").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root / "a")], check=True)
    moved = subprocess.run(["mount", "--move", str(root / "a"), str(root / "b")], check=False)
    assert moved.returncode != 0  # a shared parent indeed
    subprocess.run(["umount", str(root / "a")], check=True)
    assert spared.refill(AGENT) == 2
    _taken_whole(spared, tmp_path, "a")
    assert "could not move" not in caplog.text  # taken as it was mounted, not mounted anew


def test_F1_F3_R2_a_spares_take_makes_only_what_the_conversation_needs(
    spared: SparedQuota, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take (64 of them in a burst, on one thread, F3) neither checks again what the
    spare was made with (its markers dir, its held inodes) nor looks for data to move into
    dirs it made itself; each target is still marked moved in, so a later bind of it
    moves nothing either, and the held inodes are the spare's."""
    assert spared.refill(AGENT, 1) == 1
    c = conv(spared, tmp_path, "a")
    calls: list[str] = []
    for name in ("mkdir", "listdir", "statvfs", "stat", "lstat", "utime", "scandir"):
        real = getattr(os, name)

        def counted(*args: object, _real: object = real, _name: str = name, **kw: object) -> object:
            calls.append(_name)
            return _real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(os, name, counted)
    spared.ensure(AGENT, c.digest, c.targets, OWNER, quick=True)
    monkeypatch.undo()
    markers = spared.mount_dir(AGENT, c.digest) / ".cellgate"
    assert "listdir" not in calls and "scandir" not in calls  # no held inodes, no data looked for
    assert calls.count("statvfs") == 1  # the mount's flags, once
    assert calls.count("utime") == 1  # the lock's use, not a marker's
    assert sorted(p.name for p in markers.glob("migrated-*")) == [
        "migrated-chat",
        "migrated-home",
        "migrated-media-tg-a",
    ]
    assert len(list((markers / "spare").iterdir())) > 0  # the spare's own held inodes


def test_F1_F3_a_take_tries_the_gateways_spare_names_before_listing_the_agents_dir(
    spared: SparedQuota, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host worker's quota object made no spare itself: the gateway's names, sent as a
    hint, are taken without a listing of the agent's directory (it grows with every
    conversation, F3); a hinted name it already took is not tried again."""
    assert spared.refill(AGENT, 2) == 2
    names = spared.known(AGENT)
    assert len(names) == 2
    worker = SparedQuota(LoopQuota(spared.root, spared.limits), 0)  # as the worker has it
    listed: list[str] = []
    real = os.scandir

    def scandir(path: object = ".") -> object:
        listed.append(str(path))
        return real(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", scandir)
    convs = [conv(worker, tmp_path, "a"), conv(worker, tmp_path, "b")]
    for c in convs:
        worker.hint(AGENT, names)  # the gateway's names, the taken one still among them
        worker.ensure(AGENT, c.digest, c.targets, OWNER, quick=True)
    monkeypatch.undo()
    assert str(spared.root / AGENT) not in listed
    assert all(worker.image(AGENT, c.digest).exists() for c in convs)
    assert spared.spares(AGENT) == 0  # both taken, one each
