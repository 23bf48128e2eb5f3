"""A real gateway served by uvicorn on loopback, in a thread of its own (real HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from orchestrator.api import create_app
from orchestrator.app_modes import prepare_config
from orchestrator.gateway import Gateway
from sandbox.backends.base import SandboxBackend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served_gateway(
    config_path: Path,
    backend: Callable[[], SandboxBackend],
    *,
    port: int | None = None,
    start: bool = False,
    background: bool = False,
) -> Iterator[tuple[str, Gateway]]:
    """Yield the base URL and the gateway; stop the server and close the gateway after.

    `start`: run `Gateway.start` (recovery, channels) before serving, as `cellgate serve` does.
    `background`: also its background tasks (reaper, heartbeats, warm pools, the config
    watch of L5). The config is prepared as `cellgate serve` does (L3: app declarations
    applied).
    """
    port = port or free_port()
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        gw = Gateway(prepare_config(config_path), backend(), config_path=config_path)
        holder["gateway"] = gw
        if start:
            await gw.start()
        if background:
            gw.start_background()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(gw), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
            )
        )
        holder["server"] = server
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 - uvicorn offers no started event
            await asyncio.sleep(0.02)
        ready.set()
        await task
        await gw.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(30), "gateway did not start"
    try:
        yield f"http://127.0.0.1:{port}", holder["gateway"]
    finally:
        holder["server"].should_exit = True
        thread.join(30)
