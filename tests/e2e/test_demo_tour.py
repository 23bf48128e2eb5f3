"""The README's first command, `scripts/demo.sh --once`: the tour on a real engine.

SPEC ids: S1 (each chat its own sandbox), S2 (no capability), S3 (the persona
is read-only), M1 (a chat's memory is its own). A new user who plays the tour is left with no
running sandbox and no mount of it (nothing serves them a reaper afterwards),
and with the memory it wrote, for the next tour.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from orchestrator.demo import prepare_state, run_tour
from tests.support.run_id import remove_run_containers, run_containers, seed_gateway_id

pytestmark = pytest.mark.docker


def _mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(root))]


def test_tour_isolates_its_two_chats_and_leaves_no_sandbox_running(
    tmp_path: Path, docker_client: Any, base_image: str, capsys: pytest.CaptureFixture[str]
) -> None:
    state = seed_gateway_id(tmp_path / "demo")
    config, _ = prepare_state(state, base_image)
    try:
        assert asyncio.run(run_tour(config)) == 0
        out = capsys.readouterr()
        alice, bob, persona = out.out.split("[exit 0]")[:3]
        assert "alice likes tea" in alice
        assert "tea" not in bob  # M1: bob finds only its own, empty, memory
        assert "Permission denied" in persona and "CapEff:\t0000000000000000" in persona  # S3, S2
        assert alice.split("(")[1].split(")")[0] != bob.split("(")[1].split(")")[0]  # S1
        assert run_containers(docker_client, "demo") == []
        assert _mounts_under(state) == []
        assert "removed the tour's 2 sandboxes" in out.err
        memories = list((state / "quota").rglob("*.img"))
        assert memories, "the tour's memory images stay for the next tour"
    finally:
        remove_run_containers(docker_client, "demo")
