"""D1, F3: group commit. An accepted message and a reply commit on the turn lane
without an fsync of their own, and whoever tells the outside of them waits first for
one fsync of the WAL that began after their commit, shared with the other commits
made meanwhile. Real SQLite files; the fsyncs are counted at `os.fdatasync`."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from cellgate.errors import StoreError
from cellgate.models import ConversationKey, DeliveryReceipt, OutboundMessage
from channels.base import Channel, InboundHandler
from orchestrator.gateway import Gateway
from orchestrator.lane import in_lane
from orchestrator.store import MessageState, Store
from tests.support.host_gateway import host_agent_gateway

KEY = ConversationKey("bot", "telegram", "-1001")
AGENT = "grouped"


def _commit_levels(store: Store, write: Callable[[], object]) -> list[int]:
    """The `synchronous` level in force at each COMMIT of `write` (2 FULL, 1 NORMAL)."""
    conn = store._db.connection()
    levels: list[int] = []

    def seen(sql: str) -> None:
        if sql == "COMMIT":
            levels.append(conn.execute("PRAGMA synchronous").fetchone()[0])

    conn.set_trace_callback(seen)
    try:
        write()
    finally:
        conn.set_trace_callback(None)
    return levels


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file each `os.fdatasync` and `os.fsync` of this process was called on."""
    seen: list[str] = []
    real_data, real_full = os.fdatasync, os.fsync

    def name(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def data(fd: int) -> None:
        seen.append(name(fd))
        real_data(fd)

    def full(fd: int) -> None:
        seen.append(name(fd))
        real_full(fd)

    monkeypatch.setattr(os, "fdatasync", data)
    monkeypatch.setattr(os, "fsync", full)
    return seen


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path) as s:
        yield s


def test_D1_F3_a_deferred_write_commits_without_fsync_and_sync_puts_it_on_disk(
    store: Store, synced: list[str]
) -> None:
    wal = f"{store.path}-wal"
    with store.deferred_sync() as ticket:
        levels = _commit_levels(store, lambda: store.accept_new(KEY, "m1", sender="u", text="hi"))
    assert levels == [1]  # NORMAL: no fsync in the commit
    assert synced == []
    store.sync(ticket)
    assert synced == [wal]  # (its directory was synced once, as the store opened)
    synced.clear()
    store.sync(ticket)  # covered already: no second fsync
    assert synced == []
    # outside the block a durable write is FULL again, as before
    assert _commit_levels(store, lambda: store.accept_new(KEY, "m2", sender="u", text="x")) == [2]


def test_D1_F3_a_block_inside_another_leaves_the_outer_one_deferred(store: Store) -> None:
    with store.deferred_sync() as outer:
        with store.deferred_sync() as inner:
            store.accept_new(KEY, "m1", sender="u", text="hi")
        levels = _commit_levels(store, lambda: store.accept_new(KEY, "m2", sender="u", text="x"))
    assert levels == [1]
    assert outer.upto > inner.upto > 0
    assert _commit_levels(store, lambda: store.accept_new(KEY, "m3", sender="u", text="y")) == [2]


def test_D1_F3_one_fsync_covers_every_commit_made_before_it_began(
    store: Store, synced: list[str]
) -> None:
    tickets = []
    for i in range(5):
        with store.deferred_sync() as ticket:
            store.accept_new(KEY, f"m{i}", sender="u", text="hi")
        tickets.append(ticket)
    assert [t.upto for t in tickets] == sorted({t.upto for t in tickets})  # each its own
    store.sync(tickets[-1])
    done = len(synced)
    for ticket in tickets:
        store.sync(ticket)
    assert len(synced) == done  # the last one's fsync covered the four before it
    with store.deferred_sync() as later:
        store.accept_new(KEY, "m9", sender="u", text="new")
    store.sync(later)
    assert len(synced) == done + 1 and synced[-1] == f"{store.path}-wal"


def test_D1_an_idempotent_repeat_is_not_told_before_the_first_is_on_disk(
    store: Store, synced: list[str]
) -> None:
    """A platform that sends a message twice hears "accepted" for the repeat only once
    the first one's commit is on disk: the repeat writes nothing, its ticket covers
    the commit it found."""
    with store.deferred_sync() as first:
        store.accept_new(KEY, "m1", sender="u", text="hi")
    with store.deferred_sync() as repeat:
        _, created = store.accept_new(KEY, "m1", sender="u", text="hi")
    assert not created
    assert repeat.upto >= first.upto > 0
    store.sync(repeat)
    assert synced and synced[0] == f"{store.path}-wal"
    synced.clear()
    store.sync(first)
    assert synced == []


def test_D1_a_store_that_opens_syncs_first_what_another_left_unsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway killed between a commit and its fsync leaves the commit in the page
    cache; the next one may find it (an idempotent repeat, a reply to deliver) and
    tell it, so a store syncs the WAL and its directory as it opens."""
    with Store.open(tmp_path) as first:
        with first.deferred_sync():
            first.accept_new(KEY, "m1", sender="u", text="hi")  # never synced
        seen: list[str] = []
        real = os.fdatasync

        def data(fd: int) -> None:
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        monkeypatch.setattr(os, "fdatasync", data)
        with Store.open(tmp_path) as second:
            assert seen == [f"{second.path}-wal"]


def test_D1_a_failed_fsync_is_a_store_error_and_the_next_sync_tries_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    with store.deferred_sync() as ticket:
        store.accept_new(KEY, "m1", sender="u", text="hi")
    real = os.fdatasync

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(StoreError, match=r"syncing .* to disk failed"):
        store.sync(ticket)
    calls: list[int] = []

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    store.sync(ticket)  # not counted as synced after the failure
    assert len(calls) == 1


def test_D1_sync_without_a_wal_file_syncs_the_database_itself(
    store: Store, synced: list[str]
) -> None:
    with store.deferred_sync() as ticket:
        store.accept_new(KEY, "m1", sender="u", text="hi")
    store._db.connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    os.unlink(f"{store.path}-wal")  # as after the last connection closed
    store.sync(ticket)
    assert synced[0] == str(store.path)


# -- the gateway: nothing is told before its fsync --------------------------------


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with host_agent_gateway(tmp_path, AGENT) as gw:
        yield gw


class HeldSync:
    """`WalSync._fsync` held at a gate, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gw: Gateway) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.count = 0
        wal = gw.store._db.wal
        real = wal._fsync

        def held() -> None:
            self.count += 1
            self.entered.set()
            self.gate.wait(30)
            real()

        monkeypatch.setattr(wal, "_fsync", held)


