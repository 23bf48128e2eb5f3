"""Group commit: one fsync of the write-ahead log for every commit made before it (F3, D1).

A write the platform or the chat learns of (an accepted message is
acknowledged, a reply is sent) must be on disk first. Committed with
`synchronous=FULL`, each such commit fsyncs the WAL itself, on the thread
that made it: the turn lane, which then holds every other turn's store call
for the length of an fsync, twice per turn (64 new conversations at once:
128 fsyncs one after another on the lane).

Instead such a write may be committed without its own fsync (`NORMAL`: its
frames are in the WAL, in the page cache) and the caller, before it tells
anyone, waits for `WalSync.sync(ticket)` elsewhere: an `fdatasync` of the
WAL file that began after the commit. Commits made while one fsync runs
share the next one; a ticket already covered returns at once.

Why this is as safe as FULL: SQLite appends a commit's frames to the WAL
with `write` before COMMIT returns, and a frame counts only after every frame
before it. An fsync of the WAL file begun after that puts those frames on
disk; if a checkpoint restarted the WAL meanwhile, the frames were copied
into the database file, and SQLite (NORMAL) syncs the WAL before and the
database after every checkpoint. A WAL file not seen before (created, or
made anew) also gets its directory synced once, as SQLite does for a WAL it
creates under FULL.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import StoreError


@dataclass
class SyncTicket:
    """What a sync must cover: every deferred commit up to `upto` (0: nothing yet)."""

    upto: int = 0


class WalSync:
    def __init__(self, db_path: Path) -> None:
        self._db = db_path
        self._wal = db_path.with_name(db_path.name + "-wal")
        self._lock = threading.Lock()  # the counters
        self._syncing = threading.Lock()  # one fsync at a time; who waited may need none
        # 1: what an earlier process committed without an fsync (it may have died before
        # its sync); `Database` syncs it once at open, before anything read is told
        self._marked = 1
        self._synced = 0
        self._seen: tuple[int, int] | None = None  # the WAL file whose directory was synced

    def mark(self) -> int:
        """A durable write just committed without its own fsync: its number."""
        with self._lock:
            self._marked += 1
            return self._marked

    def marked(self) -> int:
        with self._lock:
            return self._marked

    def sync(self, ticket: SyncTicket) -> None:
        """Return once every commit the ticket covers is on disk (one fsync, or none when
        one that began after them has ended already). Blocking: run it off the loop."""
        with self._syncing:
            with self._lock:
                if self._synced >= ticket.upto:
                    return
                upto = self._marked  # every commit numbered so far has written its frames
            try:
                self._fsync()
            except OSError as exc:
                raise StoreError(f"syncing {self._wal} to disk failed: {exc}") from exc
            with self._lock:
                self._synced = max(self._synced, upto)

    def _fsync(self) -> None:
        try:
            fd = os.open(self._wal, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            # no WAL: the last connection checkpointed it into the database and removed it
            fd = os.open(self._db, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if (st.st_dev, st.st_ino) != self._seen:
            dir_fd = os.open(self._db.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self._seen = (st.st_dev, st.st_ino)
