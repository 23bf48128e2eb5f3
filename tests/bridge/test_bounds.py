"""A hostile sandbox against its bridge (R3, R4): floods, huge frames, slow frames.

Everything runs over the real unix socket of a real `BridgeServer` with the
standard tools and the `api` channel's `PendingOutbox`. The flooding client is
a separate process, so the memory measured here (tracemalloc of this process,
and its RSS) is the gateway side's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bridge import (
    BridgeLimits,
    BridgeServer,
    BuiltinTools,
    PendingOutbox,
    StoreRefusals,
    ToolHandlers,
)
from orchestrator.bridge.outbox import message_bytes
from policies.bridge import PENDING_MAX_BYTES, PENDING_MAX_MESSAGES, RateLimit
from sandbox.client import cellgate_tool
from tests.bridge.conftest import Chat, World, make_world

MiB = 1024 * 1024
NO_RATE_LIMIT = RateLimit(per_second=1e9, burst=10**9)

# The flooding sandbox: `conns` connections, each pipelining its share of
# `total` reply calls while a thread reads the answers; prints the error codes.
FLOOD = r"""
import json, socket, sys, threading
path, total, conns, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
text = "x" * size
codes = {}
lock = threading.Lock()

def one(k, n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    def send():
        for i in range(n):
            req = {"id": f"{k}-{i}", "tool": "reply", "args": {"text": f"{k}-{i} {text}"}}
            s.sendall(json.dumps(req).encode() + b"\n")
    t = threading.Thread(target=send)
    t.start()
    buf, seen = b"", 0
    while seen < n:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            doc = json.loads(line)
            code = "ok" if doc["ok"] else doc["error"]["code"]
            with lock:
                codes[code] = codes.get(code, 0) + 1
            seen += 1
    t.join()
    s.close()

per = total // conns
threads = [threading.Thread(target=one, args=(k, per)) for k in range(conns)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(codes))
"""


@dataclass
class ApiWorld:
    """A world whose tools deliver into the `api` channel's pending outbox."""

    world: World
    pending: PendingOutbox

    async def open(self, chat_id: str) -> Chat:
        return await self.world.open(chat_id, channel="api")


def api_world(root: Path, limits: BridgeLimits | None = None) -> ApiWorld:
    w = make_world(root, limits)
    pending = PendingOutbox()
    w.handlers = BuiltinTools(pending, w.store, root / "spool").install(
        ToolHandlers(refusals=StoreRefusals(w.store))
    )
    w.server = BridgeServer(w.handlers, limits)
    return ApiWorld(w, pending)


@contextlib.asynccontextmanager
async def serving(root: Path, limits: BridgeLimits | None = None) -> AsyncIterator[ApiWorld]:
    aw = api_world(root, limits)
    try:
        yield aw
    finally:
        await aw.world.server.close_all()
        aw.world.store.close()


async def flood(sock: Path, total: int, *, conns: int = 8, size: int = 15_990) -> Counter[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOOD, str(sock), str(total), str(conns), str(size),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()
    return Counter(json.loads(out))


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def test_R3_R4_a_flood_of_10000_replies_costs_the_gateway_little(short_tmp: Path) -> None:
    """The attack: `reply` in a loop between turns (it grew the gateway by 2 GB in 30 s)."""
    async with serving(short_tmp) as aw:
        a = await aw.open("flood")
        other = await aw.open("bystander")
        rss_before = rss_kib()
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            started = time.monotonic()
            codes = await flood(a.socket, 10_000)
            elapsed = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        growth = peak - base
        print(
            f"\nR3/R4 flood: 10000 reply calls of 16 kB in {elapsed:.1f} s, answers {dict(codes)}; "
            f"gateway traced peak growth {growth / MiB:.2f} MiB, "
            f"RSS {rss_before} -> {rss_kib()} KiB"
        )
        assert sum(codes.values()) == 10_000, codes  # every call answered
        assert set(codes) <= {"ok", "busy"}, codes
        assert 1 <= codes["ok"] <= 4  # 4 x 16 kB fill the 64 KiB a turn may hold
        count, size = aw.pending.pending(a.scope.conversation_id)
        assert count <= PENDING_MAX_MESSAGES and size <= PENDING_MAX_BYTES
        assert growth < 16 * MiB, f"unbounded: {growth} bytes for 160 MB of requests"
        # the gateway still answers another conversation at once, and this one
        # again once its turn took the pending messages and the bucket refilled
        assert (await other.ok("reply", {"text": "still here"}))["chat_id"] == "bystander"
        taken = aw.pending.take(a.scope.conversation_id)
        assert sum(message_bytes(m) for m in taken) <= PENDING_MAX_BYTES  # the HTTP answer
        await asyncio.sleep(0.3)
        assert (await a.ok("reply", {"text": "after"}))["chat_id"] == "flood"


async def test_R3_pending_outbox_is_bounded_in_count_and_bytes(short_tmp: Path) -> None:
    """Without the rate limit, the outbox bound alone holds; `take` frees it again."""
    async with serving(short_tmp, BridgeLimits(rate=NO_RATE_LIMIT)) as aw:
        a = await aw.open("api-1")
        codes = await flood(a.socket, 2_000, conns=4, size=10)
        assert codes == Counter({"ok": PENDING_MAX_MESSAGES, "busy": 2_000 - PENDING_MAX_MESSAGES})
        busy = await a.call("reply", {"text": "one more"})
        assert busy["error"]["code"] == "busy" and "at most 20" in busy["error"]["message"]
        taken = aw.pending.take(a.scope.conversation_id)
        assert len(taken) == PENDING_MAX_MESSAGES
        assert aw.pending.pending(a.scope.conversation_id) == (0, 0)
        assert (await a.ok("reply", {"text": "next turn"}))["chat_id"] == "api-1"

        big = "y" * 15_000
        for _ in range(4):
            await a.ok("reply", {"text": big})
        over = await a.call("reply", {"text": big})  # 5 x 15,000 bytes > 64 KiB
        assert (
            over["error"]["code"] == "busy" and str(PENDING_MAX_BYTES) in over["error"]["message"]
        )
        assert aw.pending.pending(a.scope.conversation_id)[1] <= PENDING_MAX_BYTES


async def test_R4_rate_limit_answers_busy_and_refills(short_tmp: Path) -> None:
    limits = BridgeLimits(rate=RateLimit(per_second=5, burst=5))
    async with serving(short_tmp, limits) as aw:
        a = await aw.open("rate")
        b = await aw.open("rate-b")
        lines = b"".join(
            json.dumps({"id": i, "tool": "list_tools"}).encode() + b"\n" for i in range(8)
        )
        answers = await _raw(a.socket, lines, read_lines=8)
        assert [r["ok"] for r in answers] == [True] * 5 + [False] * 3
        assert answers[5]["error"]["code"] == "busy" and answers[5]["error"]["rule"] == "R4"
        assert (await b.ok("list_tools"))["tools"]  # another conversation has its own bucket
        await asyncio.sleep(0.5)  # 2.5 tokens back
        assert (await a.ok("list_tools"))["tools"]


async def _raw(sock: Path, payload: bytes, *, read_lines: int = 1) -> list[dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    try:
        writer.write(payload)
        await writer.drain()
        out = []
        for _ in range(read_lines):
            line = await asyncio.wait_for(reader.readline(), 5)
            if not line:
                break
            out.append(json.loads(line))
        return out
    finally:
        writer.close()
        await writer.wait_closed()


def _push(path: str, total: int, result: dict[str, Any]) -> None:
    """Send `total` bytes of one never-ending line; record how much went out, and the answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        while sent < total:
            sent += s.send(chunk)
    except OSError as exc:
        result["error"] = type(exc).__name__
    result["sent"] = sent
    buf = b""
    with contextlib.suppress(OSError):
        while not buf.endswith(b"\n"):
            got = s.recv(4096)
            if not got:
                break
            buf += got
    result["answer"] = buf
    s.close()


async def test_R3_oversize_frame_is_refused_without_buffering_it(short_tmp: Path) -> None:
    """A sandbox streams a 256 MiB line: refused at the limit, the connection cut, memory flat."""
    async with serving(short_tmp) as aw:
        a = await aw.open("huge")
        limit = aw.world.server.limits.max_request_bytes
        result: dict[str, Any] = {}
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            await asyncio.to_thread(_push, str(a.socket), 256 * MiB, result)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        print(
            f"\nR3 oversize frame: client got {result['sent'] / MiB:.1f} MiB out before the cut "
            f"({result.get('error')}); traced peak growth {(peak - base) / MiB:.2f} MiB"
        )
        answer = json.loads(result["answer"])
        assert answer["error"]["code"] == "too_large"
        assert result["sent"] < 256 * MiB  # the gateway stopped reading and closed
        assert peak - base < 8 * limit
        assert (await a.ok("list_tools"))["tools"]  # and keeps serving


async def test_R3_slow_loris_frame_is_closed_after_the_time_bound(short_tmp: Path) -> None:
    """One byte every 0.1 s, never a newline: answered `timeout` and closed after 0.5 s."""
    limits = BridgeLimits(frame_timeout=0.5, max_connections=1)
    async with serving(short_tmp, limits) as aw:
        a = await aw.open("loris")
        reader, writer = await asyncio.open_unix_connection(str(a.socket))
        started = time.monotonic()
        got = b""

        async def drip() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(100):
                    writer.write(b"{")
                    await writer.drain()
                    await asyncio.sleep(0.1)

        dripping = asyncio.create_task(drip())
        got = await asyncio.wait_for(reader.readline(), 5)
        elapsed = time.monotonic() - started
        rest = b""
        with contextlib.suppress(ConnectionError):  # closed, maybe reset: it had unread bytes
            rest = await asyncio.wait_for(reader.read(), 5)
        assert rest == b""
        dripping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dripping
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        answer = json.loads(got)
        assert answer["error"]["code"] == "timeout", answer
        assert 0.4 < elapsed < 2.0, elapsed
        # its connection slot (the only one) is free again
        assert (await a.ok("list_tools"))["tools"]


async def test_R3_a_client_that_never_reads_is_dropped(short_tmp: Path) -> None:
    """Pipelined calls whose answers are never read: closed after `write_timeout`."""
    limits = BridgeLimits(write_timeout=0.3, max_connections=1, rate=NO_RATE_LIMIT)
    async with serving(short_tmp, limits) as aw:
        a = await aw.open("deaf")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect(str(a.socket))
        request = json.dumps({"tool": "list_tools"}).encode() + b"\n"
        try:
            with contextlib.suppress(BlockingIOError):
                for _ in range(20_000):  # ~60 MB of answers; never read
                    s.send(request)
            started = time.monotonic()
            while True:  # the one connection slot frees once the gateway drops the deaf client
                try:
                    doc = await a.call("list_tools")
                except cellgate_tool.BridgeUnavailable:
                    doc = {"ok": False, "error": {"code": "busy"}}  # refused before it wrote
                if doc["ok"]:
                    break
                assert doc["error"]["code"] == "busy", doc
                assert time.monotonic() - started < 10, "the deaf client holds the bridge"
                await asyncio.sleep(0.1)
        finally:
            s.close()


@pytest.mark.parametrize("n", [1, 3])
async def test_R4_connections_per_conversation_are_bounded(short_tmp: Path, n: int) -> None:
    async with serving(short_tmp, BridgeLimits(max_connections=n)) as aw:
        a = await aw.open("conns")
        held = [await asyncio.open_unix_connection(str(a.socket)) for _ in range(n)]
        await asyncio.sleep(0.05)
        [answer] = await _raw(a.socket, b"")
        assert answer["error"]["code"] == "busy"
        for _, w in held:
            w.close()
            await w.wait_closed()
