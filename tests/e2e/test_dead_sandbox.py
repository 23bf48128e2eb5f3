"""A sandbox that died is recreated for the chat's next turn, memory intact (S5, R7).

A fork bomb under gVisor can end the attacker's own sandbox (the sentry dies:
"urpc method containerManager.WaitPID failed: EOF"); an OOM or a `docker kill`
ends one under any runtime. The next turn of that chat must find out before it
runs, get a fresh sandbox with the conversation's mounts, and see its memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from cellgate.errors import CellgateError
from cellgate.models import ConversationKey
from orchestrator.config import load_config
from orchestrator.gateway import Gateway
from sandbox.backends.base import SandboxHandle
from sandbox.backends.docker import DockerBackend
from sandbox.spec import sandbox_name
from tests.e2e.conftest import install_test_app, remove_app_containers

pytestmark = pytest.mark.docker

CHAT = "victim"
BOMB = "timeout -s KILL 10 sh -c 'b() { b | b & }; b; sleep 30'; echo bombed"
# takes every pid of its sandbox and keeps grabbing any pid freed
HOARD = (
    "import os, time\nwhile True:\n try:\n  os.fork() or time.sleep(600)\n"
    " except OSError:\n  time.sleep(0.01)"
)
# takes every pid of its sandbox, then (once the turn that started it has ended) every
# pid freed meanwhile, and gives exactly one back: a shell can start, but not fork
KEEP_ONE = (
    "import os, time\nkids = []\ndef fill():\n while True:\n  try:\n   pid = os.fork()\n"
    "  except OSError:\n   return\n  if pid == 0:\n   time.sleep(600)\n   os._exit(0)\n"
    "  kids.append(pid)\nfill()\ntime.sleep(2)\nfill()\nos.kill(kids.pop(), 9)\n"
    'os.waitpid(-1, 0)\nopen(MARK, "w").close()\ntime.sleep(600)'
)
OOM = 'python3 -c "b = []\nwhile True: b.append(bytearray(64 << 20))"; echo oom-done'


@pytest.fixture(params=["runc", "runsc"])
async def gw(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    base_image: str,
) -> AsyncIterator[Gateway]:
    runtime = request.param
    settings: dict[str, Any] = {"limits": {"pids": 64, "memoryMb": 256}, "turnTimeoutSeconds": 40}
    if runtime == "runsc":
        if "runsc" not in (docker_client.info().get("Runtimes") or {}):
            pytest.skip("the engine has no runsc runtime registered")
        settings["runtime"] = "runsc"
    app = f"dead{runtime}{secrets.token_hex(3)}"
    config = install_test_app(
        tmp_path_factory.mktemp(app), docker_client, base_image, app, settings
    )
    gateway = Gateway(load_config(config), DockerBackend.from_env())
    try:
        yield gateway
    finally:
        await gateway.close()
        remove_app_containers(docker_client, app)


def _agent(gw: Gateway) -> str:
    return next(iter(gw.agents))


def _container(gw: Gateway, docker_client: Any) -> Any:
    agent = _agent(gw)
    rt = gw.agents[agent]
    assert rt.app is not None
    digest = ConversationKey(agent, "api", CHAT).digest
    name = sandbox_name(rt.app.name, digest, gateway=gw.gateway_id)
    return docker_client.containers.get(name)


def _chat_dir(gw: Gateway) -> Path:
    rt = gw.agents[_agent(gw)]
    assert rt.app is not None
    return rt.app.workspace / "chats" / ConversationKey(_agent(gw), "api", CHAT).dir_name


def _exists(docker_client: Any, container_id: str) -> bool:
    try:
        docker_client.containers.get(container_id)
    except docker.errors.NotFound:
        return False
    return True


async def _run(gw: Gateway, text: str) -> str:
    return (await gw.turn(_agent(gw), "api", CHAT, text)).result.reply


async def _remember(gw: Gateway, mark: str) -> None:
    d = ConversationKey(_agent(gw), "api", CHAT).dir_name
    reply = await _run(
        gw,
        f"echo {mark} >> /workspace/chats/{d}/MEMORY.md && "
        f"for m in /workspace/media/*/; do echo {mark} > $m/kept.txt; done && echo saved",
    )
    assert "saved" in reply and "[exit 0]" in reply, reply


async def _recalls(gw: Gateway, mark: str) -> str:
    d = ConversationKey(_agent(gw), "api", CHAT).dir_name
    reply = await _run(
        gw,
        f"ls -la /workspace/chats/{d} && stat -c %s /workspace/chats/{d}/MEMORY.md && "
        f"grep -c {mark} /workspace/chats/{d}/MEMORY.md /workspace/media/*/kept.txt",
    )
    assert "[exit 0]" in reply, reply
    assert "MEMORY.md" in reply
    assert reply.count(":1\n") == 2, reply  # grep -c: memory and media each hold the mark
    return reply


async def test_S5_R7_killed_sandbox_is_recreated_with_memory(
    gw: Gateway, docker_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    mark = f"remember-{secrets.token_hex(4)}"
    await _remember(gw, mark)
    first = _container(gw, docker_client)
    first.kill()
    with caplog.at_level(logging.WARNING, logger="sandbox.backends.docker"):
        await _recalls(gw, mark)
    second = _container(gw, docker_client)
    assert second.id != first.id
    assert second.attrs["State"]["Running"]
    assert _recreated_after_death(caplog)


def _recreated_after_death(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "is not running" in r.getMessage() and "recreating it" in r.getMessage()
    ]


async def _forks_thrice(gw: Gateway) -> bool:
    for _ in range(3):
        try:
            if "[exit 0]" not in await _run(gw, "true | true && echo ok"):
                return False
        except CellgateError:
            return False
    return True


@pytest.mark.parametrize("attack", [BOMB, OOM], ids=["fork-bomb", "oom"])
async def test_S5_R7_next_turn_after_fork_bomb_or_oom_works_with_memory(
    gw: Gateway, docker_client: Any, caplog: pytest.LogCaptureFixture, attack: str
) -> None:
    """Under runsc both end the attacker's own sandbox (its sentry is OOM-killed)."""
    mark = f"remember-{secrets.token_hex(4)}"
    await _remember(gw, mark)
    first = _container(gw, docker_client)
    # the attacker's own turn may fail with its sandbox; the next one may not
    with contextlib.suppress(CellgateError):
        await _run(gw, attack)
    first.reload()
    died = not first.attrs["State"]["Running"]
    with caplog.at_level(logging.WARNING, logger="sandbox.backends.docker"):
        if not died:
            # A bomb can leave its sandbox alive but saturated: a process that cannot
            # start makes the gateway replace the sandbox; one still draining, wait
            # until commands that fork succeed three times in a row (under runsc a
            # bomb's survivors of its group kill can keep it saturated: one lucky
            # `true` between them proved nothing, and the recall then could not fork).
            for _ in range(30):
                if await _forks_thrice(gw):
                    break
                await asyncio.sleep(1)
        await _recalls(gw, mark)
    second = _container(gw, docker_client)
    assert second.attrs["State"]["Running"]
    if died:
        assert second.id != first.id
        why = _recreated_after_death(caplog)
        assert why and "exit" in why[0], why
    elif second.id != first.id:  # died later, or alive but unable to start a process
        assert _recreated_after_death(caplog) or any(
            "cannot start processes" in r.getMessage() for r in caplog.records
        )
    assert "bombed" not in await _run(gw, "echo ok")  # and it keeps working


