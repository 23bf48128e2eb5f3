"""The bridge socket and its protocol: malformed input, limits, timeouts, lifecycle (P1)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bridge import BridgeLimits, BridgeServer, ToolCall
from tests.bridge.conftest import Chat, World, make_world

CLIENT = Path(__file__).resolve().parents[2] / "sandbox" / "client" / "cellgate_tool.py"


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


async def test_P1_socket_and_directory_modes_let_the_sandbox_uid_connect(world: World) -> None:
    a = await world.open("42")
    assert stat.S_ISSOCK(os.lstat(a.socket).st_mode)
    assert stat.S_IMODE(os.lstat(a.socket).st_mode) == 0o666
    assert stat.S_IMODE(os.lstat(a.socket.parent).st_mode) == 0o755
    # a real unprivileged uid, like the sandbox's, connects and is answered
    system_python = "/usr/bin/python3"
    if not os.access(system_python, os.X_OK):
        pytest.skip("no system python3 that an unprivileged uid can run")
    proc = await asyncio.create_subprocess_exec(
        system_python, str(a.socket.parent / "cellgate-tool"), "list_tools",
        env={"CELLGATE_BRIDGE": str(a.socket), "PATH": os.environ["PATH"]},
        user=10001, group=10001, extra_groups=[],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    assert "reply" in json.loads(out)["tools"][0]["name"]


async def test_P1_many_requests_on_one_connection_are_answered_in_order(world: World) -> None:
    a = await world.open("42")
    lines = b"".join(
        json.dumps({"id": i, "tool": "reply", "args": {"text": f"t{i}"}}).encode() + b"\n"
        for i in range(5)
    )
    answers = await _raw(a.socket, lines, read_lines=5)
    assert [r["id"] for r in answers] == [0, 1, 2, 3, 4]
    assert [m.text for m in world.outbox.sent] == ["t0", "t1", "t2", "t3", "t4"]


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"not json\n", "bad_request"),
        (b"\xff\xfe\n", "bad_request"),
        (b"[1,2]\n", "bad_request"),
        (b'{"id": 1}\n', "bad_request"),
        (b'{"id": 1, "tool": 5}\n', "bad_request"),
        (b'{"id": true, "tool": "reply"}\n', "bad_request"),
        (b'{"id": 1, "tool": "reply", "args": [1]}\n', "bad_request"),
        (b'{"id": 1, "tool": "reply", "args": {"text": 5.5}}\n', "bad_request"),
        (b'{"id": 1, "tool": "reply", "args": {}}\n', "bad_request"),
        (b'{"id": 1, "tool": "rm_rf"}\n', "unknown_tool"),
    ],
)
async def test_P1_malformed_input_gets_an_error_and_the_connection_survives(
    world: World, payload: bytes, code: str
) -> None:
    a = await world.open("42")
    good = b'{"id": "next", "tool": "reply", "args": {"text": "still here"}}\n'
    first, second = await _raw(a.socket, payload + good, read_lines=2)
    assert first["ok"] is False and first["error"]["code"] == code, first
    assert second == {"id": "next", "ok": True, "result": {"message_id": "m1", "chat_id": "42"}}


async def test_P1_oversized_request_is_refused_and_the_server_keeps_serving(
    short_tmp: Path,
) -> None:
    w = make_world(short_tmp, BridgeLimits(max_request_bytes=4096))
    try:
        a = await w.open("42")
        big = json.dumps({"id": 1, "tool": "reply", "args": {"text": "x" * 10_000}}).encode()
        [answer] = await _raw(a.socket, big + b"\n")
        assert answer["error"]["code"] == "too_large"
        assert (await a.ok("reply", {"text": "small"}))["chat_id"] == "42"
    finally:
        await w.server.close_all()
        w.store.close()


async def test_P1_connections_per_socket_are_bounded(short_tmp: Path) -> None:
    w = make_world(short_tmp, BridgeLimits(max_connections=2))
    try:
        a = await w.open("42")
        held = [await asyncio.open_unix_connection(str(a.socket)) for _ in range(2)]
        await asyncio.sleep(0.05)
        [answer] = await _raw(a.socket, b"")
        assert answer["error"]["code"] == "busy"
        for _, writer in held:
            writer.close()
            await writer.wait_closed()
        await asyncio.sleep(0.05)
        assert (await a.ok("reply", {"text": "free again"}))["chat_id"] == "42"
    finally:
        await w.server.close_all()
        w.store.close()


async def test_P1_idle_connections_are_closed(short_tmp: Path) -> None:
    w = make_world(short_tmp, BridgeLimits(idle_timeout=0.2))
    try:
        a = await w.open("42")
        reader, writer = await asyncio.open_unix_connection(str(a.socket))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await w.server.close_all()
        w.store.close()


async def test_P1_slow_and_crashing_tools_are_answered(short_tmp: Path) -> None:
    w = make_world(short_tmp, BridgeLimits(call_timeout=0.2))

    async def slow(call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(10)
        return {}

    async def crash(call: ToolCall) -> dict[str, Any]:
        raise RuntimeError("boom")

    w.handlers.register("slow", slow)
    w.handlers.register("crash", crash)
    try:
        a = await w.open("42")
        assert (await a.call("slow"))["error"]["code"] == "timeout"
        crashed = await a.call("crash")
        assert crashed["error"]["code"] == "internal"
        assert "boom" not in crashed["error"]["message"], "internals are logged, not sent"
        assert (await a.ok("reply", {"text": "fine"}))["chat_id"] == "42"
    finally:
        await w.server.close_all()
        w.store.close()


async def test_P1_open_is_idempotent_and_recreates_a_vanished_socket(world: World) -> None:
    a = await world.open("42")
    ino = os.lstat(a.socket).st_ino
    assert await world.server.open(a.scope) == a.socket
    assert os.lstat(a.socket).st_ino == ino
    os.unlink(a.socket)
    assert await world.server.open(a.scope) == a.socket
    assert (await a.ok("reply", {"text": "back"}))["chat_id"] == "42"
    await world.server.close(a.scope.scope_key)
    assert not a.socket.exists()
    await world.server.close(a.scope.scope_key)  # a no-op


async def test_P1_each_socket_serves_only_its_own_scope(world: World) -> None:
    a = await world.open("42")
    b = await world.open("77")
    assert a.socket != b.socket
    await asyncio.gather(*(c.ok("reply", {"text": c.key.chat_id}) for c in [a, b] * 10))
    assert all(s.key.chat_id == m.chat_id == m.text for s, m in world.outbox.messages)


async def test_P1_long_state_paths_still_bind(short_tmp: Path) -> None:
    """A unix socket path holds 108 bytes; the server binds through the directory's fd."""
    deep = short_tmp / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    w = make_world(deep)
    try:
        a = await w.open("42")
        assert len(str(a.socket)) > 108
        fd = os.open(a.socket.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            short = Chat(w, a.key, a.scope, Path(f"/proc/self/fd/{fd}/bridge.sock"))
            assert (await short.ok("reply", {"text": "deep"}))["chat_id"] == "42"
        finally:
            os.close(fd)
    finally:
        await w.server.close_all()
        w.store.close()


async def test_P1_close_all_removes_every_socket(short_tmp: Path) -> None:
    w = make_world(short_tmp)
    a = await w.open("42")
    b = await w.open("77")
    held = await asyncio.open_unix_connection(str(a.socket))
    await asyncio.sleep(0.05)  # accepted: an open connection is closed too
    await w.server.close_all()
    assert not a.socket.exists() and not b.socket.exists()
    assert await asyncio.wait_for(held[0].read(), 5) == b""
    held[1].close()
    await held[1].wait_closed()
    w.store.close()


def test_R3_a_close_amid_a_flood_of_connections_leaves_none_open(short_tmp: Path) -> None:
    """A gateway stopping while a sandbox floods its bridge with connections ends every one.

    The close lands at each point of an accept in turn (0..7 loop turns after the
    connects); then the loop stops, as a gateway's does. Every connection the server
    accepted is closed by it (no transport left for the garbage collector: R3), and
    every client sees its end rather than a socket held open.
    """

    async def main(root: Path, spins: int) -> list[socket.socket]:
        w = make_world(root)
        a = await w.open("42")
        clients = []
        for _ in range(12):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(a.socket))
            clients.append(s)
        for _ in range(spins):
            await asyncio.sleep(0)
        await w.server.close_all()
        w.store.close()
        return clients

    for spins in range(8):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            clients = asyncio.run(main(short_tmp / str(spins), spins))
            gc.collect()
        leaks = [str(c.message) for c in caught if "unclosed" in str(c.message)]
        assert not leaks, f"close after {spins} loop turns left {leaks}"
        for s in clients:
            s.settimeout(5)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass  # never accepted: the listening socket closed under it
            finally:
                s.close()


