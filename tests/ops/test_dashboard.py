"""O3: the dashboard, driven in headless Chromium: sign in, two live chats' sandboxes, a refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.api.dashboard import COOKIE
from tests.ops.browser import Browser, dump_dom
from tests.ops.conftest import TOOL, OpsGateway

ROWS_JS = """JSON.stringify(Array.from(document.querySelectorAll('#%s tr')).slice(1)
  .map(tr => Array.from(tr.cells).map(td => td.innerText.trim())))"""


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "profile")
    try:
        yield b
    finally:
        b.close()


def rows(browser: Browser, table: str) -> list[list[str]]:
    out: list[list[str]] = json.loads(browser.eval(ROWS_JS % table))
    return out


def test_o3_dashboard_in_headless_chromium(
    ops: OpsGateway, browser: Browser, tmp_path: Path
) -> None:
    for chat in ("dash-alice", "dash-bob"):
        r = ops.say(chat, f"echo hello {chat}")
        assert r.status_code == 200 and f"hello {chat}" in r.json()["reply"], r.text
    refused = ops.say("dash-alice", f'{TOOL} reply \'{{"text": "x", "chat_id": "dash-bob"}}\'')
    assert refused.status_code == 200

    # without a session the page is the sign-in form, and shows nothing else
    anonymous = dump_dom(f"{ops.url}/dashboard", tmp_path / "anon")
    assert 'name="key"' in anonymous and 'id="sandboxes"' not in anonymous
    assert "dash-alice" not in anonymous

    browser.goto(f"{ops.url}/dashboard")
    assert browser.eval("!!document.querySelector('input[name=key]')")
    # a non-admin key is refused with the rule
    browser.eval(
        f"document.querySelector('input[name=key]').value = {json.dumps(ops.user_key)};"
        "document.querySelector('form').submit()"
    )
    browser.wait_for("!!document.querySelector('#error')")
    assert "K2" in browser.eval("document.querySelector('#error').innerText")
    # the admin key signs in; the key is never in the URL
    browser.eval(
        f"document.querySelector('input[name=key]').value = {json.dumps(ops.admin_key)};"
        "document.querySelector('form').submit()"
    )
    browser.wait_for("!!document.querySelector('#sandboxes')")
    assert ops.admin_key not in browser.eval("location.href")
    [cookie] = [c for c in browser.cookies() if c["name"] == COOKIE]
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert ops.admin_key not in cookie["value"]

    sandboxes = rows(browser, "sandboxes")
    by_chat = {r[2]: r for r in sandboxes}
    for chat in ("dash-alice", "dash-bob"):
        row = by_chat[f"api:{chat}"]
        assert row[1] == ops.agent
        assert len(row[3]) == 16  # the spec hash
        assert row[4] == "verified", row
    names = {r[0] for r in sandboxes}
    assert {sb.name for sb in ops.gateway.store.sandboxes()} >= names

    refusals = rows(browser, "refusals")
    assert any(r[1] == "P1" and r[2] == "reply" and "dash-alice" in r[3] for r in refusals), (
        refusals
    )
    assert any(r[0] == ops.agent for r in rows(browser, "agents"))
    chats = [r[1] for r in rows(browser, "chats")]
    assert "api:dash-alice" in chats and "api:dash-bob" in chats
    assert any("dash-bob" in r[2] and r[3].startswith("ok") for r in rows(browser, "turns"))
    # readable on a phone: no horizontal overflow of the page itself at 412 px
    assert browser.eval("document.documentElement.scrollWidth <= window.innerWidth + 1")

    shot = browser.screenshot(tmp_path / "dashboard.png")
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")

    # signing out ends the session
    browser.eval("document.querySelector('form.inline').submit()")
    browser.wait_for("!!document.querySelector('input[name=key]')")


def test_o3_dashboard_refuses_without_admin_session(ops: OpsGateway) -> None:
    r = httpx.get(f"{ops.url}/dashboard", timeout=30)
    assert r.status_code == 401 and 'name="key"' in r.text
    r = httpx.get(f"{ops.url}/dashboard", cookies={COOKIE: "forged"}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{ops.url}/dashboard/login", data={"key": ops.user_key}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{ops.url}/dashboard/login", data={"key": ops.admin_key}, timeout=30)
    assert r.status_code == 303
    assert "httponly" in r.headers["set-cookie"].lower()
    assert "samesite=strict" in r.headers["set-cookie"].lower()
