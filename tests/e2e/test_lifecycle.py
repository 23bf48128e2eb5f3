"""Reaping (S5), recovery of containers (D2) and heartbeats (M4) on a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from cellgate.models import ConversationKey, InboundMessage
from orchestrator.api.context import ApiContext
from orchestrator.api.media_files import media_dir_of_session, open_stored
from orchestrator.config import load_config, write_config_document
from orchestrator.gateway import Gateway
from orchestrator.memory import heartbeat_conversation
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.store import ConversationId, conversation_id
from sandbox.backends.docker import DockerBackend
from sandbox.quota import loop_backing_file, mountinfo
from sandbox.spec import (
    LABEL_AGENT,
    LABEL_APP,
    LABEL_CONVERSATION,
    LABEL_GATEWAY,
    LABEL_MANAGED,
    LABEL_SPEC_HASH,
    sandbox_name,
)
from tests.e2e.conftest import install_test_app, remove_app_containers
from tests.support.run_id import RUN_ID, run_labels

pytestmark = pytest.mark.docker

APP = "life"
AGENT = "life-bot"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def config_path(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[Path]:
    path = install_test_app(tmp_path_factory.mktemp("life"), docker_client, base_image, APP)
    yield path
    remove_app_containers(docker_client, APP)


@pytest.fixture
async def gateway(config_path: Path) -> AsyncIterator[tuple[Gateway, Clock]]:
    clock = Clock()
    gw = Gateway(load_config(config_path), DockerBackend.from_env(), clock=clock)
    yield gw, clock
    await gw.close()


def _names(docker_client: Any) -> set[str]:
    found = docker_client.containers.list(all=True, filters={"label": run_labels(APP)})
    return {c.name for c in found}


async def test_S5_sandbox_reaped_after_idle_minutes_and_recreated_on_demand(
    gateway: tuple[Gateway, Clock], docker_client: Any
) -> None:
    gw, clock = gateway
    await gw.turn(AGENT, "api", "reap-me", "echo hi")
    name = sandbox_name(APP, ConversationKey(AGENT, "api", "reap-me").digest, gateway=RUN_ID)
    reaper = gw.reaper()
    clock.t += 29 * 60
    assert name not in await reaper.run_once()
    assert name in _names(docker_client)
    clock.t += 2 * 60
    assert name in await reaper.run_once()
    assert name not in _names(docker_client)
    assert gw.store.get_sandbox(name) is None
    conv = conversation_id(ConversationKey(AGENT, "api", "reap-me"))
    assert gw.store.live_sessions(conversation=conv) == []
    # Its memory outlives the container; the next turn gets a new one.
    out = await gw.turn(AGENT, "api", "reap-me", "echo back")
    assert "back" in out.result.reply and name in _names(docker_client)


async def test_R2_R3_a_reaped_sandbox_gives_back_its_quota_mounts_and_keeps_its_memory(
    gateway: tuple[Gateway, Clock], docker_client: Any
) -> None:
    """Strangers who come once leave no mount or loop device behind once reaped."""
    gw, clock = gateway
    key = ConversationKey(AGENT, "api", "mounts-go")
    out = await gw.turn(
        AGENT,
        "api",
        "mounts-go",
        f"echo kept > {_chat(key)}/MEMORY.md; echo ok",
    )
    assert "ok" in out.result.reply
    [session] = gw.store.live_sessions(conversation=conversation_id(key))
    media = f"/workspace/media/{key.media_dir_name(session.id)}"
    out = await gw.turn(AGENT, "api", "mounts-go", f"echo pic > {media}/pic.txt; echo ok")
    assert "ok" in out.result.reply
    sandboxes = gw.agent(AGENT).sandboxes
    assert isinstance(sandboxes, ConversationSandboxes) and sandboxes.quota is not None
    image = str(sandboxes.quota.image(sandboxes.app.agent, key.digest))

    def mounts() -> list[str]:
        return [e.mount_point for e in mountinfo() if loop_backing_file(e.dev) == image]

    assert len(mounts()) >= 4, mounts()  # the image, its chat, media and home binds
    name = sandbox_name(APP, key.digest, gateway=RUN_ID)
    clock.t += 31 * 60
    assert name in await gw.reaper().run_once()
    assert mounts() == []
    # the media API reads the image, not the empty dir under its mount point
    f = open_stored(media_dir_of_session(ApiContext(gw), session), "pic.txt")
    try:
        assert f.pread(16, 0) == b"pic\n"
    finally:
        f.close()
    assert len(mounts()) == 3  # the image, its chat and that media dir, for a while
    # the sweep gives back what nobody used for the idle time, and no live sandbox's
    other = ConversationKey(AGENT, "api", "mounts-stay")
    await gw.turn(AGENT, "api", "mounts-stay", "echo ok")
    lock = Path(image).with_suffix(".lock")
    other_lock = lock.with_name(f"{other.digest}.lock")
    assert await gw.sandboxes.quota.sweep() == 0  # used just now
    for used in (lock, other_lock):
        os.utime(used, (time.time() - 31 * 60,) * 2)
    assert await gw.sandboxes.quota.sweep() == 1
    assert mounts() == []
    assert sandboxes.quota.mounted(AGENT).keys() >= {other.digest}
    out = await gw.turn(AGENT, "api", "mounts-go", f"cat {_chat(key)}/MEMORY.md")
    assert "kept" in out.result.reply
    assert len(mounts()) >= 4


async def test_S5_L5_removing_an_app_waits_for_a_turn_in_a_sandbox_the_store_has_no_row_of(
    gateway: tuple[Gateway, Clock], docker_client: Any, base_image: str
) -> None:
    """A turn that made its sandbox before its row was written holds its conversation's
    lock: an app's removal (update, restart) finds the conversation by the container's
    label and waits for that turn, instead of pulling the sandbox from under it."""
    gw, _ = gateway
    conv = ConversationId("cv-label-only")
    name = f"{APP}-agent-c-labelonly0000000"
    docker_client.containers.create(
        base_image, "sleep infinity", name=name, network_mode="none",
        labels={LABEL_MANAGED: "1", LABEL_APP: APP, LABEL_AGENT: AGENT,
                LABEL_CONVERSATION: conv, LABEL_GATEWAY: RUN_ID},
    )  # fmt: skip
    try:
        lock = gw.loop.conversation_lock(conv)
        await lock.acquire()
        removal = asyncio.create_task(gw.sandboxes.remove_app(APP, AGENT))
        await asyncio.sleep(1.0)
        assert not removal.done() and name in _names(docker_client)  # waits for the turn
        lock.release()
        assert name in await asyncio.wait_for(removal, 60)
        assert name not in _names(docker_client)
        # the caller's own conversation (`holding`) is not waited for: it holds it already
        docker_client.containers.create(
            base_image, "sleep infinity", name=name, network_mode="none",
            labels={LABEL_MANAGED: "1", LABEL_APP: APP, LABEL_AGENT: AGENT,
                    LABEL_CONVERSATION: conv, LABEL_GATEWAY: RUN_ID},
        )  # fmt: skip
        async with gw.loop.conversation_lock(conv):
            removed = await asyncio.wait_for(gw.sandboxes.remove_app(APP, AGENT, conv), 60)
        assert name in removed
    finally:
        with contextlib.suppress(Exception):
            docker_client.api.remove_container(name, force=True)


async def test_R3_a_reset_waits_for_its_chats_turn_without_holding_up_the_channel(
    gateway: tuple[Gateway, Clock],
) -> None:
    """`/reset` arrives while its chat's turn runs: it is taken at once (a polling
    channel goes on to the next update, any chat's) and done once that turn ends."""
    gw, _ = gateway
    await gw.turn(AGENT, "telegram", "4242", "echo one")
    conv = conversation_id(ConversationKey(AGENT, "telegram", "4242"))
    assert gw.store.live_sessions(conversation=conv)
    reset = InboundMessage(AGENT, "telegram", "4242", "m-reset", "/reset", command="reset")
    lock = gw.loop.conversation_lock(conv)
    async with lock:  # its turn runs
        await asyncio.wait_for(gw.inbox(reset), 5)  # returns at once
        await asyncio.wait_for(gw.inbox(reset), 5)  # a second one joins the first
        assert gw.store.live_sessions(conversation=conv), "not before the turn ends"
    for _ in range(100):
        if not gw.store.live_sessions(conversation=conv):
            break
        await asyncio.sleep(0.05)
    assert gw.store.live_sessions(conversation=conv) == []


