"""One SQLite file in WAL mode, one connection per thread.

Thread model: every thread that touches the store gets its own connection
(`threading.local`), so WAL readers never wait for a writer and no Python
lock is held across an fsync. Writers are serialised by SQLite itself: every
write transaction starts with `BEGIN IMMEDIATE`, which takes the write lock
up front (waiting up to `busy_timeout`), so a read-then-write transaction can
never fail half-way with SQLITE_BUSY. Connections are opened with
`check_same_thread=False` only so that `close()` can close them all from one
thread; each is used by the thread that opened it and no other.

Durability: `synchronous=FULL`. In WAL mode NORMAL already survives a SIGKILL
of the gateway (a committed transaction is in the WAL, in the OS page cache);
FULL also survives a power cut or kernel crash, because the WAL is fsynced
at every commit. cellgate acknowledges an inbound event to the platform right
after `accept_message` commits, and the platform will not send it again, so
the commit must be on disk before that acknowledgement (D1).

A write the outside learns of may instead be made inside `deferred_sync()`:
it commits without its own fsync, and its caller runs `sync(ticket)` (off
the turn lane) before telling anyone; one fsync then covers every commit
made before it began (group commit: `orchestrator.store.walsync`).

A write that nothing outside the process learns of before a durable write
follows (a turn's start and finish, its sandbox's record) is committed with
`write(durable=False)`: no fsync of its own (F3: on a busy host each is a
wait, and a turn makes several). The WAL is append-only and a frame counts
only after every frame before it, so the next durable commit's fsync (a
reply recorded before it is sent, a delivery marked) or a checkpoint carries
it to disk too. A power cut can lose only such writes, and what they record
is redone by recovery (D2): a turn not shown started or finished runs again,
as one open at the crash does.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cellgate.errors import StoreError, StoreFull
from orchestrator.store.schema import MIGRATIONS, SCHEMA_VERSION
from orchestrator.store.walsync import SyncTicket, WalSync

logger = logging.getLogger(__name__)

DB_FILE = "cellgate.sqlite3"
BUSY_TIMEOUT_MS = 10_000
_MIN_SQLITE = (3, 37, 0)  # STRICT tables (3.37), RETURNING (3.35)


class Database:
    """Connections, transactions and migrations for one database file."""

    def __init__(self, path: Path, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise StoreError(
                f"SQLite {sqlite3.sqlite_version} is too old; cellgate needs "
                f"{'.'.join(map(str, _MIN_SQLITE))} or newer (use Python built against it)"
            )
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[threading.Thread, sqlite3.Connection]] = {}
        self._in_use: set[int] = set()
        self._closed = False
        self.wal = WalSync(path)
        self._create_file()
        self._migrate()
        self.sync(SyncTicket(self.wal.marked()))  # an earlier process's deferred commits

    def _create_file(self) -> None:
        """Create the file 0600 before SQLite does: it holds key and share hashes."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot open the state database {self.path}: {exc}") from exc
        os.close(fd)

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._closed:
            raise StoreError(f"the state database {self.path} is closed")
        conn = self._open()
        self._local.conn = conn
        self._local.durable = True  # its `synchronous` level: FULL
        me = threading.current_thread()
        with self._lock:
            self._reap_dead_threads()
            self._conns[id(conn)] = (me, conn)
        return conn

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=self._busy_timeout_ms / 1000,
                isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                check_same_thread=False,
            )
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                conn.close()
                raise StoreError(
                    f"{self.path} cannot use WAL mode (got {mode!r}); put the state "
                    "directory on a local filesystem, not a network share"
                )
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the state database {self.path}: {exc}") from exc
        return conn

    def _reap_dead_threads(self) -> None:
        """Close connections whose thread has ended (thread pools come and go)."""
        for key, (thread, conn) in list(self._conns.items()):
            if not thread.is_alive():
                conn.close()
                del self._conns[key]

    def _migrate(self) -> None:
        with self.write() as c:
            version: int = c.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {version}, newer than this cellgate "
                    f"knows ({SCHEMA_VERSION}); upgrade cellgate or restore an older backup"
                )
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[number - 1]:
                    c.execute(statement)
                c.execute(f"PRAGMA user_version = {number}")
                logger.info("state database %s migrated to version %d", self.path, number)

    def _failed(self, what: str, exc: sqlite3.Error) -> StoreError:
        """The store's error for a failed write; a full disk is its own kind (R7)."""
        if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc):
            return StoreFull(f"{what} {self.path} failed: the disk is full ({exc})")
        return StoreError(f"{what} {self.path} failed: {exc}")

    @contextmanager
    def _using(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, marked in use: `close` never closes it under a statement.

        A store closed meanwhile closes the connection here, when its thread is done."""
        conn = self.connection()
        with self._lock:
            self._in_use.add(id(conn))
        try:
            yield conn
        finally:
            with self._lock:
                self._in_use.discard(id(conn))
                if self._closed and self._conns.pop(id(conn), None) is not None:
                    conn.close()
                    self._local = threading.local()

    @contextmanager
    def write(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: `BEGIN IMMEDIATE`, COMMIT on success, ROLLBACK on error.

        `durable=False` commits without its own fsync (`synchronous=NORMAL`, until the
        thread's next durable write sets FULL again), for a write nothing outside the
        process is told of before a durable one follows; see the module's note on
        durability."""
        deferred = durable and getattr(self._local, "deferred", False)
        full = durable and not deferred
        with self._using() as conn:
            # the level is set only when it changes (F3: each statement is a wait for the
            # interpreter lock on a busy turn lane); every write of the thread comes here
            if self._local.durable != full:
                try:
                    conn.execute(f"PRAGMA synchronous = {'FULL' if full else 'NORMAL'}")
                except sqlite3.Error as exc:
                    raise self._failed("starting a write on", exc) from exc
                self._local.durable = full
            yield from self._write(conn)
        if deferred:
            self.wal.mark()

    @contextmanager
    def deferred_sync(self) -> Iterator[SyncTicket]:
        """Durable writes of this thread inside commit without their own fsync; once the
        block ends the ticket covers them and every such commit before (a write found
        done already, an idempotent repeat, is covered too). `sync(ticket)` before anyone
        outside the process learns of them (D1)."""
        ticket = SyncTicket()
        outer = getattr(self._local, "deferred", False)  # a block inside another keeps it
        self._local.deferred = True
        try:
            yield ticket
        finally:
            self._local.deferred = outer
            ticket.upto = self.wal.marked()

    def sync(self, ticket: SyncTicket) -> None:
        """Blocking: what `ticket` covers is on disk (group commit, `WalSync.sync`)."""
        self.wal.sync(ticket)

    def _write(self, conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._failed("starting a write on", exc) from exc
        try:
            yield conn
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise self._failed("a write to", exc) from exc
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise self._failed("a commit to", exc) from exc

    def query(self, sql: str, params: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        """The rows of one statement, which reads one snapshot by itself (F3: no BEGIN and
        COMMIT around it, two statements fewer than `read`)."""
        with self._using() as conn:
            try:
                rows: list[sqlite3.Row] = conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"read from {self.path} failed: {exc}") from exc
        return rows

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every statement inside sees the same snapshot."""
        with self._using() as conn:
            try:
                conn.execute("BEGIN")
                try:
                    yield conn
                finally:
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise StoreError(f"read from {self.path} failed: {exc}") from exc

    def close(self) -> None:
        """Close every thread's idle connection; one in use is closed by its thread when
        its statement ends (closing it underneath would crash the process). The store
        cannot be used afterwards."""
        with self._lock:
            self._closed = True
            for key, (_thread, conn) in list(self._conns.items()):
                if key not in self._in_use:
                    conn.close()
                    del self._conns[key]
        self._local = threading.local()
