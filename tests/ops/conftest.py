"""A real gateway over real HTTP on a real engine, with an admin key, for O2 and O3."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from orchestrator.api import create_app
from orchestrator.config import load_config, write_config_document
from orchestrator.gateway import Gateway
from sandbox.backends.docker import DockerBackend
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.support.served import free_port

TOOL = "python3 /run/cellgate/cellgate-tool"


@dataclass
class OpsGateway:
    url: str
    admin_key: str
    user_key: str
    agent: str
    app: str
    gateway: Gateway
    loop: asyncio.AbstractEventLoop

    def on_loop(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        """Run a coroutine on the gateway's own event loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def say(self, chat: str, text: str) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages",
            json={"text": text},
            headers={"Authorization": f"Bearer {self.user_key}"},
            timeout=180,
        )


@pytest.fixture(scope="session")
def ops(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[OpsGateway]:
    app = f"ops{secrets.token_hex(3)}"
    config_path = install_test_app(tmp_path_factory.mktemp(app), docker_client, base_image, app)
    admin_key = "cg_admin_" + secrets.token_hex(16)
    doc = json.loads(config_path.read_text())
    doc["apiKeys"].append({"name": "ops-admin", "key": admin_key, "admin": True})
    write_config_document(config_path, doc)
    try:
        with serve(config_path) as (url, gw, loop):
            yield OpsGateway(url, admin_key, CONFIG_KEY, f"{app}-bot", app, gw, loop)
    finally:
        remove_app_containers(docker_client, app)


@contextlib.contextmanager
def serve(config_path: Path) -> Iterator[tuple[str, Gateway, asyncio.AbstractEventLoop]]:
    """As `served_gateway`, with the background tasks running and the loop at hand."""
    port = free_port()
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        gw = Gateway(load_config(config_path), DockerBackend.from_env())
        holder["gateway"], holder["loop"] = gw, asyncio.get_running_loop()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(gw), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
            )
        )
        holder["server"] = server
        await gw.start()
        gw.start_background()
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 - uvicorn offers no started event
            await asyncio.sleep(0.02)
        ready.set()
        await task
        await gw.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(60), "gateway did not start"
    try:
        yield f"http://127.0.0.1:{port}", holder["gateway"], holder["loop"]
    finally:
        holder["server"].should_exit = True
        thread.join(60)
