"""The state database against real SQLite files (D1, D2, P3, P6, C1, K2)."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cellgate.errors import NotFound, StateConflict, StoreError
from cellgate.models import ConversationKey
from orchestrator.store import (
    ATTACHMENT_LEDGER_SIZE,
    DB_FILE,
    Conversation,
    CronType,
    MessageId,
    MessageState,
    SandboxState,
    Session,
    SessionId,
    SessionState,
    Store,
    Turn,
    conversation_id,
)
from orchestrator.store.messages import QUEUE_SQL
from orchestrator.store.schema import MIGRATIONS, SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store.open(tmp_path, clock=clock) as s:
        yield s


@pytest.fixture
def conv(store: Store) -> Conversation:
    return store.upsert_conversation(ConversationKey("bot", "telegram", "-1001"))


def raw_bytes(state_dir: Path) -> bytes:
    """Everything SQLite has written: the main file, the WAL and the shared-memory index."""
    parts = [state_dir / DB_FILE, state_dir / f"{DB_FILE}-wal", state_dir / f"{DB_FILE}-shm"]
    return b"".join(p.read_bytes() for p in parts if p.exists())


# -- the file ------------------------------------------------------------------


def test_D1_database_is_wal_with_full_sync_and_foreign_keys(store: Store) -> None:
    conn = sqlite3.connect(store.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()
    # The store's own connection carries the per-connection settings.
    c = store._db.connection()
    assert c.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert c.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert c.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000


def _syncs(store: Store, write: Callable[[], object]) -> list[int]:
    """The `synchronous` level each COMMIT of `write` ran under (2 FULL, 1 NORMAL)."""
    conn = store._db.connection()
    levels: list[int] = []
    level = [conn.execute("PRAGMA synchronous").fetchone()[0]]

    def seen(sql: str) -> None:
        if sql.startswith("PRAGMA synchronous = "):
            level[0] = {"FULL": 2, "NORMAL": 1}[sql.rsplit(" ", 1)[1]]
        elif sql == "COMMIT":
            levels.append(level[0])

    conn.set_trace_callback(seen)
    try:
        write()
    finally:
        conn.set_trace_callback(None)
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == level[0]
    return levels


def _statements(store: Store, work: Callable[[], object]) -> list[str]:
    conn = store._db.connection()
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    try:
        work()
    finally:
        conn.set_trace_callback(None)
    return seen


def test_D1_D2_F3_writes_told_outside_are_fsynced_and_a_turns_own_are_not(
    store: Store, conv: Conversation
) -> None:
    """What the platform or the chat learns of is on disk first: an accepted message
    (acknowledged), a reply (sent), a delivery. A turn's start, finish and sandbox record
    commit without their own fsync (F3); the next of those carries them to disk."""
    msg, _ = store.accept_message(conv.id, "m1", sender="u", text="hi")
    assert _syncs(store, lambda: store.accept_message(conv.id, "m2", sender="u", text="x")) == [2]
    new = ConversationKey("bot", "telegram", "-1002")
    assert _syncs(store, lambda: store.accept_new(new, "m1", sender="u", text="x")) == [2]
    session = store.open_session(conv.id, "shell")
    turn = store.start_turn(session.id, msg.id)
    assert _syncs(store, lambda: store.open_session(conv.id, "shell")) == [1]
    m3, _ = store.accept_message(conv.id, "m3", sender="u", text="hi")
    assert _syncs(store, lambda: store.start_turn(session.id, m3.id)) == [1]
    assert _syncs(store, lambda: store.finish_turn(turn.id, ok=True)) == [1]
    assert _syncs(
        store,
        lambda: store.record_sandbox(
            "sb", conversation=conv.id, app="app", agent="bot", spec_hash="h"
        ),
    ) == [1]
    assert _syncs(store, lambda: store.record_reply(msg.id, "out:1", "answer")) == [2]
    assert _syncs(store, lambda: store.mark_delivered("out:1")) == [2]
    with pytest.raises(StateConflict):
        store.finish_turn(turn.id, ok=True)
    # a durable write after a refused quiet one is FULL all the same
    assert _syncs(store, lambda: store.accept_message(conv.id, "m9", sender="u", text="x")) == [2]


def test_D2_F3_a_turns_start_opens_its_session_in_the_same_commit(
    store: Store, conv: Conversation
) -> None:
    """`begin_turn`: a conversation without a live session gets one, and the turn starts
    in it, in one commit without an fsync of its own (F3); a later turn reuses it; a
    refused start (the message is not ACCEPTED) leaves no session behind."""
    m1, _ = store.accept_message(conv.id, "m1", sender="u", text="hi")
    got: list[tuple[Session, Turn]] = []
    assert _syncs(store, lambda: got.append(store.begin_turn(conv.id, "shell", m1.id))) == [1]
    [(session, turn)] = got
    assert session.state is SessionState.LIVE and session.conversation_id == conv.id
    assert turn.session_id == session.id and turn.message_id == m1.id
    assert store.get_message(m1.id).state is MessageState.RUNNING  # type: ignore[union-attr]
    assert [s.id for s in store.live_sessions(conversation=conv.id)] == [session.id]
    m2, _ = store.accept_message(conv.id, "m2", sender="u", text="again")
    again, _ = store.begin_turn(conv.id, "shell", m2.id)
    assert again.id == session.id and again.busy == 1  # the first turn is still open
    other = store.upsert_conversation(ConversationKey("bot", "telegram", "-77"))
    with pytest.raises(StateConflict):
        store.begin_turn(other.id, "shell", m1.id)  # m1 is RUNNING already
    assert store.live_sessions(conversation=other.id) == []


def test_D1_F3_the_sync_level_is_set_only_when_it_changes_and_lone_reads_need_no_begin(
    store: Store, conv: Conversation
) -> None:
    """Each statement on the turn lane is a wait for the interpreter lock (F3): a run of
    writes of one durability sets `synchronous` once, and a one-statement read is sent
    alone; a durable write after them is still FULL."""
    msg, _ = store.accept_message(conv.id, "m1", sender="u", text="hi")
    session = store.open_session(conv.id, "shell")
    turn = store.start_turn(session.id, msg.id)

    def two_quiet_writes() -> None:
        store.record_sandbox("sb", conversation=conv.id, app="app", agent="bot", spec_hash="h")
        store.finish_turn(turn.id, ok=True)

    quiet = _statements(store, two_quiet_writes)
    assert [q for q in quiet if q.startswith("PRAGMA")] == []  # NORMAL since start_turn
    assert _syncs(store, lambda: store.record_reply(msg.id, "out:1", "answer")) == [2]
    reads = _statements(store, lambda: store.pending_for_conversation(conv.id))
    assert len(reads) == 1 and reads[0].startswith("SELECT")
    assert store.reply_for_message(msg.id) is not None
    assert store.get_conversation(conv.id) == conv


def test_D1_database_file_is_private(store: Store) -> None:
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600


def test_D1_reopen_keeps_data_and_does_not_migrate_again(tmp_path: Path, clock: FakeClock) -> None:
    with Store.open(tmp_path, clock=clock) as s:
        conv = s.upsert_conversation(ConversationKey("bot", "telegram", "42"))
        s.accept_message(conv.id, "m1", sender="u", text="hello")
    with Store.open(tmp_path, clock=clock) as s:
        assert [m.text for m in s.pending_for_conversation(conv.id)] == ["hello"]


def test_D1_newer_schema_is_refused(tmp_path: Path) -> None:
    Store.open(tmp_path).close()
    conn = sqlite3.connect(tmp_path / DB_FILE)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this cellgate knows"):
        Store.open(tmp_path)


def test_closed_store_refuses_use(tmp_path: Path) -> None:
    s = Store.open(tmp_path)
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.conversations()


# -- conversations -------------------------------------------------------------


def test_conversation_upsert_is_stable_and_per_agent(store: Store, clock: FakeClock) -> None:
    key = ConversationKey("bot", "telegram", "-1001")
    first = store.upsert_conversation(key)
    clock.advance(5)
    again = store.upsert_conversation(key)
    assert again.id == first.id == conversation_id(key)
    assert again.created_at == first.created_at
    assert again.last_active_at == first.created_at + 5
    assert again.dir_name == key.dir_name
    # RETURNING hands back a whole REAL as an int; rows must still carry floats.
    assert type(first.created_at) is float
    assert store.get_conversation(first.id) == again
    other_agent = store.upsert_conversation(ConversationKey("bot2", "telegram", "-1001"))
    assert other_agent.id != first.id
    assert [c.id for c in store.conversations(agent="bot")] == [first.id]


# -- inbound messages ----------------------------------------------------------


def test_D1_redelivered_inbound_event_is_one_row(store: Store, conv: Conversation) -> None:
    first, created = store.accept_message(
        conv.id, "777", sender="alice", text="hi", attachments=[{"file_id": "F1"}]
    )
    again, created_again = store.accept_message(conv.id, "777", sender="alice", text="hi")
    assert created is True
    assert created_again is False
    assert again == first
    assert first.state is MessageState.ACCEPTED
    assert first.attachments == ({"file_id": "F1"},)
    assert len(store.undelivered_messages()) == 1


def test_D1_same_platform_id_in_another_chat_is_another_message(
    store: Store, conv: Conversation
) -> None:
    other = store.upsert_conversation(ConversationKey("bot", "telegram", "-1002"))
    _, a = store.accept_message(conv.id, "1", sender="u", text="x")
    _, b = store.accept_message(other.id, "1", sender="u", text="x")
    assert a and b


def test_accept_for_unknown_conversation_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.accept_message(conversation_id(ConversationKey("x", "api", "nope")), "1",
                             sender="u", text="x")  # fmt: skip


@pytest.mark.parametrize("separate_stores", [False, True], ids=["shared", "per-thread-store"])
def test_D1_concurrent_accepts_of_one_event_create_exactly_one(
    tmp_path: Path, separate_stores: bool
) -> None:
    main = Store.open(tmp_path)
    conv = main.upsert_conversation(ConversationKey("bot", "telegram", "9"))
    threads = 16
    barrier = threading.Barrier(threads)
    results: list[bool] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        s = Store.open(tmp_path) if separate_stores else main
        try:
            barrier.wait()
            _, created = s.accept_message(conv.id, "dup", sender="u", text="same")
            with lock:
                results.append(created)
        except BaseException as exc:
            with lock:
                errors.append(exc)
        finally:
            if separate_stores:
                s.close()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []
    assert sorted(results) == [False] * (threads - 1) + [True]
    assert len(main.pending_for_conversation(conv.id)) == 1
    main.close()


# -- guarded transitions -------------------------------------------------------


def test_D1_transition_refuses_wrong_from_state(store: Store, conv: Conversation) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    running = store.transition(msg.id, MessageState.ACCEPTED, MessageState.RUNNING)
    assert running.state is MessageState.RUNNING
    assert running.attempts == 1
    with pytest.raises(StateConflict) as info:
        store.transition(msg.id, MessageState.ACCEPTED, MessageState.RUNNING)
    assert info.value.expected == "accepted"
    assert info.value.actual == "running"
    assert store.get_message(msg.id) == running  # nothing changed


def test_transition_refuses_edges_that_need_their_own_operation(
    store: Store, conv: Conversation
) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    store.transition(msg.id, MessageState.ACCEPTED, MessageState.RUNNING)
    with pytest.raises(StoreError, match="record_reply"):
        store.transition(msg.id, MessageState.RUNNING, MessageState.REPLIED)
    with pytest.raises(StoreError, match="cannot go from delivered"):
        store.transition(msg.id, MessageState.DELIVERED, MessageState.ACCEPTED)
    with pytest.raises(NotFound):
        store.transition(MessageId(msg.id + 100), MessageState.RUNNING, MessageState.FAILED)


def test_failed_keeps_the_error(store: Store, conv: Conversation) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    store.transition(msg.id, MessageState.ACCEPTED, MessageState.RUNNING)
    failed = store.transition(msg.id, MessageState.RUNNING, MessageState.FAILED, error="boom")
    assert (failed.state, failed.error) == (MessageState.FAILED, "boom")
    assert store.undelivered_messages() == []


# -- replies -------------------------------------------------------------------


def test_D1_reply_is_idempotent_on_outbound_key(store: Store, conv: Conversation) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    session = store.open_session(conv.id, "shell")
    store.start_turn(session.id, msg.id)
    reply, created = store.record_reply(msg.id, "out:1", "answer")
    again, created_again = store.record_reply(msg.id, "out:1", "a different answer")
    assert (created, created_again) == (True, False)
    assert again == reply
    assert again.text == "answer"
    assert store.get_message(msg.id).state is MessageState.REPLIED  # type: ignore[union-attr]
    assert store._db.connection().execute("SELECT count(*) FROM replies").fetchone()[0] == 1


def test_D1_a_message_has_at_most_one_reply(store: Store, conv: Conversation) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    other, _ = store.accept_message(conv.id, "2", sender="u", text="y")
    store.transition(msg.id, MessageState.ACCEPTED, MessageState.RUNNING)
    store.record_reply(msg.id, "out:1", "answer")
    with pytest.raises(StateConflict):  # already REPLIED: a second key cannot answer it
        store.record_reply(msg.id, "out:1b", "again")
    with pytest.raises(StoreError, match="already answers message"):
        store.record_reply(other.id, "out:1", "stolen key")


def test_D1_reply_needs_a_running_turn(store: Store, conv: Conversation) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    with pytest.raises(StateConflict):
        store.record_reply(msg.id, "out:1", "too early")
    assert store.get_reply("out:1") is None


def test_D1_delivered_once(store: Store, conv: Conversation, clock: FakeClock) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    store.transition(msg.id, MessageState.ACCEPTED, MessageState.RUNNING)
    store.record_reply(msg.id, "out:1", "answer")
    clock.advance(2)
    delivered = store.mark_delivered("out:1")
    assert delivered.delivered_at == clock.now
    assert store.get_message(msg.id).state is MessageState.DELIVERED  # type: ignore[union-attr]
    with pytest.raises(StateConflict):
        store.mark_delivered("out:1")
    with pytest.raises(NotFound):
        store.mark_delivered("out:nope")
    assert store.undelivered_messages() == []
    assert store.delivery_violations() == []


def test_D2_delivery_violations_find_a_broken_row(store: Store, conv: Conversation) -> None:
    msg, _ = store.accept_message(conv.id, "1", sender="u", text="x")
    store._db.connection().execute(
        "UPDATE messages SET state = 'delivered' WHERE id = ?", (msg.id,)
    )
    assert store.delivery_violations() == [
        f"message {msg.id} (delivered) is delivered but has no delivered reply"
    ]


# -- recovery after a crash (D2) ----------------------------------------------


def test_D2_undelivered_scan_after_crash_mid_turn(tmp_path: Path, clock: FakeClock) -> None:
    crashed = Store.open(tmp_path, clock=clock)
    conv = crashed.upsert_conversation(ConversationKey("bot", "telegram", "5"))
    other = crashed.upsert_conversation(ConversationKey("bot", "telegram", "6"))
    session = crashed.open_session(conv.id, "shell")
    m1, _ = crashed.accept_message(conv.id, "1", sender="u", text="first")
    clock.advance()
    o1, _ = crashed.accept_message(other.id, "1", sender="v", text="other chat")
    clock.advance()
    m2, _ = crashed.accept_message(conv.id, "2", sender="u", text="second")
    m0, _ = crashed.accept_message(conv.id, "0", sender="u", text="done")
    crashed.start_turn(session.id, m1.id)  # the process dies inside this turn
    crashed.start_turn(session.id, m0.id)
    crashed.record_reply(m0.id, "out:0", "sent?")  # recorded, never marked delivered
    # No close(): the old process is gone; a fresh Store reads only what was committed.

    fresh = Store.open(tmp_path, clock=clock)
    scan = fresh.undelivered_messages()
    assert [(m.id, m.state) for m in scan] == [
        (m1.id, MessageState.RUNNING),
        (o1.id, MessageState.ACCEPTED),
        (m2.id, MessageState.ACCEPTED),
        (m0.id, MessageState.REPLIED),
    ]
    assert [m.id for m in fresh.pending_for_conversation(conv.id)] == [m1.id, m2.id, m0.id]
    assert fresh.get_session(session.id).busy == 2  # type: ignore[union-attr]
    assert fresh.close_open_turns() == 2
    assert fresh.get_session(session.id).busy == 0  # type: ignore[union-attr]

    # Finish what the crash interrupted: requeue, run, reply, deliver; resend the reply.
    fresh.transition(m1.id, MessageState.RUNNING, MessageState.ACCEPTED)
    turn = fresh.start_turn(session.id, m1.id)
    assert fresh.get_message(m1.id).attempts == 2  # type: ignore[union-attr]
    fresh.record_reply(m1.id, "out:1", "answer")
    fresh.finish_turn(turn.id, ok=True, harness_turn_id="t-1")
    fresh.mark_delivered("out:1")
    _, created = fresh.record_reply(m0.id, "out:0", "sent?")
    assert created is False
    fresh.mark_delivered("out:0")
    assert [m.id for m in fresh.undelivered_messages()] == [o1.id, m2.id]
    assert fresh.delivery_violations() == []
    assert [t.ok for t in fresh.turns(m1.id)] == [False, True]
    fresh.close()
    crashed.close()


_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from orchestrator.conversations import ConversationKey
    from orchestrator.store import MessageState, Store

    store = Store.open(Path(sys.argv[1]))
    conv = store.upsert_conversation(ConversationKey("bot", "telegram", "crash"))
    session = store.open_session(conv.id, "shell")
    i = 0
    while True:
        msg, created = store.accept_message(conv.id, f"p{i}", sender="u", text="x" * 500)
        if i % 2:
            store.start_turn(session.id, msg.id)
            store.record_reply(msg.id, f"out:{i}", "y" * 500)
        print(f"p{i}", flush=True)
        i += 1
    """
)


