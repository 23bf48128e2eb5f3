"""The memory archive (A1): one SQLite FTS5 index, `kb.sqlite`, over an agent's memory files.

It indexes the workspace's MEMORY.md, USER.md and every `memory/*.md`, with
no conversation boundary, so it exists only for a non-isolated agent whose
archive is on (`policies.memory.archive_index`; A2, T2). It lives in the
agent's state directory (`<state>/agents/<agent>/kb.sqlite`), beside the
workspace, never inside it: no sandbox mounts it.

- `refresh(kb, workspace)` brings the index up to date at session spawn
  (callers run it off the event loop). A file whose size, mtime and inode
  are unchanged is not read again; a removed file leaves the index.
- `search(kb, query)` answers ranked snippets, each with its file and line.

The memory files are sandbox-writable: each is read through
`orchestrator.safefs` (no link followed, never a FIFO or device opened, at
most `FILE_CAP_BYTES` of one file, `TOTAL_CAP_BYTES` in the whole index, at most
`MAX_FILES` files and `MAX_DIR_ENTRIES` directory entries looked at). A file
left out is logged and stays out of the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import StoreError, UnsafePath
from orchestrator.safefs import SafeDir
from policies.memory import archive_index, mask_secret_lines

__all__ = [
    "FILE_CAP_BYTES",
    "KB_FILE",
    "Hit",
    "RefreshStats",
    "kb_path",
    "refresh",
    "refresh_at_spawn",
    "search",
]

logger = logging.getLogger(__name__)

KB_FILE = "kb.sqlite"
FILE_CAP_BYTES = 512 * 1024
TOTAL_CAP_BYTES = 16 * 1024 * 1024
MAX_FILES = 500
MAX_DIR_ENTRIES = 5_000
CHUNK_LINES = 6
CHUNK_CHARS = 1_200
MAX_QUERY_TERMS = 16
SNIPPET_TOKENS = 16

_ROOT_FILES = ("MEMORY.md", "USER.md")
_MD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}\.md$")
_TERM = re.compile(r"\w+", re.UNICODE)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS files ("
    " path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL,"
    " ino INTEGER NOT NULL) STRICT",
    "CREATE VIRTUAL TABLE IF NOT EXISTS chunks USING fts5("
    " text, path UNINDEXED, line UNINDEXED, tokenize = 'unicode61 remove_diacritics 2')",
)
_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def kb_path(state_dir: Path, agent: str) -> Path:
    """Where an agent's archive lives: its state directory, never its workspace."""
    return state_dir / "agents" / agent / KB_FILE


@dataclass(frozen=True, slots=True)
class RefreshStats:
    files: int
    read: int
    removed: int
    left_out: int


@dataclass(frozen=True, slots=True)
class Hit:
    file: str
    line: int
    snippet: str
    score: float


