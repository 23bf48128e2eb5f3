"""The composed CLAUDE.md (M5, M7, L6, A2), its safe placement, and heartbeat targets (M4).

Every test composes from a real workspace tree under tmp_path.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from cellgate.errors import UnsafePath
from cellgate.models import HEARTBEAT_CHAT, ConversationKey
from orchestrator.config import MemorySettings
from orchestrator.conversations import conversation_paths, ensure_conversation
from orchestrator.memory import (
    HARD_FILE_CHARS,
    HeartbeatTarget,
    compose_claude_md,
    heartbeat_conversation,
    heartbeat_targets,
    read_text_nofollow,
    write_session_files,
)

ROOT_USER = "ROOT-USER-profile: Alice from before the mode was on"
ROOT_MEMORY = "ROOT-MEMORY: shop order 4471 for Alice"
CHAT_USER = "CHAT-USER: Bob, prefers short answers"
CHAT_MEMORY = "CHAT-MEMORY: Bob's cart holds two mugs"
PERSONA = {
    "AGENTS.md": "AGENTS-TEXT: be helpful",
    "IDENTITY.md": "IDENTITY-TEXT: I am Shopbot",
    "SOUL.md": "SOUL-TEXT: calm and kind",
    "HEARTBEAT.md": "HEARTBEAT-TEXT: check open orders",
    "CLAUDE.md": "TEMPLATE-TEXT: house rules",
}
DEFAULTS = MemorySettings()


@dataclass
class Tree:
    workspace: Path
    chat_dir: Path
    home_dir: Path
    key: ConversationKey


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    ws = tmp_path / "workspace"
    ws.mkdir()
    for name, text in PERSONA.items():
        (ws / name).write_text(text)
    (ws / "USER.md").write_text(ROOT_USER)
    (ws / "MEMORY.md").write_text(ROOT_MEMORY)
    key = ConversationKey("shop-bot", "telegram", "-100200300")
    paths = conversation_paths(tmp_path / "agent", ws, key, "s1")
    (tmp_path / "agent").mkdir()
    ensure_conversation(paths, None, None)
    (paths.chat_dir / "USER.md").write_text(CHAT_USER)
    (paths.chat_dir / "MEMORY.md").write_text(CHAT_MEMORY)
    return Tree(ws, paths.chat_dir, paths.home_dir, key)


def compose(t: Tree, *, isolated: bool, archive: bool, **kw: object) -> str:
    settings = kw.pop("settings", DEFAULTS)
    assert isinstance(settings, MemorySettings)
    return compose_claude_md(t.workspace, t.chat_dir, settings, isolated, archive, **kw)  # type: ignore[arg-type]


# (isolated, archive): what must and must not be in the composed text.
CASES = [
    pytest.param(True, True, id="isolated+archive"),
    pytest.param(True, False, id="isolated-no-archive"),
    pytest.param(False, True, id="shared+archive"),
    pytest.param(False, False, id="shared-no-archive"),
]


@pytest.mark.parametrize(("isolated", "archive"), CASES)
def test_M5_persona_stays_shared_in_every_mode(tree: Tree, isolated: bool, archive: bool) -> None:
    text = compose(tree, isolated=isolated, archive=archive)
    for marker in PERSONA.values():
        assert marker.split(":")[0] in text


@pytest.mark.parametrize(("isolated", "archive"), CASES)
def test_M5_memory_sections_follow_the_mode(tree: Tree, isolated: bool, archive: bool) -> None:
    text = compose(tree, isolated=isolated, archive=archive)
    root_shown = ROOT_USER in text or ROOT_MEMORY in text
    chat_shown = CHAT_USER in text and CHAT_MEMORY in text
    assert root_shown is not isolated
    assert chat_shown is isolated
    if isolated:
        assert CHAT_USER not in text.split("Memory Rule")[0]


@pytest.mark.parametrize(("isolated", "archive"), CASES)
def test_M5_A2_retrieval_note_only_for_shared_agent_with_archive(
    tree: Tree, isolated: bool, archive: bool
) -> None:
    text = compose(tree, isolated=isolated, archive=archive, write_routing=True)
    wanted = archive and not isolated
    assert ("MEMORY RETRIEVAL" in text) is wanted
    assert ("memory_search" in text) is wanted
    assert ("memory/<topic>.md`, where memory_search" in text) is wanted  # write routing


def test_M5_isolated_rule_names_this_conversations_files_only(tree: Tree) -> None:
    text = compose(tree, isolated=True, archive=False)
    shown = f"/workspace/chats/{tree.key.dir_name}"
    assert f"`{shown}/MEMORY.md`" in text and f"`{shown}/USER.md`" in text
    assert "task_memory_append" in text
    assert "Write only to this conversation's files" in text
    other = ConversationKey("shop-bot", "telegram", "999").dir_name
    assert other not in text


def test_L6_isolated_rule_tells_the_agent_to_decline_persona_changes(tree: Tree) -> None:
    text = compose(tree, isolated=True, archive=True)
    assert "decline" in text and "name" in text and "persona" in text
    assert "operator only" in text


def test_M3_empty_conversation_files_never_fall_back_to_root(tree: Tree) -> None:
    (tree.chat_dir / "USER.md").write_text("")
    (tree.chat_dir / "MEMORY.md").unlink()
    text = compose(tree, isolated=True, archive=True)
    assert ROOT_USER not in text and ROOT_MEMORY not in text
    assert text.count("(empty)") == 2


def test_M5_isolated_needs_a_chat_dir(tree: Tree) -> None:
    with pytest.raises(ValueError, match="chat_dir"):
        compose_claude_md(tree.workspace, None, DEFAULTS, True, False)


# M7: (settings, which file is over, expected banner start, expected in text)
BUDGET_CASES = [
    pytest.param(
        MemorySettings(memoryBudgetChars=10), "MEMORY.md", "⚠️ MEMORY.md", id="memory-warn"
    ),
    pytest.param(
        MemorySettings(memoryBudgetChars=10, overBudget="error"),
        "MEMORY.md",
        "🛑 OVER BUDGET: MEMORY.md",
        id="memory-error",
    ),
    pytest.param(
        MemorySettings(userBudgetChars=5, overBudget="loud"),
        "USER.md",
        "⚠️ USER.md",
        id="user-unknown-severity-falls-back-to-warn",
    ),
]


@pytest.mark.parametrize(("settings", "name", "banner"), BUDGET_CASES)
def test_M7_over_budget_file_gets_banner_and_disk_is_untouched(
    tree: Tree, settings: MemorySettings, name: str, banner: str
) -> None:
    path = tree.chat_dir / name
    before_bytes = path.read_bytes()
    os.utime(path, (1_000_000, 1_000_000))
    before = path.stat()
    text = compose(tree, isolated=True, archive=False, settings=settings)
    section = text.split(f"/{name})", 1)[1]
    body = section.split("\n# ", 1)[0]
    assert body.strip().startswith(banner)
    assert (CHAT_MEMORY if name == "MEMORY.md" else CHAT_USER) in body
    after = path.stat()
    assert path.read_bytes() == before_bytes
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)


def test_M7_an_unknown_severity_is_warn_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="orchestrator.config"):
        settings = MemorySettings(overBudget="eror")
    assert settings.over_budget == "warn"
    assert any("'eror'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(MemorySettings(), id="within-budget"),
        pytest.param(MemorySettings(memoryBudgetChars=0, userBudgetChars=0), id="disabled"),
    ],
)
def test_M7_no_banner_within_budget_or_when_disabled(tree: Tree, settings: MemorySettings) -> None:
    (tree.chat_dir / "MEMORY.md").write_text(
        "x" * 9000 if settings.memory_budget_chars == 0 else "y"
    )
    text = compose(tree, isolated=True, archive=False, settings=settings)
    assert "⚠️" not in text and "🛑" not in text


def test_M7_shared_agent_with_archive_core_shrinks_an_over_budget_memory(tree: Tree) -> None:
    (tree.workspace / "MEMORY.md").write_text("## Orders\nlong entry\n## Preferences\nmore\n")
    text = compose(
        tree, isolated=False, archive=True, settings=MemorySettings(memoryBudgetChars=10)
    )
    assert "- ## Orders" in text and "- ## Preferences" in text
    assert "long entry" not in text and "memory_search" in text


def test_M7_isolated_never_core_shrinks(tree: Tree) -> None:
    (tree.chat_dir / "MEMORY.md").write_text("## Orders\nlong entry\n")
    text = compose(tree, isolated=True, archive=True, settings=MemorySettings(memoryBudgetChars=5))
    assert "long entry" in text and "Section index" not in text


def test_hard_cap_truncates_a_huge_file(tree: Tree) -> None:
    (tree.chat_dir / "MEMORY.md").write_text("z" * (HARD_FILE_CHARS + 500))
    text = compose(tree, isolated=True, archive=False)
    assert "[TRUNCATED: 500 more characters not shown]" in text
    assert text.count("z") == HARD_FILE_CHARS


def test_M5_symlink_planted_in_chat_dir_is_not_followed(tree: Tree, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET-CONTENT")
    (tree.chat_dir / "MEMORY.md").unlink()
    (tree.chat_dir / "MEMORY.md").symlink_to(secret)
    (tree.chat_dir / "USER.md").unlink()
    (tree.chat_dir / "USER.md").symlink_to(tree.workspace / "USER.md")
    text = compose(tree, isolated=True, archive=False)
    assert "HOST-SECRET-CONTENT" not in text and ROOT_USER not in text


def test_M5_fifo_planted_in_chat_dir_does_not_hang_compose(tree: Tree) -> None:
    (tree.chat_dir / "MEMORY.md").unlink()
    os.mkfifo(tree.chat_dir / "MEMORY.md")
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(compose(tree, isolated=True, archive=False)))
    t.start()
    t.join(5)
    assert not t.is_alive(), "compose blocked on a FIFO"
    assert CHAT_USER in out[0]


def test_M5_F3_compose_opens_each_directory_once(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persona files come through one descriptor of the workspace, the conversation's
    memory through one of its chat dir (F3: a first turn composes under a burst)."""
    opened: list[str] = []
    real_open = os.open

    def counting(path: object, flags: int, *args: object, **kw: object) -> int:
        if flags & os.O_DIRECTORY and kw.get("dir_fd") is None:
            opened.append(os.fspath(path))  # type: ignore[arg-type]
        return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting)
    text = compose(tree, isolated=True, archive=False)
    assert CHAT_MEMORY in text and "SOUL-TEXT" in text
    assert sorted(opened) == sorted([str(tree.workspace), str(tree.chat_dir)])


