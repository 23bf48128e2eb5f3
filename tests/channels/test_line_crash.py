"""SIGKILL while a LINE push is in flight, then restart: the push is posted once (W4, D2).

A real `cellgate serve` process takes a signed webhook; the reply token is
stale by the time the answer is ready, so the answer goes by push. The
stand-in posts the push at once but holds its answer, and the gateway is
killed with SIGKILL in that window: LINE has the message, the store does not
know it. The restarted gateway delivers the stored reply again under the
same `X-Line-Retry-Key` (derived from the reply's durable outbound key), and
LINE answers 409: nothing is posted twice.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import read_config_document, write_config_document
from tests.e2e.conftest import install_test_app, remove_app_containers
from tests.e2e.test_crash import GatewayProcess
from tests.fakes.line_standin import LineStandin
from tests.support.served import free_port

pytestmark = pytest.mark.docker

APP = "linecrash"
AGENT = f"{APP}-bot"
SECRET_ENV = "CELLGATE_TEST_LINE_CRASH_SECRET"
TOKEN_ENV = "CELLGATE_TEST_LINE_CRASH_TOKEN"
SECRET = "crashLineChannelSecret0123456789"
TOKEN = "crashLineAccessTokenValue0123456789abcdefgh"
CHAT = "Ucrash0000000001"


def _delivered(config: Path) -> bool:
    db = sqlite3.connect(config.parent / "cellgate.sqlite3", timeout=10)
    try:
        row = db.execute("SELECT count(*), sum(state = 'delivered') FROM messages").fetchone()
    finally:
        db.close()
    return bool(row[0] == 1 and row[1] == 1)


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_W4_D2_sigkill_while_a_push_is_in_flight_then_restart_posts_it_once(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    config = install_test_app(tmp_path, docker_client, base_image, APP)
    saved = {k: os.environ.get(k) for k in (SECRET_ENV, TOKEN_ENV)}
    os.environ[SECRET_ENV] = SECRET
    os.environ[TOKEN_ENV] = TOKEN
    port = free_port()
    gw = GatewayProcess(config, port, tmp_path / "gateway.log")
    try:
        with LineStandin(TOKEN, SECRET) as line:
            doc = read_config_document(config)
            doc["agents"][0]["channels"] = {
                "line": {
                    "channelSecretEnv": SECRET_ENV,
                    "accessTokenEnv": TOKEN_ENV,
                    "apiBaseUrl": line.base_url,
                    "dataApiBaseUrl": line.base_url,
                }
            }
            write_config_document(config, doc)
            line.token_seconds = 0.0  # the reply token is stale: the answer goes by push
            line.hold_push_answers(600)  # answered only after the kill, if ever
            gw.start()
            hook = f"{gw.url}/v1/line/{AGENT}/webhook"
            r = line.post_webhook(hook, [line.text_event(line.user(CHAT), "echo posted-once")])
            assert r.status_code == 200, r.text
            _wait(lambda: line.texts(CHAT), 120, "LINE to accept the push")
            assert not _delivered(config), "the store does not know it was posted"
            gw.kill()
            gw.start()
            _wait(lambda: _delivered(config), 120, "the restarted gateway to deliver it")
            time.sleep(2.0)
            pushes = [c for c in line.calls_of("/v2/bot/message/push") if c.body["to"] == CHAT]
            statuses = [c.status for c in pushes]  # before the stand-in stops holding
            texts = line.texts(CHAT)
    finally:
        gw.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        remove_app_containers(docker_client, APP)
    print(f"\nline crash test: {len(pushes)} push calls {statuses}, "
          f"{len(texts)} posted")  # fmt: skip
    assert texts == ["posted-once\n[exit 0]"], "posted once across the kill"
    # the first push was posted and never answered (0): its gateway was killed waiting
    assert statuses == [0, 409]
    assert pushes[0].headers["x-line-retry-key"] == pushes[1].headers["x-line-retry-key"]