def test_D1_D2_sigkill_mid_write_loses_nothing_committed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert child.stdout is not None
    committed: list[str] = []
    try:
        for line in child.stdout:
            committed.append(line.strip())
            if len(committed) >= 120:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert len(committed) >= 120

    with Store.open(tmp_path) as s:
        c = s._db.connection()
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert c.execute("PRAGMA foreign_key_check").fetchall() == []
        ids = [r[0] for r in c.execute("SELECT platform_message_id FROM messages")]
        assert len(ids) == len(set(ids))
        assert set(committed) <= set(ids)
        # The child commits one after another: the file holds an unbroken prefix.
        assert sorted(ids, key=lambda p: int(p[1:])) == [f"p{i}" for i in range(len(ids))]
        assert s.delivery_violations() == []
        replies = c.execute("SELECT count(*) FROM replies").fetchone()[0]
        replied = [m for m in s.undelivered_messages() if m.state is MessageState.REPLIED]
        assert replies == len(replied)


# -- sessions and turns --------------------------------------------------------


def test_sessions_live_busy_and_end(store: Store, conv: Conversation, clock: FakeClock) -> None:
    other = store.upsert_conversation(ConversationKey("bot2", "telegram", "1"))
    s1 = store.open_session(conv.id, "claude", harness_session_id="abc")
    s2 = store.open_session(other.id, "shell")
    assert (s1.state, s1.agent, s1.busy) == (SessionState.LIVE, "bot", 0)
    assert [s.id for s in store.live_sessions()] == [s1.id, s2.id]
    assert [s.id for s in store.live_sessions("bot")] == [s1.id]

    heartbeat = store.start_turn(s1.id)  # M4: a turn without an inbound message
    assert store.get_session(s1.id).busy == 1  # type: ignore[union-attr]
    store.finish_turn(heartbeat.id, ok=True)
    with pytest.raises(StateConflict):
        store.finish_turn(heartbeat.id, ok=True)
    assert store.get_session(s1.id).busy == 0  # type: ignore[union-attr]

    assert store.last_session_end(conv.id) is None
    clock.advance(30)
    ended = store.end_session(s1.id)
    assert (ended.state, ended.ended_at) == (SessionState.ENDED, clock.now)
    assert store.last_session_end(conv.id) == clock.now
    with pytest.raises(StateConflict):
        store.end_session(s1.id)
    with pytest.raises(StoreError, match="has ended"):
        store.start_turn(s1.id)
    assert store.set_harness_session_id(s2.id, "h-2").harness_session_id == "h-2"


