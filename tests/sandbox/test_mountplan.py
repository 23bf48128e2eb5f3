"""The pure mount plan (S3) over a table of workspace trees, and its verification (S4)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox.mountplan import EntryKind, MountPlan, own_dirs, plan_mounts, scan_workspace
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer, ObservedMount, mount_violations

Tree = Callable[[Path], None]


def _files(*names: str) -> Tree:
    def make(ws: Path) -> None:
        for n in names:
            p = ws / n
            if n.endswith("/"):
                p.mkdir(parents=True, exist_ok=True)
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(n)

    return make


def _plan(tmp_path: Path, tree: Tree) -> tuple[MountPlan, Path]:
    ws = tmp_path / "ws"
    ws.mkdir()
    tree(ws)
    chat = ws / "chats" / "api-c-0123"
    media = ws / "media" / "api-s1"
    home = tmp_path / "homes" / "api-c-0123"
    bridge = tmp_path / "bridge" / "0123"
    for d in (chat, media, home, bridge):
        d.mkdir(parents=True, exist_ok=True)
    return plan_mounts(scan_workspace(ws), own_dirs(chat, media, home, bridge)), ws


OWN = {
    "/workspace/chats/api-c-0123": False,
    "/workspace/media/api-s1": False,
    "/home/agent/.claude": False,
    "/run/cellgate": True,
}


def _symlinks(ws: Path) -> None:
    (ws / "real").mkdir()
    os.symlink(ws / "real", ws / "linkdir")
    os.symlink("/etc/passwd", ws / "AGENTS.md")
    os.symlink("/", ws / "skills")


def _claude_extras(ws: Path) -> None:
    for d in ("skills", "commands", "agents", "projects", "plugins"):
        (ws / ".claude" / d).mkdir(parents=True)
    (ws / ".claude" / "settings.json").write_text("{}")
    (ws / ".claude" / "settings.local.json").write_text("{}")
    (ws / ".claude" / ".credentials.json").write_text("secret")
    os.symlink("/etc", ws / ".claude" / "agents-link")


def _claude_symlinked(ws: Path) -> None:
    (ws / "elsewhere" / "skills").mkdir(parents=True)
    os.symlink(ws / "elsewhere", ws / ".claude")


def _file_named_like_dir(ws: Path) -> None:
    (ws / "skills").write_text("I am a file named skills")
    (ws / "memory").write_text("a file named memory")
    (ws / ".claude").mkdir()
    (ws / ".claude" / "skills").write_text("a file where a dir is expected")
    (ws / ".claude" / "settings.json").mkdir()


CASES: list[tuple[str, Tree, dict[str, bool]]] = [
    (
        "persona files only",
        _files("CLAUDE.md", "AGENTS.md", "SOUL.md", "IDENTITY.md", "HEARTBEAT.md"),
        {
            f"/workspace/{n}": True
            for n in ("CLAUDE.md", "AGENTS.md", "SOUL.md", "IDENTITY.md", "HEARTBEAT.md")
        },
    ),
    (
        "root memory, kb.sqlite and stray notes are not mounted",
        _files(
            "AGENTS.md",
            "MEMORY.md",
            "USER.md",
            "kb.sqlite",
            "SKILLS_LEARNED.md",
            "notes-from-before.md",
            "config.json",
        ),
        {"/workspace/AGENTS.md": True},
    ),
    (
        "directories except chats, memory, media and dot dirs",
        _files(
            "skills/a/SKILL.md",
            "tools/",
            "memory/topic.md",
            "media/telegram-1/x.png",
            "chats/telegram-9-abc/MEMORY.md",
            ".git/config",
            ".cache/",
            ".telegram-state/",
        ),
        {"/workspace/skills": True, "/workspace/tools": True},
    ),
    (
        "symlinks are never mounted or followed",
        _symlinks,
        {"/workspace/real": True},
    ),
    (
        ".claude keeps only skills, commands, agents and settings.json",
        _claude_extras,
        {
            "/workspace/.claude/skills": True,
            "/workspace/.claude/commands": True,
            "/workspace/.claude/agents": True,
            "/workspace/.claude/settings.json": True,
        },
    ),
    ("a symlinked .claude is not read", _claude_symlinked, {"/workspace/elsewhere": True}),
    ("files named like directories and the reverse", _file_named_like_dir, {}),
    ("an empty workspace", _files(), {}),
]


@pytest.mark.parametrize(
    ("tree", "expected"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_S3_mount_plan_table(tmp_path: Path, tree: Tree, expected: dict[str, bool]) -> None:
    plan, _ = _plan(tmp_path, tree)
    got = {m.target: m.read_only for m in plan.mounts}
    assert got == {**expected, **OWN}
    assert plan.writable_targets() == (
        "/home/agent/.claude",
        "/workspace/chats/api-c-0123",
        "/workspace/media/api-s1",
    )
    for m in plan.mounts:
        assert m.kind in (EntryKind.FILE, EntryKind.DIR)
        assert not os.path.islink(m.source)


def test_S3_persona_files_keep_their_identity(tmp_path: Path) -> None:
    plan, ws = _plan(tmp_path, _files("AGENTS.md"))
    m = plan.by_target()["/workspace/AGENTS.md"]
    st = os.lstat(ws / "AGENTS.md")
    assert (m.dev, m.ino, m.kind) == (st.st_dev, st.st_ino, EntryKind.FILE)


def test_S3_own_dirs_must_be_real_directories(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "chats").mkdir(parents=True)
    target = tmp_path / "other-chat"
    target.mkdir()
    os.symlink(target, ws / "chats" / "api-c-0123")
    (ws / "media" / "api-s1").mkdir(parents=True)
    (tmp_path / "h").mkdir()
    with pytest.raises(ValueError, match="not a real directory"):
        plan_mounts(
            scan_workspace(ws),
            own_dirs(
                ws / "chats" / "api-c-0123", ws / "media" / "api-s1", tmp_path / "h", tmp_path / "h"
            ),
        )


# --- S4: verification is a pure comparison ---------------------------------------------


def _spec(plan: MountPlan) -> SandboxSpec:
    return SandboxSpec(
        name="app-agent-c-1",
        image="img",
        image_id="sha256:1",
        user="1000:1000",
        env={},
        networks=(),
        plan=plan,
    )


def _observed(
    mounts: list[ObservedMount], tmpfs: tuple[str, ...] = ("/tmp", "/home/agent")
) -> ObservedContainer:
    return ObservedContainer(
        name="app-agent-c-1",
        id="c",
        image_id="sha256:1",
        labels={},
        user="1000:1000",
        mounts=tuple(mounts),
        tmpfs=tmpfs,
        cap_add=(),
        cap_drop=("ALL",),
        privileged=False,
        readonly_rootfs=True,
        security_opt=("no-new-privileges:true",),
        network_mode="none",
        pid_mode="",
        ipc_mode="private",
        devices=0,
        runtime="runc",
        running=True,
        pids_limit=128,
        memory=512 * 1024 * 1024,
        memory_swap=512 * 1024 * 1024,
        nano_cpus=1_000_000_000,
        ulimits=(("core", 0, 0), ("nofile", 1024, 1024)),
        tmpfs_options={},
        networks=("none",),
        apparmor_profile="",
        log_type="none",
        log_options={},
        cgroupns_mode="private",
    )


def _faithful(plan: MountPlan) -> list[ObservedMount]:
    return [
        ObservedMount("bind", m.source, m.target, not m.read_only, (m.kind, m.dev, m.ino))
        for m in plan.mounts
    ]


def test_S4_faithful_container_has_no_violations(tmp_path: Path) -> None:
    plan, _ = _plan(tmp_path, _files("AGENTS.md", "skills/"))
    assert mount_violations(_spec(plan), _observed(_faithful(plan))) == []


def test_S4_extra_bind_is_refused_by_name(tmp_path: Path) -> None:
    plan, ws = _plan(tmp_path, _files("AGENTS.md"))
    extra = ObservedMount("bind", str(ws / "chats"), "/workspace/chats", True, None)
    found = mount_violations(_spec(plan), _observed([*_faithful(plan), extra]))
    assert found == [f"unplanned bind mount {ws / 'chats'} -> /workspace/chats"]


def test_S4_read_write_persona_is_refused(tmp_path: Path) -> None:
    plan, ws = _plan(tmp_path, _files("AGENTS.md"))
    mounts = [
        ObservedMount(
            m.type,
            m.source,
            m.target,
            True if m.target == "/workspace/AGENTS.md" else m.read_write,
            m.identity,
        )
        for m in _faithful(plan)
    ]
    found = mount_violations(_spec(plan), _observed(mounts))
    assert found == [
        f"{ws / 'AGENTS.md'} -> /workspace/AGENTS.md is read-write; the plan has it read-only"
    ]


def test_S4_parent_source_is_refused(tmp_path: Path) -> None:
    plan, ws = _plan(tmp_path, _files())
    chat = plan.by_target()["/workspace/chats/api-c-0123"]
    mounts = [
        m
        if m.target != chat.target
        else ObservedMount("bind", str(ws / "chats"), chat.target, True, None)
        for m in _faithful(plan)
    ]
    (found,) = mount_violations(_spec(plan), _observed(mounts))
    assert "a parent of the planned" in found and chat.target in found


def test_S4_swapped_directory_same_path_is_refused(tmp_path: Path) -> None:
    plan, _ = _plan(tmp_path, _files())
    chat = plan.by_target()["/workspace/chats/api-c-0123"]
    os.rename(chat.source, str(tmp_path / "moved"))
    os.mkdir(chat.source)
    st = os.lstat(chat.source)
    mounts = [
        m
        if m.target != chat.target
        else ObservedMount(
            "bind", chat.source, chat.target, True, (EntryKind.DIR, st.st_dev, st.st_ino)
        )
        for m in _faithful(plan)
    ]
    (found,) = mount_violations(_spec(plan), _observed(mounts))
    assert "device/inode changed" in found


def test_S4_volume_and_extra_tmpfs_are_refused(tmp_path: Path) -> None:
    plan, _ = _plan(tmp_path, _files())
    vol = ObservedMount("volume", "", "/data", True, None)
    found = mount_violations(
        _spec(plan), _observed([*_faithful(plan), vol], tmpfs=("/tmp", "/home/agent", "/dev/shm2"))
    )
    assert "unplanned volume mount (anonymous) -> /data" in found
    assert "unplanned tmpfs at /dev/shm2" in found


def test_S4_missing_planned_mount_is_reported(tmp_path: Path) -> None:
    plan, _ = _plan(tmp_path, _files("AGENTS.md"))
    mounts = [m for m in _faithful(plan) if m.target != "/workspace/AGENTS.md"]
    (found,) = mount_violations(_spec(plan), _observed(mounts))
    assert found.endswith("-> /workspace/AGENTS.md is missing")
