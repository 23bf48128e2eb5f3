"""The FIFO attack on a real gateway and engine: `rm MEMORY.md && mkfifo MEMORY.md` (R3, M5, D3).

A hostile shell replaces every file the gateway reads or writes in its chat
directory (MEMORY.md, USER.md, transcript.jsonl, session.json) with a named
pipe. The gateway must keep answering that chat and another one, and a new
gateway on the same state must finish its start-up recovery and
reconciliation (which ensure every conversation's directory) instead of
blocking in `open()` forever. Latencies are printed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cellgate.models import ConversationKey
from orchestrator.config import load_config
from orchestrator.gateway import Gateway
from sandbox.backends.docker import DockerBackend
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker

FILES = ("MEMORY.md", "USER.md", "transcript.jsonl", "session.json")
BOUND_SECONDS = 60.0


def _say(url: str, agent: str, chat: str, text: str) -> tuple[str, float]:
    started = time.monotonic()
    r = httpx.post(
        f"{url}/v1/agents/{agent}/chats/{chat}/messages",
        json={"text": text},
        headers={"Authorization": f"Bearer {CONFIG_KEY}"},
        timeout=BOUND_SECONDS,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["reply"]), time.monotonic() - started


async def _start_and_close(config: Path) -> float:
    gw = Gateway(load_config(config), DockerBackend.from_env())
    started = time.monotonic()
    try:
        async with asyncio.timeout(BOUND_SECONDS):
            await gw.start()
        return time.monotonic() - started
    finally:
        await gw.close()


def test_R3_fifo_attack_does_not_hang_the_gateway_or_its_restart(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    """covers: R3, M5, D3 - every chat-dir file a FIFO; answers go on, and a restart finishes."""
    app = f"fifo{secrets.token_hex(3)}"
    agent = f"{app}-bot"
    config = install_test_app(tmp_path, docker_client, base_image, app)
    chat_dir = ConversationKey(agent, "api", "mallory").dir_name
    plant = "; ".join(f"rm -f {f}; mkfifo {f}" for f in FILES)
    try:
        with served_gateway(config, DockerBackend.from_env) as (url, _gw):
            _say(url, agent, "mallory", "echo warm")
            reply, _ = _say(
                url, agent, "mallory", f"cd /workspace/chats/{chat_dir}; {plant}; ls -l"
            )
            assert reply.count("prw") == len(FILES), reply
            again, mallory_s = _say(url, agent, "mallory", "echo still-answered")
            assert "still-answered" in again
            other, other_s = _say(url, agent, "alice", "echo alice-answered")
            assert "alice-answered" in other
        restart_s = asyncio.run(_start_and_close(config))
        with served_gateway(config, DockerBackend.from_env) as (url, _gw):
            after, after_s = _say(url, agent, "mallory", "echo after-restart")
            assert "after-restart" in after
        host_dir = config.parent / "agents" / agent / "workspace" / "chats" / chat_dir
        still_fifos = [f for f in FILES if (host_dir / f).is_fifo()]
        assert "MEMORY.md" in still_fifos, "the planted pipes are left out, not followed or removed"
        print(
            f"\nFIFO attack: mallory {mallory_s:.2f} s, alice {other_s:.2f} s, "
            f"restart recovery {restart_s:.2f} s, mallory after restart {after_s:.2f} s "
            f"(bound {BOUND_SECONDS:.0f} s); pipes left in place: {still_fifos}"
        )
    finally:
        remove_app_containers(docker_client, app)