def test_turn_refuses_a_message_of_another_conversation(store: Store, conv: Conversation) -> None:
    other = store.upsert_conversation(ConversationKey("bot", "telegram", "other"))
    msg, _ = store.accept_message(other.id, "1", sender="u", text="x")
    session = store.open_session(conv.id, "shell")
    with pytest.raises(StoreError, match="belongs to conversation"):
        store.start_turn(session.id, msg.id)
    assert store.get_message(msg.id).state is MessageState.ACCEPTED  # type: ignore[union-attr]


def test_session_id_must_be_a_safe_name(store: Store, conv: Conversation) -> None:
    with pytest.raises(StoreError, match="not a safe name"):
        store.open_session(conv.id, "shell", session_id=SessionId("../x"))


# -- sandboxes -----------------------------------------------------------------


def test_sandbox_rows_follow_the_container(
    store: Store, conv: Conversation, clock: FakeClock
) -> None:
    name = "app-agent-c-0123"
    first = store.record_sandbox(name, conversation=conv.id, app="app", agent="bot", spec_hash="h1")
    clock.advance(10)
    same = store.record_sandbox(name, conversation=conv.id, app="app", agent="bot", spec_hash="h1",
                                state=SandboxState.STOPPED)  # fmt: skip
    assert same.created_at == first.created_at
    assert same.state is SandboxState.STOPPED
    clock.advance(10)
    recreated = store.record_sandbox(name, conversation=conv.id, app="app", agent="bot",
                                     spec_hash="h2")  # fmt: skip
    assert recreated.created_at == clock.now
    clock.advance(1)
    assert store.touch_sandbox(name).last_used_at == clock.now
    assert [s.name for s in store.sandboxes(app="app")] == [name]
    assert store.sandboxes(app="other") == []
    assert store.forget_sandbox(name) is True
    assert store.forget_sandbox(name) is False
    assert store.get_sandbox(name) is None


