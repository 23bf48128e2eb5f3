"""Conversation keys and directories (M1-M3): stable, safe for any chat id, never seeded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cellgate.errors import ConversationError
from cellgate.models import ConversationKey
from orchestrator.conversations import conversation_paths, ensure_conversation

HOSTILE_IDS = [
    "-1001234567890",
    "U4af4980629e6fd3f6a52b3c1e2e9fd4a",
    "../../etc",
    "..",
    "a/b\\c",
    "nul\x00byte",
    "x" * 4096,
    "日本語のチャット",
    " spaced out ",
    ".hidden",
]


@pytest.mark.parametrize("chat_id", HOSTILE_IDS)
def test_M1_dir_name_is_one_safe_path_segment(chat_id: str) -> None:
    key = ConversationKey("bot", "telegram", chat_id)
    for name in (key.dir_name, key.media_dir_name("s1")):
        assert "/" not in name and "\\" not in name and "\x00" not in name
        assert name not in (".", "..") and not name.startswith(".")
        assert len(name.encode()) <= 80
        assert name.startswith("telegram-")


def test_M1_dir_name_is_stable_and_distinct() -> None:
    a = ConversationKey("bot", "telegram", "a/b")
    assert a.dir_name == ConversationKey("bot", "telegram", "a/b").dir_name
    # Same slug after sanitising, different chats: the hash keeps them apart.
    assert a.dir_name != ConversationKey("bot", "telegram", "a_b").dir_name
    assert a.media_dir_name("s") != ConversationKey("bot", "telegram", "a_b").media_dir_name("s")
    # Same chat id on two channels: two conversations.
    assert a.dir_name != ConversationKey("bot", "line", "a/b").dir_name


def test_M1_media_dir_names_follow_the_seed() -> None:
    assert ConversationKey("b", "telegram", "-100123").media_dir_name("s") == "telegram--100123"
    assert ConversationKey("b", "api", "anything/../x").media_dir_name("sess-1") == "api-sess-1"
    with pytest.raises(ConversationError):
        ConversationKey("b", "api", "x").media_dir_name("../up")


@pytest.mark.parametrize("channel", ["", "Telegram", "tele-gram", "../x", "a" * 17])
def test_bad_channel_names_are_refused(channel: str) -> None:
    with pytest.raises(ConversationError):
        ConversationKey("b", channel, "1")


def test_empty_and_oversized_chat_ids_are_refused() -> None:
    with pytest.raises(ConversationError):
        ConversationKey("b", "api", "")
    with pytest.raises(ConversationError):
        ConversationKey("b", "api", "x" * 5000)


def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    ws = tmp_path / "agents" / "bot" / "workspace"
    ws.mkdir(parents=True)
    (ws / "USER.md").write_text("root user profile: Alice, lives in Paris\n")
    (ws / "MEMORY.md").write_text("root memory: secret plans\n")
    return tmp_path / "agents" / "bot", ws


def test_M3_new_conversation_starts_empty_never_seeded(tmp_path: Path) -> None:
    root, ws = _workspace(tmp_path)
    paths = conversation_paths(root, ws, ConversationKey("bot", "telegram", "42"), "s1")
    ensure_conversation(paths, None, None)
    assert paths.chat_dir == ws / "chats" / ConversationKey("bot", "telegram", "42").dir_name
    assert (paths.chat_dir / "USER.md").read_text() == ""
    assert (paths.chat_dir / "MEMORY.md").read_text() == ""
    assert paths.media_dir == ws / "media" / "telegram-42"
    assert paths.home_dir == root / "sandbox-homes" / paths.chat_dir.name
    assert paths.media_dir.is_dir() and paths.home_dir.is_dir()


def test_M1_existing_memory_is_kept_on_second_ensure(tmp_path: Path) -> None:
    root, ws = _workspace(tmp_path)
    paths = conversation_paths(root, ws, ConversationKey("bot", "api", "c"), "s1")
    ensure_conversation(paths, None, None)
    (paths.chat_dir / "MEMORY.md").write_text("likes tea\n")
    ensure_conversation(paths, None, None)
    assert (paths.chat_dir / "MEMORY.md").read_text() == "likes tea\n"


def test_M1_symlinked_conversation_dir_is_refused(tmp_path: Path) -> None:
    root, ws = _workspace(tmp_path)
    key = ConversationKey("bot", "api", "c")
    (ws / "chats").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, ws / "chats" / key.dir_name)
    with pytest.raises(ConversationError):
        ensure_conversation(conversation_paths(root, ws, key, "s1"), None, None)
    assert list(elsewhere.iterdir()) == []


def test_M1_symlinked_memory_file_is_not_followed(tmp_path: Path) -> None:
    root, ws = _workspace(tmp_path)
    key = ConversationKey("bot", "api", "c")
    paths = conversation_paths(root, ws, key, "s1")
    ensure_conversation(paths, None, None)
    target = tmp_path / "outside.txt"
    target.write_text("keep me")
    (paths.chat_dir / "MEMORY.md").unlink()
    os.symlink(target, paths.chat_dir / "MEMORY.md")
    ensure_conversation(paths, None, None)  # left out with a log line, never followed
    assert target.read_text() == "keep me"
    assert (paths.chat_dir / "MEMORY.md").is_symlink(), "the planted link is left untouched"
