"""A real gateway process killed with SIGKILL while hundreds of messages are in flight (D1, D2).

Every accepted message must be answered exactly once, in its own chat, and no
container may be left without a conversation. The counts are printed.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.store import Store
from sandbox.spec import LABEL_AGENT, LABEL_APP, LABEL_CONVERSATION, LABEL_GATEWAY, LABEL_MANAGED
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.support.run_id import RUN_ID, run_labels
from tests.support.served import free_port

pytestmark = pytest.mark.docker

APP = "crash"
AGENT = "crash-bot"
CHATS = 20
PER_CHAT = 15
KILLS = 5


class GatewayProcess:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config, self.port, self.log = config, port, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(self.config),
                 "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"gateway did not start; see {self.log}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def _post(url: str, chat: str, mid: str, text: str) -> bool:
    try:
        r = httpx.post(
            f"{url}/v1/agents/{AGENT}/chats/{chat}/messages?wait=false",
            json={"text": text, "message_id": mid},
            headers={"Authorization": f"Bearer {CONFIG_KEY}"},
            timeout=10,
        )
    except httpx.HTTPError:
        return False
    assert r.status_code in (202, 503), r.text
    return r.status_code == 202


def test_D1_D2_sigkill_in_flight_every_message_answered_exactly_once(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    config = install_test_app(tmp_path, docker_client, base_image, APP,
                              {"maxConcurrentTurns": 4})  # fmt: skip
    gw = GatewayProcess(config, free_port(), tmp_path / "gateway.log")
    rng = random.Random(int(os.environ.get("CELLGATE_CRASH_SEED", "20261202")))
    plan = [(f"c{c}", f"m-{c}-{i}", i) for i in range(PER_CHAT) for c in range(CHATS)]
    accepted: set[str] = set()
    done = threading.Event()

    def submit() -> None:
        for chat, mid, i in plan:
            while not _post(gw.url, chat, mid, f'echo "$GATEWAY_ORIGIN_CHAT_ID:{i}"'):
                time.sleep(0.1)  # the gateway is down: retry the same id
            accepted.add(mid)
        done.set()

    gw.start()
    try:
        sender = threading.Thread(target=submit, daemon=True)
        sender.start()
        kills = 0
        for k in range(KILLS):
            time.sleep(rng.uniform(0.5, 2.5))
            if k == KILLS - 1:
                # An orphan the recovery scan must remove: no conversation has it.
                docker_client.containers.create(
                    base_image, "sleep infinity", name=f"{APP}-agent-c-orphan", network_mode="none",
                    labels={LABEL_MANAGED: "1", LABEL_APP: APP, LABEL_AGENT: AGENT,
                            LABEL_CONVERSATION: "gone", LABEL_GATEWAY: RUN_ID},
                )  # fmt: skip
            gw.kill()
            kills += 1
            gw.start()
        assert done.wait(240), "the sender did not finish"
        deadline = time.monotonic() + 240
        pending = set(accepted)
        while pending and time.monotonic() < deadline:
            for chat, mid, _ in plan:
                if mid not in pending:
                    continue
                r = httpx.get(
                    f"{gw.url}/v1/agents/{AGENT}/chats/{chat}/messages/{mid}",
                    headers={"Authorization": f"Bearer {CONFIG_KEY}"},
                    timeout=10,
                )
                if r.status_code == 200 and r.json()["state"] == "delivered":
                    pending.discard(mid)
            time.sleep(0.5)
        assert not pending, f"{len(pending)} accepted messages never answered"
    finally:
        gw.stop()

    db = sqlite3.connect(config.parent / "cellgate.sqlite3")
    rows = db.execute(
        "SELECT c.chat_id, m.platform_message_id, m.state, count(r.id), group_concat(r.text, '|')"
        " FROM messages m JOIN conversations c ON c.id = m.conversation_id"
        " LEFT JOIN replies r ON r.message_id = m.id GROUP BY m.id"
    ).fetchall()
    reruns = db.execute(
        "SELECT count(*) FROM (SELECT message_id FROM turns WHERE message_id IS NOT NULL"
        " GROUP BY message_id HAVING count(*) > 1)"
    ).fetchone()[0]
    db.close()
    expected = {mid: (chat, i) for chat, mid, i in plan}
    answered = sum(1 for r in rows if r[3] == 1)
    twice = [r for r in rows if r[3] > 1]
    wrong = [r for r in rows if r[3] == 1 and r[4] != f"{r[0]}:{expected[r[1]][1]}\n[exit 0]"]
    with Store.open(config.parent) as store:
        violations = store.delivery_violations()
        conversations = {c.id for c in store.conversations()}
        # a pooled sandbox (F1) learns its conversation at its claim, after its labels
        recorded = {sb.name: sb.conversation_id for sb in store.sandboxes()}
    containers = docker_client.containers.list(all=True, filters={"label": run_labels(APP)})
    homeless = [
        c.name
        for c in containers
        if (c.labels[LABEL_CONVERSATION] or recorded.get(c.name)) not in conversations
    ]
    print(
        f"\ncrash test: {kills} SIGKILLs, {len(plan)} sent, {len(accepted)} accepted, "
        f"{len(rows)} stored, {answered} answered once, {len(twice)} answered twice, "
        f"{len(wrong)} in the wrong chat or wrong, {reruns} turns re-run after a crash, "
        f"{len(containers)} sandboxes, {len(homeless)} without a conversation"
    )
    try:
        assert len(accepted) == len(plan) == len(rows)
        assert {r[1] for r in rows} == set(expected)
        assert all(r[2] == "delivered" for r in rows)
        assert answered == len(plan) and not twice
        assert not wrong, wrong[:3]
        assert violations == []
        assert not homeless, homeless
        assert len(containers) == CHATS
    finally:
        remove_app_containers(docker_client, APP)