# -- shares (P6) ---------------------------------------------------------------


def test_P6_share_token_is_stored_hashed(tmp_path: Path, store: Store, conv: Conversation) -> None:
    session = store.open_session(conv.id, "shell")
    share, token = store.create_share(session.id, "report.pdf")
    raw = raw_bytes(tmp_path)
    assert hashlib.sha256(token.encode()).hexdigest().encode() in raw  # we read the right bytes
    assert token.encode() not in raw
    assert store.get_share_by_token(token) == share
    assert store.get_share_by_token(token + "x") is None


def test_P6_share_records_its_maker_and_who_revoked(store: Store, conv: Conversation) -> None:
    maker = store.open_session(conv.id, "shell")
    share, token = store.create_share(maker.id, "a.png")
    assert (share.session_id, share.conversation_id) == (maker.id, conv.id)
    revoked = store.revoke_share(token, revoked_by=maker.id)
    assert (revoked.active, revoked.revoked_by) == (False, maker.id)
    assert store.get_share_by_token(token) is None
    assert store.get_share_by_token(token, include_revoked=True) == revoked
    with pytest.raises(StateConflict):
        store.revoke_share(share.id, revoked_by=maker.id)
    with pytest.raises(NotFound) as info:
        store.revoke_share("not-a-real-token", revoked_by=maker.id)
    assert "not-a-real-token" not in str(info.value)  # a token never lands in an error
    second, _ = store.create_share(maker.id, "b.png")
    assert store.revoke_share(second.id, revoked_by="admin").revoked_by == "admin"
    assert [s.id for s in store.list_shares(conv.id)] == [share.id, second.id]
    assert store.list_shares(conv.id, include_revoked=False) == []


