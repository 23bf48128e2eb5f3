"""orchestrator.safefs against one table of hostile cases, on real directories (P5, M6, D3, R3).

Every row plants something a sandbox could plant in a directory it writes,
then runs every operation the gateway does there (read, open, append,
ensure, copy, atomic write), each in a thread with a deadline: a blocked
call fails the test instead of hanging it. Nothing outside the directory may
be read, written or created.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cellgate.errors import UnsafePath
from cellgate.models import ConversationKey
from orchestrator.config import MemorySettings
from orchestrator.conversations import conversation_paths, ensure_conversation
from orchestrator.memory import compose_claude_md
from orchestrator.safefs import SafeDir, audit_left_out
from orchestrator.store import Store, conversation_id
from orchestrator.transcripts import (
    append_transcript,
    load_session_id,
    recent_history,
    save_session_id,
)

SECRET = b"SECRET-OUTSIDE-THE-SANDBOX"
DEADLINE = 5.0


@dataclass
class Tree:
    base: Path
    outside: Path
    secret: Path


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    base = tmp_path / "chat"
    outside = tmp_path / "outside"
    base.mkdir()
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_bytes(SECRET)
    return Tree(base, outside, secret)


def _bounded(fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` in a daemon thread; fail (never hang) if it is not done within DEADLINE."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test thread below
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), f"{what} blocked for {DEADLINE} s"
    if err:
        raise err[0]
    return out[0] if out else None


# -- the table ---------------------------------------------------------------------------


def _symlink_out(t: Tree) -> str:
    (t.base / "x").symlink_to(t.secret)
    return "x"


def _dangling_symlink(t: Tree) -> str:
    (t.base / "x").symlink_to(t.outside / "created-by-attacker")
    return "x"


def _symlink_dir_component(t: Tree) -> str:
    (t.base / "d").symlink_to(t.outside, target_is_directory=True)
    return "d/secret.txt"


def _hardlink(t: Tree) -> str:
    os.link(t.secret, t.base / "x")
    return "x"


def _fifo(t: Tree) -> str:
    os.mkfifo(t.base / "x")
    return "x"


def _socket(t: Tree) -> str:
    s = socket.socket(socket.AF_UNIX)
    s.bind(f"{t.base}/x")
    s.close()  # the socket file stays
    return "x"


def _char_device(t: Tree) -> str:
    try:
        os.mknod(t.base / "x", 0o600 | 0o020000, os.makedev(1, 3))  # /dev/null
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD (root)")
    return "x"


def _directory(t: Tree) -> str:
    (t.base / "x").mkdir()
    return "x"


def _dotdot(t: Tree) -> str:
    return "../outside/secret.txt"


def _inner_dotdot(t: Tree) -> str:
    (t.base / "sub").mkdir()
    return "sub/../../outside/secret.txt"


def _absolute(t: Tree) -> str:
    return str(t.secret)


def _nul(t: Tree) -> str:
    return "x\0y"


# (id, setup, kind any operation reports, kind write_atomic reports; None = it replaces the entry)
HOSTILE: list[tuple[str, Callable[[Tree], str], str, str | None]] = [
    ("symlink-to-outside", _symlink_out, "symlink", None),
    ("dangling-symlink", _dangling_symlink, "symlink", None),
    ("symlink-dir-component", _symlink_dir_component, "symlink", "escape"),
    ("hardlink-to-outside", _hardlink, "hardlink", None),
    ("fifo", _fifo, "fifo", None),
    ("socket", _socket, "socket", None),
    ("char-device", _char_device, "device", None),
    ("directory-for-a-file", _directory, "dir", "dir"),
    ("dotdot", _dotdot, "escape", "escape"),
    ("inner-dotdot", _inner_dotdot, "escape", "escape"),
    ("absolute", _absolute, "escape", "escape"),
    ("nul-byte", _nul, "escape", "escape"),
]


def _operations(d: SafeDir, rel: str, spool: SafeDir) -> dict[str, Callable[[], Any]]:
    def copy() -> int:
        with d.open_file(rel, max_size=1 << 20) as f:
            return f.copy_into(spool, "copy")

    return {
        "read": lambda: d.read(rel),
        "read-tail": lambda: d.read(rel, tail=True),
        "open": lambda: d.open_file(rel, max_size=1 << 20).close(),
        "append": lambda: d.append(rel, b"pwned\n"),  # plain names only: a path is refused
        "ensure": lambda: d.ensure_file(rel),
        "copy": copy,
    }


@pytest.mark.parametrize(
    ("setup", "kind", "atomic_kind"),
    [pytest.param(s, k, a, id=i) for i, s, k, a in HOSTILE],
)
def test_P5_M6_D3_hostile_table(
    tree: Tree, tmp_path: Path, setup: Callable[[Tree], str], kind: str, atomic_kind: str | None
) -> None:
    """covers: P5, M6, D3, R3 - every operation refuses, never blocks, never touches outside."""
    rel = setup(tree)
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    with SafeDir.open(tree.base) as d, SafeDir.trusted(spool_dir) as spool:
        for what, op in _operations(d, rel, spool).items():
            plain_only = what in ("append", "ensure") and "/" in rel.strip("/")
            expected = "escape" if plain_only else kind
            with pytest.raises(UnsafePath) as info:
                _bounded(op, f"{what} of {rel!r}")
            assert info.value.kind == expected, (what, info.value)
            assert str(tree.base) not in str(info.value), "no host path in the message"
        if "/" not in rel and "\0" not in rel and rel not in ("..", "."):
            if atomic_kind is None:
                _bounded(lambda: d.write_atomic(rel, b"fresh"), "write_atomic")
                assert (tree.base / rel).read_bytes() == b"fresh"
                assert not (tree.base / rel).is_symlink()
            else:
                with pytest.raises(UnsafePath) as info:
                    d.write_atomic(rel, b"fresh")
                assert info.value.kind == atomic_kind
        else:
            with pytest.raises(UnsafePath):
                d.write_atomic(rel, b"fresh")
    assert tree.secret.read_bytes() == SECRET
    assert sorted(p.name for p in tree.outside.iterdir()) == ["secret.txt"], "nothing created"
    assert list(spool_dir.iterdir()) == [], "no partial copy is left"


def test_missing_file_reads_as_none_and_opens_as_not_found(tree: Tree) -> None:
    (tree.base / "f").write_bytes(b"a file, not a directory")
    with SafeDir.open(tree.base) as d:
        assert d.read("nope") is None
        assert d.read("f/x") is None  # a file where a directory was named: nothing there
        with pytest.raises(FileNotFoundError):
            d.open_file("nope", max_size=10)


def test_symlinked_base_directory_is_refused(tree: Tree, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tree.outside, target_is_directory=True)
    with pytest.raises(UnsafePath) as info:
        SafeDir.open(link)
    assert info.value.kind == "symlink"


def test_R3_huge_sparse_file_is_read_only_up_to_the_cap(tree: Tree, tmp_path: Path) -> None:
    """covers: R3, D3 - a 1 TB sparse transcript costs one capped read, and is never copied."""
    with open(tree.base / "big", "wb") as fh:
        fh.truncate(1 << 40)
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    started = time.monotonic()
    with SafeDir.open(tree.base) as d, SafeDir.trusted(spool_dir) as spool:
        assert _bounded(lambda: d.read("big", cap=4096), "head read") == b"\0" * 4096
        assert _bounded(lambda: d.read("big", cap=4096, tail=True), "tail read") == b"\0" * 4096
        with pytest.raises(UnsafePath) as info:
            d.open_file("big", max_size=50 << 20)
        assert info.value.kind == "too_large"
        with d.open_file("big", max_size=2 << 40) as f:
            assert f.sparse
            with pytest.raises(UnsafePath) as info:
                f.copy_into(spool, "copy")
            assert info.value.kind == "sparse"
    assert time.monotonic() - started < 2.0
    assert list(spool_dir.iterdir()) == []


def test_P5_swap_race_never_yields_outside_bytes(tree: Tree) -> None:
    """covers: P5 - a thread flips x between a regular file and a symlink out; reads never leak."""
    stop = threading.Event()

    def flip() -> None:
        i = 0
        while not stop.is_set():
            tmp = tree.base / f".t{i % 2}"
            if i % 2:
                tmp.write_bytes(b"PUBLIC")
            else:
                tmp.symlink_to(tree.secret)
            os.replace(tmp, tree.base / "x")
            i += 1

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    seen = {"ok": 0, "refused": 0}
    try:
        with SafeDir.open(tree.base) as d:
            for _ in range(2000):
                try:
                    data = d.read("x")
                except UnsafePath as exc:
                    # a rename seen mid-way may show two links for an instant: refused too
                    assert exc.kind in ("symlink", "swapped", "hardlink"), exc
                    seen["refused"] += 1
                else:
                    assert data in (b"PUBLIC", b"", None), data
                    seen["ok"] += 1
    finally:
        stop.set()
        t.join()
    assert seen["refused"] > 0 and seen["ok"] > 0, seen
    assert tree.secret.read_bytes() == SECRET


@pytest.mark.parametrize("op", ["read", "append"])
def test_P5_flip_and_back_during_open_is_a_swap(
    tree: Tree, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5: a path that is a symlink at the open and regular again at the look after is 'swapped'.

    The flip happens inside os.open (the window the race test hits by chance); a
    file the sandbox keeps from being opened (a lease) is refused; the gateway's own
    shortage (no descriptors left) is raised as it is.
    """
    import errno

    import orchestrator.safefs as safefs

    (tree.base / "x").write_bytes(b"PUBLIC")
    real_open = os.open
    failures = [
        OSError(errno.ELOOP, "flipped"),
        OSError(errno.EWOULDBLOCK, "a lease"),
        OSError(errno.EMFILE, "no descriptors left"),
    ]

    def flipping_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if path == "x" and failures:
            raise failures.pop(0)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(safefs.os, "open", flipping_open)
    with SafeDir.open(tree.base) as d:
        run = (lambda: d.read("x")) if op == "read" else (lambda: d.append("x", b"!"))
        with pytest.raises(UnsafePath) as refused:
            run()
        assert refused.value.kind == "swapped"
        with pytest.raises(UnsafePath) as leased:  # the sandbox holds a lease on it
            run()
        assert leased.value.kind == "unopenable"
        with pytest.raises(OSError) as plain:
            run()
        assert not isinstance(plain.value, UnsafePath) and plain.value.errno == errno.EMFILE


