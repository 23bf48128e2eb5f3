"""F1, S3, S4: the pure checks of a claimed pooled sandbox, and the pool's spec identity."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath

import pytest
from pydantic import ValidationError

from orchestrator.config import PoolSettings
from sandbox.latebind import LateBindError, Slot, skeleton, slot_path, unescape
from sandbox.mountplan import EntryKind, MountPlan, PlannedMount
from sandbox.pool import SandboxView, ViewMount, parse_mountinfo, pool_key, view_violations
from sandbox.spec import SandboxLimits, SandboxSpec

DEV = os.makedev(254, 3)
CHAT = PlannedMount("/h/chats/a", "/workspace/chats/a", False, EntryKind.DIR, DEV, 11)
PERSONA = PlannedMount("/h/AGENTS.md", "/workspace/AGENTS.md", True, EntryKind.FILE, DEV, 12)
HOME = PlannedMount("/h/homes/a", "/home/agent/.claude", False, EntryKind.DIR, DEV, 13)
BRIDGE = PlannedMount("/h/bridge/a", "/run/cellgate", True, EntryKind.DIR, DEV, 14)
PLAN = MountPlan((PERSONA, CHAT, HOME, BRIDGE))
SLOTS = (
    ViewMount("/workspace", True, (254, 0)),
    ViewMount("/home/agent", False, (0, 50)),
    ViewMount("/home/agent/.claude", True, (254, 0)),
    ViewMount("/run/cellgate", True, (254, 0)),
)


def exact() -> SandboxView:
    mounts = (
        *SLOTS,
        ViewMount("/workspace/AGENTS.md", True, (254, 3)),
        ViewMount("/workspace/chats/a", False, (254, 3)),
        ViewMount("/home/agent/.claude", False, (254, 3)),
        ViewMount("/run/cellgate", True, (254, 3)),
        ViewMount("/proc", False, (0, 9)),
    )
    targets = {m.target: (m.kind, m.dev, m.ino) for m in PLAN.mounts}
    return SandboxView(mounts, targets)


def test_S3_exact_claim_has_no_violation() -> None:
    assert view_violations(PLAN, exact()) == []


def test_S3_S4_another_conversations_mount_is_named() -> None:
    view = exact()
    view = dataclasses.replace(
        view, mounts=(*view.mounts, ViewMount("/workspace/chats/b", False, (254, 3)))
    )
    assert view_violations(PLAN, view) == ["unplanned mount at /workspace/chats/b"]


def test_S4_swapped_directory_is_caught_by_inode() -> None:
    view = exact()
    view.targets["/workspace/chats/a"] = (EntryKind.DIR, DEV, 999)
    [v] = view_violations(PLAN, view)
    assert "/workspace/chats/a" in v and "device/inode" in v


def test_S4_writable_persona_and_missing_bridge() -> None:
    view = exact()
    mounts = [
        dataclasses.replace(m, read_only=False) if m.target == "/workspace/AGENTS.md" else m
        for m in view.mounts
        if not (m.target == "/run/cellgate" and m.dev == (254, 3))
    ]
    found = view_violations(PLAN, dataclasses.replace(view, mounts=tuple(mounts)))
    assert any("/workspace/AGENTS.md is read-write" in v for v in found)
    assert any("/run/cellgate is missing" in v for v in found)


def test_S4_mount_from_another_device_and_a_stacked_extra() -> None:
    view = exact()
    mounts = [
        dataclasses.replace(m, dev=(7, 1)) if m.target == "/workspace/chats/a" else m
        for m in view.mounts
    ]
    mounts.append(ViewMount("/home/agent/.claude", False, (254, 3)))  # a third one stacked
    found = view_violations(PLAN, dataclasses.replace(view, mounts=tuple(mounts)))
    assert any("/workspace/chats/a is on device (7, 1)" in v for v in found)
    assert "unplanned mount at /home/agent/.claude" in found


def test_S3_parse_mountinfo_reads_flags_devices_and_escapes() -> None:
    text = (
        "410 393 254:0 /slots/x/ws /workspace ro,relatime master:9 - ext4 /dev/vda rw\n"
        "196 410 254:3 /d /workspace/chats/a\\040b rw,relatime master:12 - ext4 /dev/vda rw\n"
        "garbage\n"
    )
    assert parse_mountinfo(text) == (
        ViewMount("/workspace", True, (254, 0)),
        ViewMount("/workspace/chats/a b", False, (254, 3)),
    )
    assert unescape("a\\134b\\011") == "a\\b\t"


def test_S3_slot_paths_stay_in_their_slot() -> None:
    slot = Slot(Path("/s/slots/abc"))
    assert slot_path(slot, PurePosixPath("/workspace/chats/a")) == Path("/s/slots/abc/ws/chats/a")
    assert slot_path(slot, PurePosixPath("/run/cellgate")) == Path("/s/slots/abc/bridge")
    assert slot_path(slot, PurePosixPath("/home/agent/.claude")) == Path("/s/slots/abc/home")
    with pytest.raises(LateBindError):
        slot_path(slot, PurePosixPath("/etc/passwd"))
    with pytest.raises(LateBindError):
        slot_path(slot, PurePosixPath("/workspace/../etc"))


def spec(**changes: object) -> SandboxSpec:
    base = SandboxSpec(
        name="app-agent-c-1", image="img", image_id="sha256:1", user="1000:1000",
        env={"A": "1"}, networks=(), plan=MountPlan((CHAT,)), app="app", agent="app-bot",
        conversation="c1", gateway="gw",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_F1_S3_skeleton_holds_the_apps_mountpoints_and_no_conversations_own() -> None:
    """What a slot is made with ahead of its claim: the read-only (app) targets and the
    parents of every target; a conversation's own dir (its chat, media, home) never."""
    skill = PlannedMount(
        "/h/.claude/skills", "/workspace/.claude/skills", True, EntryKind.DIR, DEV, 15
    )
    media = PlannedMount("/h/media/a", "/workspace/media/a", False, EntryKind.DIR, DEV, 16)
    made = dict(skeleton(MountPlan((*PLAN.mounts, skill, media))))
    assert made == {
        "/workspace/AGENTS.md": EntryKind.FILE,
        "/workspace/chats": EntryKind.DIR,
        "/workspace/.claude": EntryKind.DIR,
        "/workspace/.claude/skills": EntryKind.DIR,
        "/workspace/media": EntryKind.DIR,
    }
    assert skeleton(MountPlan((HOME, BRIDGE))) == ()  # slot dirs themselves: nothing to make


def test_F1_pool_key_ignores_the_conversation_and_drains_on_spec_change() -> None:
    same = spec(name="app-agent-c-2", conversation="c2", plan=MountPlan(()))
    assert pool_key(same) == pool_key(spec())
    for change in (
        {"image_id": "sha256:2"},
        {"env": {"A": "2"}},
        {"user": "1001:1001"},
        {"limits": SandboxLimits(pids=64)},
        {"runtime": "runsc"},
        {"networks": ("net",)},
        {"gateway": "other"},
    ):
        assert pool_key(spec(**change)) != pool_key(spec()), change


def test_F1_pool_settings() -> None:
    assert 0 < PoolSettings().size <= PoolSettings().max  # small by default; 0 turns it off
    assert PoolSettings.model_validate({"size": 2}).max >= 2
    assert PoolSettings.model_validate({"size": 0, "max": 0}).size == 0
    with pytest.raises(ValidationError):
        PoolSettings.model_validate({"size": 5, "max": 2})
