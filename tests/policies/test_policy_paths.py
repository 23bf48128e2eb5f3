"""P5: files a tool sends must be regular, unlinked files inside the media directory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.base import Decision
from policies.paths import FileFacts, decide, normalize_request

MEDIA = "/srv/agents/a/workspace/media/telegram-42"
GOOD = FileFacts(
    requested="a.png",
    media_dir=MEDIA,
    resolved=f"{MEDIA}/a.png",
    kind="regular",
    nlink=1,
    symlink_in_path=False,
    size=1000,
)


@pytest.mark.parametrize(
    ("changes", "allowed", "needle"),
    [
        ({}, True, ""),
        ({"requested": "sub/a.png", "resolved": f"{MEDIA}/sub/a.png"}, True, ""),
        ({"requested": f"{MEDIA}/a.png"}, True, ""),  # absolute inside
        ({"requested": f"{MEDIA}//./a.png"}, True, ""),
        ({"max_size": 1000}, True, ""),  # at the cap is fine
        ({"requested": ""}, False, "empty"),
        ({"requested": "a\0.png"}, False, "NUL"),
        ({"requested": "../telegram-43/a.png"}, False, "'..'"),
        ({"requested": "sub/../a.png"}, False, "'..'"),  # even when it stays inside
        ({"requested": ".."}, False, "'..'"),
        ({"requested": "/etc/passwd"}, False, "outside"),
        ({"requested": f"{MEDIA}1/a.png"}, False, "outside"),  # sibling with same prefix
        ({"requested": MEDIA}, False, "outside"),  # the directory itself
        ({"resolved": "/etc/passwd"}, False, "resolves outside"),
        ({"resolved": f"{MEDIA}1/a.png"}, False, "resolves outside"),
        ({"resolved": MEDIA, "kind": "dir"}, False, "resolves outside"),
        ({"resolved": None}, False, "could not be resolved"),
        ({"kind": "symlink"}, False, "symbolic link"),
        ({"symlink_in_path": True}, False, "symbolic link"),
        ({"kind": "missing"}, False, "does not exist"),
        ({"kind": "dir"}, False, "a directory"),
        ({"kind": "fifo"}, False, "named pipe"),
        ({"kind": "socket"}, False, "socket"),
        ({"kind": "device"}, False, "device"),
        ({"nlink": 2}, False, "hard link"),
        ({"nlink": 0}, False, "hard link"),
        ({"size": -1}, False, "negative"),
        ({"max_size": 999}, False, "over the limit"),
        ({"media_dir": "media/telegram-42"}, False, "not an absolute"),
        ({"media_dir": "/srv/../etc"}, False, "not an absolute"),
    ],
)
def test_P5_file_facts_table(changes: dict[str, object], allowed: bool, needle: str) -> None:
    d = decide(replace(GOOD, **changes))  # type: ignore[arg-type]
    assert d.rule == "P5"
    assert d.allowed is allowed, d.reason
    assert needle in d.reason


def test_P5_refusal_says_what_to_do_instead() -> None:
    d = decide(replace(GOOD, symlink_in_path=True))
    assert "regular file" in d.reason and "media directory" in d.reason


SANDBOX_MEDIA = "/workspace/media/telegram-42"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("a.png", "a.png"),
        ("./a.png", "a.png"),
        ("sub/a.png", "sub/a.png"),
        ("sub//a.png", "sub/a.png"),
        ("/workspace/media/telegram-42/a.png", "a.png"),
        ("/workspace/media/telegram-42/sub/a.png", "sub/a.png"),
        ("//workspace/media//telegram-42/./a.png", "a.png"),
        ("/workspace/media/telegram-421/a.png", None),  # same prefix, other chat
        ("/workspace/media/telegram-43/a.png", None),
        ("/workspace/media/telegram-42", None),  # the directory itself
        ("/workspace/media/telegram-42/", None),
        (".", None),
        ("", None),
        ("/etc/passwd", None),
        ("/workspace/chats/x/MEMORY.md", None),
        ("../telegram-43/a.png", None),
        ("/workspace/media/telegram-42/../telegram-43/a.png", None),
        ("a.png\0.txt", None),
    ],
)
def test_P5_normalize_request_table(path: str, expected: str | None) -> None:
    got = normalize_request(path, SANDBOX_MEDIA)
    if expected is None:
        assert isinstance(got, Decision)
        assert not got.allowed and got.rule == "P5"
    else:
        assert got == expected


def test_P5_normalize_request_refuses_relative_media_dir() -> None:
    got = normalize_request("a.png", "workspace/media/x")
    assert isinstance(got, Decision) and not got.allowed
