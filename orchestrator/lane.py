"""The turn lane: one worker thread for the short blocking calls of every turn (F3).

A turn's store reads and writes, its conversation's host files and its
session files are many short calls, each a hop off the event loop. Spread
over the default executor's threads, a burst of new conversations keeps all
of them runnable at once, and every short system call of one becomes a hand
over of the interpreter lock to another: on a 2-core host 64 first turns
cost twice the context switches, and the loop itself waits its turn for the
lock (`benchmarks/pool_start.py --burst 64`: its event-loop lag, see
benchmarks/README.md). So they run here, one at a time, in the order they
came.

Only what is short and bounded by the turn's own data belongs here. What can
wait long on something else stays off the lane, so that it never queues
every turn of the gateway behind it: a new quota image to format (`mkfs`),
backups, archives, engine calls (the backend's own threads), anything a
background task does.

A conversation's sandbox host side (its quota image taken and bound onto its
dirs, the dirs made: `ConversationSandboxes.spec_for`) goes through a second
such thread, the host lane: mostly mount and inode work in the kernel, the
largest share of a new conversation's lane time, it runs beside the store
writes and files of the other turns instead of in their queue (measured with
64 new conversations at once: the event loop's lag p99 had a median of 8 ms
against 26 ms with it on the turn lane). The lane only hands it to the host
worker, a process of its own (`orchestrator.host_worker`), and runs it itself
when that worker cannot be had.

A third, the sync lane, runs the store's group fsync (`orchestrator.store.walsync`):
an accepted message and a reply are committed on the turn lane without an fsync of
their own, and their turn waits here, not on the turn lane, until they are on disk.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME = "cellgate-turns"
HOST_THREAD_NAME = "cellgate-host"
SYNC_THREAD_NAME = "cellgate-sync"
EXIT_WAIT = 30.0  # at interpreter exit, how long calls already queued get to finish


class Lane:
    """One thread running the calls given to it, in the order they came.

    Lighter than an executor and `wrap_future` on the event loop's side (F3: each
    hop is loop time, and a turn makes a dozen): the call goes into a queue, and its
    result comes back with one `call_soon_threadsafe` onto the caller's own future."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._starting = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._finished = threading.Event()

    def submit(
        self,
        call: Callable[[], T],
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[T],
    ) -> None:
        """Run `call` on the lane; its result or error is set on `future` in `loop`. A
        future cancelled before its call starts skips the call."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the interpreter is shutting down")
        self._inbox.put((call, loop, future))
        if self._thread is None:
            with self._starting:
                if self._thread is None:  # a daemon: `finish` (atexit) lets queued calls end
                    name = f"{self.name}_0"
                    thread = threading.Thread(target=self._run, name=name, daemon=True)
                    thread.start()
                    self._thread = thread

    def _run(self) -> None:
        while True:
            call, loop, future = self._inbox.get()
            if loop is None:
                self._finished.set()  # `finish`'s mark: everything queued before it ran
                continue
            if future.cancelled():
                continue  # its caller was cancelled before it started
            try:
                outcome: tuple[Any, BaseException | None] = (call(), None)
            except BaseException as exc:  # handed to the caller, as an executor does
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # its loop is closed: no one waits
                loop.call_soon_threadsafe(_settle, future, *outcome)
            del call, loop, future, outcome

    def finish(self, timeout: float = EXIT_WAIT) -> None:
        """Take no more calls and wait (bounded) for those queued and running to end."""
        self._closed = True
        if self._thread is not None:
            self._inbox.put((_nothing, None, None))
            self._finished.wait(timeout)


_Item = tuple[Callable[[], Any], Any, Any]


def _nothing() -> None:
    return None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future cannot carry it
        future.set_exception(RuntimeError(f"a lane call raised {error!r}"))
    else:
        future.set_exception(error)


_lane = Lane(THREAD_NAME)
_host = Lane(HOST_THREAD_NAME)
_sync = Lane(SYNC_THREAD_NAME)
for _each in (_lane, _host, _sync):
    atexit.register(_each.finish)


async def _on(lane: Lane, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    lane.submit(call, loop, future)
    return await future


async def in_lane(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`asyncio.to_thread`, on the turn lane (the caller's context variables too)."""
    return await _on(_lane, fn, *args, **kwargs)


async def in_host_lane(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`in_lane`, on the host lane (a conversation's sandbox host side, see above)."""
    return await _on(_host, fn, *args, **kwargs)


async def in_sync_lane(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`in_lane`, on the sync lane: the store's group fsync (`Store.sync`), which a turn
    waits for before it tells the outside and which no other turn's store call waits for."""
    return await _on(_sync, fn, *args, **kwargs)
