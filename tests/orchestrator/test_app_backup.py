"""Backup never follows what a sandbox planted; restore refuses a hostile archive (issue 11).

No engine here: a hostile archive is refused while it is unpacked, before the
engine is asked anything; the full round trip is in tests/e2e/test_apps.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from cellgate.errors import AppError
from cellgate.models import ConversationKey
from orchestrator.app_backup import backup_app, restore_app
from orchestrator.apps import InstalledApp
from orchestrator.config import write_config_document
from orchestrator.conversations import conversation_paths
from orchestrator.host_side import quota_targets
from orchestrator.store import Store
from policies.archive import ArchiveLimits
from sandbox.quota import LoopQuota, QuotaLimits, release_all
from tests.orchestrator.test_app_modes import _installed

SECRET = "host-secret-do-not-copy-4471"


def test_backup_leaves_out_links_fifos_and_files_planted_by_a_sandbox(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True})
    ws = state / "agents" / "shop-bot" / "workspace"
    chat = ws / "chats" / "api-1-aa"
    chat.mkdir(parents=True)
    (chat / "USER.md").write_text("likes tea\n")
    outside = tmp_path / "host-secret.txt"
    outside.write_text(SECRET)
    (chat / "MEMORY.md").symlink_to(outside)
    (ws / "chats" / "linked-dir").symlink_to(tmp_path)
    os.mkfifo(chat / "pipe")
    lines: list[str] = []
    archive = backup_app("shop", state, tmp_path / "out" / "shop.tar.gz", lines.append)
    assert oct(archive.stat().st_mode & 0o777) == "0o600"
    with tarfile.open(archive, "r:gz") as tar:
        names = tar.getnames()
        assert all(m.isfile() or m.isdir() for m in tar.getmembers())
        data = b"".join(
            tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.isfile()  # type: ignore[union-attr]
        )
    assert "workspace/chats/api-1-aa/USER.md" in names
    assert "workspace/chats/api-1-aa/MEMORY.md" not in names
    assert "workspace/chats/linked-dir" not in names
    assert "workspace/chats/api-1-aa/pipe" not in names
    assert SECRET.encode() not in data
    assert any("left out" in line and "MEMORY.md" in line for line in lines)
    assert any(line.startswith("backup done") for line in lines)  # progress is shown


@pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")
def test_R2_backup_reads_each_conversations_quota_image_mounted_or_not(tmp_path: Path) -> None:
    """After a reboot, or once its sandbox is gone, a conversation's image is not
    mounted: the backup mounts it for its reading, so no memory is left out."""
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True})
    app = InstalledApp.load(state, "shop")
    ws, agent_root = app.workspace, app.agent_root
    ws.mkdir(parents=True, exist_ok=True)
    quota = LoopQuota(state / "quota", QuotaLimits(16 << 20, 2000))
    keys = {
        "tg": ConversationKey(app.agent, "telegram", "42"),
        "api": ConversationKey(app.agent, "api", "caller-1"),
    }
    with Store.open(state) as store:
        sid = store.open_session(store.upsert_conversation(keys["api"]).id, "claude").id
        store.upsert_conversation(keys["tg"])
    media = {"tg": keys["tg"].media_dir_name(""), "api": keys["api"].media_dir_name(sid)}
    try:
        for k, key in keys.items():
            paths = conversation_paths(agent_root, ws, key, sid)
            quota.ensure(app.agent, key.digest, quota_targets(paths, agent_root), None)
            (paths.chat_dir / "MEMORY.md").write_text(f"memory of {k}\n")
            (paths.media_dir / "pic.png").write_bytes(b"png")
        quota.release(app.agent, keys["api"].digest)  # its sandbox went: not mounted
        quota.release(app.agent, keys["tg"].digest)
        quota.ensure(  # the telegram chat's sandbox runs again
            app.agent,
            keys["tg"].digest,
            quota_targets(conversation_paths(agent_root, ws, keys["tg"], sid), agent_root),
            None,
        )
        lines: list[str] = []
        archive = backup_app("shop", state, tmp_path / "out" / "shop.tar.gz", lines.append)
        with tarfile.open(archive, "r:gz") as tar:
            got = {
                m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers()
                if m.isfile()
            }
        for k, key in keys.items():
            assert got[f"workspace/chats/{key.dir_name}/MEMORY.md"] == f"memory of {k}\n".encode()
            assert got[f"workspace/media/{media[k]}/pic.png"] == b"png"
        assert not any("left out" in line for line in lines), lines
    finally:
        release_all(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")
def test_R2_a_backup_that_cannot_read_a_quota_image_fails_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Else `uninstall --purge` would delete a conversation's memory it never saved."""
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True})
    app = InstalledApp.load(state, "shop")
    app.workspace.mkdir(parents=True, exist_ok=True)
    quota = LoopQuota(state / "quota", QuotaLimits(16 << 20, 2000))
    key = ConversationKey(app.agent, "telegram", "7")
    with Store.open(state) as store:
        store.upsert_conversation(key)
    paths = conversation_paths(app.agent_root, app.workspace, key, "")
    try:
        quota.ensure(app.agent, key.digest, quota_targets(paths, app.agent_root), None)
        (paths.chat_dir / "MEMORY.md").write_text("precious\n")
        quota.release(app.agent, key.digest)
        # something else sits where the image mounts: it cannot be read
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
             str(quota.mount_dir(app.agent, key.digest))],
            check=True,
        )  # fmt: skip
        target = tmp_path / "out" / "shop.tar.gz"
        with pytest.raises(AppError, match="no backup was written"):
            backup_app("shop", state, target, lambda line: None)
        assert not target.exists() and not list(target.parent.iterdir())
    finally:
        release_all(tmp_path)


