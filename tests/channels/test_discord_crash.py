"""SIGKILL while Discord replies are being delivered, then restart (D2, W4).

A real `cellgate serve` process, pointed at the stand-in by its config
(`apiBaseUrl`, `gatewayUrl`), is killed with SIGKILL at random points while it
runs turns and posts replies, then started again (a fresh IDENTIFY each
time). The messages are all stored before the first kill: Discord does not
redeliver what a dead process missed, so what is counted here is delivery.
On the stand-in's side at the end:

- every stored message's reply is posted;
- a reply posted twice only in the window REST leaves open (Discord accepted
  the post, the process died before the store recorded it: no idempotency
  key exists); each duplicate's first copy was accepted just before a kill.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import read_config_document, write_config_document
from orchestrator.store import Store
from tests.e2e.conftest import install_test_app, remove_app_containers
from tests.e2e.test_crash import GatewayProcess
from tests.fakes.discord_standin import DiscordStandin
from tests.support.served import free_port

pytestmark = pytest.mark.docker

APP = "dccrash"
TOKEN_ENV = "CELLGATE_TEST_DC_CRASH_TOKEN"
TOKEN = "MTUxNTE1.crash.DiscordCrashTokenValue0123456789"
CHATS = 6
PER_CHAT = 4
KILLS = 3
WINDOW = 2.0


def _counts(config: Path) -> tuple[int, int]:
    db = sqlite3.connect(config.parent / "cellgate.sqlite3", timeout=10)
    try:
        row = db.execute("SELECT count(*), sum(state = 'delivered') FROM messages").fetchone()
    finally:
        db.close()
    return int(row[0] or 0), int(row[1] or 0)


def _wait(pred: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_D2_W4_sigkill_while_delivering_every_reply_posted_duplicates_only_in_the_window(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    config = install_test_app(tmp_path, docker_client, base_image, APP, {"maxConcurrentTurns": 3})
    rng = random.Random(int(os.environ.get("CELLGATE_CRASH_SEED", "20261203")))
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN
    kill_times: list[float] = []
    try:
        with DiscordStandin(TOKEN) as dc:
            doc = read_config_document(config)
            doc["agents"][0]["channels"] = {
                "discord": {
                    "tokenEnv": TOKEN_ENV,
                    "apiBaseUrl": dc.api_base_url,
                    "gatewayUrl": dc.gateway_url,
                }
            }
            write_config_document(config, doc)
            chats = [dc.add_text_channel(f"crash-{c}") for c in range(CHATS)]
            gw = GatewayProcess(config, free_port(), tmp_path / "gateway.log")
            gw.start()
            try:
                _wait(lambda: dc.identifies == 1 and dc.identified_intents, 60, "IDENTIFY")
                time.sleep(2.5)  # the guild arrives (discord.py waits for it before READY)
                expected: dict[str, int] = {}
                for i in range(PER_CHAT):
                    for chat in chats:
                        text = f"m-{chat}-{i}"
                        expected[f"{text}\n[exit 0]"] = chat
                        dc.user_says(chat, f"sleep 0.3; echo {text}")
                _wait(lambda: _counts(config)[0] == len(expected), 60, "every message stored")
                for _ in range(KILLS):
                    time.sleep(rng.uniform(0.5, 2.5))
                    kill_times.append(time.time())
                    gw.kill()
                    gw.start()
                _wait(lambda: _counts(config)[1] == len(expected), 240, "every reply delivered")
                time.sleep(2.0)  # anything still to be posted twice would show now
            finally:
                gw.stop()
            posts = [p for p in dc.messages() if p.channel_id in chats]
    finally:
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved

    db = sqlite3.connect(config.parent / "cellgate.sqlite3")
    replies = db.execute(
        "SELECT c.chat_id, r.text FROM replies r JOIN conversations c ON c.id = r.conversation_id"
    ).fetchall()
    db.close()
    with Store.open(config.parent) as store:
        violations = store.delivery_violations()
    owed = Counter((int(chat), text) for chat, text in replies)
    got = Counter((p.channel_id, p.content) for p in posts)
    missing = [k for k, n in owed.items() if got[k] < n]
    extra = {k: got[k] - owed[k] for k in got if got[k] > owed[k]}
    echoed = sum(1 for (chat, text) in owed if expected.get(text) == chat)

    def in_window(key: tuple[int, str]) -> bool:
        times = [p.at for p in posts if (p.channel_id, p.content) == key]
        return any(0 <= k - t < WINDOW for k in kill_times for t in times)

    unexplained = [k for k in extra if not in_window(k)]
    print(
        f"\ndiscord crash test: {len(kill_times)} SIGKILLs, {len(expected)} messages, "
        f"{sum(owed.values())} replies recorded ({echoed} the echo), "
        f"{sum(owed.values()) - len(missing)} posted, {sum(extra.values())} posted twice, "
        f"{len(unexplained)} of them outside the accepted-but-not-recorded window"
    )
    try:
        assert sum(owed.values()) == len(expected), "one reply per message"
        assert not missing, f"{len(missing)} recorded replies never posted: {missing[:3]}"
        assert not unexplained, f"posted twice outside the window: {unexplained[:3]}"
        assert all(n == 1 for n in extra.values())
        assert echoed >= len(expected) - KILLS * 3, "most turns ran to their echo"
        assert violations == []
    finally:
        remove_app_containers(docker_client, APP)
