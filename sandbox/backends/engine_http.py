"""A lean JSON GET to the Docker engine over its unix socket, for the hot inspects (F3).

The SDK's unix adapter keeps one connection pool per request URL, so every
inspect of another container opens (and, past its pool limit, closes) a
connection of its own, and each request goes through requests' proxy and
netrc lookups: about 3 ms of the gateway's CPU per inspect, two per pooled
first turn. Here each control thread keeps one HTTP/1.1 connection to the
engine and reuses it; a GET that finds its kept connection closed by the
engine is sent once more on a new one (GET is idempotent).

Only for an engine on a unix socket; `for_client` says None otherwise and the
SDK is used as before. Errors are the SDK's: `docker.errors.NotFound` for a
404, `docker.errors.APIError` for any other refusal (with the engine's own
message), and `EngineUnavailable` when the engine cannot be reached or
answers something that is not HTTP.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors

from cellgate.errors import EngineUnavailable

RESPONSE_MAX = 16 * 1024 * 1024  # an inspect is a few KiB; the engine is trusted, bounded anyway
UNIX_PREFIX = "http+docker://"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


@dataclass(frozen=True, slots=True)
class EngineRef:
    """Where an `EngineHTTP` talks to, as plain values (it crosses to the host worker)."""

    socket_path: str
    api_version: str
    timeout: float


class EngineHTTP:
    """GETs of engine JSON on one kept connection per thread."""

    def __init__(self, socket_path: str, api_version: str, timeout: float = 60.0) -> None:
        self.socket_path = socket_path
        self.prefix = f"/v{api_version}"
        self.timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[_UnixConnection] = []

    @property
    def ref(self) -> EngineRef:
        return EngineRef(self.socket_path, self.prefix[2:], self.timeout)

    @classmethod
    def from_ref(cls, ref: EngineRef) -> EngineHTTP:
        return cls(ref.socket_path, ref.api_version, ref.timeout)

    @classmethod
    def for_client(cls, client: docker.DockerClient) -> EngineHTTP | None:
        """The lean path to the engine `client` talks to, when that is a unix socket."""
        api = client.api
        if not str(api.base_url).startswith(UNIX_PREFIX):
            return None
        adapter = api.adapters.get(UNIX_PREFIX)
        path = getattr(adapter, "socket_path", None)
        timeout = getattr(adapter, "timeout", 60)
        if not isinstance(path, str) or not path:
            return None
        return cls(path, str(api.api_version), float(timeout or 60))

    def get_json(self, path_fmt: str, *args: str) -> Any:
        """GET `path_fmt` (args URL-quoted) under the API version; the decoded JSON."""
        path = self.prefix + path_fmt.format(*(urllib.parse.quote(a, safe="") for a in args))
        for attempt in (0, 1):
            conn, kept = self._connection()
            try:
                conn.request("GET", path, headers={"Host": "docker"})
                resp = conn.getresponse()
                body = resp.read(RESPONSE_MAX + 1)
                status, closing = resp.status, resp.will_close
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop(conn)
                if kept and attempt == 0:
                    continue  # the engine closed a kept connection: once more on a new one
                raise EngineUnavailable(f"GET {path}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                raise EngineUnavailable(f"GET {path}: {exc}") from exc
            except BaseException:
                self._drop(conn)
                raise
            if closing or len(body) > RESPONSE_MAX:
                self._drop(conn)
            if len(body) > RESPONSE_MAX:
                raise docker.errors.APIError(f"GET {path}: an answer over {RESPONSE_MAX} bytes")
            return _decoded(path, status, body)
        raise AssertionError("unreachable")

    def inspect(self, name: str) -> dict[str, Any] | None:
        """A container's inspect document; None when the engine says it does not exist."""
        try:
            attrs: dict[str, Any] = self.get_json("/containers/{}/json", name)
        except docker.errors.NotFound:
            return None
        return attrs

    def _connection(self) -> tuple[_UnixConnection, bool]:
        conn: _UnixConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = _UnixConnection(self.socket_path, self.timeout)
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)
        return conn, False

    def _drop(self, conn: _UnixConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        """Close every kept connection (the backend is closing)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _decoded(path: str, status: int, body: bytes) -> Any:
    if status == 200:
        try:
            return json.loads(body)
        except ValueError as exc:
            raise EngineUnavailable(f"GET {path}: the engine answered no JSON ({exc})") from exc
    try:
        message = str(json.loads(body).get("message") or "")
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    text = f"{status} GET {path}: {message}"
    if status == 404:
        raise docker.errors.NotFound(text)
    raise docker.errors.APIError(text)