# -- attachment ledger (P3) ----------------------------------------------------


def test_P3_ledger_keeps_newest_200_per_chat(store: Store, conv: Conversation) -> None:
    other = store.upsert_conversation(ConversationKey("bot", "telegram", "elsewhere"))
    store.remember_attachment(other.id, "F0")
    for i in range(ATTACHMENT_LEDGER_SIZE + 5):
        store.remember_attachment(conv.id, f"F{i}")
    known = [
        i for i in range(ATTACHMENT_LEDGER_SIZE + 5) if store.attachment_known(conv.id, f"F{i}")
    ]
    assert known == list(range(5, ATTACHMENT_LEDGER_SIZE + 5))
    assert store.attachment_known(other.id, "F0")  # another chat's ledger is untouched
    assert not store.attachment_known(other.id, "F10")  # and never shared
    assert not store.attachment_known(conv.id, "F10", platform="discord")
    count = store._db.connection().execute(
        "SELECT count(*) FROM attachments WHERE conversation_id = ?", (conv.id,)
    )
    assert count.fetchone()[0] == ATTACHMENT_LEDGER_SIZE


def test_P3_seeing_a_file_again_makes_it_newest(store: Store, conv: Conversation) -> None:
    for i in range(ATTACHMENT_LEDGER_SIZE):
        store.remember_attachment(conv.id, f"F{i}")
    store.remember_attachment(conv.id, "F0")
    store.remember_attachment(conv.id, "NEW")
    assert store.attachment_known(conv.id, "F0")
    assert not store.attachment_known(conv.id, "F1")


