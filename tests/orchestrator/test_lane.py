"""F3: the turn lane, one worker thread for the short blocking calls of every turn.

A burst keeps one thread, not the default executor's many, handing the
interpreter lock back and forth with the event loop; and a turn never waits
behind what fills the default executor (backups, spare quota images, a
refill). Nothing here needs an engine: the turn is a host agent's.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.gateway import Gateway
from orchestrator.lane import HOST_THREAD_NAME, THREAD_NAME, Lane, in_host_lane, in_lane
from tests.support.host_gateway import host_agent_gateway

AGENT = "laned"
WHO = contextvars.ContextVar("WHO", default="nobody")


async def test_F3_lane_is_one_thread_in_order_with_the_callers_context() -> None:
    seen: list[tuple[str, str, float, float]] = []

    def job(i: int) -> int:
        t0 = time.monotonic()
        time.sleep(0.02)
        seen.append((threading.current_thread().name, WHO.get(), t0, time.monotonic()))
        return i * 2

    WHO.set("caller")
    got = await asyncio.gather(*(in_lane(job, i) for i in range(4)))
    assert got == [0, 2, 4, 6]
    assert {name.rsplit("_", 1)[0] for name, *_ in seen} == {THREAD_NAME}
    assert {who for _, who, *_ in seen} == {"caller"}
    spans = sorted((t0, t1) for *_, t0, t1 in seen)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # one at a time


async def _held_lane() -> tuple[threading.Event, asyncio.Future[None]]:
    """The turn lane busy with a call that waits for the returned event."""
    gate, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(10)

    held = asyncio.ensure_future(in_lane(hold))
    assert await asyncio.to_thread(started.wait, 5)
    return gate, held


async def test_F3_a_call_whose_caller_was_cancelled_before_it_started_never_runs() -> None:
    ran: list[str] = []
    gate, held = await _held_lane()
    doomed = asyncio.ensure_future(in_lane(ran.append, "doomed"))
    await asyncio.sleep(0.05)
    doomed.cancel()
    gate.set()
    await held
    await in_lane(ran.append, "after")
    assert ran == ["after"]
    with pytest.raises(asyncio.CancelledError):
        await doomed


async def test_F3_a_calls_error_reaches_its_caller_and_the_lane_goes_on() -> None:
    def fails() -> None:
        raise ValueError("broken call")

    def stops() -> None:
        raise StopIteration  # a future cannot carry it: a RuntimeError instead

    with pytest.raises(ValueError, match="broken call"):
        await in_lane(fails)
    with pytest.raises(RuntimeError, match="StopIteration"):
        await in_lane(stops)
    assert await in_lane(lambda: 7) == 7


async def test_F3_finish_lets_queued_calls_end_then_takes_no_more() -> None:
    """At interpreter exit (atexit) a lane runs what was queued, bounded, as an
    executor's threads would; a call after that is refused, not lost silently."""
    lane = Lane("test-lane")
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    done: list[int] = []
    futures: list[asyncio.Future[None]] = [loop.create_future() for _ in range(3)]

    def hold() -> None:
        gate.wait(10)

    lane.submit(hold, loop, futures[0])
    lane.submit(functools.partial(done.append, 1), loop, futures[1])
    lane.submit(functools.partial(done.append, 2), loop, futures[2])
    finishing = asyncio.ensure_future(asyncio.to_thread(lane.finish, 10))
    await asyncio.sleep(0.05)
    assert not finishing.done()  # the first call still holds the lane
    gate.set()
    await finishing
    assert done == [1, 2]
    with pytest.raises(RuntimeError, match="shutting down"):
        lane.submit(hold, loop, loop.create_future())
    await asyncio.gather(*futures)


async def test_F3_host_lane_is_its_own_thread_beside_the_turn_lane() -> None:
    """A conversation's sandbox host side held up (a slow mount) does not hold up the
    turn lane: another turn's store writes and files go on."""
    held, started = threading.Event(), threading.Event()

    def host_job() -> str:
        started.set()
        held.wait(10)
        return threading.current_thread().name

    WHO.set("caller")
    host = asyncio.ensure_future(in_host_lane(host_job))
    try:
        assert await asyncio.to_thread(started.wait, 5)
        name, who = await asyncio.wait_for(
            in_lane(lambda: (threading.current_thread().name, WHO.get())), 5
        )
        assert name.rsplit("_", 1)[0] == THREAD_NAME and who == "caller"
        assert not host.done()
    finally:
        held.set()
    assert (await host).rsplit("_", 1)[0] == HOST_THREAD_NAME


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with host_agent_gateway(tmp_path, AGENT) as gw:
        yield gw


async def test_F3_a_turn_does_not_wait_behind_a_full_default_executor(gateway: Gateway) -> None:
    """Every thread of the default executor busy (a backup, a refill): a turn is
    answered all the same, its store and host-file calls on the lane. (The gateway's
    start, once, uses the default executor: it is over before.)"""
    assert (await gateway.turn(AGENT, "api", "alice", "true")).result.ok
    loop = asyncio.get_running_loop()
    busy = ThreadPoolExecutor(1, "test-default")
    loop.set_default_executor(busy)
    held = threading.Event()
    blocker = loop.run_in_executor(None, held.wait, 60)
    try:
        async with asyncio.timeout(20):
            out = await gateway.turn(AGENT, "api", "bob", "echo answered")
        assert out.result.ok and "answered" in out.result.reply
        assert not blocker.done()  # the default executor was held all along
    finally:
        held.set()
        await blocker
        busy.shutdown()
