"""The cron_* and memory_* bridge tools over real unix sockets and the real client (C1, C2,
A1, A2, T2).

The bridge world serves the standard tools; each test adds the cron and
archive tools as the gateway does, with the agent's facts in a dict the
test changes (the gateway's view of isolateMemory and of the agent's app).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.archive import kb_path, refresh
from orchestrator.bridge.cron_tools import CronTools
from orchestrator.bridge.memory_tools import MemoryTools
from orchestrator.cron import AgentFacts, CronJobs
from tests.bridge.conftest import World, make_world

T2_TOOLS = {"memory_search", "memory_get", "cron_create", "cron_list", "cron_pause",
            "cron_resume", "cron_delete"}  # fmt: skip


@dataclass
class Tools:
    world: World
    facts: dict[str, AgentFacts]
    jobs: CronJobs


@pytest.fixture
async def tools(short_tmp: Path) -> AsyncIterator[Tools]:
    w = make_world(short_tmp)
    facts = {w.agent: AgentFacts(isolated=False, is_app=True)}
    jobs = CronJobs(w.store, facts.get, clock=time.time)
    CronTools(jobs).install(w.handlers)
    MemoryTools(lambda agent: kb_path(short_tmp, agent)).install(w.handlers)
    try:
        yield Tools(w, facts, jobs)
    finally:
        await w.server.close_all()
        w.store.close()


async def names(chat: object) -> set[str]:
    listed = await chat.ok("list_tools")  # type: ignore[attr-defined]
    return {t["name"] for t in listed["tools"]}


# -- cron ------------------------------------------------------------------------------


async def test_cron_tools_schedule_into_this_conversation_only(tools: Tools) -> None:
    a = await tools.world.open("42", isolated=False)
    assert {"cron_create", "cron_list"} <= await names(a)
    made = await a.ok(
        "cron_create",
        {"prompt": "water the basil", "cron": "0 7 * * *", "timezone": "Asia/Bangkok",
         "chat_id": "999"},
    )  # fmt: skip
    job = made["job"]
    assert (job["channel"], job["chat_id"], job["state"]) == ("telegram", "42", "active")
    assert job["schedule"] == {"kind": "cron", "expr": "0 7 * * *", "timezone": "Asia/Bangkok"}
    listed = await a.ok("cron_list")
    assert [j["id"] for j in listed["jobs"]] == [job["id"]]
    assert (await a.ok("cron_pause", {"job_id": job["id"]}))["job"]["state"] == "paused"
    assert (await a.ok("cron_resume", {"job_id": job["id"]}))["job"]["state"] == "active"
    other = tools.jobs.store.create_cron_job("someone-else", *_prompt())
    doc = await a.call("cron_delete", {"job_id": other.id})
    assert doc["error"]["code"] == "not_found"  # another agent's job is not this one's
    assert await a.ok("cron_delete", {"job_id": job["id"]}) == {"deleted": job["id"]}
    bad = await a.call("cron_create", {"prompt": "x", "every": "5"})
    assert bad["error"]["code"] == "bad_request" and "60" in bad["error"]["message"]


def _prompt() -> tuple[object, str, str]:
    from orchestrator.store import CronType

    return CronType.PROMPT, "0 9 * * *", "hi"


async def test_C1_over_the_bridge_an_isolated_agent_cannot_create_a_job(tools: Tools) -> None:
    # a session that started before the mode was turned on: its scope says "not isolated"
    a = await tools.world.open("42", isolated=False)
    tools.facts[tools.world.agent] = AgentFacts(isolated=True, is_app=True)
    err = await a.refused("cron_create", {"prompt": "hi", "every": "3600"}, "C1")
    assert "isolated" in err["message"]
    assert tools.jobs.list() == []
    # a session of the isolated agent: the tools are not even offered (T2)
    b = await tools.world.open("43", isolated=True)
    await b.refused("cron_create", {"prompt": "hi", "every": "3600"}, "T2")
    assert not T2_TOOLS & await names(b)
    rules = [r.rule for r in tools.world.store.refusals() if r.action == "cron_create"]
    assert sorted(rules) == ["C1", "T2"]  # each refusal audited once


async def test_C2_over_the_bridge_an_app_agent_gets_no_command_job(tools: Tools) -> None:
    a = await tools.world.open("42", isolated=False)
    err = await a.refused("cron_create", {"type": "command", "command": "id", "every": "60"}, "C2")
    assert "host" in err["message"]
    assert tools.jobs.list() == []


# -- the archive -----------------------------------------------------------------------


async def test_A1_memory_search_and_get_over_the_bridge(tools: Tools) -> None:
    ws = tools.world.workspace
    (ws / "memory").mkdir(exist_ok=True)
    (ws / "memory" / "pets.md").write_text("# Pets\n\nThe cat is called Mango.\n")
    refresh(kb_path(tools.world.root, tools.world.agent), ws)
    a = await tools.world.open("42", isolated=False, archive_enabled=True)
    assert {"memory_search", "memory_get"} <= await names(a)
    hits = (await a.ok("memory_search", {"query": "cat name Mango"}))["hits"]
    assert [(h["file"], h["line"]) for h in hits] == [("memory/pets.md", 3)]
    got = await a.ok("memory_get", {"file": hits[0]["file"], "line": 3, "lines": 1})
    assert got["text"] == "The cat is called Mango."
    await a.refused("memory_get", {"file": "../../bridge/x"}, "A1")
    os.symlink("/etc/passwd", ws / "memory" / "link.md")
    err = await a.refused("memory_get", {"file": "memory/link.md"}, "A1")
    assert "root:" not in err["message"]


async def test_A2_T2_no_memory_tools_with_the_archive_off_or_isolated(tools: Tools) -> None:
    off = await tools.world.open("42", isolated=False, archive_enabled=False)
    listed = await names(off)
    assert not {"memory_search", "memory_get"} & listed
    assert "cron_create" in listed  # A2 does not turn isolation on
    await off.refused("memory_search", {"query": "x"}, "A2")
    iso = await tools.world.open("43", isolated=True, archive_enabled=True)
    assert not T2_TOOLS & await names(iso)
    await iso.refused("memory_get", {"file": "MEMORY.md"}, "T2")
    assert not kb_path(tools.world.root, tools.world.agent).exists()  # nothing opened it