def _lock(kb: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(kb, threading.Lock())


@contextlib.contextmanager
def _connect(kb: Path, *, readonly: bool) -> Iterator[sqlite3.Connection]:
    """The index database; a link or non-file in its place is refused (never followed)."""
    try:
        st = os.lstat(kb)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise StoreError(f"the memory archive of {kb.parent.name} is not a regular file")
    uri = f"file:{kb}?mode={'ro' if readonly else 'rwc'}"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=10, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open the memory archive of {kb.parent.name}: {exc}") from exc
    try:
        yield conn
    finally:
        conn.close()


# --- sources ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Source:
    rel: str
    size: int
    mtime_ns: int
    ino: int


def _sources(ws: SafeDir) -> tuple[list[_Source], int]:
    """The archive's files as they are now (regular files only), and how many were left out."""
    found: list[_Source] = []
    skipped = 0

    def add(rel: str, st: os.stat_result | None) -> None:
        nonlocal skipped
        if st is None:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            skipped += 1
            logger.warning("memory archive: %r is not a plain file; left out", rel)
            return
        found.append(_Source(rel, st.st_size, st.st_mtime_ns, st.st_ino))

    for name in _ROOT_FILES:
        add(name, ws.lstat(name))
    try:
        memory = ws.subdir("memory")
    except FileNotFoundError:
        return found, skipped
    except UnsafePath as exc:
        logger.warning("memory archive: memory/ is %s; left out", exc.kind)
        return found, skipped + 1
    with memory, os.scandir(memory.fd) as entries:
        names: list[str] = []
        for i, entry in enumerate(entries):
            if i >= MAX_DIR_ENTRIES:
                logger.warning("memory archive: memory/ has over %d entries", MAX_DIR_ENTRIES)
                break
            if _MD_NAME.fullmatch(entry.name):
                names.append(entry.name)
        for name in sorted(names)[:MAX_FILES]:
            with contextlib.suppress(FileNotFoundError):
                add(f"memory/{name}", os.stat(name, dir_fd=memory.fd, follow_symlinks=False))
    return found, skipped


def _shown(raw: bytes) -> str:
    """The file's text as the archive may hold it: secret-looking lines masked (M8)."""
    return mask_secret_lines(raw.decode("utf-8", "replace"))[0]


def _chunks(text: str) -> Iterator[tuple[int, str]]:
    """(first line, text) pieces of at most CHUNK_LINES lines, cut at blank lines."""
    start, buf, size = 0, list[str](), 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            if buf:
                yield start, "\n".join(buf)
                buf, size = [], 0
            continue
        if not buf:
            start = number
        buf.append(line[:CHUNK_CHARS])
        size += len(buf[-1])
        if len(buf) >= CHUNK_LINES or size >= CHUNK_CHARS:
            yield start, "\n".join(buf)
            buf, size = [], 0
    if buf:
        yield start, "\n".join(buf)


def refresh(kb: Path, workspace: Path) -> RefreshStats:
    """Bring `kb` up to date with the workspace's memory files (blocking: call off the loop)."""
    with _lock(kb), SafeDir.trusted(workspace) as ws:
        sources, skipped = _sources(ws)
        kb.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _connect(kb, readonly=False) as db:
            for statement in _SCHEMA:
                db.execute(statement)
            known = {
                r[0]: (r[1], r[2], r[3])
                for r in db.execute("SELECT path, size, mtime_ns, ino FROM files")
            }
            unchanged = {s.rel for s in sources if known.get(s.rel) == (s.size, s.mtime_ns, s.ino)}
            kept = sum(min(known[rel][0], FILE_CAP_BYTES) for rel in unchanged)
            budget, read = TOTAL_CAP_BYTES - kept, 0  # the whole index holds at most this
            db.execute("BEGIN IMMEDIATE")
            try:
                current = {s.rel for s in sources}
                gone = [p for p in known if p not in current]
                for rel in gone:
                    db.execute("DELETE FROM chunks WHERE path = ?", (rel,))
                    db.execute("DELETE FROM files WHERE path = ?", (rel,))
                for src in sources:
                    if src.rel in unchanged:
                        continue
                    if budget <= 0:
                        skipped += 1
                        continue
                    try:
                        raw = ws.read(src.rel, cap=min(FILE_CAP_BYTES, budget))
                    except UnsafePath as exc:  # swapped since it was listed
                        logger.warning("memory archive: %r %s; left out", src.rel, exc.reason)
                        skipped += 1
                        raw = None
                    db.execute("DELETE FROM chunks WHERE path = ?", (src.rel,))
                    db.execute("DELETE FROM files WHERE path = ?", (src.rel,))
                    if raw is None:
                        continue
                    budget -= len(raw)
                    read += 1
                    db.executemany(
                        "INSERT INTO chunks (text, path, line) VALUES (?, ?, ?)",
                        [(t, src.rel, line) for line, t in _chunks(_shown(raw))],
                    )
                    db.execute(
                        "INSERT INTO files VALUES (?, ?, ?, ?)",
                        (src.rel, src.size, src.mtime_ns, src.ino),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
    return RefreshStats(len(sources), read, len(gone), skipped)


async def refresh_at_spawn(
    state_dir: Path, agent: str, workspace: Path, *, isolated: bool, disabled: bool
) -> RefreshStats | None:
    """A1/A2/T2: refresh the agent's archive off the event loop, if it has one.

    With the archive off or the agent isolated nothing is opened: no kb.sqlite
    is made and an old one is neither read nor touched. A failure is logged;
    the session spawns anyway (memory_search then finds what was indexed before).
    """
    if not archive_index(isolated, disabled):
        return None
    kb = kb_path(state_dir, agent)
    try:
        stats = await asyncio.to_thread(refresh, kb, workspace)
    except (OSError, StoreError, sqlite3.Error) as exc:
        logger.warning("memory archive of %s not refreshed: %s", agent, exc)
        return None
    logger.debug("memory archive of %s refreshed: %s", agent, stats)
    return stats


def _match(terms: list[str], joiner: str) -> str:
    return joiner.join('"' + t.replace('"', "") + '"' for t in terms)


def _line_of(text: str, start: int, terms: list[str]) -> int:
    lowered = [t.lower() for t in terms]
    for offset, line in enumerate(text.split("\n")):
        low = line.lower()
        if any(t in low for t in lowered):
            return start + offset
    return start


def search(kb: Path, query: str, limit: int = 8) -> list[Hit]:
    """Ranked hits for `query` (all words first; any word when none has them all)."""
    terms = _TERM.findall(query)[:MAX_QUERY_TERMS]
    if not terms or not kb.exists():
        return []
    limit = max(1, min(limit, 50))
    sql = (
        "SELECT path, line, text, snippet(chunks, 0, '[', ']', '…', ?), bm25(chunks)"
        " FROM chunks WHERE chunks MATCH ? ORDER BY bm25(chunks) LIMIT ?"
    )
    with _connect(kb, readonly=True) as db:
        try:
            rows = db.execute(sql, (SNIPPET_TOKENS, _match(terms, " "), limit)).fetchall()
            if not rows and len(terms) > 1:
                rows = db.execute(sql, (SNIPPET_TOKENS, _match(terms, " OR "), limit)).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"memory archive search failed: {exc}") from exc
    return [
        Hit(file=path, line=_line_of(text, int(line), terms), snippet=snip, score=-float(score))
        for path, line, text, snip, score in rows
    ]