async def test_D1_F3_a_message_is_acknowledged_only_once_its_fsync_is_done(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit` returning is what lets a channel acknowledge the platform: not before
    the fsync that covers the message's commit has ended. Ten more submitted while
    that fsync runs share one more (group commit), not ten."""
    held = HeldSync(monkeypatch, gateway)
    first = asyncio.ensure_future(gateway.submit(AGENT, "api", "alice", "true"))
    assert await asyncio.to_thread(held.entered.wait, 10)
    more = [
        asyncio.ensure_future(gateway.submit(AGENT, "api", f"chat{i}", "true")) for i in range(10)
    ]
    await asyncio.sleep(0.3)
    assert not first.done() and not any(m.done() for m in more)
    held.gate.set()
    async with asyncio.timeout(20):
        await asyncio.gather(first, *more)
    assert held.count <= 3  # the first, then at most two for the ten queued behind it


async def test_D1_a_reply_is_handed_over_only_once_its_fsync_is_done(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (await gateway.turn(AGENT, "api", "bob", "echo warm")).result.ok
    msg, _ = await gateway.submit(AGENT, "api", "bob", "echo answered")
    held = HeldSync(monkeypatch, gateway)
    waiting = asyncio.ensure_future(gateway.loop.wait(msg.id, 30))
    assert await asyncio.to_thread(held.entered.wait, 20)  # the reply's commit, syncing
    await asyncio.sleep(0.3)
    assert not waiting.done()
    reply = gateway.store.reply_for_message(msg.id)
    assert reply is not None and "answered" in reply.text  # committed, not yet told
    held.gate.set()
    async with asyncio.timeout(20):
        got = await waiting
    assert "answered" in got.text


async def test_D1_a_message_whose_fsync_failed_is_refused_to_its_sender_but_not_lost(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk failed the accepted message's fsync: its sender is not told it was
    accepted (an error: a platform sends it again), yet the stored message is answered,
    once its reply's own fsync, which covers the message too, has gone through."""
    wal = gateway.store._db.wal
    real = wal._fsync
    failures = [1]

    def once() -> None:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        real()

    monkeypatch.setattr(wal, "_fsync", once)
    with pytest.raises(StoreError, match="to disk failed"):
        await gateway.submit(AGENT, "api", "carol", "echo kept", message_id="m-kept")
    conv = gateway.store.upsert_conversation(ConversationKey(AGENT, "api", "carol"))
    msg = gateway.store.find_message(conv.id, "m-kept")
    assert msg is not None
    async with asyncio.timeout(20):
        reply = await gateway.loop.wait(msg.id, 20)
    assert "kept" in reply.text
    again, created = await gateway.submit(AGENT, "api", "carol", "echo kept", message_id="m-kept")
    assert again.id == msg.id and not created  # the platform's resend: the same message


def _until(done: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Sent(Channel):
    """A platform channel that records what it sent; `on_send` runs after each send."""

    name = "telegram"

    def __init__(self, on_send: Callable[[], None]) -> None:
        self.agent = AGENT
        self.sent: list[OutboundMessage] = []
        self.on_send = on_send

    async def start(self, on_message: InboundHandler) -> None: ...

    async def stop(self) -> None: ...

    async def send(self, message: OutboundMessage) -> DeliveryReceipt:
        self.sent.append(message)
        self.on_send()
        return DeliveryReceipt(f"tg-{len(self.sent)}")


async def test_D1_F3_a_sent_reply_is_stamped_without_holding_the_turn_lane_for_its_fsync(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply sent on a platform channel is stamped delivered with the shared WAL fsync
    (off the turn lane, which serves other turns meanwhile); its worker goes on only
    once that fsync has ended."""
    holds: list[HeldSync] = []
    channel = Sent(lambda: holds.append(HeldSync(monkeypatch, gateway)))
    gateway.channels[(AGENT, "telegram")] = channel
    msg, _ = await gateway.submit(AGENT, "telegram", "-42", "echo sent")
    worker = gateway.loop._workers[msg.conversation_id]
    async with asyncio.timeout(20):
        await asyncio.to_thread(_until, lambda: bool(holds))
    held = holds[0]
    try:
        assert await asyncio.to_thread(held.entered.wait, 20)  # the stamp's commit, syncing
        assert "sent" in channel.sent[0].text
        async with asyncio.timeout(5):  # the turn lane is free while the fsync is held
            stamped = await in_lane(gateway.store.reply_for_message, msg.id)
        assert stamped is not None and stamped.delivered_at is not None
        await asyncio.sleep(0.2)  # the worker waits for the fsync
        assert not worker.done()
    finally:
        held.gate.set()  # the sync lane is the whole process's
    async with asyncio.timeout(20):
        await worker
    stored = gateway.store.get_message(msg.id)
    assert stored is not None and stored.state is MessageState.DELIVERED
    assert len(channel.sent) == 1
