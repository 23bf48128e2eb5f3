"""A hostile stranger with a shell attacks the gateway, not the walls (R1-R7).

Each test serves a gateway of its own, runs the attack from inside sandboxes
as a stranger would (the shell harness runs each message as a shell command),
and measures another chat's answer during it. Figures are printed (`-s`).
"""

from __future__ import annotations

import shutil
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


TOOL = "python3 /run/cellgate/cellgate-tool"


def rss_mb() -> float:
    """This process's resident memory: the served gateway runs in it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def tree_bytes(root: Path) -> int:
    total = 0
    for p in root.rglob("*"):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        total += st.st_blocks * 512
    return total


def test_R3_R4_reply_flood_between_turns_keeps_the_gateway_bounded(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    """A background loop of bridge `reply` calls outlives its turn; memory stays flat."""
    app = "abuseflood"
    with serve(tmp_path, docker_client, base_image, app, {}) as (client, _):
        before = rss_mb()
        loop = (
            "cat > /tmp/flood.py <<'EOF'\n"
            "import importlib.machinery, importlib.util\n"
            "spec = importlib.util.spec_from_loader('t', importlib.machinery.SourceFileLoader("
            "'t', '/run/cellgate/cellgate-tool'))\n"
            "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n"
            "i = 0\n"
            "while True:\n"
            "    i += 1\n"
            "    try:\n"
            "        t.call('reply', {'text': 'x' * 4000 + str(i)})\n"
            "    except Exception:\n"
            "        pass\n"
            "EOF\n"
            "setsid nohup python3 /tmp/flood.py >/dev/null 2>&1 & echo started"
        )
        r = client.say("flooder", loop)
        assert r.status_code == 200 and "started" in r.json()["reply"], r.text
        waits = []
        for n in range(10):
            time.sleep(2)
            waits.append(timed(client, "bystander", f"echo hi-{n}")[0])
        r = client.say("flooder", "echo next-turn")
        assert r.status_code == 200
        body = r.json()
        size = len(r.content)
        after = rss_mb()
        print(
            f"\n[reply flood] gateway RSS {before:.0f} -> {after:.0f} MB over 20 s; next answer "
            f"{size} bytes with {len(body['meta'].get('messages', []))} messages; bystander "
            f"p95 {sorted(waits)[int(0.95 * (len(waits) - 1))]:.2f} s"
        )
        assert after - before < 100
        assert size < 1_000_000
        assert max(waits) < 10


def test_R3_send_file_flood_of_a_sparse_file_keeps_the_spool_bounded(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    app = "abusespool"
    with serve(tmp_path, docker_client, base_image, app, {}) as (client, gw):
        state = gw.config.gateway.state_dir
        free_before = shutil.disk_usage(state).free
        attack = (
            "cd /workspace/media/*/ && truncate -s 50M big.bin && for i in $(seq 1 40); do "
            f'{TOOL} send_file \'{{"path": "big.bin"}}\' >/dev/null 2>&1; done; echo done'
        )
        r = client.say("spooler", attack, timeout=300)
        assert r.status_code == 200, r.text
        spool = tree_bytes(state / "bridge-spool") if (state / "bridge-spool").exists() else 0
        used = free_before - shutil.disk_usage(state).free
        print(
            f"\n[send_file flood] spool {spool / 1e6:.1f} MB, host space used {used / 1e6:.1f} MB"
        )
        assert spool < 60_000_000
        assert used < 200_000_000
