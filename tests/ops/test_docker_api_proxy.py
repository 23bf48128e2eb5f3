"""O1: the Compose stack's Docker API proxy passes exactly the calls cellgate makes.

The pure half reads the allow-list HAProxy loads and checks it refuses what
cellgate never needs (images list, build, volumes, archives, attach...). The
engine half runs a real gateway turn and the backend's other calls through a
recording proxy in front of the real engine, and checks every request it made
is one the allow-list passes: a new SDK call in the backend fails here before
it fails in production behind HAProxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from sandbox.backends.docker import DockerBackend
from sandbox.spec import LABEL_APP, LABEL_GATEWAY
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.ops.docker_api_allow import allow_patterns, allowed
from tests.support.run_id import RUN_ID
from tests.support.served import served_gateway

ID = "3f1c0a9b8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6b5a4938271605f4e3d"
USED = [
    ("GET", "/_ping"),
    ("HEAD", "/_ping"),
    ("GET", "/version"),
    ("GET", "/v1.41/info"),
    ("POST", "/v1.41/containers/create?name=cellgate-x"),
    ("GET", "/v1.41/containers/json?all=1&filters=%7B%7D"),
    ("GET", "/v1.41/containers/cellgate-g1-demo-abc/json"),
    ("POST", f"/v1.41/containers/{ID}/start"),
    ("POST", f"/v1.41/containers/{ID}/wait"),
    ("GET", "/v1.41/containers/cellgate-probe-x/logs?stdout=1&stderr=0"),
    ("DELETE", "/v1.41/containers/cellgate-x?v=True&force=True"),
    ("POST", f"/v1.41/containers/{ID}/exec"),
    ("POST", f"/v1.41/exec/{ID}/start"),
    ("GET", f"/v1.41/exec/{ID}/json"),
    ("POST", f"/v1.41/networks/{ID}/connect"),
    ("GET", "/v1.41/images/cellgate-app-demo:1/json"),
    ("GET", "/v1.41/images/sha256:" + ID + "/json"),
    ("GET", "/v1.41/images/library/python:3.12-slim/json"),
]
UNUSED = [
    ("GET", "/v1.41/images/json"),
    ("POST", "/v1.41/images/create?fromImage=alpine"),
    ("POST", "/v1.41/build"),
    ("GET", "/v1.41/volumes"),
    ("POST", "/v1.41/volumes/create"),
    ("PUT", f"/v1.41/containers/{ID}/archive?path=/"),
    ("GET", f"/v1.41/containers/{ID}/archive?path=/etc"),
    ("GET", f"/v1.41/containers/{ID}/export"),
    ("POST", f"/v1.41/containers/{ID}/attach?stream=1"),
    ("POST", f"/v1.41/containers/{ID}/update"),
    ("POST", f"/v1.41/containers/{ID}/kill"),
    ("POST", "/v1.41/commit?container=x"),
    ("GET", "/v1.41/containers/../images/json"),
    ("GET", "/v1.41/containers/x/../../volumes/json"),
    ("GET", "/v1.41/images/../../volumes/json"),
    ("POST", f"/v1.41/exec/{ID}/resize"),
    ("POST", "/v1.41/networks/create"),
    ("POST", "/v1.41/swarm/init"),
    ("GET", "/v1.41/secrets"),
    ("POST", "/v1.41/plugins/pull"),
    ("POST", "/v1.41/containers/prune"),
    ("POST", "/session"),
    ("GET", "/v1.41/events"),
    ("GET", "/v1.41/containers/x/json/extra"),
    ("get", "/_ping"),
]


def test_allow_list_passes_cellgates_calls_and_nothing_else_o1() -> None:
    patterns = allow_patterns()
    assert len(patterns) >= 10
    assert [c for c in USED if not allowed(*c, patterns)] == []
    assert [c for c in UNUSED if allowed(*c, patterns)] == []


# -- the calls the backend really makes ---------------------------------------

_REQUEST_LINE = re.compile(rb"(?m)^(GET|HEAD|POST|PUT|DELETE|PATCH) (/\S*) HTTP/1\.[01]\r$")


class RecordingProxy:
    """A unix socket in front of the engine's that notes every request line sent through it."""

    def __init__(self, path: Path, upstream: str = "/var/run/docker.sock") -> None:
        self.path, self.upstream = path, upstream
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        import select

        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(self.upstream)
        pair = {client: upstream, upstream: client}
        try:
            while not self._closed:
                ready, _, _ = select.select(list(pair), [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        # pass a half-close on (an exec's stdin ends so)
                        with contextlib.suppress(OSError):
                            pair[s].shutdown(socket.SHUT_WR)
                        del pair[s]
                        if not pair or s is upstream:
                            return
                        continue
                    if s is client:
                        with self._lock:
                            self.calls += [
                                (m.decode(), p.decode()) for m, p in _REQUEST_LINE.findall(data)
                            ]
                    pair[s].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


@contextlib.contextmanager
def recording(path: Path) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(path)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.docker
def test_every_call_a_gateway_turn_makes_is_allowed_o1(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    app = f"o1rec{secrets.token_hex(3)}"
    config_path = install_test_app(tmp_path, docker_client, base_image, app, {"quota": "off"})
    sock = Path(f"/tmp/cg-o1-{secrets.token_hex(4)}.sock")

    def backend() -> DockerBackend:
        return DockerBackend(docker.DockerClient(base_url=f"unix://{sock}"))

    try:
        with recording(sock) as rec:
            with served_gateway(config_path, backend, start=True) as (url, _gw):
                r = httpx.post(
                    f"{url}/v1/agents/{app}-bot/chats/c1/messages",
                    json={"text": "echo recorded-$((6*7))"},
                    headers={"Authorization": f"Bearer {CONFIG_KEY}"},
                    timeout=180,
                )
                assert r.status_code == 200, r.text
                assert "recorded-42" in r.json()["reply"]

            async def the_rest() -> None:
                b = backend()
                try:
                    rows = await b.list({LABEL_GATEWAY: RUN_ID, LABEL_APP: app})
                    mine = list(rows)
                    assert mine, rows
                    await b.inspect(mine[0].name)
                    await b.remove(mine[0].name)
                finally:
                    await b.close()

            asyncio.run(the_rest())
            calls = list(rec.calls)
    finally:
        remove_app_containers(docker_client, app)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)
    patterns = allow_patterns()
    made = {(m, p.split("?", 1)[0]) for m, p in calls}
    assert [c for c in sorted(made) if not allowed(*c, patterns)] == []
    # the recording saw the turn's real work, so the check above is not empty
    kinds = {re.sub(r"/(v1\.\d+)", "", p).split("/")[1] + " " + m for m, p in made}
    assert {"containers POST", "exec POST", "exec GET", "containers DELETE"} <= kinds, made
    assert any(p.endswith("/start") and "/exec/" in p for _, p in made), made
