"""Admission (R4): rates, queue bounds, the sandbox cap, fair slots; supervised tasks."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from cellgate.errors import SandboxesBusy, Throttled
from cellgate.models import Attachment, ConversationKey, InboundMessage
from orchestrator.admission import LiveSandbox, MessageGate, SandboxGate, default_max_sandboxes
from orchestrator.config import Admission, load_config, write_config_document
from orchestrator.gateway import Gateway
from orchestrator.runner import Outcome, Outcomes
from orchestrator.slots import FairSlots
from orchestrator.store import ConversationId, MessageId, Store, conversation_id
from orchestrator.supervise import supervised
from policies.admission import Bucket, queue_room, sandbox_room, take_token
from tests.fakes.no_engine import NoEngineBackend
from tests.support.run_id import seed_gateway_id


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the pure policies -------------------------------------------------------


@pytest.mark.parametrize(
    ("bucket", "now", "allowed", "left"),
    [
        (None, 0.0, True, 4.0),  # a newcomer starts with a full burst
        (Bucket(0.0, 0.0), 1.0, False, 0.5),  # half a token after 1 s at 30/min
        (Bucket(0.0, 0.0), 2.0, True, 0.0),  # a whole one after 2 s
        (Bucket(5.0, 0.0), 1000.0, True, 4.0),  # never more than the burst
    ],
)
def test_R4_token_bucket(bucket: Bucket | None, now: float, allowed: bool, left: float) -> None:
    decision, after = take_token(bucket, now, per_minute=30, burst=5, what="you are sending")
    assert decision.allowed is allowed and decision.rule == "R4"
    assert after.tokens == pytest.approx(left)
    if not allowed:
        assert decision.reason == "you are sending more than 30 messages a minute; wait 1 s"


@pytest.mark.parametrize(("pending", "allowed"), [(0, True), (9, True), (10, False), (50, False)])
def test_R4_queue_room(pending: int, allowed: bool) -> None:
    assert queue_room(pending, 10).allowed is allowed


@pytest.mark.parametrize(
    ("live", "idle", "allowed", "evict"),
    [
        (3, [], True, None),
        (4, ["old", "new"], True, "old"),  # the longest idle makes room
        (4, [], False, None),  # all busy: the newcomer is refused, nobody evicted
    ],
)
def test_R4_sandbox_room(live: int, idle: list[str], allowed: bool, evict: str | None) -> None:
    room = sandbox_room(live, 4, idle)
    assert room.decision.allowed is allowed and room.evict == evict


def test_R4_default_sandbox_cap_fits_host_memory() -> None:
    # 24 GiB host, 512 MB sandboxes: 38, not the 100 that committed 51 GB
    assert default_max_sandboxes(512, 24 * 1024**3) == 38
    assert default_max_sandboxes(65536, 1024**3) == 1


# -- the gates ---------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(tmp_path)
    yield s  # type: ignore[misc]
    s.close()


async def test_R4_sender_rate_refuses_with_one_audit_row_per_minute(store: Store) -> None:
    clock = Clock()
    gate = MessageGate(
        Admission(senderPerMinute=6, chatPerMinute=1000, burst=3), store, clock=clock
    )

    async def none() -> int:
        return 0

    for i in range(3):
        await gate.admit("a", "tg", f"chat{i}", "mallory", None, none)
    for i in range(50):
        with pytest.raises(Throttled) as info:
            await gate.admit("a", "tg", f"chat{i}", "mallory", None, none)
    assert info.value.rule == "R4" and info.value.public
    await gate.admit("a", "tg", "x", "alice", None, none)  # another sender is not held up
    audits = [r for r in store.refusals() if r.action == "message"]
    assert len(audits) == 1  # one per refused sender a minute, not one per flood message
    clock.now += 10.0  # 6/min: one token per 10 s
    await gate.admit("a", "tg", "chat0", "mallory", None, none)


async def test_R4_queue_bound_refuses_the_eleventh_waiting_message(store: Store) -> None:
    gate = MessageGate(Admission(maxQueuedPerChat=10), store, clock=Clock())
    conv = store.upsert_conversation(ConversationKey("a", "tg", "c"))

    async def ten() -> int:
        return 10

    with pytest.raises(Throttled, match="10 messages waiting"):
        await gate.admit("a", "tg", "c", "u", conv.id, ten)


async def test_R4_rate_buckets_are_bounded(store: Store) -> None:
    gate = MessageGate(Admission(), store, clock=Clock(), size=100)

    async def none() -> int:
        return 0

    for i in range(1000):
        await gate.admit("a", "tg", f"c{i}", f"u{i}", None, none)
    assert len(gate._buckets) <= 100


async def test_R4_sandbox_cap_evicts_idle_then_refuses_when_all_busy(store: Store) -> None:
    live = [
        LiveSandbox("sb-old", ConversationId("c-old"), 1.0, busy=False),
        LiveSandbox("sb-busy", ConversationId("c-busy"), 0.5, busy=True),
    ]
    evicted: list[str] = []

    async def listing() -> list[LiveSandbox]:
        return list(live)

    async def evict(name: str) -> bool:
        evicted.append(name)
        live[:] = [sb for sb in live if sb.name != name]
        return True

    gate = SandboxGate(2, listing, evict, store)
    await gate.make_room(ConversationId("c-busy"))  # its own sandbox: nothing to do
    await gate.make_room(ConversationId("c-new"))
    assert evicted == ["sb-old"]
    live.append(LiveSandbox("sb-new", ConversationId("c-new"), 2.0, busy=True))
    with pytest.raises(SandboxesBusy) as info:
        await gate.make_room(ConversationId("c-third"))
    assert "busy" in (info.value.public or "")
    assert [r.rule for r in store.refusals() if r.action == "sandbox"] == ["R4"]


# -- fair slots --------------------------------------------------------------


async def test_R4_fair_slots_serve_owners_round_robin() -> None:
    slots = FairSlots(2, per_owner=2)
    order: list[str] = []
    release = asyncio.Event()

    async def turn(owner: str, tag: str) -> None:
        async with slots.slot(owner):
            order.append(tag)
            await release.wait()

    tasks = [asyncio.create_task(turn("flood", f"f{i}")) for i in range(6)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(turn("quiet", "q")))
    await asyncio.sleep(0.01)
    assert order == ["f0", "f1"]
    release.set()
    await asyncio.gather(*tasks)
    assert order.index("q") <= 3  # right after the first slot frees, not after the flood


async def test_R4_fair_slots_cancelled_waiter_frees_nothing_it_did_not_hold() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    slots.release("a")
    assert slots.in_use == 0 and slots.waiting == 0
    await asyncio.wait_for(slots.acquire("c"), 1)


# -- bounded maps and supervised tasks ---------------------------------------


def test_R4_turn_outcomes_are_bounded() -> None:
    outcomes = Outcomes(size=10)
    for i in range(1000):
        outcomes.put(MessageId(i), Outcome("sb", None, None))
    assert len(outcomes) == 10
    assert outcomes.take(MessageId(999)) is not None and outcomes.take(MessageId(999)) is None


async def test_supervised_task_logs_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"pass {runs} broke")

    caplog.set_level(logging.ERROR)
    await asyncio.wait_for(supervised("reaper", flaky, first_pause=0.01), 5)
    assert runs == 3
    assert sum("background task reaper failed" in r.getMessage() for r in caplog.records) == 2


async def test_supervised_task_stops_when_cancelled() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(supervised("heartbeats", forever))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_R4_refused_messages_from_new_chats_store_nothing(tmp_path: Path) -> None:
    """A flood of new chats from one sender: what admission refuses is not stored at
    all, not even as a conversation row; what it admits is stored with its conversation
    in one transaction (D1: committed before the caller hears it was accepted)."""
    state = seed_gateway_id(tmp_path / "state")
    config = state / "config.json"
    host = {
        "id": "floody",
        "isolateMemory": True,
        "harness": {"type": "command", "argv": ["/bin/true"], "output": "text"},
    }
    admission = {"senderPerMinute": 6, "chatPerMinute": 1000, "burst": 3}
    write_config_document(
        config, {"gateway": {"stateDir": str(state), "admission": admission}, "agents": [host]}
    )
    gw = Gateway(load_config(config), NoEngineBackend())
    try:
        admitted = []
        for i in range(40):
            try:
                msg, created = await gw.intake.submit(
                    "floody", "api", f"flood-{i}", "hi", sender="mallory"
                )
            except Throttled:
                continue
            assert created
            admitted.append((f"flood-{i}", msg))
        assert len(admitted) == 3  # the burst
        for i in range(40):  # the same sender through a channel, a photo in each message
            photo = Attachment("photo", f"file-{i}")
            inbound = InboundMessage(
                "floody", "api", f"pic-{i}", f"m{i}", "", "mallory", None, (photo,)
            )
            with pytest.raises(Throttled):
                await gw.inbox(inbound)
        convs = gw.store.conversations("floody")
        assert sorted(c.chat_id for c in convs) == sorted(chat for chat, _ in admitted)
        count = gw.store._db.connection().execute("SELECT count(*) FROM attachments")
        assert count.fetchone()[0] == 0
        for chat, msg in admitted:
            key = ConversationKey("floody", "api", chat)
            found = gw.store.find_message(conversation_id(key), msg.platform_message_id)
            assert found is not None and (found.id, found.text) == (msg.id, "hi")
        photo = Attachment("photo", "file-ok")
        await gw.inbox(InboundMessage("floody", "api", "pic-ok", "ok", "", "alice", None, (photo,)))
        conv = conversation_id(ConversationKey("floody", "api", "pic-ok"))
        assert gw.store.attachment_known(conv, "file-ok", platform="api")  # another sender
    finally:
        await gw.close()
