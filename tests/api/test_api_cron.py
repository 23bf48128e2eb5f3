"""`/v1/agents/{agent}/cron` over real HTTP (C1, C2, K2).

The suite's gateway has `iso` (isolateMemory: true, an app's agent) and
`open` (a host agent); a second small gateway here has a non-isolated app
agent for C2.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.config import write_config_document
from orchestrator.store import Store
from tests.api.conftest import Live
from tests.fakes.no_engine import NoEngineBackend
from tests.support.served import served_gateway

ADMIN = "cfg-admin-key-0123456789abcdef"


def prompt_job(**kw: object) -> dict[str, object]:
    return {"prompt": "good morning", "cron": "0 9 * * *", "timezone": "Asia/Bangkok",
            "channel": "telegram", "chat_id": "42", **kw}  # fmt: skip


def test_C1_api_refuses_a_job_for_an_isolated_agent_with_rule_and_reason(live: Live) -> None:
    admin = live.seed.keys["admin"]
    r = live.request("POST", "/v1/agents/iso/cron", admin, json=prompt_job())
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert (err["code"], err["rule"]) == ("policy_denied", "C1")
    assert "isolated" in err["message"] and "whole agent" in err["message"]
    assert live.request("GET", "/v1/agents/iso/cron", admin).json() == []
    audit = [x for x in live.store.refusals(limit=500) if x.action == "cron_create"]
    assert audit and audit[0].rule == "C1" and audit[0].detail["via"] == "api"


def test_cron_api_create_list_pause_resume_delete(live: Live) -> None:
    admin = live.seed.keys["admin"]
    r = live.request("POST", "/v1/agents/open/cron", admin, json=prompt_job(name="morning"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["agent"], job["state"], job["chat_id"], job["name"]) == (
        "open", "active", "42", "morning")  # fmt: skip
    assert job["next_run_at"] > 0
    listed = live.request("GET", "/v1/agents/open/cron", admin).json()
    assert job["id"] in [j["id"] for j in listed]
    base = f"/v1/agents/open/cron/{job['id']}"
    assert live.request("POST", f"{base}/pause", admin).json()["state"] == "paused"
    assert live.request("POST", f"{base}/resume", admin).json()["state"] == "active"
    assert live.request("POST", f"/v1/agents/iso/cron/{job['id']}/pause", admin).status_code == 404
    assert live.request("DELETE", base, admin).json() == {"deleted": job["id"]}
    assert live.request("DELETE", base, admin).status_code == 404


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (prompt_job(cron="bad"), "bad_schedule"),
        (prompt_job(every=3600), "bad_schedule"),  # two schedules
        (prompt_job(timezone="Nowhere/Land"), "bad_schedule"),
        (prompt_job(channel=None), "bad_schedule"),
        (prompt_job(channel="Bad Channel"), "bad_conversation"),
    ],
)
def test_cron_api_bad_jobs_are_400_with_a_reason(
    live: Live, body: dict[str, object], code: str
) -> None:
    r = live.request("POST", "/v1/agents/open/cron", live.seed.keys["admin"], json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_K2_cron_api_needs_an_admin_key(live: Live) -> None:
    r = live.request("POST", "/v1/agents/open/cron", live.seed.keys["open"], json=prompt_job())
    assert r.status_code == 403 and r.json()["error"]["rule"] == "K2"
    assert live.request("GET", "/v1/agents/open/cron").status_code == 401


@pytest.fixture(scope="module")
def app_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    state = tmp_path_factory.mktemp("cron-c2") / "state"
    state.mkdir()
    config_path = state / "config.json"
    write_config_document(
        config_path,
        {
            "gateway": {"stateDir": str(state)},
            "apiKeys": [{"name": "admin", "key": ADMIN, "agents": ["*"], "admin": True}],
            "agents": [
                {"id": "shop", "app": "shopapp", "isolateMemory": False},
                {"id": "ops", "isolateMemory": False},
            ],
        },
    )
    with served_gateway(config_path, NoEngineBackend) as (url, _gw):
        yield url, state


def test_C2_api_refuses_a_command_job_for_an_app_agent(app_gateway: tuple[str, Path]) -> None:
    url, state = app_gateway
    auth = {"Authorization": f"Bearer {ADMIN}"}
    body = {"type": "command", "command": "date", "every": 3600}
    r = httpx.post(f"{url}/v1/agents/shop/cron", json=body, headers=auth)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["rule"] == "C2"
    assert "type: prompt" in r.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/agents/shop/cron", json=prompt_job(), headers=auth)
    assert ok.status_code == 201, ok.text  # a prompt job is fine for the same agent
    host = httpx.post(f"{url}/v1/agents/ops/cron", json=body, headers=auth)
    assert host.status_code == 201 and host.json()["type"] == "command"  # a host agent may
    with Store.open(state) as store:
        assert {j.agent for j in store.cron_jobs()} == {"shop", "ops"}
