"""Apps that live and change, on a real engine, over the CLI and the admin API (issue 11).

SPEC ids: L3 (declarations written at install, update, reconfigure, start),
L4 (inspect reports agentDeclaration), L5 (a mode change waits for the busy
turn, then the agent restarts, no gateway restart), S5 (an update or
uninstall removes every sandbox of the app).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.app_modes import prepare_config
from orchestrator.cli import main as cli
from orchestrator.config import write_config_document
from orchestrator.demo import sample_app_dir
from orchestrator.gateway import Gateway
from orchestrator.store import Store
from sandbox.backends.docker import DockerBackend
from sandbox.gateway_id import write_gateway_id
from sandbox.latebind import mountpoints
from tests.e2e.conftest import SUITE_ADMISSION
from tests.support.run_id import RUN_ID, remove_run_containers, run_labels
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker

ADMIN = "cg_appsADMINkey0123456789abcdefghijk"
ROOT_NOTES = "ROOT-NOTES-7731"
MODE = (
    f'if grep -q {ROOT_NOTES} "$HOME/.claude/CLAUDE.md"; then echo MODE=shared; '
    "else echo MODE=isolated; fi"
)
REMEMBER = "cd /workspace/chats/*/ && echo fact-42 >> MEMORY.md && cd /workspace"
SHOW = 'cat /etc/app-release; cat "$HOME/.claude/CLAUDE.md"; cat /workspace/chats/*/MEMORY.md'


def release(
    tmp: Path, name: str, version: str, persona: str, *, isolate: bool | None = True
) -> Path:
    """A release of app `name`: its persona, a root MEMORY.md, an image marked with it."""
    src = tmp / f"src-{name}-{version}"
    shutil.copytree(sample_app_dir(), src, symlinks=True)
    doc = yaml.safe_load((src / "app.yaml").read_text())
    doc["name"], doc["version"] = name, version
    svc = doc["services"]["agent"]
    svc["name"] = f"{name}-bot"
    svc["harness"] = {"type": "shell", "timeoutSeconds": 60}
    svc.pop("isolate_memory", None)
    if isolate is not None:
        svc["isolate_memory"] = isolate
    (src / "app.yaml").write_text(yaml.safe_dump(doc))
    (src / "agent" / "AGENTS.md").write_text(f"# {name}-bot\n\n{persona}\n")
    (src / "agent" / "MEMORY.md").write_text(f"{ROOT_NOTES}: the operator's own notes\n")
    (src / "image" / "Dockerfile").write_text(
        "ARG BASE_IMAGE=python:3.12-slim\nFROM ${BASE_IMAGE}\n"
        f"RUN echo release-{version} > /etc/app-release\n"
        "USER 10001:10001\nWORKDIR /workspace\n"
    )
    return src


def fresh_state(tmp: Path, label: str, base_image: str) -> Path:
    state = tmp / f"state-{label}"
    state.mkdir()
    write_gateway_id(state, RUN_ID)
    config = state / "config.json"
    write_config_document(
        config,
        {
            "gateway": {
                "stateDir": str(state),
                "admission": SUITE_ADMISSION,
                "baseImage": base_image,
                "limits": {"pids": 64},
            },
            "apiKeys": [{"name": "admin", "key": ADMIN, "admin": True, "agents": ["*"]}],
            "agents": [],
        },
    )
    return config


def installed(tmp: Path, app: str, persona: str, base_image: str) -> tuple[Path, Path]:
    """A fresh state dir with release 1 of `app` installed by the CLI; (config, release)."""
    config = fresh_state(tmp, "one", base_image)
    v1 = release(tmp, app, "1", persona)
    assert cli(["apps", "install", str(v1), "--config", str(config)]) == 0
    return config, v1


class Client:
    def __init__(self, url: str, agent: str) -> None:
        self.url = url
        self.agent = agent
        self.headers = {"Authorization": f"Bearer {ADMIN}"}

    def say(self, chat: str, text: str) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages",
            json={"text": text},
            headers=self.headers,
            timeout=180,
        )

    def run(self, chat: str, text: str) -> str:
        r = self.say(chat, text)
        assert r.status_code == 200, r.text
        return str(r.json()["reply"])

    def api(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = httpx.post(
            f"{self.url}/api/v1/apps{path}", json=body or {}, headers=self.headers, timeout=600
        )
        assert r.status_code in (200, 201), r.text
        out: dict[str, Any] = r.json()
        return out


def sandboxes(docker: Any, app: str) -> set[str]:
    return {c.id for c in docker.containers.list(all=True, filters={"label": run_labels(app)})}


def wait_for(what: str, check: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def running(gw: Gateway, agent: str, version: str) -> bool:
    """The agent's runtime serves `version` of its app and takes turns."""
    rt = gw.agents.get(agent)
    return (
        rt is not None and rt.app is not None and rt.app.version == version
        and rt.app.running and rt.unavailable is None
    )  # fmt: skip