async def test_S5_R7_turn_in_a_sandbox_out_of_pids_runs_in_a_fresh_one(
    gw: Gateway, docker_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A sandbox whose pids are all taken cannot start the next turn's process; nothing
    of that turn ran, so the gateway replaces the sandbox and runs the turn there."""
    mark = f"remember-{secrets.token_hex(4)}"
    await _remember(gw, mark)
    first = _container(gw, docker_client)
    await _run(gw, f"setsid python3 -c '{HOARD}' >/dev/null 2>&1 & sleep 2; echo hoarding")
    first.reload()
    assert first.attrs["State"]["Running"]
    with caplog.at_level(logging.WARNING):
        # Under runsc a pid freed by the last turn's exit may reach this turn's shell
        # before the hoarder takes it back: the shell starts and its fork fails. That
        # turn's reply says so, and the sandbox is replaced after it (the next test).
        # Probes after it may find a pid free a moment too: then ask again.
        for _ in range(5):
            reply = await _run(gw, "ls / >/dev/null && echo forked")
            if "forked" in reply or not _exists(docker_client, first.id):
                break
            await asyncio.sleep(0.5)
        await _recalls(gw, mark)  # answered, not failed
    second = _container(gw, docker_client)
    assert second.id != first.id
    said = [m for r in caplog.records if "cannot start processes" in (m := r.getMessage())]
    assert said, caplog.records
    if "forked" in reply:  # nothing could start: replaced at once and the turn run there
        assert any("retrying message" in r.getMessage() for r in caplog.records)


# runc only: under runsc, starting a process takes more than one pid of the sentry's
# count, so "all pids but one" leaves a shell unable to start (the case above), and no
# exact number of free pids makes a shell start and then fail to fork every time.
@pytest.mark.parametrize("gw", ["runc"], indirect=True)
async def test_R7_a_sandbox_whose_shell_starts_but_cannot_fork_is_replaced(
    gw: Gateway, docker_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A process keeps all but one of its sandbox's pids: each turn's shell starts and
    cannot fork. That turn's reply says so; the gateway finds that a probe cannot fork
    either, removes the sandbox, and the chat's next turn runs in a fresh one."""
    mark = f"remember-{secrets.token_hex(4)}"
    await _remember(gw, mark)
    first = _container(gw, docker_client)
    # the turns go through the sandbox's resident runner, which starts a command with one
    # pid (an engine exec takes two: with one free, nothing starts, the case above)
    residents = gw.runner.residents
    assert residents is not None
    assert await residents.wait_connected(SandboxHandle(first.name, first.id, ""), 20)
    d = ConversationKey(_agent(gw), "api", CHAT).dir_name
    given_back = _chat_dir(gw) / "kept-one"
    await _run(
        gw,
        f"setsid python3 -c 'MARK = \"/workspace/chats/{d}/kept-one\"\n{KEEP_ONE}' "
        ">/dev/null 2>&1 & echo hoarding",
    )
    for _ in range(100):  # the hoarder has taken every pid and given exactly one back
        if given_back.exists():
            break
        await asyncio.sleep(0.1)
    assert given_back.exists()
    with caplog.at_level(logging.WARNING):
        reply = await _run(gw, "ls / >/dev/null && echo forked")
        assert "forked" not in reply and "Cannot fork" in reply, reply  # started; no fork
        with pytest.raises(docker.errors.NotFound):  # removed once that turn was over
            first.reload()
        await _recalls(gw, mark)
    assert _container(gw, docker_client).id != first.id
    assert any(
        r.name == "sandbox.backends.base" and "cannot start processes" in r.getMessage()
        for r in caplog.records
    )
