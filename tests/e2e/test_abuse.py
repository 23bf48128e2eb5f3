"""A hostile stranger with a shell attacks the gateway, not the walls (R1-R7).

Each test serves a gateway of its own, runs the attack from inside sandboxes
as a stranger would (the shell harness runs each message as a shell command),
and measures another chat's answer during it. Figures are printed (`-s`).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import load_config
from sandbox.backends.docker import DockerBackend
from tests.e2e.test_resilience import Client, serve
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker

PLANT = {
    "MEMORY.md": "rm -f MEMORY.md && mkfifo MEMORY.md",
    "USER.md": "rm -f USER.md && mkfifo USER.md",
    "transcript": "rm -f transcript.jsonl && mkfifo transcript.jsonl",
    "session": "rm -f session.json && mkfifo session.json",
    "symlink": "rm -f MEMORY.md && ln -s /etc/shadow MEMORY.md",
    "directory": "rm -f USER.md && mkdir USER.md",
}


def timed(client: Client, chat: str, text: str) -> tuple[float, str]:
    t0 = time.monotonic()
    r = client.say(chat, text, timeout=120)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0, str(r.json()["reply"])


def test_R3_M6_fifo_and_link_planted_in_chat_dirs_never_hang_the_gateway(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    """`rm MEMORY.md && mkfifo MEMORY.md` in six chats, one more message each, a restart."""
    app = "abusefifo"
    with serve(tmp_path, docker_client, base_image, app, {"turnTimeoutSeconds": 30}) as (
        client,
        gw,
    ):
        for i, (what, attack) in enumerate(PLANT.items()):
            out = client.say(
                f"evil-{i}", f"cd /workspace/chats/*/ && {attack} && echo planted {what}"
            )
            assert out.status_code == 200 and "planted" in out.json()["reply"], out.text
        answers: list[tuple[str, int]] = []

        def again(i: int) -> None:
            r = client.say(f"evil-{i}", "echo still-served", timeout=120)
            answers.append((f"evil-{i}", r.status_code))

        threads = [threading.Thread(target=again, args=(i,)) for i in range(len(PLANT))]
        for t in threads:
            t.start()
        waits = [timed(client, "bystander", f"echo hello-{n}")[0] for n in range(5)]
        for t in threads:
            t.join(150)
        assert sorted(answers) == sorted((f"evil-{i}", 200) for i in range(len(PLANT))), answers
        print(f"\n[fifo] bystander p50 {statistics.median(waits):.2f} s, max {max(waits):.2f} s")
        assert max(waits) < 15
        config = load_config(gw.config.gateway.state_dir / "config.json")
    # a restart: recovery and reconciliation open the same planted files, and must not hang
    t0 = time.monotonic()
    with served_gateway(config.gateway.state_dir / "config.json", DockerBackend.from_env) as (
        url,
        _,
    ):
        client = Client(url, f"{app}-bot")
        _, reply = timed(client, "evil-0", "echo after-restart")
        assert "after-restart" in reply
        _, reply = timed(client, "bystander", "echo hi-again")
        assert "hi-again" in reply
    print(f"[fifo] restarted and answered in {time.monotonic() - t0:.2f} s")
