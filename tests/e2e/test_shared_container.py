"""S6: an app agent without isolate mode runs every chat in the one app container.

Two chats of a non-isolated app agent share `<app>-agent` (chat B's shell sees
a file chat A wrote in /tmp, and A's root MEMORY.md is composed into B's
session); it is hardened and verified like a per-conversation sandbox (S2, S4,
R5) and carries this gateway's id (R1); each chat's replies still go through
its own bridge socket (P1). Two chats of an isolated app agent never share.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cellgate.errors import MountVerificationFailed, SandboxError
from cellgate.models import ConversationKey
from orchestrator.config import load_config
from orchestrator.gateway import Gateway
from orchestrator.shared_sandbox import SHARED_HOME
from orchestrator.store import conversation_id
from sandbox.backends.docker import DockerBackend
from sandbox.spec import LABEL_GATEWAY, shared_sandbox_name
from tests.support.app_gateways import MakeGateway, app_gateways, install
from tests.support.run_id import RUN_ID

pytestmark = pytest.mark.docker


@pytest.fixture
async def gateways(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> AsyncIterator[MakeGateway]:
    async with app_gateways(tmp_path_factory, docker_client, base_image) as make:
        yield make


def _agent(gw: Gateway) -> str:
    return next(iter(gw.agents))


async def test_S6_two_chats_of_a_non_isolated_app_agent_share_the_app_container(
    gateways: MakeGateway, docker_client: Any
) -> None:
    gw: Gateway = await gateways(False)
    agent = _agent(gw)
    rt = gw.agents[agent]
    assert rt.app is not None and not rt.started_isolated
    mark = f"mark-{secrets.token_hex(4)}"
    a = await gw.turn(
        agent,
        "api",
        "chat-a",
        f"echo {mark} > /tmp/from-a && echo 'fact {mark}' >> /workspace/MEMORY.md && echo ok",
    )
    assert "ok" in a.result.reply and "[exit 0]" in a.result.reply, a.result.reply
    b = await gw.turn(agent, "api", "chat-b", "cat /tmp/from-a && ls /workspace/chats")
    assert mark in b.result.reply and "[exit 0]" in b.result.reply, b.result.reply
    name = shared_sandbox_name(rt.app.name)
    assert a.sandbox == b.sandbox == name
    # both chats' directories are in the one mounted workspace
    assert b.result.reply.count("api-chat-") == 2, b.result.reply

    # hardened like a per-conversation sandbox, and this gateway's (S2, R1)
    attrs = docker_client.api.inspect_container(name)
    host = attrs["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] and not host["Privileged"]
    assert host["NetworkMode"] == "none" and host["PidsLimit"] == 64
    assert attrs["Config"]["Labels"][LABEL_GATEWAY] == RUN_ID
    assert attrs["Config"]["User"] not in ("", "0", "root")
    mounts = {m["Destination"]: m for m in attrs["Mounts"] if m["Type"] == "bind"}
    assert mounts["/workspace"]["Source"] == str(rt.app.workspace) and mounts["/workspace"]["RW"]
    assert not mounts["/run/cellgate"]["RW"]

    # memory composed from the workspace root: B's session was told A's fact
    composed = (rt.app.agent_root / "sandbox-homes" / SHARED_HOME / "CLAUDE.md").read_text()
    assert f"fact {mark}" in composed and "Long-term memory (MEMORY.md)" in composed

    # each chat replies through its own socket (P1): B's reply lands in B's answer
    tool = "python3 /run/cellgate/cellgate-tool reply"
    b2 = await gw.turn(agent, "api", "chat-b", f"{tool} '{json.dumps({'text': 'to-b'})}'")
    assert [m.text for m in b2.result.messages_sent] == ["to-b"], b2.result.reply
    other = await gw.turn(
        agent, "api", "chat-b", f"{tool} '{json.dumps({'text': 'x', 'chat_id': 'chat-a'})}'"
    )
    assert not other.result.messages_sent and "P1" in other.result.reply, other.result.reply


async def test_S6_S4_a_loosened_app_container_is_refused_and_replaced(
    gateways: MakeGateway, docker_client: Any
) -> None:
    gw: Gateway = await gateways(False)
    agent = _agent(gw)
    first = await gw.turn(agent, "api", "chat-a", "echo one")
    docker_client.api.update_container(first.sandbox, mem_limit="900m", memswap_limit="900m")
    old_id = docker_client.api.inspect_container(first.sandbox)["Id"]
    with pytest.raises(MountVerificationFailed) as refused:
        await gw.turn(agent, "api", "chat-b", "echo two")
    assert any("memory limit" in v for v in refused.value.violations)
    again = await gw.turn(agent, "api", "chat-b", "echo three")
    assert again.sandbox == first.sandbox and "three" in again.result.reply
    assert docker_client.api.inspect_container(again.sandbox)["Id"] != old_id


async def test_S6_two_chats_of_an_isolated_app_agent_never_share(
    gateways: MakeGateway,
) -> None:
    gw: Gateway = await gateways(True)
    agent = _agent(gw)
    rt = gw.agents[agent]
    assert rt.app is not None and rt.started_isolated
    mark = f"mark-{secrets.token_hex(4)}"
    a = await gw.turn(agent, "api", "chat-a", f"echo {mark} > /tmp/from-a && echo ok")
    b = await gw.turn(agent, "api", "chat-b", "cat /tmp/from-a; ls /workspace/chats")
    assert mark not in b.result.reply and "No such file" in b.result.reply, b.result.reply
    assert b.result.reply.count("api-chat-") == 1, b.result.reply
    assert a.sandbox != b.sandbox
    assert shared_sandbox_name(rt.app.name) not in (a.sandbox, b.sandbox)


async def test_S6_R4_app_container_is_not_evicted_under_another_chats_turn(
    gateways: MakeGateway,
) -> None:
    gw: Gateway = await gateways(False)
    agent = _agent(gw)
    slow = asyncio.create_task(gw.turn(agent, "api", "chat-a", "sleep 5; echo a-done"))
    await asyncio.sleep(1.5)  # A's turn is running in the app container
    quick = await gw.turn(agent, "api", "chat-b", "echo b-done")  # the row now names chat B
    name = quick.sandbox
    row = gw.store.get_sandbox(name)
    assert row is not None and row.conversation_id != conversation_id(
        ConversationKey(agent, "api", "chat-a")
    )
    (live,) = [s for s in await gw.sandboxes.live() if s.name == name]
    assert live.busy  # A's turn counts, though the row names B
    assert not await gw.sandboxes.evict(name)
    assert "a-done" in (await slow).result.reply
    (live,) = [s for s in await gw.sandboxes.live() if s.name == name]
    assert not live.busy


async def test_S6_R1_another_gateways_app_container_of_the_same_name_is_left_alone(
    gateways: MakeGateway,
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    base_image: str,
) -> None:
    gw: Gateway = await gateways(False)
    agent = _agent(gw)
    rt = gw.agents[agent]
    assert rt.app is not None
    mine = await gw.turn(agent, "api", "chat-a", "echo mine")
    before = docker_client.api.inspect_container(mine.sandbox)["Id"]
    other_id = f"{RUN_ID}-b"
    config = install(
        tmp_path_factory.mktemp("twin"),
        docker_client,
        base_image,
        rt.app.name,
        False,
        gateway_id=other_id,
    )
    other = Gateway(load_config(config), DockerBackend.from_env())
    try:
        await other.start()  # its reconciliation does not touch this gateway's container
        with pytest.raises(SandboxError, match="belongs to another gateway"):
            await other.turn(agent, "api", "chat-a", "echo theirs")
    finally:
        await other.close()
        for row in docker_client.api.containers(
            all=True, filters={"label": [f"{LABEL_GATEWAY}={other_id}"]}
        ):
            docker_client.api.remove_container(row["Id"], force=True)
    assert docker_client.api.inspect_container(mine.sandbox)["Id"] == before
    again = await gw.turn(agent, "api", "chat-b", "echo still-mine")
    assert again.sandbox == mine.sandbox and "still-mine" in again.result.reply
