"""A unix-socket listener whose close ends every connection it accepted (R3).

The bridge and the runner socket listen where a sandbox can connect, and a
sandbox may flood them with connections right as the gateway closes them.
`asyncio.start_unix_server` (3.11) leaves such a connection's transport open:
an accept already under way when `Server.close()` runs fails in asyncio's own
transport set-up (`Server._attach` asserts the server still listens), and the
half-made transport holds its socket until the garbage collector finds it.

`UnixListener` accepts on a bound socket itself. Each accepted socket is owned
by exactly one party at any moment: the listener, until the task that wraps it
in a transport takes its first step; from then on that transport, which
closes it on any failure or cancellation. `close()` stops accepting, cancels
the wrapping tasks and closes the sockets no transport took yet, so nothing is
left for the collector. `on_connect` is a plain function called inside the
protocol's `connection_made`: its owner knows each connection at once, ends
them all with its own close, and ends one handed over after that (a transport
made just before the close; `closed` is then true).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

__all__ = ["OnConnect", "UnixListener"]

logger = logging.getLogger(__name__)

OnConnect = Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]

ACCEPTS_PER_WAKE = 64  # a flood of connections cannot starve the loop's other work
RETRY_AFTER = 1.0  # an accept failed (out of descriptors or memory): try again after this long


class UnixListener:
    """Serves `on_connect` on `sock` (bound and owned by the listener from here)."""

    def __init__(self, sock: socket.socket, on_connect: OnConnect, *, limit: int) -> None:
        self._sock = sock
        self._on_connect = on_connect
        self._limit = limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._reading = False
        self._retry: asyncio.TimerHandle | None = None
        self._unowned: dict[asyncio.Task[None], socket.socket] = {}

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Listen and accept on the running loop."""
        if self._closed:
            raise RuntimeError("listener is closed")
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._sock.listen(128)
        self._resume()

    def _resume(self) -> None:
        self._retry = None
        if not self._closed and not self._reading and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)
            self._reading = True

    def _pause(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _accept(self) -> None:
        loop = self._loop
        assert loop is not None
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                # out of descriptors or memory (the listening socket stays readable)
                # or worse: stop watching it for a while rather than spin
                logger.warning("cannot accept on %s (%s); retrying in %gs", self, exc, RETRY_AFTER)
                self._pause()
                self._retry = loop.call_later(RETRY_AFTER, self._resume)
                return
            if self._closed:
                conn.close()
                continue
            task = loop.create_task(self._wrap(conn))
            self._unowned[task] = conn
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        conn = self._unowned.pop(task, None)
        if conn is not None:  # cancelled before its first step (not by close): still ours
            conn.close()

    def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self._on_connect(reader, writer)
        except Exception:  # inside connection_made: nobody else would end this connection
            logger.exception("connection on %s refused: its handler failed", self)
            writer.transport.abort()

    async def _wrap(self, conn: socket.socket) -> None:
        task = asyncio.current_task()
        # from this step on the transport owns the socket and closes it on failure
        self._unowned.pop(task, None)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self._limit, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, self._serve, loop=loop)
        try:
            await loop.connect_accepted_socket(lambda: protocol, conn)
        except asyncio.CancelledError:
            raise
        except Exception:  # the peer left before its transport was made
            logger.debug("connection on %s failed before it was served", self, exc_info=True)

    def close(self) -> None:
        """Stop accepting and close the socket; connections not yet handed over end here.

        Connections already handed to `on_connect` belong to its owner, who ends them.
        """
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._pause()
        self._sock.close()
        for task, conn in list(self._unowned.items()):
            task.cancel()  # not started: its coroutine never runs, so the socket is ours
            conn.close()
        self._unowned.clear()

    def __repr__(self) -> str:
        return f"<UnixListener fd={self._sock.fileno()}>"
