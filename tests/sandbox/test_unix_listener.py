"""The unix listener behind the bridge and the runner socket (R3): a close ends everything."""

from __future__ import annotations

import asyncio
import functools
import gc
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from sandbox.unix_listener import UnixListener

T = TypeVar("T")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: a unix socket's path has 108 bytes."""
    root = Path(tempfile.mkdtemp(prefix="cgl-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _bound(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def _leaks(run: Callable[[], T]) -> tuple[T, list[str]]:
    """`run()`'s result, and the "unclosed ..." ResourceWarnings it left to the collector."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        result = run()
        gc.collect()
    return result, [str(c.message) for c in caught if "unclosed" in str(c.message)]


async def test_R3_connections_are_served_as_streams(short_tmp: Path) -> None:
    served: list[asyncio.Task[None]] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((await reader.readline()).upper())
        await writer.drain()
        writer.close()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(asyncio.create_task(echo(reader, writer)))

    listener = UnixListener(_bound(short_tmp / "s.sock"), on_connect, limit=1024)
    listener.start()
    try:
        for word in (b"one", b"two"):
            reader, writer = await asyncio.open_unix_connection(str(short_tmp / "s.sock"))
            writer.write(word + b"\n")
            assert await asyncio.wait_for(reader.read(), 5) == word.upper() + b"\n"
            writer.close()
            await writer.wait_closed()
    finally:
        listener.close()
    await asyncio.gather(*served)
    assert listener.closed and len(served) == 2


def test_R3_a_close_at_any_point_of_an_accept_leaves_no_socket_open(short_tmp: Path) -> None:
    """Connections caught between accept and hand-over are closed by the close itself."""
    handed: list[asyncio.StreamWriter] = []

    async def main(path: Path, spins: int) -> list[socket.socket]:
        def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if listener.closed:  # as an owner does: what arrives after its close is ended
                writer.transport.abort()
            else:
                handed.append(writer)

        listener = UnixListener(_bound(path), on_connect, limit=1024)
        listener.start()
        clients = []
        for _ in range(10):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(path))
            clients.append(c)
        for _ in range(spins):
            await asyncio.sleep(0)
        listener.close()
        for writer in handed:  # the owner ends what was handed to it
            writer.transport.abort()
        return clients

    for spins in range(8):
        handed.clear()
        clients, leaks = _leaks(
            functools.partial(asyncio.run, main(short_tmp / f"{spins}.sock", spins))
        )
        assert not leaks, f"close after {spins} loop turns left {leaks}"
        for c in clients:
            c.settimeout(5)
            try:
                assert c.recv(1) == b""
            except ConnectionResetError:
                pass
            finally:
                c.close()


def test_R3_running_out_of_descriptors_pauses_accepting_and_recovers(short_tmp: Path) -> None:
    """EMFILE on accept is logged and retried later, not spun on; the listener lives on."""
    script = textwrap.dedent(
        """
        import asyncio, resource, socket, sys
        from sandbox import unix_listener
        from sandbox.unix_listener import UnixListener
        unix_listener.RETRY_AFTER = 0.2
        path = sys.argv[1]

        async def main():
            got = []
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            listener = UnixListener(sock, lambda r, w: got.append(w), limit=1024)
            listener.start()
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(path)
            hog = []
            try:  # no descriptor is left for the accept
                while True:
                    hog.append(socket.socket())
            except OSError:
                pass
            await asyncio.sleep(0.5)
            assert not got, "accepted without a descriptor"
            for s in hog:
                s.close()
            for _ in range(50):
                await asyncio.sleep(0.05)
                if got:
                    break
            assert len(got) == 1, "the listener did not accept again"
            got[0].transport.abort()
            listener.close()
            client.close()
            print("ok")

        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        asyncio.run(main())
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script, str(short_tmp / "x.sock")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "cannot accept" in done.stderr


def test_R3_an_accept_whose_task_is_cancelled_by_another_leaves_no_socket_open(
    short_tmp: Path,
) -> None:
    """A wrapping task cancelled before its first step (asyncio.run's final sweep, an
    owner's cancel) and not by the listener's close: the accepted socket is closed."""
    path = short_tmp / "s.sock"
    clients: list[socket.socket] = []

    async def main() -> None:
        listener = UnixListener(_bound(path), lambda _r, w: w.transport.abort(), limit=1024)
        listener.start()
        clients.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        clients[0].connect(str(path))
        for _ in range(50):  # until the accept made its wrapping task, not yet started
            await asyncio.sleep(0)
            if listener._unowned:
                break
        assert listener._unowned, "no accept happened"
        for task in list(listener._unowned):
            task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        listener.close()

    try:
        _, leaks = _leaks(lambda: asyncio.run(main()))
        assert not leaks, leaks
    finally:
        for c in clients:
            c.close()


def test_R3_a_handler_that_fails_ends_its_connection(short_tmp: Path) -> None:
    """`on_connect` raising inside connection_made: the peer sees the connection end
    and no transport is left to the collector."""
    path = short_tmp / "s.sock"

    def on_connect(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        raise RuntimeError("handler bug")

    async def main() -> bytes:
        listener = UnixListener(_bound(path), on_connect, limit=1024)
        listener.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            try:
                return await asyncio.wait_for(reader.read(), 5)  # b"" once the gateway ends it
            finally:
                writer.close()
                await writer.wait_closed()
        finally:
            listener.close()

    got, leaks = _leaks(lambda: asyncio.run(main()))
    assert got == b"" and not leaks, leaks
