"""S6, K2: a host agent's turns run as processes on the gateway host.

Not an operating-system sandbox (the README and the start-up log say so);
with isolateMemory it gets its own memory directory, home and bridge socket
per conversation, and a key minted for it alone. `HostExec` bounds output and
time like the Docker exec path. Nothing here needs an engine: the gateway's
backend is `NoEngineBackend`, and a host turn never touches it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from cellgate.errors import AgentUnavailable
from cellgate.models import ConversationKey
from orchestrator.config import load_config, write_config_document
from orchestrator.gateway import Gateway
from orchestrator.keys import MCP_KEY_PREFIX
from sandbox.backends.host import HostExec, host_handle
from tests.e2e.conftest import SUITE_ADMISSION
from tests.fakes.no_engine import NoEngineBackend
from tests.fakes.openai_standin import OpenAIStandin, call, final, tool_results
from tests.support.run_id import seed_gateway_id

README = Path(__file__).resolve().parents[2] / "README.md"
AGENT = "hosty"
CANARY = "123456789:canaryHOSTtokenAAAAAAAAAAAAAAAAAAAAAAAA"
MODEL_KEY = "sk-standinHOSTkey-0123456789abcdef"
REPORT = (
    'echo "ns=$(readlink /proc/self/ns/pid)"; echo "host=$(hostname)"; echo "cwd=$(pwd)"; '
    'echo "home=$HOME"; echo "key=$CELLGATE_API_KEY"; echo "bridge=$CELLGATE_BRIDGE"; env'
)


def _config(tmp: Path, agent: dict[str, Any]) -> Path:
    state = seed_gateway_id(tmp / "state")
    path = state / "config.json"
    write_config_document(
        path,
        {
            "gateway": {"stateDir": str(state), "admission": SUITE_ADMISSION},
            "agents": [agent],
        },
    )
    return path


def _host_agent(isolated: bool = True, argv: list[str] | None = None) -> dict[str, Any]:
    return {
        "id": AGENT,
        "isolateMemory": isolated,
        "harness": {
            "type": "command",
            "argv": argv or ["/bin/sh", "-c", "{prompt}"],
            "output": "text",
            "timeoutSeconds": 20,
        },
    }


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Callable[..., Gateway]]:
    made: list[Gateway] = []

    def build(agent: dict[str, Any] | None = None) -> Gateway:
        config = tmp_path / "state" / "config.json"
        if not config.exists():
            config = _config(tmp_path, agent or _host_agent())
        gw = Gateway(load_config(config), NoEngineBackend())
        made.append(gw)
        return gw

    yield build
    for gw in made:
        await gw.close()


def _fields(reply: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in reply.splitlines():
        name, sep, value = line.partition("=")
        if sep and name not in out:
            out[name] = value
    return out


async def test_S6_host_agent_turn_runs_on_the_host(
    make: Callable[..., Gateway],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", CANARY)  # the gateway's own secret
    with caplog.at_level(logging.WARNING, logger="orchestrator.agents"):
        gw = make()
    assert any(
        AGENT in r.getMessage() and "NOT an operating-system sandbox" in r.getMessage()
        for r in caplog.records
    )
    out = await gw.turn(AGENT, "api", "alice", REPORT)
    assert out.sandbox == host_handle(AGENT).name and out.result.ok, out.result.reply
    got = _fields(out.result.reply)
    assert got["ns"] == os.readlink("/proc/self/ns/pid")  # the host's own pid namespace
    assert got["host"] == socket.gethostname()
    key = ConversationKey(AGENT, "api", "alice")
    rt = gw.agents[AGENT]
    assert rt.host is not None
    assert got["cwd"] == str(rt.host.workspace / "chats" / key.dir_name)  # its own memory dir
    home = rt.host.agent_root / "host-homes" / key.dir_name
    assert got["home"] == str(home)
    assert got["bridge"] == str(rt.host.agent_root / "bridge" / key.digest / "bridge.sock")
    assert "CLAUDE_CODE_DISABLE_AUTO_MEMORY=1" in out.result.reply  # T3
    assert CANARY not in out.result.reply  # nothing of the gateway's environment (K1)
    assert (home / "CLAUDE.md").is_file()


async def test_K2_host_agent_key_is_minted_per_agent_non_admin_naming_only_it(
    make: Callable[..., Gateway],
) -> None:
    gw = make()
    out = await gw.turn(AGENT, "api", "alice", REPORT)
    secret = _fields(out.result.reply)["key"]
    row = gw.store.lookup_key(secret)
    assert row is not None and row.active
    assert row.name == f"{MCP_KEY_PREFIX}{AGENT}"
    assert not row.admin and row.agents == (AGENT,)
    await gw.close()
    again = make()  # a restart mints a fresh key and revokes the old one
    second = _fields((await again.turn(AGENT, "api", "alice", REPORT)).result.reply)["key"]
    assert second != secret
    assert again.store.lookup_key(secret) is None or not again.store.lookup_key(secret).active  # type: ignore[union-attr]
    mine = [k for k in again.store.list_keys(include_revoked=False) if k.name == row.name]
    assert len(mine) == 1 and not mine[0].admin and mine[0].agents == (AGENT,)


async def test_S6_M5_isolated_host_agent_memory_tools_and_replies_per_chat(
    make: Callable[..., Gateway],
) -> None:
    gw = make()
    rt = gw.agents[AGENT]
    assert rt.host is not None
    rt.host.workspace.mkdir(parents=True, exist_ok=True)
    (rt.host.workspace / "MEMORY.md").write_text("operator-only note 4471\n")
    tool = f'{sys.executable} "$(dirname "$CELLGATE_BRIDGE")/cellgate-tool"'
    to_me = await gw.turn(AGENT, "api", "alice", f"{tool} reply '{json.dumps({'text': 'hi'})}'")
    assert [m.text for m in to_me.result.messages_sent] == ["hi"], to_me.result.reply
    other = json.dumps({"text": "x", "chat_id": "bob"})
    refused = await gw.turn(AGENT, "api", "alice", f"{tool} reply '{other}'")
    assert not refused.result.messages_sent and "(ref r-" in refused.result.reply
    assert any(r.rule == "P1" for r in gw.store.refusals(limit=50))  # audited for the operator
    listed = await gw.turn(AGENT, "api", "alice", f"{tool} list_tools '{{}}'")
    assert "task_memory_append" in listed.result.reply
    assert "memory_search" not in listed.result.reply  # T2: isolated scope's tool gating
    key = ConversationKey(AGENT, "api", "alice")
    composed = (rt.host.agent_root / "host-homes" / key.dir_name / "CLAUDE.md").read_text()
    assert "operator-only note 4471" not in composed  # M3/M5: root memory not shown
    assert str(rt.host.workspace / "chats" / key.dir_name / "MEMORY.md") in composed


async def test_S6_non_isolated_host_agent_shares_root_memory(
    make: Callable[..., Gateway],
) -> None:
    gw = make(_host_agent(isolated=False))
    rt = gw.agents[AGENT]
    assert rt.host is not None
    await gw.turn(AGENT, "api", "alice", "echo 'likes tea 5521' >> MEMORY.md")
    out = await gw.turn(AGENT, "api", "bob", REPORT)
    assert _fields(out.result.reply)["cwd"] == str(rt.host.workspace)
    composed = (rt.host.agent_root / "host-homes" / "_agent" / "CLAUDE.md").read_text()
    assert "likes tea 5521" in composed


async def test_S6_host_agent_with_the_shell_harness_takes_no_turns(
    make: Callable[..., Gateway],
) -> None:
    gw = make({"id": AGENT, "harness": {"type": "shell"}})
    with pytest.raises(AgentUnavailable, match="host agent runs the command or openai"):
        gw.agents.runnable(AGENT)


async def test_R6_a_failing_host_command_shows_a_chat_a_reference_not_host_paths(
    make: Callable[..., Gateway], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "operator-bin" / "no-such-agent"
    gw = make(_host_agent(argv=[str(missing), "{prompt}"]))
    with caplog.at_level(logging.WARNING, logger="orchestrator.harnesses.command"):
        out = await gw.turn(AGENT, "api", "alice", "hello")
    reply = out.result.reply
    assert not out.result.ok and "(ref r-" in reply, reply
    assert str(tmp_path) not in reply and "operator-bin" not in reply, reply
    ref = reply.rsplit("(ref ", 1)[1].rstrip(")")
    logged = [r.getMessage() for r in caplog.records if ref in r.getMessage()]
    assert logged and str(missing) in logged[0]  # the operator finds it under the ref


@pytest.mark.parametrize(
    "command",
    [
        pytest.param("cat {tmp}/nothing-here", id="stderr"),
        pytest.param("echo 'no config at {tmp}/op.cfg'; exit 2", id="stdout"),
    ],
)
async def test_R6_a_failing_host_command_s_output_stays_in_the_log(
    make: Callable[..., Gateway], tmp_path: Path, command: str
) -> None:
    gw = make(_host_agent())
    out = await gw.turn(AGENT, "api", "alice", command.format(tmp=tmp_path))
    assert not out.result.ok and "(ref r-" in out.result.reply
    assert str(tmp_path) not in out.result.reply, out.result.reply


async def test_R6_a_timed_out_turn_carries_a_reference(make: Callable[..., Gateway]) -> None:
    agent = _host_agent()
    agent["harness"]["timeoutSeconds"] = 1
    gw = make(agent)
    out = await gw.turn(AGENT, "api", "alice", "sleep 30")
    assert not out.result.ok
    assert out.result.reply.startswith("[timed out after 1 s] (ref r-"), out.result.reply


def test_S6_readme_says_a_host_agent_is_not_an_os_sandbox() -> None:
    text = README.read_text()
    section = text[text.index("## Three ways an agent runs (S6)") :]
    section = section[: section.index("\n## ", 4)]
    assert "not an operating-system sandbox" in section
    assert "| shared between chats |" in section and "**everything**" in section
    assert "`<app>-agent`, one container for every conversation" in section


def _alive_sleep(pid: int, cmdline: bytes) -> bool:
    """Is `pid` still that child, and not a zombie (its number may have gone to another)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        return state != "Z" and Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