def _chat(key: ConversationKey) -> str:
    return f"/workspace/chats/{key.dir_name}"


async def test_D2_start_removes_orphaned_and_stale_sandboxes(
    gateway: tuple[Gateway, Clock], docker_client: Any, base_image: str
) -> None:
    gw, _ = gateway
    await gw.turn(AGENT, "api", "stale-one", "true")
    stale = sandbox_name(APP, ConversationKey(AGENT, "api", "stale-one").digest, gateway=RUN_ID)
    # Drift the stale one's spec: a new persona file changes the mount plan.
    ws = gw.agent(AGENT).app.workspace  # type: ignore[union-attr]
    (ws / "HEARTBEAT.md").write_text("check the shop once an hour\n")
    orphan = f"{APP}-agent-c-orphan0000000000"
    docker_client.containers.create(
        base_image, "sleep infinity", name=orphan, network_mode="none",
        labels={LABEL_MANAGED: "1", LABEL_APP: APP, LABEL_AGENT: AGENT,
                LABEL_CONVERSATION: "no-such-conversation", LABEL_SPEC_HASH: "x",
                LABEL_GATEWAY: RUN_ID},
    )  # fmt: skip
    other = docker_client.containers.create(
        base_image, "sleep infinity", name="other-agent-c-0000", network_mode="none",
        labels={LABEL_MANAGED: "1", LABEL_APP: APP, LABEL_AGENT: AGENT,
                LABEL_CONVERSATION: "no-such-conversation", LABEL_GATEWAY: f"other-{RUN_ID}"},
    )  # fmt: skip
    try:
        restarted = Gateway(gw.config, DockerBackend.from_env(), clock=gw.clock)
        try:
            await restarted.start()
        finally:
            await restarted.close()
        names = _names(docker_client)
        assert orphan not in names and stale not in names
        other.reload()  # R1: another gateway's sandbox of the same app is left alone
    finally:
        other.remove(force=True)
        (ws / "HEARTBEAT.md").unlink()


