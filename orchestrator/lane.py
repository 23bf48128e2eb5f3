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
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME = "cellgate-turns"
_lane = ThreadPoolExecutor(1, THREAD_NAME)
HOST_THREAD_NAME = "cellgate-host"
_host = ThreadPoolExecutor(1, HOST_THREAD_NAME)


async def in_lane(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`asyncio.to_thread`, on the turn lane (the caller's context variables too)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await loop.run_in_executor(_lane, call)


async def in_host_lane(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`in_lane`, on the host lane (a conversation's sandbox host side, see above)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await loop.run_in_executor(_host, call)
