"""The README's first command, `scripts/demo.sh --once`: the tour on a real engine.

SPEC ids: S1 (each chat its own sandbox), S2 (no capability), S3 (the persona
is read-only), M1 (a chat's memory is its own). A new user who plays the tour is left with no
running sandbox and no mount of it (nothing serves them a reaper afterwards),
with the memory it wrote, and with chats the demo's key can go on with when the
demo is served next (K4).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.demo import prepare_state, run_tour
from sandbox.backends.docker import DockerBackend
from sandbox.latebind import mountpoints
from tests.support.run_id import remove_run_containers, run_containers, seed_gateway_id
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker


def test_tour_isolates_its_two_chats_and_leaves_no_sandbox_running(
    tmp_path: Path, docker_client: Any, base_image: str, capsys: pytest.CaptureFixture[str]
) -> None:
    state = seed_gateway_id(tmp_path / "demo")
    config, key = prepare_state(state, base_image)
    try:
        assert asyncio.run(run_tour(config)) == 0
        out = capsys.readouterr()
        alice, bob, persona = out.out.split("[exit 0]")[:3]
        assert "alice likes tea" in alice
        assert "tea" not in bob  # M1: bob finds only its own, empty, memory
        assert "Permission denied" in persona and "CapEff:\t0000000000000000" in persona  # S3, S2
        assert alice.split("(")[1].split(")")[0] != bob.split("(")[1].split(")")[0]  # S1
        assert run_containers(docker_client, "demo") == []
        assert [p for p in mountpoints() if p.startswith(str(state))] == []
        assert "removed the tour's 2 sandboxes" in out.err
        memories = list((state / "quota").rglob("*.img"))
        assert memories, "the tour's memory images stay for the next tour"
        # K4: served next, the demo's key goes on with the tour's chats, as its curl lines do
        with served_gateway(config, DockerBackend.from_env) as (url, _):
            r = httpx.post(
                f"{url}/v1/agents/demo-bot/chats/alice/messages",
                headers={"Authorization": f"Bearer {key}"},
                json={"text": "cat chats/*/MEMORY.md"},
                timeout=120,
            )
        assert r.status_code == 200, r.text
        assert "alice likes tea" in r.json()["reply"]
    finally:
        remove_run_containers(docker_client, "demo")
