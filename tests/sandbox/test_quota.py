"""R2: the per-conversation loop-image quota, on this host's real kernel (no engine needed).

Every image and mount is under the test's tmp dir; the `quota` fixture unmounts
them after the test, even on failure.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cellgate.errors import QuotaError
from cellgate.models import ConversationKey
from orchestrator.apps import InstalledApp
from orchestrator.config import GatewaySettings, Limits
from orchestrator.sandboxes import ConversationSandboxes
from sandbox import quota as quota_mod
from sandbox.quota import (
    Busy,
    LoopQuota,
    QuotaLimits,
    QuotaTarget,
    locked,
    loop_backing_file,
    mountinfo,
    probe,
    release_all,
)
from tests.fakes.no_engine import NoEngineBackend
from tests.support.run_id import RUN_ID

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")

MB = 1024 * 1024
DISK_MB = 16
INODES = 2000
OWNER = (65532, 65532)


@dataclass
class Conv:
    quota: LoopQuota
    digest: str
    targets: tuple[QuotaTarget, ...]

    @property
    def chat(self) -> Path:
        return self.targets[0].path

    @property
    def media(self) -> Path:
        return self.targets[1].path

    @property
    def home(self) -> Path:
        return self.targets[2].path

    def ensure(self) -> None:
        self.quota.ensure("agent-q", self.digest, self.targets, OWNER)


@pytest.fixture
def quota(tmp_path: Path) -> Iterator[LoopQuota]:
    try:
        yield LoopQuota(tmp_path / "state" / "quota", QuotaLimits(DISK_MB * MB, INODES))
    finally:
        release_all(tmp_path)


def conv(quota: LoopQuota, tmp: Path, name: str) -> Conv:
    ws, agent_root = tmp / "ws", tmp / "agent"
    ws.mkdir(exist_ok=True)
    agent_root.mkdir(exist_ok=True)
    digest = f"{abs(hash(name)):016x}"[:16]
    return Conv(
        quota,
        digest,
        (
            QuotaTarget("chat", ws, ws / "chats" / name),
            QuotaTarget(f"media/tg-{name}", ws, ws / "media" / f"tg-{name}"),
            QuotaTarget("home", agent_root, agent_root / "sandbox-homes" / name),
        ),
    )


def fill(path: Path) -> int:
    """Write zeros until the filesystem refuses; the bytes that got in."""
    written = 0
    block = b"\0" * MB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(4 * DISK_MB):
            try:
                written += os.write(fd, block)
            except OSError as exc:
                assert exc.errno in (errno.ENOSPC, errno.EDQUOT), exc
                return written
        raise AssertionError(f"wrote {written} bytes into a {DISK_MB} MB quota without ENOSPC")
    finally:
        os.close(fd)


def entries_at(path: Path) -> list[str]:
    return [e.root for e in mountinfo() if e.mount_point == str(path)]


def test_r2_probe_finds_the_loop_quota_on_this_host(tmp_path: Path) -> None:
    support = probe(tmp_path / "quota")
    assert support.ok, support.reason
    assert support.mechanism == "loop-ext4"
    assert not any(p.name.startswith(".probe") for p in (tmp_path / "quota").iterdir())


def test_r2_three_dirs_one_image_nosuid_nodev_noexec(quota: LoopQuota, tmp_path: Path) -> None:
    c = conv(quota, tmp_path, "a")
    c.ensure()
    image_dev = os.stat(quota.mount_dir("agent-q", c.digest)).st_dev
    for t in c.targets:
        assert os.lstat(t.path).st_dev == image_dev, t.path
        assert os.lstat(t.path).st_uid == OWNER[0]
        top = [e for e in mountinfo() if e.mount_point == str(t.path)][-1]
        assert {"rw", "nosuid", "nodev", "noexec"} <= top.options, top
        assert top.root == "/" + t.name
    image = quota.image("agent-q", c.digest)
    assert image.stat().st_size == DISK_MB * MB
    assert image.stat().st_blocks * 512 < DISK_MB * MB // 2  # sparse


def test_r2_a_new_image_costs_little_real_disk(tmp_path: Path) -> None:
    """A conversation's image at the defaults (256 MiB, 20 000 inodes) stays a hole: its
    journal is not written with zeros at mkfs (nor its inode tables after the mount, by
    the kernel's background init); a host of many conversations pays for their data."""
    q = LoopQuota(tmp_path / "quota", QuotaLimits(256 * MB, 20_000))
    c = conv(q, tmp_path, "thin")
    c.ensure()
    os.sync()
    image = q.image("agent-q", c.digest)
    assert image.stat().st_blocks * 512 < 2 * MB  # was 8.4 MiB of journal zeros alone
    (c.chat / "note").write_text("kept")  # and it is a working filesystem
    os.sync()
    assert (c.chat / "note").read_text() == "kept"


def test_r2_dd_stops_at_the_quota_for_all_three_dirs_and_not_the_neighbour(
    quota: LoopQuota, tmp_path: Path
) -> None:
    a, b = conv(quota, tmp_path, "a"), conv(quota, tmp_path, "b")
    a.ensure()
    b.ensure()
    host_before = os.statvfs(tmp_path)
    written = fill(a.chat / "big")
    assert 10 * MB < written <= DISK_MB * MB
    with pytest.raises(OSError) as exc:  # media and home share the same budget
        (a.media / "more").write_bytes(b"x" * MB)
    assert exc.value.errno == errno.ENOSPC
    host_after = os.statvfs(tmp_path)
    drop = (host_before.f_bavail - host_after.f_bavail) * host_after.f_frsize
    assert drop <= DISK_MB * MB + 32 * MB, drop
    assert quota.image("agent-q", a.digest).stat().st_blocks * 512 <= DISK_MB * MB
    (b.home / "fine").write_bytes(b"y" * (4 * MB))  # another conversation still writes
    assert (b.home / "fine").stat().st_size == 4 * MB
    print(f"R2 figures: wrote {written} bytes before ENOSPC; host free dropped {drop} bytes")


def test_r2_inode_flood_stops_at_the_inode_limit(quota: LoopQuota, tmp_path: Path) -> None:
    c = conv(quota, tmp_path, "a")
    c.ensure()
    made = 0
    with pytest.raises(OSError) as exc:
        for i in range(10 * INODES):
            os.close(os.open(c.home / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600))
            made += 1
    assert exc.value.errno == errno.ENOSPC
    assert INODES * 0.8 < made < INODES * 1.6, made


def test_r2_after_an_unmount_ensure_mounts_again_and_the_data_is_there(
    quota: LoopQuota, tmp_path: Path
) -> None:
    c = conv(quota, tmp_path, "a")
    c.ensure()
    (c.chat / "MEMORY.md").write_text("remember me")
    c.ensure()  # idempotent: nothing stacked
    assert len(entries_at(c.chat)) == 1
    released = release_all(tmp_path)  # a reboot, as far as mounts go
    assert str(c.chat) in released
    assert not (c.chat / "MEMORY.md").exists()
    c.ensure()
    assert (c.chat / "MEMORY.md").read_text() == "remember me"
    assert len(entries_at(c.chat)) == 1
    assert len(entries_at(quota.mount_dir("agent-q", c.digest))) == 1


def test_R2_an_agent_dir_removed_while_running_is_made_again(
    quota: LoopQuota, tmp_path: Path
) -> None:
    """The agent's dir is checked once and then remembered (F3); removed meanwhile (its
    app uninstalled and installed again in the same process), the next ensure makes it
    again instead of failing on a missing lock."""
    a = conv(quota, tmp_path, "a")
    a.ensure()
    release_all(tmp_path)
    shutil.rmtree(quota.root / "agent-q")
    b = conv(quota, tmp_path, "b")
    b.ensure()
    assert len(entries_at(b.chat)) == 1
    assert stat.S_IMODE(os.lstat(quota.root / "agent-q").st_mode) == 0o700


def test_F3_R2_a_quick_ensure_is_busy_for_anything_slow_and_does_it_not(
    quota: LoopQuota, tmp_path: Path
) -> None:
    """On the turn lane (F3) `ensure` is quick: an image to make or to mount, or its lock
    held, is `Busy` at once and nothing is made; in place, it is done as ever."""
    c = conv(quota, tmp_path, "a")
    with pytest.raises(Busy):
        quota.ensure("agent-q", c.digest, c.targets, OWNER, quick=True)
    assert not quota.image("agent-q", c.digest).exists()  # no mkfs was started
    c.ensure()
    quota.ensure("agent-q", c.digest, c.targets, OWNER, quick=True)  # all in place
    held = locked(quota.root / "agent-q" / f"{c.digest}.lock")  # a reader holds it
    with held, pytest.raises(Busy):
        quota.ensure("agent-q", c.digest, c.targets, OWNER, quick=True)
    release_all(tmp_path)  # a reboot, as far as mounts go
    with pytest.raises(Busy):
        quota.ensure("agent-q", c.digest, c.targets, OWNER, quick=True)
    assert not entries_at(c.chat)  # nothing mounted by it
    c.ensure()
    assert len(entries_at(c.chat)) == 1


def test_R2_R3_release_gives_back_one_conversations_mounts_and_keeps_its_data(
    quota: LoopQuota, tmp_path: Path
) -> None:
    """Its sandbox gone, a conversation holds no mount or loop device until its next turn."""
    a, b = conv(quota, tmp_path, "a"), conv(quota, tmp_path, "b")
    a.ensure()
    b.ensure()
    (a.chat / "MEMORY.md").write_text("remember me")
    image = str(quota.image("agent-q", a.digest))

    def of_a() -> list[str]:
        return [e.mount_point for e in mountinfo() if loop_backing_file(e.dev) == image]

    assert len(of_a()) == 4  # the image, and its chat, media and home binds
    assert quota.release("agent-q", a.digest) == 4
    assert of_a() == [] and not (a.chat / "MEMORY.md").exists()
    # the loop device went with its last mount (autoclear): nothing left attached
    assert not any(
        p.read_text().strip() == image for p in Path("/sys/block").glob("loop*/loop/backing_file")
    )
    assert len(entries_at(b.chat)) == 1  # the neighbour keeps its own
    assert quota.release("agent-q", a.digest) == 0  # again: nothing to do
    a.ensure()
    assert (a.chat / "MEMORY.md").read_text() == "remember me"
    assert len(of_a()) == 4


def _mounts_of(quota: LoopQuota, digest: str) -> list[str]:
    image = str(quota.image("agent-q", digest))
    return [e.mount_point for e in mountinfo() if loop_backing_file(e.dev) == image]


def test_R2_R3_held_mounts_a_released_conversation_for_a_reader(
    quota: LoopQuota, tmp_path: Path
) -> None:
    """A backup, the media API or /reset outside a turn (after a reboot, or once the
    sandbox is gone) reads and writes the image, not the empty dir under its mount point."""
    a = conv(quota, tmp_path, "a")
    a.ensure()
    (a.chat / "MEMORY.md").write_text("remember me")
    (a.media / "photo.png").write_bytes(b"png")
    assert quota.release("agent-q", a.digest) == 4
    assert not (a.chat / "MEMORY.md").exists()
    with quota.held("agent-q", a.digest, a.targets[:2]) as there:
        assert there
        assert (a.chat / "MEMORY.md").read_text() == "remember me"
        assert (a.media / "photo.png").read_bytes() == b"png"
        (a.chat / "session.json").write_text("{}")
        assert not os.path.ismount(a.home)  # only what the reader asked for
    # it stays mounted (a flood of readers mounts it once) until the sweep releases it
    assert len(_mounts_of(quota, a.digest)) == 3
    assert quota.mounted("agent-q").keys() == {a.digest}
    assert quota.release("agent-q", a.digest) == 3
    assert not (a.chat / "session.json").exists()  # written into the image, not the dir
    a.ensure()
    assert (a.chat / "session.json").read_text() == "{}"


def test_R2_held_binds_an_old_sessions_media_dir_of_a_mounted_conversation(
    quota: LoopQuota, tmp_path: Path
) -> None:
    """An API conversation gets a media dir per session: after a release, its next turn
    binds only the current one; a shared link to an older session's file still reads
    the image. What is bound already (a running sandbox's) is left exactly as it is."""
    a = conv(quota, tmp_path, "a")
    a.ensure()
    (a.media / "old.png").write_bytes(b"old")
    ws = tmp_path / "ws"
    new_media = QuotaTarget("media/tg-a2", ws, ws / "media" / "tg-a2")
    quota.release("agent-q", a.digest)
    quota.ensure("agent-q", a.digest, (a.targets[0], new_media, a.targets[2]), OWNER)
    before = _mounts_of(quota, a.digest)
    assert not (a.media / "old.png").exists()
    with quota.held("agent-q", a.digest, a.targets[:2]):
        assert (a.media / "old.png").read_bytes() == b"old"
    after = _mounts_of(quota, a.digest)
    assert sorted(after) == sorted([*before, str(a.media)])


def test_R2_held_binds_nothing_through_a_link_and_nothing_without_an_image(
    quota: LoopQuota, tmp_path: Path
) -> None:
    a, b = conv(quota, tmp_path, "a"), conv(quota, tmp_path, "b")
    a.ensure()
    (a.chat / "MEMORY.md").write_text("mine")
    quota.release("agent-q", a.digest)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ws = tmp_path / "ws"
    (ws / "media").rename(tmp_path / "media-moved")
    (ws / "media").symlink_to(elsewhere)  # a planted link on the way to the media dir
    (elsewhere / "tg-a").mkdir()
    with quota.held("agent-q", a.digest, a.targets[:2]) as there:
        assert there and (a.chat / "MEMORY.md").exists()
        assert not os.path.ismount(elsewhere / "tg-a")  # never bound where a link leads
    assert len(_mounts_of(quota, a.digest)) == 2  # the image and its chat
    with quota.held("agent-q", b.digest, b.targets) as there:
        assert not there  # never had a turn: no image, nothing mounted
    assert not quota.image("agent-q", b.digest).exists()
    assert not os.path.ismount(b.chat)


def test_R2_a_reader_waits_a_bounded_time_for_a_busy_conversation(
    quota: LoopQuota, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of share fetches must not hold every worker thread while a turn's ensure
    holds the conversation (moving a big dir in): the reader is told to try again."""
    monkeypatch.setattr(quota_mod, "READER_WAIT", 0.3)
    a = conv(quota, tmp_path, "a")
    a.ensure()
    lock = quota.agent_dir("agent-q", a.digest) / f"{a.digest}.lock"
    reader = quota.held("agent-q", a.digest, a.targets)
    with locked(lock), pytest.raises(QuotaError, match="try again"), reader:
        pass
    with quota.held("agent-q", a.digest, a.targets) as there:
        assert there


def test_R2_release_leaves_a_mount_point_that_is_not_the_image_alone(
    quota: LoopQuota, tmp_path: Path
) -> None:
    a = conv(quota, tmp_path, "a")
    mnt = quota.mount_dir("agent-q", a.digest)
    quota.agent_dir("agent-q", a.digest)
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    assert quota.release("agent-q", a.digest) == 0
    assert entries_at(mnt), "a foreign mount was taken down"
    assert quota.release("agent-q", "0000000000000000") == 0  # never mounted


def test_r2_pre_quota_data_is_copied_in_once_without_following_anything(
    quota: LoopQuota, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = conv(quota, tmp_path, "a")
    c.chat.mkdir(parents=True)
    (c.chat / "MEMORY.md").write_text("old memory")
    (c.chat / "notes").mkdir()
    (c.chat / "notes" / "n.txt").write_text("n")
    (c.chat / "passwd").symlink_to("/etc/passwd")
    os.mkfifo(c.chat / "fifo")
    with open(c.chat / "sparse", "wb") as f:  # 1 GB that costs nothing: left out
        f.truncate(1024 * MB)
    with caplog.at_level(logging.INFO, logger="sandbox.quota"):
        c.ensure()
    assert (c.chat / "MEMORY.md").read_text() == "old memory"
    assert (c.chat / "notes" / "n.txt").read_text() == "n"
    assert os.readlink(c.chat / "passwd") == "/etc/passwd"  # recreated as a link, not read
    assert (c.chat / "passwd").is_symlink()
    assert not (c.chat / "fifo").exists()
    assert not (c.chat / "sparse").exists()
    assert "left under the mount" in caplog.text and "fifo" in caplog.text
    (c.chat / "MEMORY.md").write_text("newer")
    release_all(tmp_path)
    assert (c.chat / "MEMORY.md").read_text() == "old memory"  # the originals, kept (incomplete)
    c.ensure()
    assert (c.chat / "MEMORY.md").read_text() == "newer"  # copied once, never again


def test_r2_a_complete_copy_removes_the_host_originals(quota: LoopQuota, tmp_path: Path) -> None:
    c = conv(quota, tmp_path, "a")
    c.home.mkdir(parents=True)
    (c.home / "settings.json").write_text("{}")
    c.ensure()
    release_all(tmp_path)
    assert list(c.home.iterdir()) == []  # the host pays once, inside the image
    c.ensure()
    assert (c.home / "settings.json").read_text() == "{}"


def test_r2_a_foreign_mount_on_a_conversation_dir_is_refused(
    quota: LoopQuota, tmp_path: Path
) -> None:
    c = conv(quota, tmp_path, "a")
    c.media.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(c.media)], check=True)
    with pytest.raises(QuotaError, match="already a mount point"):
        c.ensure()


def test_r2_a_symlinked_conversation_dir_is_refused(quota: LoopQuota, tmp_path: Path) -> None:
    c = conv(quota, tmp_path, "a")
    c.chat.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    c.chat.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(QuotaError, match="symlinks are refused"):
        c.ensure()
    assert entries_at(tmp_path / "elsewhere") == []


def test_r2_exec_allowed_when_the_operator_says_so(tmp_path: Path) -> None:
    q = LoopQuota(tmp_path / "quota", QuotaLimits(DISK_MB * MB, INODES, exec_allowed=True))
    try:
        c = conv(q, tmp_path, "a")
        c.ensure()
        top = [e for e in mountinfo() if e.mount_point == str(c.chat)][-1]
        assert "noexec" not in top.options and {"nosuid", "nodev"} <= top.options
    finally:
        release_all(tmp_path)


def test_r2_config_defaults_and_bounds() -> None:
    lim = Limits()
    assert (lim.disk_mb, lim.disk_inodes, lim.writable_exec) == (256, 20_000, False)
    assert GatewaySettings().quota == "required"
    assert GatewaySettings.model_validate({"quota": "off"}).quota == "off"
    with pytest.raises(ValueError, match="diskInodes"):
        Limits.model_validate({"diskMb": 8, "diskInodes": 100_000})
    with pytest.raises(ValueError):
        GatewaySettings.model_validate({"quota": "maybe"})


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def app_in(state: Path) -> InstalledApp:
    agent_root = state / "agents" / "quota-bot"
    return InstalledApp(
        name="quota",
        version="1",
        agent="quota-bot",
        image="none",
        image_id="sha256:none",
        user=None,
        environment={},
        networks=(),
        isolate_memory=True,
        disable_archive=True,
        workspace=agent_root / "workspace",
        agent_root=agent_root,
    )


async def test_r2_without_root_sandboxed_agents_are_refused_with_how_to_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = GatewaySettings.model_validate({"stateDir": str(tmp_path)})
    with as_nobody(), caplog.at_level(logging.ERROR):
        support = probe(tmp_path / "quota")
        sandboxes = ConversationSandboxes(
            app_in(tmp_path), settings, NoEngineBackend(), gateway_id=RUN_ID
        )
    assert support.ok is False
    assert "not root" in support.reason and "gateway.quota" in support.reason
    assert "quota-bot is refused" in caplog.text
    with pytest.raises(QuotaError, match="not root"):
        await sandboxes.ensure(ConversationKey("quota-bot", "telegram", "1"), "s-1")
    assert not (tmp_path / "quota").exists()


def test_r2_quota_off_warns_at_every_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = GatewaySettings.model_validate({"stateDir": str(tmp_path), "quota": "off"})
    for _ in range(2):
        with caplog.at_level(logging.WARNING):
            sandboxes = ConversationSandboxes(
                app_in(tmp_path), settings, NoEngineBackend(), gateway_id=RUN_ID
            )
        assert sandboxes.quota is None and sandboxes.quota_refusal is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "R2" in r.message]
    assert len(warnings) == 2
