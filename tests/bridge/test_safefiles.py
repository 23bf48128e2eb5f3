"""safefiles on real directories: every P5 refusal; memory appends never follow a link (M6)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from cellgate.errors import PolicyDenied
from orchestrator.bridge.safefiles import append_memory, open_media_file

IN_SANDBOX = "/workspace/media/telegram-42"


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    media = tmp_path / "workspace" / "media" / "telegram-42"
    other = tmp_path / "workspace" / "media" / "telegram-77"
    chat = tmp_path / "workspace" / "chats" / "telegram-42-x"
    for d in (media, other, chat):
        d.mkdir(parents=True)
    (media / "a.png").write_bytes(b"PNG-A")
    (media / "sub").mkdir()
    (media / "sub" / "b.txt").write_bytes(b"B")
    secret = other / "secret.txt"
    secret.write_bytes(b"SECRET-OF-CHAT-77")
    (chat / "MEMORY.md").write_text("")
    return {"media": media, "other": other, "chat": chat, "secret": secret, "root": tmp_path}


def _open(tree: dict[str, Path], requested: str, **kw: int) -> bytes:
    with open_media_file(tree["media"], requested, IN_SANDBOX, **kw) as f:
        return f.read()


def _refused(tree: dict[str, Path], requested: str, needle: str, **kw: int) -> None:
    with pytest.raises(PolicyDenied) as info:
        _open(tree, requested, **kw)
    assert info.value.rule == "P5"
    assert needle in info.value.reason, info.value.reason


def test_P5_opens_relative_and_absolute_in_sandbox_paths(tree: dict[str, Path]) -> None:
    assert _open(tree, "a.png") == b"PNG-A"
    assert _open(tree, f"{IN_SANDBOX}/a.png") == b"PNG-A"
    assert _open(tree, "./sub/b.txt") == b"B"
    assert _open(tree, f"{IN_SANDBOX}//sub/./b.txt") == b"B"


@pytest.mark.parametrize(
    ("requested", "needle"),
    [
        ("../telegram-77/secret.txt", "'..'"),
        ("sub/../../telegram-77/secret.txt", "'..'"),
        ("/etc/passwd", "outside"),
        ("/workspace/media/telegram-77/secret.txt", "outside"),
        ("/workspace/media/telegram-42x/a.png", "outside"),
        ("a.png\0.txt", "NUL"),
        ("", "empty"),
        (IN_SANDBOX, "outside"),
        (".", "media directory itself"),
        ("missing.png", "does not exist"),
        ("nodir/missing.png", "does not exist"),
        ("a.png/b", "does not exist"),
        ("sub", "a directory"),
    ],
)
def test_P5_refuses_paths(tree: dict[str, Path], requested: str, needle: str) -> None:
    _refused(tree, requested, needle)


def test_P5_refuses_final_symlink_out(tree: dict[str, Path]) -> None:
    (tree["media"] / "link.txt").symlink_to(tree["secret"])
    _refused(tree, "link.txt", "symbolic link")


def test_P5_refuses_symlink_inside_the_media_dir_too(tree: dict[str, Path]) -> None:
    (tree["media"] / "alias.png").symlink_to("a.png")
    _refused(tree, "alias.png", "symbolic link")


def test_P5_refuses_intermediate_symlink(tree: dict[str, Path]) -> None:
    (tree["media"] / "dirlink").symlink_to(tree["other"])
    _refused(tree, "dirlink/secret.txt", "symbolic link")


def test_P5_refuses_dangling_symlink(tree: dict[str, Path]) -> None:
    (tree["media"] / "dangling").symlink_to(tree["root"] / "nowhere")
    _refused(tree, "dangling", "symbolic link")


def test_P5_refuses_hardlink_to_a_file_outside(tree: dict[str, Path]) -> None:
    os.link(tree["secret"], tree["media"] / "hard.txt")
    _refused(tree, "hard.txt", "hard link")


def test_P5_refuses_fifo_without_blocking(tree: dict[str, Path]) -> None:
    os.mkfifo(tree["media"] / "pipe")
    _refused(tree, "pipe", "named pipe")


def test_P5_refuses_unix_socket(tree: dict[str, Path]) -> None:
    s = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(tree["media"])  # socket paths are short; bind relative to the dir
    try:
        s.bind("sock")
    finally:
        os.chdir(cwd)
    try:
        _refused(tree, "sock", "a socket")
    finally:
        s.close()


def test_P5_refuses_device(tree: dict[str, Path]) -> None:
    try:
        os.mknod(tree["media"] / "null", 0o600 | 0o020000, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    _refused(tree, "null", "a device")


def test_P5_refuses_file_over_the_cap(tree: dict[str, Path]) -> None:
    (tree["media"] / "big.bin").write_bytes(b"x" * 2048)
    _refused(tree, "big.bin", "over the limit", max_size=1024)
    assert len(_open(tree, "big.bin", max_size=4096)) == 2048


def test_P5_bytes_come_from_the_checked_descriptor(tree: dict[str, Path]) -> None:
    """A swap after the check changes nothing: the open descriptor is the regular file."""
    media = tree["media"]
    (media / "x.txt").write_bytes(b"REGULAR")
    with open_media_file(media, "x.txt", IN_SANDBOX) as f:
        os.unlink(media / "x.txt")
        (media / "x.txt").symlink_to(tree["secret"])
        assert f.read() == b"REGULAR"


def test_P5_swap_race_never_leaks(tree: dict[str, Path]) -> None:
    """A thread flips x between a regular file and a symlink out; no open ever leaks."""
    media = tree["media"]
    stop = threading.Event()

    def flip() -> None:
        i = 0
        while not stop.is_set():
            tmp = media / f".t{i % 2}"
            if i % 2:
                tmp.write_bytes(b"PUBLIC")
            else:
                tmp.symlink_to(tree["secret"])
            os.replace(tmp, media / "x")
            i += 1

    t = threading.Thread(target=flip)
    t.start()
    outcomes = {"ok": 0, "refused": 0}
    try:
        for i in range(50_000):  # at least 500 opens, and until the race showed both faces
            if i >= 500 and all(outcomes.values()):
                break
            time.sleep(0)  # let the flipper run between opens, even on a loaded machine
            try:
                data = _open(tree, "x")
            except PolicyDenied as exc:
                assert exc.rule == "P5"
                outcomes["refused"] += 1
            else:
                assert b"SECRET" not in data
                assert data in (b"PUBLIC", b"")
                outcomes["ok"] += 1
    finally:
        stop.set()
        t.join()
    assert outcomes["refused"] > 0, outcomes


# -- M6: memory appends ------------------------------------------------------


def test_M6_appends_with_a_newline(tree: dict[str, Path]) -> None:
    assert append_memory(tree["chat"], "MEMORY.md", "likes tea") == len("likes tea\n")
    append_memory(tree["chat"], "MEMORY.md", "lives in Oslo\n")
    assert (tree["chat"] / "MEMORY.md").read_text() == "likes tea\nlives in Oslo\n"


def test_M6_creates_a_missing_file(tree: dict[str, Path]) -> None:
    append_memory(tree["chat"], "USER.md", "name: Ada")
    assert (tree["chat"] / "USER.md").read_text() == "name: Ada\n"


def test_M6_never_follows_a_planted_symlink(tree: dict[str, Path]) -> None:
    memory = tree["chat"] / "MEMORY.md"
    memory.unlink()
    memory.symlink_to(tree["secret"])
    with pytest.raises(PolicyDenied) as info:
        append_memory(tree["chat"], "MEMORY.md", "pwned")
    assert info.value.rule == "M6"
    assert "symbolic link" in info.value.reason
    assert tree["secret"].read_bytes() == b"SECRET-OF-CHAT-77"


def test_M6_never_follows_a_dangling_symlink(tree: dict[str, Path]) -> None:
    memory = tree["chat"] / "MEMORY.md"
    memory.unlink()
    target = tree["root"] / "created-by-attacker"
    memory.symlink_to(target)
    with pytest.raises(PolicyDenied):
        append_memory(tree["chat"], "MEMORY.md", "pwned")
    assert not target.exists()


def test_M6_refuses_a_hardlinked_memory_file(tree: dict[str, Path]) -> None:
    memory = tree["chat"] / "MEMORY.md"
    memory.unlink()
    os.link(tree["secret"], memory)
    with pytest.raises(PolicyDenied) as info:
        append_memory(tree["chat"], "MEMORY.md", "pwned")
    assert "hard link" in info.value.reason
    assert tree["secret"].read_bytes() == b"SECRET-OF-CHAT-77"


def test_M6_refuses_a_fifo_memory_file(tree: dict[str, Path]) -> None:
    memory = tree["chat"] / "MEMORY.md"
    memory.unlink()
    os.mkfifo(memory)
    with pytest.raises(PolicyDenied) as info:
        append_memory(tree["chat"], "MEMORY.md", "x")
    assert "named pipe" in info.value.reason or "fifo" in info.value.reason