# -- cron jobs (C1) ------------------------------------------------------------


def test_C1_stored_job_stays_unchanged(tmp_path: Path, clock: FakeClock) -> None:
    with Store.open(tmp_path, clock=clock) as s:
        job = s.create_cron_job("bot", CronType.PROMPT, "0 9 * * *", "good morning", one_shot=True)
        assert s.cron_jobs("bot") == [job]
        assert s.get_cron_job(job.id) == job
    clock.advance(3600)
    with Store.open(tmp_path, clock=clock) as s:
        assert s.cron_jobs() == [job]  # reading never uses up a one-shot job
        ran = s.mark_cron_run(job.id)  # only an actual run does
        assert (ran.enabled, ran.last_run_at) == (False, clock.now)
        with pytest.raises(StateConflict):
            s.mark_cron_run(job.id)
        updated = s.update_cron_job(job.id, enabled=True, schedule="0 10 * * *")
        assert (updated.enabled, updated.schedule, updated.payload) == (
            True, "0 10 * * *", "good morning")  # fmt: skip
        assert s.delete_cron_job(job.id) is True
        with pytest.raises(NotFound):
            s.update_cron_job(job.id, enabled=False)


# -- API keys (K2) -------------------------------------------------------------


def test_K2_key_secret_not_stored_and_lookup_works(
    tmp_path: Path, store: Store, clock: FakeClock
) -> None:
    key, secret = store.create_key("mcp bot", ["bot"], write=True)
    wide, wide_secret = store.create_key("ops", ["*"], admin=True)
    assert secret.startswith("cg_") and len(secret) > 40
    assert secret.startswith(key.prefix) and len(key.prefix) < len(secret) // 3
    raw = raw_bytes(tmp_path)
    assert hashlib.sha256(secret.encode()).hexdigest().encode() in raw
    assert secret.encode() not in raw
    assert secret[len(key.prefix) :].encode() not in raw

    found = store.lookup_key(secret)
    assert found == key
    assert (found.agents, found.admin, found.write) == (("bot",), False, True)
    assert store.lookup_key(wide_secret) == wide
    assert wide.agents == ("*",) and wide.admin
    assert store.lookup_key(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert store.lookup_key("") is None

    clock.advance(7)
    store.touch_key(key.id)
    assert store.lookup_key(secret).last_used_at == clock.now  # type: ignore[union-attr]


def test_K2_revoked_key_is_not_valid(store: Store) -> None:
    key, secret = store.create_key("old", ["bot"])
    revoked = store.revoke_key(key.id)
    assert not revoked.active
    assert store.lookup_key(secret) is None
    with pytest.raises(StateConflict):
        store.revoke_key(key.id)
    assert [k.id for k in store.list_keys()] == [key.id]
    assert store.list_keys(include_revoked=False) == []


def test_key_agents_must_be_a_list(store: Store) -> None:
    with pytest.raises(StoreError, match="list of agent ids"):
        store.create_key("x", "bot")


# -- audit of refusals ---------------------------------------------------------


def test_refusals_are_recorded_newest_first(store: Store, conv: Conversation) -> None:
    store.record_refusal(rule="P1", action="telegram_reply", reason="other chat",
                         conversation=conv.id, detail={"chat_id": "-5"})  # fmt: skip
    store.record_refusal(rule="K3", action="GET /v1/agents/bot/chats", reason="not admin")
    latest = store.record_refusal(rule="P5", action="share_file", reason="outside media",
                                  conversation=conv.id)  # fmt: skip
    mine = store.refusals(conv.id)
    assert [r.rule for r in mine] == ["P5", "P1"]
    assert mine[0] == latest
    assert mine[1].detail == {"chat_id": "-5"}
    assert [r.rule for r in store.refusals(limit=1)] == ["P5"]
    assert len(store.refusals()) == 3


def test_D1_close_while_another_thread_writes_waits_for_its_statement(tmp_path: Path) -> None:
    """Closing a connection under a running statement crashed the process (a segfault)."""
    store = Store.open(tmp_path)
    conv = store.upsert_conversation(ConversationKey("a", "api", "c"))
    inside = threading.Event()
    release = threading.Event()
    done: list[object] = []

    def writer() -> None:
        with store._db.write() as c:
            inside.set()
            release.wait(5)
            c.execute("UPDATE conversations SET last_active_at = 2 WHERE id = ?", (conv.id,))
        done.append("committed")

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(5)
    store.close()  # the writer's connection is in use: left to its thread
    release.set()
    t.join(5)
    assert done == ["committed"]
    with pytest.raises(StoreError, match="closed"):
        store.get_conversation(conv.id)
    reopened = Store.open(tmp_path)
    assert reopened.get_conversation(conv.id).last_active_at == 2.0  # type: ignore[union-attr]
    reopened.close()


def test_R4_F3_a_chats_queue_is_read_without_walking_its_history(
    store: Store, conv: Conversation
) -> None:
    """Every admission check and every turn reads the chat's queue: through the partial
    index of pending messages, so a chat of 20000 answered messages (years of it, or a
    stranger's flood) costs what a new chat costs. Counted in SQLite VM steps."""
    now = store._now()
    with store._db.write() as c:
        c.executemany(
            "INSERT INTO messages (conversation_id, platform_message_id, sender, text,"
            " received_at, state, updated_at) VALUES (?, ?, 's', 'old', ?, 'delivered', ?)",
            [(conv.id, f"old-{i}", now, now) for i in range(20_000)],
        )
    store.accept_message(conv.id, "new-1", sender="s", text="one")
    store.accept_message(conv.id, "new-2", sender="s", text="two")
    conn = store._db.connection()
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    conn.set_progress_handler(step, 100)  # called every 100 VM instructions
    try:
        assert [m.text for m in store.pending_for_conversation(conv.id)] == ["one", "two"]
        assert store.pending_count(conv.id) == 2
    finally:
        conn.set_progress_handler(None, 0)
    assert steps[0] < 20, steps[0]  # a walk of the history takes thousands
    plan = conn.execute(
        f"EXPLAIN QUERY PLAN SELECT * {QUEUE_SQL} ORDER BY id", (conv.id,)
    ).fetchall()
    assert any("messages_queue" in row[3] for row in plan), [tuple(r) for r in plan]


def test_R4_a_database_from_before_the_queue_index_gets_it(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / DB_FILE)
    for migration in MIGRATIONS[:-1]:
        for statement in migration:
            db.execute(statement)
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) - 1}")
    db.commit()
    db.close()
    with Store.open(tmp_path) as store:
        names = {r[0] for r in store._db.query("SELECT name FROM sqlite_master")}
    assert "messages_queue" in names