async def test_M4_heartbeat_runs_in_live_sessions_else_in_its_own(
    config_path: Path, docker_client: Any
) -> None:
    doc = json.loads(config_path.read_text())
    doc["agents"][0]["heartbeat"] = {"everyMinutes": 60, "prompt": "echo heartbeat-ran; pwd"}
    hb_config = config_path.with_name("config-hb.json")
    write_config_document(hb_config, doc)
    gw = Gateway(load_config(hb_config), DockerBackend.from_env())
    try:
        for s in gw.store.live_sessions(AGENT):
            gw.store.end_session(s.id)
        (only,) = await gw.heartbeat_once(AGENT)
        assert only[0] == heartbeat_conversation(AGENT)
        assert "heartbeat-ran" in only[1].reply
        await gw.turn(AGENT, "api", "hb-chat", "true")
        ran = await gw.heartbeat_once(AGENT)
        keys = [k for k, _ in ran]
        assert ConversationKey(AGENT, "api", "hb-chat") in keys
        assert heartbeat_conversation(AGENT) not in keys
        ws = gw.agent(AGENT).app.workspace  # type: ignore[union-attr]
        chat = ws / "chats" / ConversationKey(AGENT, "api", "hb-chat").dir_name
        roles = [
            json.loads(x)["role"] for x in (chat / "transcript.jsonl").read_text().splitlines()
        ]
        assert "heartbeat" in roles
    finally:
        await gw.close()


LEASE = (
    "import fcntl,os,time\n"
    "fd=os.open('USER.md',os.O_WRONLY|os.O_CREAT,0o644)\n"
    "fcntl.fcntl(fd,fcntl.F_SETLEASE,fcntl.F_WRLCK)\n"
    "print('leased',flush=True)\n"
    "time.sleep(120)\n"
)


async def test_M4_a_chat_holding_a_lease_on_its_memory_stops_no_other_heartbeat(
    config_path: Path, docker_client: Any
) -> None:
    """M4, P5: a hostile chat leaves a process holding a write lease on its USER.md (the
    gateway's non-blocking open of it then fails with EWOULDBLOCK). Its file is left
    out, and the heartbeat still runs in every live conversation, its own included."""
    doc = json.loads(config_path.read_text())
    doc["agents"][0]["heartbeat"] = {"everyMinutes": 60, "prompt": "echo heartbeat-ran"}
    hb_config = config_path.with_name("config-hb-lease.json")
    write_config_document(hb_config, doc)
    gw = Gateway(load_config(hb_config), DockerBackend.from_env())
    hostile, fine = (ConversationKey(AGENT, "api", c) for c in ("hb-lease", "hb-lease-ok"))
    try:
        for s in gw.store.live_sessions(AGENT):
            gw.store.end_session(s.id)
        chat = f"/workspace/chats/{hostile.dir_name}"
        held = await gw.turn(
            AGENT,
            "api",
            hostile.chat_id,
            f"cd {chat} && (setsid python3 -c {shlex.quote(LEASE)} > lease.out 2>&1 &);"
            " sleep 1; cat lease.out",
        )
        assert "leased" in held.result.reply, held.result.reply
        await gw.turn(AGENT, "api", fine.chat_id, "true")
        ran = dict(await gw.heartbeat_once(AGENT))
        assert {hostile, fine} <= set(ran)  # (an earlier test's chat may be live too)
        assert "heartbeat-ran" in ran[fine].reply and "heartbeat-ran" in ran[hostile].reply
    finally:
        await gw.close()
