"""The memory archive (A1, A2, T2): kb.sqlite over MEMORY.md, USER.md and memory/*.md.

Real files, real SQLite FTS5. The memory files are sandbox-writable, so the
hostile cases plant what a sandbox could: a FIFO, symlinks (to a file and to
a directory), a hard link, a huge sparse file, a flood of entries.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from cellgate.errors import PolicyDenied
from orchestrator.archive import excerpt, kb_path, refresh, refresh_at_spawn, search
from orchestrator.archive import index as archive_index


@pytest.fixture
def state(tmp_path: Path) -> Path:
    ws = tmp_path / "agents" / "bot" / "workspace"
    (ws / "memory").mkdir(parents=True)
    (ws / "MEMORY.md").write_text("# Memory\n\nThe user likes green tea.\n")
    (ws / "USER.md").write_text("# User\n\nName: Somchai\nLives in Chiang Mai.\n")
    (ws / "memory" / "projects.md").write_text(
        "# Projects\n\n## Garden\nplanted basil on Monday\n\n## Boat\n"
        "the boat engine needs a new impeller\nordered from the marina shop\n"
    )
    return tmp_path


def ws_of(state: Path) -> Path:
    return state / "agents" / "bot" / "workspace"


def test_A1_search_finds_ranked_snippets_with_file_and_line(state: Path) -> None:
    kb = kb_path(state, "bot")
    stats = refresh(kb, ws_of(state))
    assert (stats.files, stats.read, stats.left_out) == (3, 3, 0)
    [hit] = search(kb, "impeller")
    assert (hit.file, hit.line) == ("memory/projects.md", 7)
    assert "[impeller]" in hit.snippet
    [hit] = search(kb, "Chiang Mai")
    assert (hit.file, hit.line) == ("USER.md", 4)
    hits = search(kb, "boat marina")  # all words in one chunk
    assert hits[0].file == "memory/projects.md"
    assert search(kb, "basil OR NEAR( drop") != []  # FTS syntax in a query is just words
    assert search(kb, "nothing-like-this") == []
    assert not str(kb).startswith(str(ws_of(state)))  # never inside the workspace


def test_A1_refresh_is_incremental_and_follows_removals(state: Path) -> None:
    kb = kb_path(state, "bot")
    refresh(kb, ws_of(state))
    again = refresh(kb, ws_of(state))
    assert again.read == 0  # nothing changed: nothing read again
    (ws_of(state) / "memory" / "projects.md").unlink()
    (ws_of(state) / "memory" / "trip.md").write_text("flight to Osaka on Friday\n")
    later = refresh(kb, ws_of(state))
    assert (later.read, later.removed) == (1, 1)
    assert search(kb, "impeller") == []
    assert [h.file for h in search(kb, "Osaka")] == ["memory/trip.md"]


def test_R3_hostile_memory_files_are_left_out_never_followed_or_waited_on(
    state: Path, tmp_path: Path
) -> None:
    ws = ws_of(state)
    secret = tmp_path / "host-secret.md"
    secret.write_text("host secret password hunter2\n")
    os.symlink(secret, ws / "memory" / "link.md")
    os.mkfifo(ws / "memory" / "fifo.md")
    os.link(ws / "MEMORY.md", ws / "memory" / "hard.md")
    with open(ws / "memory" / "huge.md", "wb") as f:  # 64 GiB sparse
        f.write(b"needle at the start\n")
        f.truncate(64 * 1024**3)
    for i in range(50):
        (ws / "memory" / f"n{i}.txt").write_text("not markdown")
    kb = kb_path(state, "bot")
    stats = refresh(kb, ws)  # returns: a FIFO is never opened
    assert stats.left_out >= 3
    assert search(kb, "hunter2") == []
    assert [h.file for h in search(kb, "needle")] == ["memory/huge.md"]
    assert os.path.getsize(kb) < 8 * 1024 * 1024


def test_R3_a_symlinked_memory_directory_is_not_indexed(state: Path, tmp_path: Path) -> None:
    ws = ws_of(state)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.md").write_text("outside words\n")
    for f in (ws / "memory").iterdir():
        f.unlink()
    (ws / "memory").rmdir()
    os.symlink(elsewhere, ws / "memory")
    kb = kb_path(state, "bot")
    refresh(kb, ws)
    assert search(kb, "outside") == []
    assert search(kb, "green tea") != []


def test_a_flood_of_entries_is_bounded(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive_index, "MAX_DIR_ENTRIES", 20)
    monkeypatch.setattr(archive_index, "MAX_FILES", 5)
    for i in range(100):
        (ws_of(state) / "memory" / f"f{i:03}.md").write_text(f"word{i}\n")
    stats = refresh(kb_path(state, "bot"), ws_of(state))
    assert stats.files <= 2 + 5


async def test_A2_disabled_archive_builds_nothing_and_leaves_an_old_kb_untouched(
    state: Path,
) -> None:
    kb = kb_path(state, "bot")
    assert await refresh_at_spawn(state, "bot", ws_of(state), isolated=False, disabled=True) is None
    assert not kb.exists()  # no index built at spawn
    refresh(kb, ws_of(state))  # an archive from before the switch
    os.utime(kb, (1_000_000, 1_000_000))
    before = os.stat(kb)
    (ws_of(state) / "MEMORY.md").write_text("a new fact: the cat is called Mango\n")
    assert await refresh_at_spawn(state, "bot", ws_of(state), isolated=False, disabled=True) is None
    after = os.stat(kb)
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert search(kb, "Mango") == []  # not updated


async def test_T2_an_isolated_agent_gets_no_archive(state: Path) -> None:
    kb = kb_path(state, "bot")
    assert await refresh_at_spawn(state, "bot", ws_of(state), isolated=True, disabled=False) is None
    assert not kb.exists()
    stats = await refresh_at_spawn(state, "bot", ws_of(state), isolated=False, disabled=False)
    assert stats is not None and kb.exists()  # the same agent, not isolated: it has one


async def test_a_broken_kb_never_stops_a_spawn(state: Path) -> None:
    kb = kb_path(state, "bot")
    kb.parent.mkdir(parents=True, exist_ok=True)
    kb.write_bytes(b"this is not a database" * 100)
    assert (
        await refresh_at_spawn(state, "bot", ws_of(state), isolated=False, disabled=False) is None
    )


def test_kb_in_place_of_a_link_is_refused(state: Path, tmp_path: Path) -> None:
    target = tmp_path / "other.sqlite"
    sqlite3.connect(target).close()
    kb = kb_path(state, "bot")
    kb.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, kb)
    with pytest.raises(Exception, match="not a regular file"):
        refresh(kb, ws_of(state))


# -- memory_get ------------------------------------------------------------------------


def test_A1_memory_get_reads_a_bounded_excerpt(state: Path) -> None:
    got = excerpt(ws_of(state), "memory/projects.md", 7, 2)
    assert got.text == "the boat engine needs a new impeller\nordered from the marina shop"
    assert (got.start, got.end, got.total_lines) == (7, 8, 8)
    assert excerpt(ws_of(state), "/workspace/USER.md").text.startswith("# User")
    big = ws_of(state) / "memory" / "big.md"
    big.write_text("x" * 500 + "\n" + "\n".join(f"line {i}" for i in range(10_000)))
    got = excerpt(ws_of(state), "memory/big.md", 1, 10_000)
    assert got.end - got.start + 1 == 200 and got.truncated


@pytest.mark.parametrize(
    "path",
    ["../config.json", "memory/../../x.md", "/etc/passwd", "chats/a/MEMORY.md", "kb.sqlite",
     "memory/sub/x.md", "memory/x.txt"],
)  # fmt: skip
def test_A1_memory_get_refuses_paths_outside_the_archive(state: Path, path: str) -> None:
    with pytest.raises(PolicyDenied) as err:
        excerpt(ws_of(state), path)
    assert err.value.rule == "A1"


def test_A1_memory_get_refuses_a_symlink_and_a_fifo(state: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.md"
    secret.write_text("password hunter2\n")
    os.symlink(secret, ws_of(state) / "memory" / "link.md")
    os.mkfifo(ws_of(state) / "memory" / "pipe.md")
    for name in ("memory/link.md", "memory/pipe.md"):
        with pytest.raises(PolicyDenied) as err:
            excerpt(ws_of(state), name)
        assert err.value.rule == "A1" and "hunter2" not in err.value.reason
    with pytest.raises(FileNotFoundError):
        excerpt(ws_of(state), "memory/missing.md")


def test_R3_the_whole_index_is_bounded_across_refreshes(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_index, "FILE_CAP_BYTES", 1000)
    monkeypatch.setattr(archive_index, "TOTAL_CAP_BYTES", 3000)
    kb = kb_path(state, "bot")
    for i in range(10):  # one new 1000-byte file per spawn
        (ws_of(state) / "memory" / f"grow{i}.md").write_text(f"token{i} " + "x" * 990)
        refresh(kb, ws_of(state))
    found = [i for i in range(10) if search(kb, f"token{i}")]
    assert len(found) <= 3  # never more than the cap, however many spawns added files


def test_M8_A1_a_secret_line_is_neither_indexed_nor_shown_by_memory_get(state: Path) -> None:
    """A sandbox can write a key into memory/*.md with its shell; the archive never carries it
    to a later session: the line is masked in the index and in excerpts, numbering kept."""
    token = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    (ws_of(state) / "memory" / "keys.md").write_text(
        f"deploy notes\nthe github token is {token}\nrotate it monthly\n"
    )
    kb = kb_path(state, "bot")
    refresh(kb, ws_of(state))
    assert not search(kb, "ghp_" + token[4:12])
    assert token not in str(search(kb, "github token"))
    hits = search(kb, "rotate monthly")
    assert hits and all(token not in h.snippet for h in hits)
    got = excerpt(ws_of(state), "memory/keys.md")
    assert token not in got.text and got.total_lines == 3
    assert got.text.splitlines()[2] == "rotate it monthly"
    assert "M8" in got.text.splitlines()[1]
    with sqlite3.connect(kb) as db:
        assert not [r for r in db.execute("SELECT text FROM chunks") if token in r[0]]
