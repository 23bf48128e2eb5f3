"""The durable turn loop with a scripted turn function over a real store (D1, D2, R4, R6).

No sandbox, no Docker: each test scripts what a turn does (sleep, raise, time
out, block) and what delivery does, and checks what a chat would notice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from cellgate.errors import EngineUnavailable, ExecFailed
from cellgate.models import ConversationKey
from orchestrator.lane import in_lane
from orchestrator.store import Conversation, Message, MessageId, MessageState, Reply, Store
from orchestrator.turns import TurnAnswer, TurnLoop

HOST_PATH = "/var/lib/cellgate/agents/a/workspace/chats/secret"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(tmp_path)
    yield s  # type: ignore[misc]
    s.close()


class Delivered:
    def __init__(self) -> None:
        self.replies: list[tuple[str, str]] = []
        self.fail_next = 0

    async def __call__(self, conv: Conversation, reply: Reply) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise ConnectionError("the platform hung up")
        self.replies.append((conv.chat_id, reply.text))


def submit(store: Store, loop: TurnLoop, chat: str, text: str, sender: str = "") -> Message:
    conv = store.upsert_conversation(ConversationKey("a", "tg", chat))
    msg, _ = store.accept_message(conv.id, f"{chat}:{text}", sender=sender, text=text)
    loop.wake(conv.id)
    return msg


async def settle(
    store: Store, ids: list[MessageId], *, within: float = 10.0
) -> dict[MessageId, MessageState]:
    """Wait until every message is DELIVERED or FAILED; their final states."""
    async with asyncio.timeout(within):
        while True:
            states = {i: store.get_message(i).state for i in ids}  # type: ignore[union-attr]
            if all(s in (MessageState.DELIVERED, MessageState.FAILED) for s in states.values()):
                return states
            await asyncio.sleep(0.02)


@pytest.fixture
async def make_loop(store: Store) -> AsyncIterator[Callable[..., TurnLoop]]:
    loops: list[TurnLoop] = []

    def make(
        run: Callable[[Conversation, Message], Awaitable[TurnAnswer]],
        deliver: Callable[[Conversation, Reply], Awaitable[None]],
        **kw: object,
    ) -> TurnLoop:
        kw.setdefault("bound", 4)
        kw.setdefault("retry_pause", 0.05)
        loop = TurnLoop(store, run, deliver, **kw)  # type: ignore[arg-type]
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        await loop.close()


async def echo(conv: Conversation, msg: Message) -> TurnAnswer:
    await asyncio.sleep(0.01)
    return TurnAnswer(True, f"re:{msg.text}")


async def test_D1_turns_of_one_conversation_run_in_arrival_order(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    out = Delivered()
    loop = make_loop(echo, out)
    ids = [submit(store, loop, "c1", f"m{i}").id for i in range(8)]
    await settle(store, ids)
    assert out.replies == [("c1", f"re:m{i}") for i in range(8)]


async def test_D1_F3_a_reply_read_from_the_store_is_delivered_as_it_is_stored(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    """A conversation whose caller reads the stored reply (the `api` channel) has it
    stamped delivered in the commit that records it: one durable commit for the answer,
    not two; the delivery is still called (and counted). Another chat's reply is marked
    delivered only after its channel took it."""
    out = Delivered()
    loop = make_loop(echo, out, delivered_by_store=lambda conv: conv.chat_id == "api-chat")
    commits: list[str] = []

    def trace() -> None:  # the turn lane's connection: the loop's reads and writes
        conn = store._db.connection()
        conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)

    await in_lane(trace)
    try:
        api = submit(store, loop, "api-chat", "q")
        await settle(store, [api.id])
        api_commits = len(commits)
        commits.clear()
        other = submit(store, loop, "tg-chat", "q")
        await settle(store, [other.id])
    finally:
        await in_lane(lambda: store._db.connection().set_trace_callback(None))
    assert out.replies == [("api-chat", "re:q"), ("tg-chat", "re:q")]
    api_reply, tg_reply = store.reply_for_message(api.id), store.reply_for_message(other.id)
    assert api_reply is not None and api_reply.delivered_at == api_reply.created_at
    assert tg_reply is not None and tg_reply.delivered_at is not None
    assert api_commits == len(commits) - 1  # the api chat's has no mark_delivered commit


async def test_R4_the_global_bound_holds_and_is_used(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    running = 0
    peak = 0

    async def slow(conv: Conversation, msg: Message) -> TurnAnswer:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.1)
        running -= 1
        return TurnAnswer(True, "done")

    loop = make_loop(slow, Delivered(), bound=3)
    ids = [submit(store, loop, f"c{i}", "x", sender=f"u{i}").id for i in range(9)]
    await settle(store, ids)
    assert peak == 3


async def test_R4_one_senders_slow_turns_do_not_hold_every_slot(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    """A stranger floods 8 chats with slow turns; another chat still starts at once."""
    started: dict[str, float] = {}
    gate = asyncio.Event()

    async def run(conv: Conversation, msg: Message) -> TurnAnswer:
        started[conv.chat_id] = asyncio.get_running_loop().time()
        if msg.sender == "flooder":
            await gate.wait()
        return TurnAnswer(True, "ok")

    loop = make_loop(run, Delivered(), bound=4, per_sender=2)
    flood = [submit(store, loop, f"flood{i}", "sleep", sender="flooder").id for i in range(8)]
    await asyncio.sleep(0.1)
    assert sum(1 for c in started if c.startswith("flood")) == 2  # the flooder's share
    t0 = asyncio.get_running_loop().time()
    other = submit(store, loop, "other", "hi", sender="someone-else").id
    await settle(store, [other], within=2.0)
    assert started["other"] - t0 < 0.5
    gate.set()
    await settle(store, flood)


async def test_R6_a_turn_that_times_out_is_answered_briefly(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    async def hang(conv: Conversation, msg: Message) -> TurnAnswer:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    out = Delivered()
    loop = make_loop(hang, out, turn_timeout=0.2)
    msg = submit(store, loop, "c1", "hang")
    assert (await settle(store, [msg.id]))[msg.id] is MessageState.DELIVERED
    [(_, text)] = out.replies
    assert "took longer than 0.2 s" in text and "(ref r-" in text


@pytest.mark.parametrize(
    "error",
    [ExecFailed(f"mount {HOST_PATH} failed", 1, HOST_PATH), RuntimeError(f"boom at {HOST_PATH}")],
    ids=["cellgate-error", "crash"],
)
async def test_R6_a_failed_turn_shows_a_reference_not_internals(
    store: Store,
    make_loop: Callable[..., TurnLoop],
    error: Exception,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fail(conv: Conversation, msg: Message) -> TurnAnswer:
        raise error

    out = Delivered()
    loop = make_loop(fail, out)
    caplog.set_level(logging.INFO)
    msg = submit(store, loop, "c1", "x")
    await settle(store, [msg.id])
    [(_, text)] = out.replies
    assert "/var/lib" not in text and "secret" not in text and type(error).__name__ not in text
    ref = text.rsplit("(ref ", 1)[1].rstrip(")")
    assert any(ref in r.getMessage() for r in caplog.records)  # the operator finds it
    [audit] = [r for r in store.refusals() if r.action == "turn"]
    assert audit.detail == {"ref": ref} and HOST_PATH in audit.reason


async def test_D2_a_delivery_that_raises_is_retried_and_the_worker_goes_on(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    """Before: a failing delivery ended the worker and the message waited forever."""
    out = Delivered()
    out.fail_next = 2
    loop = make_loop(echo, out)
    first = submit(store, loop, "c1", "one")
    second = submit(store, loop, "c1", "two")
    states = await settle(store, [first.id, second.id])
    assert set(states.values()) == {MessageState.DELIVERED}
    assert out.replies == [("c1", "re:one"), ("c1", "re:two")]  # still in order


async def test_D2_a_delivery_that_never_works_is_given_up_not_retried_forever(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    out = Delivered()
    out.fail_next = 10_000
    loop = make_loop(echo, out, retry_pause=0.01)
    first = submit(store, loop, "c1", "one")
    states = await settle(store, [first.id])
    assert states[first.id] is MessageState.FAILED
    out.fail_next = 0
    later = submit(store, loop, "c1", "two")
    await settle(store, [later.id])
    assert out.replies == [("c1", "re:two")]


async def test_D2_a_waiter_gets_the_reply_even_when_delivery_fails(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    out = Delivered()
    out.fail_next = 1
    loop = make_loop(echo, out)
    msg = submit(store, loop, "c1", "hello")
    reply = await loop.wait(msg.id, 5)
    assert reply.text == "re:hello"


async def test_D2_cancelled_turns_are_run_again_after_recovery(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    entered = asyncio.Event()

    async def block(conv: Conversation, msg: Message) -> TurnAnswer:
        entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    loop = make_loop(block, Delivered())
    msg = submit(store, loop, "c1", "x")
    await asyncio.wait_for(entered.wait(), 5)
    await loop.close()
    state = store.get_message(msg.id).state  # type: ignore[union-attr]
    assert state in (MessageState.ACCEPTED, MessageState.RUNNING)  # still queued, not lost
    out = Delivered()
    again = make_loop(echo, out)
    assert await again.recover() == 1
    await settle(store, [msg.id])
    assert out.replies == [("c1", "re:x")]


async def test_R4_lock_and_worker_maps_do_not_grow_with_strangers(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    loop = make_loop(echo, Delivered(), bound=8)
    ids = [submit(store, loop, f"c{i}", "x").id for i in range(200)]
    await settle(store, ids)
    await asyncio.sleep(0.05)
    assert loop.workers == 0
    assert len(loop._locks) == 0 and len(loop._workers) == 0


async def test_R7_engine_away_the_message_waits_and_is_answered_when_it_returns(
    store: Store, make_loop: Callable[..., TurnLoop], caplog: pytest.LogCaptureFixture
) -> None:
    away = 2

    async def run(conv: Conversation, msg: Message) -> TurnAnswer:
        nonlocal away
        if away:
            away -= 1
            raise EngineUnavailable("connection refused")
        return TurnAnswer(True, f"re:{msg.text}")

    caplog.set_level(logging.INFO)
    out = Delivered()
    loop = make_loop(run, out, retry_pause=0.02)
    first = submit(store, loop, "c1", "one")
    second = submit(store, loop, "c1", "two")
    await settle(store, [first.id, second.id])
    assert out.replies == [("c1", "re:one"), ("c1", "re:two")]  # once each, in order
    logs = [r.getMessage() for r in caplog.records]
    assert any("engine is unavailable" in m for m in logs)
    assert any("engine answers again" in m for m in logs)


async def test_R7_engine_away_for_good_is_answered_with_a_reference(
    store: Store, make_loop: Callable[..., TurnLoop]
) -> None:
    async def run(conv: Conversation, msg: Message) -> TurnAnswer:
        raise EngineUnavailable("connection refused at /var/run/docker.sock")

    out = Delivered()
    loop = make_loop(run, out, retry_pause=0.001)
    msg = submit(store, loop, "c1", "x")
    await settle(store, [msg.id], within=20)
    [(_, text)] = out.replies
    assert "(ref r-" in text and "docker.sock" not in text