def app_env(gw: Gateway, agent: str) -> dict[str, str]:
    rt = gw.agents.get(agent)
    return dict(rt.app.environment) if rt is not None and rt.app is not None else {}


def entry(config: Path, agent: str) -> dict[str, Any] | None:
    agents = json.loads(config.read_text())["agents"]
    return next((a for a in agents if a["id"] == agent), None)


def image_present(client: Any, ref: str) -> bool:
    from docker import errors

    try:
        client.images.get(ref)
    except errors.ImageNotFound:
        return False
    return True


@pytest.fixture
def cleanup(docker_client: Any) -> Iterator[list[str]]:
    apps: list[str] = []
    yield apps
    for app in apps:
        remove_run_containers(docker_client, app)
        for ref in [t for img in docker_client.images.list() for t in img.tags]:
            # this run's tags only (they name its gateway id): another run on this engine
            # may be building the same app name right now
            if ref.startswith(f"cellgate-app-{app}:") and ref.endswith(f"-{RUN_ID}"):
                docker_client.images.remove(ref, force=True)


def pool_of(gw: Any, agent: str) -> Any:
    """The agent's current warm pool (a restart replaces it), or None."""
    return next((p for p in gw.pools.pools if p.current() and p.sandboxes.app.agent == agent), None)


def test_S5_L3_L4_app_life_over_the_cli(
    tmp_path: Path, docker_client: Any, base_image: str, cleanup: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    app, agent = "appscli", "appscli-bot"
    cleanup.append(app)
    config, _ = installed(tmp_path, app, "PERSONA-ONE", base_image)
    state = config.parent
    with served_gateway(config, DockerBackend.from_env, background=True) as (url, gw):
        c = Client(url, agent)
        first = c.run("alice", f"{REMEMBER}; {SHOW}")
        assert "release-1" in first and "PERSONA-ONE" in first
        before = sandboxes(docker_client, app)
        assert before

        # Update: new persona and image; old sandboxes gone, memory kept (S5).
        v2 = release(tmp_path, app, "2", "PERSONA-TWO")
        assert cli(["apps", "update", str(v2), "--config", str(config)]) == 0
        assert not sandboxes(docker_client, app) & before
        wait_for("the gateway to restart the agent", lambda: running(gw, agent, "2"))
        second = c.run("alice", SHOW)
        assert "release-2" in second and "PERSONA-TWO" in second and "PERSONA-ONE" not in second
        assert "fact-42" in second
        assert sandboxes(docker_client, app).isdisjoint(before)
        # F1, L5: the restarted agent has a warm pool of its new sandboxes
        wait_for(
            "the restarted agent's warm pool",
            lambda: pool_of(gw, agent) is not None and bool(pool_of(gw, agent).ready),
            seconds=120,
        )
        assert "release-2" in c.run("bob", SHOW)
        assert pool_of(gw, agent).claimed  # bob's sandbox came from it

        # L4: inspect, list. A directory named like the app in the working directory is
        # not what a bare name means: the installed app is.
        here = tmp_path / "elsewhere"
        (here / app).mkdir(parents=True)
        monkeypatch.chdir(here)
        capsys.readouterr()
        assert cli(["apps", "inspect", app, "--config", str(config)]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["agentDeclaration"]["isolateMemory"] is True
        assert shown["agentDeclaration"]["disableArchive"] is True
        assert cli(["apps", "list", "--config", str(config)]) == 0
        assert app in capsys.readouterr().out

        # Reconfigure: the operator's environment; the agent restarts into it.
        assert cli(["apps", "reconfigure", app, "--env", "GREETING=hola",
                    "--config", str(config)]) == 0  # fmt: skip
        wait_for(
            "the restart after reconfigure",
            lambda: running(gw, agent, "2") and "GREETING" in app_env(gw, agent),
        )
        assert "hola" in c.run("alice", "echo $GREETING")

        # Stop, start.
        assert cli(["apps", "stop", app, "--config", str(config)]) == 0
        wait_for("the restart after stop", lambda: gw.agents[agent].unavailable is not None)
        assert c.say("alice", "echo hi").status_code == 503
        # the CLI removed them; a sandbox a warm pool was making meanwhile is drained by
        # the gateway a moment later (F1)
        wait_for("the app's sandboxes to go", lambda: not sandboxes(docker_client, app))
        assert cli(["apps", "start", app, "--config", str(config)]) == 0
        wait_for("the restart after start", lambda: running(gw, agent, "2"))
        assert "fact-42" in c.run("alice", "cat /workspace/chats/*/MEMORY.md")

        # Uninstall without --purge keeps the data; installing the app again picks it up.
        assert image_present(docker_client, f"cellgate-app-{app}:2-{RUN_ID}")  # its own tag
        assert cli(["apps", "uninstall", app, "--config", str(config)]) == 0
        wait_for("the gateway to drop the agent", lambda: agent not in gw.agents)
        assert (state / "agents" / agent / "workspace" / "chats").is_dir()
        # nothing of it stays mounted: quota images, pool slots (its data is in the files)
        root = f"{state.resolve()}/"
        wait_for(
            "the uninstalled agent's mounts to go",
            lambda: not [m for m in mountpoints() if m.startswith(root) and agent in m],
        )
        other = release(tmp_path, "appsother", "1", "OTHER")  # another app, the same agent
        doc = yaml.safe_load((other / "app.yaml").read_text())
        doc["services"]["agent"]["name"] = agent
        (other / "app.yaml").write_text(yaml.safe_dump(doc))
        capsys.readouterr()
        assert cli(["apps", "install", str(other), "--config", str(config)]) == 2
        assert "move it away" in capsys.readouterr().err
        assert cli(["apps", "install", str(v2), "--config", str(config)]) == 0
        wait_for("the reinstalled agent", lambda: running(gw, agent, "2"))
        again = c.run("alice", SHOW)
        assert "fact-42" in again and "PERSONA-TWO" in again and "release-2" in again

        # Backup, then uninstall with --purge (which writes its own backup first).
        assert cli(["apps", "backup", app, "-o", str(tmp_path / "b.tar.gz"),
                    "--config", str(config)]) == 0  # fmt: skip
        assert (tmp_path / "b.tar.gz").stat().st_mode & 0o077 == 0
        purge_backup = tmp_path / "purge.tar.gz"
        assert cli(["apps", "uninstall", app, "--purge", "--backup", str(purge_backup),
                    "--config", str(config)]) == 0  # fmt: skip
        assert purge_backup.is_file()
        assert entry(config, agent) is None
        assert not (state / "agents" / agent).exists()
        assert not image_present(docker_client, f"cellgate-app-{app}:2-{RUN_ID}")
        wait_for("the gateway to drop the agent", lambda: agent not in gw.agents)
        # the CLI removed them; a sandbox a warm pool was making meanwhile is drained by
        # the gateway a moment later (F1)
        wait_for("the app's sandboxes to go", lambda: not sandboxes(docker_client, app))

    # Restore on a fresh state directory (another machine: the image is rebuilt).
    config2 = fresh_state(tmp_path, "two", base_image)
    assert cli(["apps", "restore", str(purge_backup), "--config", str(config2)]) == 0
    restored = entry(config2, agent)
    assert restored is not None and restored["isolateMemory"] is True  # L3 at restore
    with Store.open(config2.parent) as store:
        assert [c.chat_id for c in store.conversations(agent)]
    with served_gateway(config2, DockerBackend.from_env) as (url, _):
        back = Client(url, agent).run("alice", SHOW)
    assert "fact-42" in back and "PERSONA-TWO" in back and "release-2" in back


def test_S5_L4_app_life_over_the_admin_api(
    tmp_path: Path, docker_client: Any, base_image: str, cleanup: list[str]
) -> None:
    app, agent = "appsapi", "appsapi-bot"
    cleanup.append(app)
    config = fresh_state(tmp_path, "one", base_image)
    v1 = release(tmp_path, app, "1", "PERSONA-ONE")
    with served_gateway(config, DockerBackend.from_env, background=True) as (url, gw):
        c = Client(url, agent)
        # Admin key only: an agent key is refused before the body is read.
        r = httpx.post(f"{url}/api/v1/apps/inspect", json={"path": str(v1)})
        assert r.status_code == 401
        shown = c.api("/inspect", {"path": str(v1)})
        assert shown["agentDeclaration"] == {
            "name": agent, "isolateMemory": True, "disableArchive": True, "image": None,
            "build": True, "harness": "shell",
        }  # fmt: skip
        installed = c.api("/install", {"path": str(v1)})
        assert installed["steps"] and installed["isolateMemory"] is True
        # F1: an agent added on a running gateway gets its warm pool, as at start
        wait_for(
            "the installed agent's warm pool",
            lambda: pool_of(gw, agent) is not None and bool(pool_of(gw, agent).ready),
            seconds=120,
        )
        first = c.run("alice", f"{REMEMBER}; {SHOW}")
        assert "PERSONA-ONE" in first
        before = sandboxes(docker_client, app)

        updated = c.api(f"/{app}/update", {"path": str(release(tmp_path, app, "2", "PERSONA-TWO"))})
        assert updated["version"] == "2" and not updated["restartPending"]
        assert not sandboxes(docker_client, app) & before  # S5
        second = c.run("alice", SHOW)
        assert "release-2" in second and "PERSONA-TWO" in second and "fact-42" in second

        c.api(f"/{app}/reconfigure", {"env": {"GREETING": "bonjour"}})
        assert "bonjour" in c.run("alice", "echo $GREETING")
        assert c.api("/inspect", {"name": app})["installed"]["state"] == "running"
        c.api(f"/{app}/stop")
        assert c.say("alice", "echo hi").status_code == 503
        c.api(f"/{app}/start")
        wait_for(
            "the started agent's warm pool",
            lambda: pool_of(gw, agent) is not None and bool(pool_of(gw, agent).ready),
            seconds=120,
        )
        assert "fact-42" in c.run("alice", "cat /workspace/chats/*/MEMORY.md")
        assert pool_of(gw, agent).claimed  # alice's sandbox is a pooled one, its slot bound

        backup = c.api(f"/{app}/backup", {"path": str(tmp_path / "api.tar.gz")})
        assert Path(backup["archive"]).is_file()
        gone = c.api(f"/{app}/uninstall", {"purge": True, "backupPath": str(tmp_path / "p.tgz")})
        assert gone["purged"] and Path(gone["backup"]).is_file()
        assert agent not in gw.agents and entry(config, agent) is None
        # the CLI removed them; a sandbox a warm pool was making meanwhile is drained by
        # the gateway a moment later (F1)
        wait_for("the app's sandboxes to go", lambda: not sandboxes(docker_client, app))
        assert [a["name"] for a in httpx.get(f"{url}/api/v1/apps", headers=c.headers).json()] == []
        # F1, R2: nothing of it stays mounted (the claimed slot, stage, slots, spare quota
        # images a refill may have mounted meanwhile)
        root = f"{config.parent.resolve()}/"
        wait_for(
            "the uninstalled app's mounts to go",
            lambda: not [m for m in mountpoints() if m.startswith(root) and agent in m],
        )

    config2 = fresh_state(tmp_path, "two", base_image)
    with served_gateway(config2, DockerBackend.from_env) as (url, _):
        c = Client(url, agent)
        hostile = tmp_path / "hostile.tgz"  # the real backup plus a link out of the workspace
        with tarfile.open(tmp_path / "p.tgz") as good, tarfile.open(hostile, "w:gz") as bad:
            for m in good.getmembers():
                bad.addfile(m, good.extractfile(m) if m.isfile() else None)
            link = tarfile.TarInfo("workspace/chats/escape")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc"
            bad.addfile(link)
        r = httpx.post(f"{url}/api/v1/apps/restore", json={"archive": str(hostile)},
                       headers=c.headers, timeout=60)  # fmt: skip
        assert r.status_code == 409 and "links are never restored" in r.text
        assert not (config2.parent / "agents").exists() and entry(config2, agent) is None
        c.api("/restore", {"archive": str(tmp_path / "p.tgz")})
        assert "fact-42" in c.run("alice", "cat /workspace/chats/*/MEMORY.md")


def test_F1_R2_uninstall_on_a_stopped_gateway_leaves_no_mount(
    tmp_path: Path, docker_client: Any, base_image: str, cleanup: list[str]
) -> None:
    """A stopped gateway leaves its sandboxes and their mounts for the next start; an
    uninstall then removes the sandboxes, and the quota and warm-pool mounts with them."""
    app, agent = "appsoff", "appsoff-bot"
    cleanup.append(app)
    config, _ = installed(tmp_path, app, "P1", base_image)
    state = config.parent
    with served_gateway(config, DockerBackend.from_env, background=True) as (url, gw):
        wait_for(
            "the warm pool",
            lambda: pool_of(gw, agent) is not None and bool(pool_of(gw, agent).ready),
            seconds=120,
        )
        assert "fact-42" in Client(url, agent).run("alice", f"{REMEMBER}; {SHOW}")
        assert pool_of(gw, agent).claimed
    root = f"{state.resolve()}/"
    assert [m for m in mountpoints() if m.startswith(root) and agent in m]  # kept for a start
    assert cli(["apps", "uninstall", app, "--config", str(config)]) == 0
    assert not sandboxes(docker_client, app)
    assert not [m for m in mountpoints() if m.startswith(root) and agent in m]


def test_R2_uninstall_mid_turn_keeps_that_conversation_s_disk_mounted(
    tmp_path: Path, docker_client: Any, base_image: str, cleanup: list[str]
) -> None:
    """An uninstall leaves a sandbox that runs a turn to the gateway; that conversation's
    disk image stays mounted until then, so what the gateway writes after the turn (its
    transcript) lands in the image and is there when the app is installed again."""
    app, agent = "appsmid", "appsmid-bot"
    cleanup.append(app)
    config, v1 = installed(tmp_path, app, "P1", base_image)
    with served_gateway(config, DockerBackend.from_env, background=True) as (url, gw):
        c = Client(url, agent)
        c.run("alice", "true")
        replies: list[str] = []
        t = threading.Thread(target=lambda: replies.append(c.run("alice", "sleep 5; echo slow-7")))
        t.start()
        wait_for("the slow turn to start", lambda: bool(gw.reloader.busy_now(agent)), 30)
        assert cli(["apps", "uninstall", app, "--config", str(config)]) == 0
        t.join(120)
        assert replies and "slow-7" in replies[0]
        wait_for("the gateway to drop the agent", lambda: agent not in gw.agents, 60)
        assert cli(["apps", "install", str(v1), "--config", str(config)]) == 0
        wait_for("the reinstalled agent", lambda: running(gw, agent, "1"), 60)
        assert "slow-7" in c.run("alice", "cat /workspace/chats/*/transcript.jsonl")


def test_L5_mode_flip_waits_for_the_running_turn_then_the_agent_restarts(
    tmp_path: Path, docker_client: Any, base_image: str, cleanup: list[str]
) -> None:
    app, agent = "appsl5", "appsl5-bot"
    cleanup.append(app)
    config, _ = installed(tmp_path, app, "P1", base_image)
    with served_gateway(config, DockerBackend.from_env, background=True) as (url, gw):
        c = Client(url, agent)
        assert "MODE=isolated" in c.run("alice", MODE)
        replies: list[str] = []

        def slow_turn(seconds: int = 6) -> None:
            replies.append(c.run("alice", f"sleep {seconds}; {MODE}"))

        # By the admin API: update to a release without isolate_memory while a turn runs.
        t = threading.Thread(target=slow_turn)
        t.start()
        wait_for("the slow turn to start", lambda: bool(gw.reloader.busy_now(agent)), 30)
        out = c.api(
            f"/{app}/update", {"path": str(release(tmp_path, app, "2", "P2", isolate=None))}
        )
        assert out["restartPending"] is True
        assert entry(config, agent)["isolateMemory"] is False  # type: ignore[index]  # L3
        assert gw.agents[agent].started_isolated is True  # L5: keeps its mode meanwhile
        t.join(120)
        assert replies == [replies[0]] and "MODE=isolated" in replies[0]  # finished in the old mode
        assert "MODE=shared" in c.run("alice", MODE)  # the next turn in the new mode
        assert gw.reloader.restarts == 1

        # By the CLI (the config file watch): back to isolated while a turn runs. The CLI
        # builds the release's image first, so this turn is long enough to outlast it.
        t = threading.Thread(target=slow_turn, args=(30,))
        t.start()
        wait_for("the slow turn to start", lambda: bool(gw.reloader.busy_now(agent)), 30)
        v3 = release(tmp_path, app, "3", "P3", isolate=True)
        assert cli(["apps", "update", str(v3), "--config", str(config)]) == 0
        wait_for("the watch to notice", lambda: agent in gw.reloader.pending, 25)
        assert gw.agents[agent].started_isolated is False
        t.join(120)
        assert "MODE=shared" in replies[1]
        assert "MODE=isolated" in c.run("alice", MODE)
        assert gw.reloader.restarts == 2


async def test_L5_sighup_reloads_the_config(tmp_path: Path, base_image: str) -> None:
    config = fresh_state(tmp_path, "hup", base_image)
    gw = Gateway(prepare_config(config), DockerBackend.from_env(), config_path=config)
    try:
        assert gw.reloader.install_sighup()
        doc = json.loads(config.read_text())
        doc["agents"].append({"id": "hup-bot"})
        config.write_text(json.dumps(doc))
        watch = asyncio.create_task(gw.reloader.watch(interval=3600))
        await asyncio.sleep(0.2)
        assert "hup-bot" not in gw.agents  # no poll within the hour: only the signal
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if "hup-bot" in gw.agents:
                break
            await asyncio.sleep(0.05)
        watch.cancel()
        assert "hup-bot" in gw.agents
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await gw.close()