def _client(env_sock: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, str(CLIENT), *args],
        input=stdin,
        capture_output=True,
        env={"CELLGATE_BRIDGE": env_sock, "PATH": os.environ["PATH"]},
        timeout=30,
        check=False,
    )


async def test_P1_client_exit_codes(world: World, short_tmp: Path) -> None:
    a = await world.open("42")
    sock = str(a.socket)
    ok = await asyncio.to_thread(_client, sock, "reply", '{"text": "hi"}')
    assert ok.returncode == 0 and json.loads(ok.stdout)["chat_id"] == "42"
    piped = await asyncio.to_thread(_client, sock, "reply", "-", stdin=b'{"text": "stdin"}')
    assert piped.returncode == 0
    refused = await asyncio.to_thread(_client, sock, "reply", '{"text": "x", "chat_id": "1"}')
    assert refused.returncode == 1 and b"refused by P1" in refused.stderr
    failed = await asyncio.to_thread(_client, sock, "nope", "{}")
    assert failed.returncode == 1 and b"unknown_tool" in failed.stderr
    bad = await asyncio.to_thread(_client, sock, "reply", "{not json")
    assert bad.returncode == 2
    usage = await asyncio.to_thread(_client, sock)
    assert usage.returncode == 2 and b"usage" in usage.stderr
    gone = await asyncio.to_thread(_client, str(short_tmp / "none.sock"), "reply", "{}")
    assert gone.returncode == 2 and b"cannot reach the bridge" in gone.stderr
    assert [m.text for m in world.outbox.sent] == ["hi", "stdin"]


async def test_P1_server_without_scope_has_no_socket(short_tmp: Path) -> None:
    w = make_world(short_tmp)
    server = BridgeServer(w.handlers)
    assert server.scope("nothing") is None
    await server.close_all()
    w.store.close()