def _hostile(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        meta = tarfile.TarInfo("cellgate-backup.json")
        body = b'{"format": 1, "app": "shop", "agent": "shop-bot"}'
        meta.size = len(body)
        tar.addfile(meta, io.BytesIO(body))
        member.size = len(data) if member.isreg() else 0
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return path


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = tarfile.SYMTYPE, target
    return m


def _hardlink(name: str, target: str) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = tarfile.LNKTYPE, target
    return m


def _device(name: str) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.devmajor, m.devminor = tarfile.CHRTYPE, 1, 3
    return m


@pytest.mark.parametrize(
    ("member", "data", "why"),
    [
        (tarfile.TarInfo("/tmp/cellgate-escape-abs"), b"x", "absolute"),
        (tarfile.TarInfo("workspace/../../cellgate-escape-dots"), b"x", "'..'"),
        (_symlink("workspace/chats/a", "/etc"), b"", "symlink"),
        (_hardlink("workspace/chats/b", "/etc/passwd"), b"", "hardlink"),
        (_device("workspace/null"), b"", "device"),
        (tarfile.TarInfo("workspace/huge"), b"y" * 4096, "per-file bound"),
        (tarfile.TarInfo("etc/cron.d/evil"), b"x", "not part of a cellgate backup"),
    ],
)
def test_restore_refuses_a_hostile_archive(
    tmp_path: Path, member: tarfile.TarInfo, data: bytes, why: str
) -> None:
    state = tmp_path / "fresh-state"
    state.mkdir()
    config = state / "config.json"
    write_config_document(config, {"gateway": {"stateDir": str(state)}, "agents": []})
    before = config.read_text()
    archive = _hostile(tmp_path / "evil.tar.gz", member, data)
    limits = ArchiveLimits(max_member_bytes=1024)
    with pytest.raises(AppError, match="archive refused") as info:
        restore_app(archive, config, state, None, lambda _: None, limits=limits)
    assert why in str(info.value)
    assert sorted(p.name for p in state.iterdir()) == ["config.json"]  # staging removed
    assert config.read_text() == before
    assert not Path("/tmp/cellgate-escape-abs").exists()
    assert not (tmp_path / "cellgate-escape-dots").exists()


def test_restore_refuses_a_member_count_bomb(tmp_path: Path) -> None:
    state = tmp_path / "fresh-state"
    state.mkdir()
    config = state / "config.json"
    write_config_document(config, {"gateway": {"stateDir": str(state)}, "agents": []})
    archive = tmp_path / "many.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(50):
            tar.addfile(tarfile.TarInfo(f"workspace/f{i}"), io.BytesIO(b""))
    with pytest.raises(AppError, match="more than 20 members"):
        restore_app(archive, config, state, None, lambda _: None,
                    limits=ArchiveLimits(max_members=20))  # fmt: skip
    assert not (state / "agents").exists()


def test_restore_refuses_what_is_not_an_archive(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir()
    config = state / "config.json"
    write_config_document(config, {"gateway": {"stateDir": str(state)}, "agents": []})
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(AppError, match="not a readable archive"):
        restore_app(junk, config, state, None, lambda _: None)


def test_restore_refuses_an_archive_whose_names_climb_out(tmp_path: Path) -> None:
    state = tmp_path / "deep" / "fresh-state"
    state.mkdir(parents=True)
    config = state / "config.json"
    write_config_document(config, {"gateway": {"stateDir": str(state)}, "agents": []})
    archive = tmp_path / "names.tar.gz"
    files = {
        "cellgate-backup.json": b'{"format": 1, "app": "../../escaped", "agent": "x-bot"}',
        "app/app.json": b'{"name": "../../escaped", "agent": "x-bot"}',
        "store/rows.json": b"{}",
        "workspace/AGENTS.md": b"persona",
    }
    with tarfile.open(archive, "w:gz") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    with pytest.raises(AppError, match="not a plain name"):
        restore_app(archive, config, state, None, lambda _: None)
    assert not (tmp_path / "escaped").exists() and not (state / "apps").exists()
