"""A unix-socket proxy in front of the real Docker engine that a test can cut (R7).

The gateway under test talks to the engine only through this proxy; `down()`
drops every connection in flight and answers new ones by hanging up, as an
engine that died would; `up()` lets traffic through again. The real engine,
and everything else on it, is never touched.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

ENGINE_SOCKET = "/var/run/docker.sock"


class EngineProxy:
    def __init__(self, path: Path, upstream: str = ENGINE_SOCKET) -> None:
        self.path = path
        self.upstream = upstream
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(64)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="engine-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def down(self) -> None:
        """The engine goes away: every connection in flight is cut."""
        self._up.clear()
        with self._lock:
            for s in list(self._live):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.down()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self._thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()  # an engine that is not there hangs up
                continue
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(self.upstream)
        except OSError:
            client.close()
            upstream.close()
            return
        with self._lock:
            self._live.update((client, upstream))
        try:
            pair = {client: upstream, upstream: client}
            while self._up.is_set():
                ready, _, _ = select.select(list(pair), [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    pair[s].sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._live.difference_update((client, upstream))
            client.close()
            upstream.close()


@contextlib.contextmanager
def engine_proxy(path: Path) -> Iterator[EngineProxy]:
    proxy = EngineProxy(path)
    try:
        yield proxy
    finally:
        proxy.close()