async def test_S6_R3_host_exec_bounds_output_time_and_children(tmp_path: Path) -> None:
    ex = HostExec(output_cap=4096)
    handle = host_handle("bounds")
    flood = await ex.exec(handle, ["/bin/sh", "-c", "head -c 5000000 /dev/zero; echo done >&2"])
    assert flood.exit_code == 0 and len(flood.stdout) == 4096 and flood.stderr == b"done\n"
    started = time.monotonic()
    slow = await ex.exec(handle, ["/bin/sh", "-c", "sleep 30"], timeout=1)
    assert slow.timed_out and time.monotonic() - started < 15
    pidfile = tmp_path / "child.pid"
    left = await ex.exec(
        handle, ["/bin/sh", "-c", f"sleep 300 & echo $! > {pidfile}; echo parent-done"], timeout=60
    )
    # the child holding the pipe did not hold the turn to its deadline
    assert not left.timed_out and left.stdout == b"parent-done\n"
    pid = int(pidfile.read_text())
    assert not _alive_sleep(pid, b"sleep\x00300\x00")
    fed = await ex.exec(handle, ["cat"], stdin=b"x" * 300_000, timeout=10)
    assert len(fed.stdout) == 4096 and fed.exit_code == 0
    missing = await ex.exec(handle, ["/nonexistent/agent-binary"])
    assert missing.exit_code == 127 and b"cannot start" in missing.stderr