def test_M5_R3_a_chat_dir_replaced_by_a_link_leaves_both_memory_files_out(
    tree: Tree, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "USER.md").write_text("OTHER-USER")
    (elsewhere / "MEMORY.md").write_text("OTHER-MEMORY")
    for name in ("USER.md", "MEMORY.md"):
        (tree.chat_dir / name).unlink()
    tree.chat_dir.rmdir()
    tree.chat_dir.symlink_to(elsewhere)
    seen: list[UnsafePath] = []
    text = compose(tree, isolated=True, archive=False, report=seen.append)
    assert "OTHER-USER" not in text and "OTHER-MEMORY" not in text
    assert [e.kind for e in seen] == ["symlink", "symlink"]


def test_read_is_capped(tmp_path: Path) -> None:
    p = tmp_path / "big.md"
    p.write_bytes(b"a" * 5000)
    assert read_text_nofollow(p, cap=100) == "a" * 100
    assert read_text_nofollow(tmp_path / "missing.md") is None


def test_M5_session_claude_md_written_atomically_over_a_planted_symlink(
    tree: Tree, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("do not touch")
    (tree.home_dir / "CLAUDE.md").symlink_to(victim)
    text = compose(tree, isolated=True, archive=False)
    path = write_session_files(tree.home_dir, text)
    assert victim.read_text() == "do not touch"
    assert not path.is_symlink() and path.read_text() == text
    assert [p.name for p in tree.home_dir.iterdir()] == ["CLAUDE.md"]  # no temp file left


def test_M5_session_files_refuse_a_symlinked_home_dir(tree: Tree, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "home-link"
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath):
        write_session_files(link, "text")
    assert list(elsewhere.iterdir()) == []


# M4: heartbeat targets.
A = ConversationKey("shop-bot", "telegram", "1")
B = ConversationKey("shop-bot", "line", "U2")
OTHER_AGENT = ConversationKey("other-bot", "telegram", "1")
HB = heartbeat_conversation("shop-bot")

HEARTBEAT_CASES = [
    pytest.param([], [HeartbeatTarget(HB, live=False)], id="none-live"),
    pytest.param([A], [HeartbeatTarget(A, live=True)], id="one-live"),
    pytest.param(
        [A, B, A], [HeartbeatTarget(A, live=True), HeartbeatTarget(B, live=True)], id="dedup"
    ),
    pytest.param([HB], [HeartbeatTarget(HB, live=False)], id="only-heartbeat-session-live"),
    pytest.param([HB, B], [HeartbeatTarget(B, live=True)], id="heartbeat-session-not-counted"),
    pytest.param([OTHER_AGENT], [HeartbeatTarget(HB, live=False)], id="other-agent-ignored"),
]


@pytest.mark.parametrize(("live", "expected"), HEARTBEAT_CASES)
def test_M4_heartbeat_targets(live: list[ConversationKey], expected: list[HeartbeatTarget]) -> None:
    assert list(heartbeat_targets("shop-bot", live)) == expected


def test_M4_heartbeat_conversation_keeps_a_memory_of_its_own(tmp_path: Path) -> None:
    assert HB.chat_id == HEARTBEAT_CHAT
    paths = conversation_paths(tmp_path / "agent", tmp_path / "ws", HB, "s1")
    assert paths.chat_dir.name == HB.dir_name
    assert (
        paths.chat_dir != conversation_paths(tmp_path / "agent", tmp_path / "ws", A, "s1").chat_dir
    )