def test_M6_append_creates_and_appends_without_a_link(tree: Tree) -> None:
    with SafeDir.open(tree.base) as d:
        assert d.append("MEMORY.md", b"a\n") == 2
        d.append("MEMORY.md", b"b\n")
        d.ensure_file("MEMORY.md")  # kept as it is
    assert (tree.base / "MEMORY.md").read_bytes() == b"a\nb\n"


def test_atomic_write_leaves_no_temp_file(tree: Tree) -> None:
    with SafeDir.open(tree.base) as d:
        d.write_atomic("session.json", b"{}")
        d.write_atomic("session.json", b'{"a": 1}')
    assert [p.name for p in tree.base.iterdir()] == ["session.json"]
    assert (tree.base / "session.json").read_bytes() == b'{"a": 1}'


def test_D3_F3_session_id_is_replaced_whole_without_an_fsync(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """session.json names a harness session whose own files nothing syncs: it is written
    without the two fsyncs (file and directory) a durable write waits for, still whole
    and atomic (a temp file renamed over it), and a torn or missing one reads as no id."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    assert save_session_id(tree.base, "s1", "h1")
    assert save_session_id(tree.base, "s1", "h2")
    assert synced == []
    assert load_session_id(tree.base) == "h2"
    assert [p.name for p in tree.base.iterdir()] == ["session.json"]
    (tree.base / "session.json").write_bytes(b'{"session": "s1", "harn')  # torn
    assert load_session_id(tree.base) is None
    with SafeDir.open(tree.base) as d:
        d.write_atomic("other.json", b"{}")  # a durable write still syncs both
    assert len(synced) == 2


def test_mkdirs_never_walks_through_a_link(tree: Tree) -> None:
    (tree.base / "m").symlink_to(tree.outside, target_is_directory=True)
    with SafeDir.open(tree.base) as d:
        with pytest.raises(UnsafePath):
            d.mkdirs("m/new")
        d.mkdirs("a/b/c")
    assert (tree.base / "a" / "b" / "c").is_dir()
    assert not (tree.outside / "new").exists()


def test_F3_mkdirs_makes_only_what_is_missing(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dir that is there costs one open, no `mkdir` (F3: every turn walks its
    conversation's dirs); a link or a file in the way is still refused."""
    (tree.base / "a" / "b").mkdir(parents=True)
    (tree.base / "f").write_text("x")
    (tree.base / "m").symlink_to(tree.outside, target_is_directory=True)
    made: list[object] = []
    real_mkdir = os.mkdir

    def mkdir(path: object, *args: object, **kw: object) -> None:
        made.append(path)
        real_mkdir(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", mkdir)
    with SafeDir.open(tree.base) as d:
        d.mkdirs("a/b")
        assert made == []
        d.mkdirs("a/b/c/d")
        assert made == ["c", "d"]
        for bad in ("m/x", "f/x", "f"):
            with pytest.raises(UnsafePath):
                d.mkdirs(bad)
    assert (tree.base / "a" / "b" / "c" / "d").is_dir() and not (tree.outside / "x").exists()


# -- the gateway's own calls, with a FIFO planted in place of each file --------------------


def _conversation(tmp_path: Path) -> Any:
    root = tmp_path / "agents" / "bot"
    ws = root / "workspace"
    ws.mkdir(parents=True)
    paths = conversation_paths(root, ws, ConversationKey("bot", "telegram", "42"), "s1")
    ensure_conversation(paths, None, None)
    return paths


FIFO_NAMES = ["MEMORY.md", "USER.md", "transcript.jsonl", "session.json"]


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_R3_M5_D3_fifo_planted_never_blocks_the_gateway(tmp_path: Path, name: str) -> None:
    """covers: M5, D3, R3 - `rm X && mkfifo X` in a chat dir; every gateway call returns."""
    paths = _conversation(tmp_path)
    target = paths.chat_dir / name
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    settings = MemorySettings()
    calls: dict[str, Callable[[], Any]] = {
        "ensure_conversation": lambda: ensure_conversation(paths, os.geteuid() + 1, None),
        "compose_claude_md": lambda: compose_claude_md(
            paths.workspace, paths.chat_dir, settings, True, False
        ),
        "append_transcript": lambda: append_transcript(paths.chat_dir, [{"role": "user"}]),
        "recent_history": lambda: recent_history(paths.chat_dir),
        "load_session_id": lambda: load_session_id(paths.chat_dir),
        "save_session_id": lambda: save_session_id(paths.chat_dir, "s1", "h1"),
    }
    for what, call in calls.items():
        _bounded(call, f"{what} with a FIFO as {name}")
    if name == "session.json":
        assert load_session_id(paths.chat_dir) == "h1"  # the FIFO was replaced, not written
    else:
        assert os.path.exists(target) and not os.path.isfile(target), "the FIFO is left as is"


def test_left_out_file_is_logged_and_recorded_as_an_audit_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """covers: D3, M5 - a file left out: a log line without a host path, and an audit row."""
    paths = _conversation(tmp_path)
    (paths.chat_dir / "MEMORY.md").unlink()
    os.mkfifo(paths.chat_dir / "MEMORY.md")
    store = Store.open(tmp_path / "state")
    key = ConversationKey("bot", "telegram", "42")
    conv = store.upsert_conversation(key)
    report = audit_left_out(store, conv.id, "M5")
    with caplog.at_level("WARNING"):
        text = compose_claude_md(
            paths.workspace, paths.chat_dir, MemorySettings(), True, False, report=report
        )
    assert "(empty)" in text
    try:
        [row] = store.refusals(conversation_id(key))
    finally:
        store.close()
    assert (row.rule, row.action) == ("M5", "file_left_out")
    assert "fifo" in row.reason or "named pipe" in row.reason
    assert str(tmp_path) not in row.reason
    assert any("MEMORY.md" in r.getMessage() for r in caplog.records)
    assert all(str(tmp_path) not in r.getMessage() for r in caplog.records)
