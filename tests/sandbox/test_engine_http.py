"""The lean engine GET (F3): one kept connection per thread, the SDK's errors, bounded.

Against a stand-in engine on a unix socket made here (a real HTTP/1.1 server),
and against the real engine: the inspect it returns is the SDK's.
"""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from cellgate.errors import EngineUnavailable
from sandbox.backends import engine_http
from sandbox.backends.engine_http import EngineHTTP


class _Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    connections = 0
    requests: list[str]
    close_after_first = False


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Engine

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        name = self.path.rsplit("/", 2)[-2]
        if name == "garbage":
            self.wfile.write(b"this is not HTTP\r\n\r\n")
            self.close_connection = True
            return
        status, doc = 200, {"Id": name, "Name": f"/{name}"}
        if name == "missing":
            status, doc = 404, {"message": f"No such container: {name}"}
        elif name == "broken":
            status, doc = 500, {"message": "the daemon is unwell"}
        body = json.dumps(doc).encode()
        if name == "huge":
            body = b"[" + b"0," * (engine_http.RESPONSE_MAX // 2) + b"0]"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.server.close_after_first:
            self.close_connection = True


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[_Engine]:
    server = _Engine(str(tmp_path / "engine.sock"), _Handler)
    server.requests = []
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _client(server: _Engine) -> EngineHTTP:
    return EngineHTTP(str(server.server_address), "1.45", timeout=5)


def test_F3_gets_of_many_containers_share_one_kept_connection(engine: _Engine) -> None:
    client = _client(engine)
    try:
        for i in range(20):
            assert client.get_json("/containers/{}/json", f"c{i}")["Id"] == f"c{i}"
    finally:
        client.close()
    assert engine.connections == 1
    assert engine.requests[0] == "/v1.45/containers/c0/json"


def test_F3_a_name_is_quoted_into_one_path_segment(engine: _Engine) -> None:
    client = _client(engine)
    try:
        client.get_json("/containers/{}/json", "a/../../b c?x")
    finally:
        client.close()
    assert engine.requests == ["/v1.45/containers/a%2F..%2F..%2Fb%20c%3Fx/json"]


def test_F3_a_connection_the_engine_closed_is_replaced_once(engine: _Engine) -> None:
    engine.close_after_first = True
    client = _client(engine)
    try:
        for i in range(3):
            assert client.get_json("/containers/{}/json", f"c{i}")["Id"] == f"c{i}"
    finally:
        client.close()
    assert engine.connections == 3


def test_F3_errors_are_the_sdks(engine: _Engine) -> None:
    client = _client(engine)
    try:
        with pytest.raises(docker.errors.NotFound, match="No such container"):
            client.get_json("/containers/{}/json", "missing")
        with pytest.raises(docker.errors.APIError, match="unwell") as err:
            client.get_json("/containers/{}/json", "broken")
        assert not isinstance(err.value, docker.errors.NotFound)
        with pytest.raises(EngineUnavailable):
            client.get_json("/containers/{}/json", "garbage")
        with pytest.raises(docker.errors.APIError, match="over"):
            client.get_json("/containers/{}/json", "huge")
        # after all that, the next GET still works
        assert client.get_json("/containers/{}/json", "ok")["Id"] == "ok"
    finally:
        client.close()


def test_F3_nothing_listening_is_engine_unavailable(tmp_path: Path) -> None:
    client = EngineHTTP(str(tmp_path / "nobody.sock"), "1.45", timeout=5)
    with pytest.raises(EngineUnavailable):
        client.get_json("/containers/{}/json", "x")


def test_F3_only_a_unix_socket_engine_gets_the_lean_path() -> None:
    tcp = docker.DockerClient(base_url="tcp://127.0.0.1:1", version="1.45")
    try:
        assert EngineHTTP.for_client(tcp) is None
    finally:
        tcp.close()
    unix = docker.DockerClient(base_url="unix:///nonexistent/docker.sock", version="1.45")
    try:
        lean = EngineHTTP.for_client(unix)
        assert lean is not None and lean.socket_path == "/nonexistent/docker.sock"
    finally:
        unix.close()