async def test_S6_host_agent_runs_the_openai_harness_on_the_host(
    make: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", CANARY)
    with OpenAIStandin(key=MODEL_KEY) as ai:
        gw = make(
            {
                "id": AGENT,
                "isolateMemory": True,
                "harness": {
                    "type": "openai",
                    "baseUrl": ai.base_url,
                    "model": "standin-1",
                    "apiKey": MODEL_KEY,
                },
            }
        )
        ai.script(
            call("shell", command="readlink /proc/self/ns/pid; pwd; env"),
            call("write_file", path="note.txt", content="from the model"),
            call("reply", text="to-alice"),
            lambda body: final("done: " + " | ".join(tool_results(body))[:2000]),
        )
        out = await gw.turn(AGENT, "api", "alice", "go")
        shell_out = tool_results(ai.requests[1].body)[0]
    rt = gw.agents[AGENT]
    assert rt.host is not None and out.result.ok, out.result.reply
    chat = rt.host.workspace / "chats" / ConversationKey(AGENT, "api", "alice").dir_name
    assert shell_out.splitlines()[:2] == [os.readlink("/proc/self/ns/pid"), str(chat)]
    assert (chat / "note.txt").read_text() == "from the model"
    assert [m.text for m in out.result.messages_sent] == ["to-alice"]
    assert MODEL_KEY not in shell_out and CANARY not in shell_out  # K1: not in its processes


async def test_D2_first_messages_wait_for_recovery_instead_of_losing_their_turns(
    make: Callable[..., Gateway],
) -> None:
    """A gateway started by its first `submit`: messages that come while its recovery
    runs wait for it. Recovery closes every open turn it finds (D2), so a turn that one
    of them opened meanwhile would be closed under it and the message fail."""
    gw = make()
    checks = gw.check_runtimes

    async def slow_checks() -> None:  # a start that takes a while, as a real one may
        await asyncio.sleep(0.5)
        await checks()

    gw.check_runtimes = slow_checks  # type: ignore[method-assign]
    outs = await asyncio.gather(
        *(gw.turn(AGENT, "api", f"early-{i}", "sleep 1; echo served") for i in range(4))
    )
    for out in outs:
        assert out.result.ok and out.result.reply.strip() == "served", out.result.reply
