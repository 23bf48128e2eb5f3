"""Cron prompt jobs and the memory archive through a real `cellgate serve` process (C1, A1).

A non-isolated app agent (archive on) on a real engine. A prompt job runs its
turn in its conversation on schedule, through the turn loop, and survives a
gateway restart; a run missed while the gateway was down runs once at start.
A fact written in one session is found by `memory_search` from a later one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.apps import install_app
from orchestrator.archive import refresh
from orchestrator.cli import main as cli_main
from orchestrator.config import read_config_document, write_config_document
from orchestrator.demo import sample_app_dir
from orchestrator.store import CronJobId, Store
from sandbox.gateway_id import write_gateway_id
from tests.e2e.conftest import SUITE_ADMISSION, remove_app_containers
from tests.e2e.test_crash import GatewayProcess
from tests.support.run_id import RUN_ID
from tests.support.served import free_port

pytestmark = pytest.mark.docker

APP = "cronarc"
AGENT = "cronarc-bot"
OFF_APP = "cronoff"
OFF_AGENT = "cronoff-bot"
ADMIN = "cg_cronADMINkey0123456789abcdefghijkl"
TOOL = "python3 /run/cellgate/cellgate-tool"


@dataclass
class World:
    state: Path
    gw: GatewayProcess

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.request(method, f"{self.gw.url}{path}", headers=auth, timeout=150, **kw)

    def say(self, chat: str, text: str, agent: str = AGENT) -> str:
        r = self.api("POST", f"/v1/agents/{agent}/chats/{chat}/messages", json={"text": text})
        assert r.status_code == 200, r.text
        return str(r.json()["reply"])

    def job(self, chat: str, prompt: str, **schedule: object) -> dict[str, Any]:
        body = {"prompt": prompt, "channel": "api", "chat_id": chat, **schedule}
        r = self.api("POST", f"/v1/agents/{AGENT}/cron", json=body)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def answered(self, chat: str) -> list[tuple[str, str | None]]:
        """(message text, reply text) of every message in the chat, oldest first."""
        db = sqlite3.connect(f"file:{self.state / 'cellgate.sqlite3'}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT m.text, r.text FROM messages m JOIN conversations c"
                " ON c.id = m.conversation_id LEFT JOIN replies r ON r.message_id = m.id"
                " WHERE c.agent = ? AND c.channel = 'api' AND c.chat_id = ? ORDER BY m.id",
                (AGENT, chat),
            ).fetchall()
        finally:
            db.close()
        return [(str(t), None if r is None else str(r)) for t, r in rows]

    def wait_answered(self, chat: str, n: int = 1, timeout: float = 150) -> list[tuple[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.answered(chat)
            if len(got) >= n and all(r is not None for _, r in got):
                return [(t, r or "") for t, r in got]
            time.sleep(0.5)
        raise AssertionError(f"{chat}: {self.answered(chat)}; see {self.gw.log}")


def _app_dir(tmp: Path, name: str, agent: str, *, disable_archive: bool) -> Path:
    app_dir = tmp / f"app-src-{name}"
    shutil.copytree(sample_app_dir(), app_dir, symlinks=True)
    manifest = yaml.safe_load((app_dir / "app.yaml").read_text())
    manifest["name"] = name
    manifest["services"]["agent"].update(
        name=agent, isolate_memory=False, disable_archive=disable_archive
    )
    (app_dir / "app.yaml").write_text(yaml.safe_dump(manifest))
    return app_dir


def _install(tmp: Path, docker_client: Any, base_image: str) -> Path:
    """Two non-isolated app agents: `cronarc-bot` (archive on), `cronoff-bot` (A2: off)."""
    state = tmp / "state"
    state.mkdir()
    write_gateway_id(state, RUN_ID)
    config = state / "config.json"
    write_config_document(
        config,
        {
            "gateway": {"stateDir": str(state), "admission": SUITE_ADMISSION},
            "apiKeys": [{"name": "admin", "key": ADMIN, "agents": ["*"], "admin": True}],
            "agents": [],
        },
    )
    for name, agent, off in ((APP, AGENT, False), (OFF_APP, OFF_AGENT, True)):
        install_app(_app_dir(tmp, name, agent, disable_archive=off), config, state,
                    docker_client, lambda _: None,
                    build_args={"BASE_IMAGE": base_image})  # fmt: skip
    return config


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp(APP)
    config = _install(tmp, docker_client, base_image)
    gw = GatewayProcess(config, free_port(), tmp / "gateway.log")
    gw.start()
    try:
        yield World(config.parent, gw)
    finally:
        gw.stop()
        remove_app_containers(docker_client, APP)
        remove_app_containers(docker_client, OFF_APP)


def test_C1_prompt_jobs_run_on_schedule_survive_a_restart_and_a_missed_run_runs_once(
    world: World,
) -> None:
    soon = world.job("cron-a", "echo cron-ran-in-$(hostname)", at="+3s")
    [(text, reply)] = world.wait_answered("cron-a")
    assert text == "echo cron-ran-in-$(hostname)" and "cron-ran-in-" in reply and "exit 0" in reply
    hourly = world.job("cron-b", "echo hourly-ran", every=3600)
    later = world.job("cron-c", "echo after-restart", at="+25s")
    world.gw.kill()  # SIGKILL: nothing is flushed on the way out
    with Store.open(world.state) as store:  # the gateway was down while ten runs were due
        store.update_cron_job(CronJobId(hourly["id"]), next_run_at=time.time() - 10 * 3600 - 5)
        used = store.get_cron_job(CronJobId(soon["id"]))
        assert used is not None and not used.enabled and used.runs == 1  # a one-shot is used up
    world.gw.start()
    [(_, reply_b)] = world.wait_answered("cron-b")  # the missed run runs once, at start
    assert "hourly-ran" in reply_b
    [(_, reply_c)] = world.wait_answered("cron-c")  # due after the restart: runs on schedule
    assert "after-restart" in reply_c
    time.sleep(6)  # the scheduler ticks at least every 5 s: no second run of either
    assert len(world.answered("cron-b")) == 1 and len(world.answered("cron-c")) == 1
    with Store.open(world.state) as store:
        job = store.get_cron_job(CronJobId(hourly["id"]))
        assert job is not None and job.runs == 1
        assert job.next_run_at is not None and job.next_run_at > time.time() + 3000
        ran_c = store.get_cron_job(CronJobId(later["id"]))
        assert ran_c is not None and ran_c.runs == 1 and ran_c.last_run_at is not None
        assert ran_c.last_run_at >= ts_of(later["next_run_at"])


def ts_of(value: object) -> float:
    assert isinstance(value, int | float)
    return float(value)


@pytest.mark.skipif(
    importlib.util.find_spec("orchestrator.shared_sandbox") is None,
    reason="a non-isolated app agent writes the workspace only in the S6 shared container",
)
def test_A1_memory_search_finds_a_fact_written_in_an_earlier_session(world: World) -> None:
    wrote = world.say(
        "mem-a",
        "mkdir -p /workspace/memory && "
        "echo 'The boat is named Saltmoth and sleeps four.' > /workspace/memory/boat.md && "
        "echo written",
    )
    assert "written" in wrote, wrote
    kb = world.state / "agents" / AGENT / "kb.sqlite"
    found = world.say("mem-b", f'{TOOL} memory_search \'{{"query": "boat Saltmoth"}}\'')
    assert "memory/boat.md" in found and "Saltmoth" in found, found
    got = world.say("mem-b", f'{TOOL} memory_get \'{{"file": "memory/boat.md"}}\'')
    assert "sleeps four" in got, got
    assert kb.exists()
    escaped = world.say("mem-b", f'{TOOL} memory_get \'{{"file": "../config.json"}}\'')
    assert "A1" in escaped and ADMIN not in escaped, escaped


NAMES = (
    ' | python3 -c "import json,sys; '
    "print(' '.join(t['name'] for t in json.load(sys.stdin)['tools']))\""
)
NOTE = "grep -c 'MEMORY RETRIEVAL' ~/.claude/CLAUDE.md"


def test_A1_a_session_searches_the_archive_refreshed_at_its_spawn(world: World) -> None:
    memory = world.state / "agents" / AGENT / "workspace" / "memory"
    memory.mkdir(exist_ok=True)
    (memory / "garden.md").write_text("# Garden\n\nThe lemon tree was planted in March.\n")
    out = world.say("arc-a", f"{TOOL} list_tools{NAMES}; {NOTE}; "
                    f"{TOOL} memory_search '{{\"query\": \"lemon tree\"}}'")  # fmt: skip
    names, note = out.split("\n")[:2]
    assert {"memory_search", "memory_get", "cron_create"} <= set(names.split()), out
    assert note == "1", out  # the retrieval note is in the composed CLAUDE.md
    assert '"file": "memory/garden.md"' in out and '"line": 3' in out, out


def test_A2_disable_archive_no_index_no_tools_no_note_old_kb_untouched(world: World) -> None:
    kb = world.state / "agents" / OFF_AGENT / "kb.sqlite"
    ws = world.state / "agents" / OFF_AGENT / "workspace"
    (ws / "memory").mkdir(exist_ok=True)
    (ws / "memory" / "note.md").write_text("the spare key is under the blue pot\n")
    out = world.say("off-a", f"{TOOL} list_tools{NAMES}; {NOTE}", OFF_AGENT)
    names, note = out.split("\n")[:2]
    assert not {"memory_search", "memory_get"} & set(names.split()), out
    assert "cron_create" in names.split(), out  # A2 does not turn isolation on
    assert note == "0", out
    assert not kb.exists()  # no index built at spawn
    refresh(kb, ws)  # an archive from before disableArchive was turned on
    os.utime(kb, (1_000_000_000, 1_000_000_000))
    before = os.stat(kb)
    (ws / "memory" / "note.md").write_text("changed: the key is now in the mailbox\n")
    refused = world.say("off-b", f'{TOOL} memory_search \'{{"query": "key"}}\'', OFF_AGENT)
    assert "A2" in refused and "blue pot" not in refused, refused
    after = os.stat(kb)
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)


def _set_isolated(config: Path, agent: str, on: bool) -> None:
    """The mode as a release declares it: the installed app's app.yaml and the config
    entry (a hand edit of the config alone is reset from app.yaml at start, L3)."""
    doc = read_config_document(config)
    for entry in doc["agents"]:
        if entry["id"] == agent:
            entry["isolateMemory"] = on
            record_path = config.parent / "apps" / entry["app"] / "app.json"
            record = json.loads(record_path.read_text())
            record["manifest"]["services"]["agent"]["isolate_memory"] = on
            record_path.write_text(json.dumps(record))
    write_config_document(config, doc)


def test_C1_a_job_made_before_the_mode_was_on_waits_unchanged_and_runs_once_it_is_off(
    world: World,
) -> None:
    config = world.state / "config.json"
    world.gw.stop()
    add = ["cron", "add", "--config", str(config), "--agent", AGENT, "--at", "+4s",
           "--prompt", "echo c1-ran", "--channel", "api", "--chat", "c1-chat"]  # fmt: skip
    assert cli_main(add) == 0
    with Store.open(world.state) as store:
        [job] = [j for j in store.cron_jobs(AGENT) if j.chat_id == "c1-chat"]
    _set_isolated(config, AGENT, True)
    try:
        world.gw.start()
        body = {"prompt": "x", "every": 3600, "channel": "api", "chat_id": "c"}
        refused = world.api("POST", f"/v1/agents/{AGENT}/cron", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["rule"] == "C1"
        time.sleep(12)  # due 4 s after it was made; the scheduler looked at least twice
        assert world.answered("c1-chat") == []
        with Store.open(world.state) as store:
            assert store.get_cron_job(job.id) == job  # stored unchanged: not used up
        world.gw.stop()
    finally:
        _set_isolated(config, AGENT, False)
    world.gw.start()
    [(_, reply)] = world.wait_answered("c1-chat")
    assert "c1-ran" in reply
    with Store.open(world.state) as store:
        ran = store.get_cron_job(job.id)
        assert ran is not None and ran.runs == 1 and not ran.enabled
