"""The isolation suite again, with the warm pool on (F1, S3, S4, R5), under runc and runsc.

The module's own `live` gateway runs its background tasks, so its pools fill
ahead; every isolation test of `test_isolation` is collected here again and
runs against it (chat A's and chat B's sandboxes come from the pool under
runc; under gVisor the pool refuses to late-bind and they start cold). Then
the pool's own promises: a pooled sandbox that served chat A is never handed
to chat B; a claim shows nothing of another slot; tampering with a claimed
sandbox's late-bound mount refuses its next turn and replaces the sandbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from cellgate.models import ConversationKey
from orchestrator.apps import install_app
from orchestrator.config import write_config_document
from orchestrator.host_worker import CLAIMER
from orchestrator.pool import CLAIMS_AT_ONCE, REFILL_DEFER, WarmPool
from orchestrator.store.db import Database
from sandbox.backends.base import SandboxInfo
from sandbox.backends.docker import DockerBackend
from sandbox.backends.docker_pool import INIT_FD
from sandbox.latebind import LateBinder, slot_path
from sandbox.spec import LABEL_APP, LABEL_GATEWAY
from tests.e2e.conftest import (
    CANARIES,
    CONFIG_KEY,
    LiveGateway,
    _prepare_app,
    install_test_app,
    remove_app_containers,
)
from tests.e2e.test_isolation import *  # noqa: F403 - the isolation suite, pool on
from tests.e2e.test_isolation import A, B, dir_of
from tests.support.run_id import RUN_ID
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker

POOL = {"size": 2, "max": 4}


@pytest.fixture(scope="module", params=["runc", "runsc"])
def live(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    base_image: str,
) -> Iterator[LiveGateway]:
    runtime = request.param
    # both are opt-in (F1, F2): this suite turns them on
    gateway: dict[str, Any] = {"limits": {"pids": 64}, "pool": POOL, "residentRunner": True}
    if runtime == "runsc":
        if "runsc" not in (docker_client.info().get("Runtimes") or {}):
            pytest.skip("the engine has no runsc runtime registered")
        gateway["runtime"] = "runsc"
    app = "e2epool" if runtime == "runc" else "e2epoolgv"
    config_path = install_test_app(
        tmp_path_factory.mktemp(app), docker_client, base_image, app, gateway
    )
    saved = {k: os.environ.get(k) for k in CANARIES}
    os.environ.update(CANARIES)
    try:
        with served_gateway(config_path, DockerBackend.from_env, background=True) as (url, gw):
            lg = LiveGateway(
                url, CONFIG_KEY, config_path.parent, app, f"{app}-bot", docker_client, gw, runtime
            )
            if runtime == "runc":
                wait_ready(lg, POOL["size"])
            yield lg
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        remove_app_containers(docker_client, app)
        LateBinder(config_path.parent / "pool" / RUN_ID).teardown()


def pool_of(live: LiveGateway) -> WarmPool:
    [pool] = live.gateway.pools.pools
    return pool


def wait_ready(live: LiveGateway, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(pool_of(live).ready) < n:
        assert time.monotonic() < deadline, "the warm pool did not fill"
        time.sleep(0.1)


def test_F1_pool_sandboxes_carry_this_gateway_id(live: LiveGateway) -> None:
    if live.runtime != "runc":
        assert pool_of(live).refusal and "runsc" in pool_of(live).refusal
        return
    wait_ready(live, 1)
    for p in list(pool_of(live).ready):
        labels = live.docker.containers.get(p.handle.container_id).labels
        assert labels[LABEL_GATEWAY] == live.gateway.gateway_id


def test_F1_S3_sandbox_of_chat_a_is_never_handed_to_chat_b(live: LiveGateway) -> None:
    pool = pool_of(live)
    if live.runtime == "runc":
        wait_ready(live, 1)
    a, b = "pool-a", "pool-b"
    live.run(a, "echo a-secret-91 > $HOME/.claude/a.txt; echo ok")
    seen = {c.pooled.handle.container_id for c in pool.claimed.values()}
    id_a = live.run(a, "cat /proc/1/cpuset >/dev/null; hostname")
    reply_b = live.run(b, "hostname; cat $HOME/.claude/a.txt 2>&1; ls /workspace/chats")
    assert id_a.split("\n")[0] not in reply_b
    assert "a-secret-91" not in reply_b
    assert dir_of(live, a) not in reply_b
    if live.runtime == "runc":
        conv = {k: c.pooled.handle.container_id for k, c in pool.claimed.items()}
        assert len(set(conv.values())) == len(conv)  # one sandbox per conversation
        assert seen <= set(conv.values())
        assert all(p.handle.container_id not in conv.values() for p in pool.ready)


def test_F1_S3_hostile_shell_sees_only_its_claim(live: LiveGateway) -> None:
    chat = "pool-hostile"
    if live.runtime == "runc":
        wait_ready(live, 1)  # its sandbox comes from the pool
    reply = live.run(
        chat,
        "cat /proc/self/mountinfo; ls -la /workspace /workspace/chats /run/cellgate; "
        "ls /workspace/chats/*/ 2>&1",
    )
    own = dir_of(live, chat)
    listing = reply.split("total", 1)[-1]
    chats = [ln.split()[-1] for ln in listing.splitlines() if ln.startswith("d")]
    assert own in reply
    for other in (dir_of(live, A), dir_of(live, B), dir_of(live, "pool-a")):
        assert other not in chats
    slots = live.state_dir / "pool"
    if live.runtime == "runc":
        # the sandbox's own mount table names its own slot, never another one
        mine = [ln for ln in reply.splitlines() if "/pool/" in ln and "/slots/" in ln]
        assert mine, reply
        ids = {ln.split("/slots/")[1].split("/")[0] for ln in mine}
        assert len(ids) == 1, ids
        others = {p.slot.id for p in pool_of(live).ready}
        assert not ids & others
        assert slots.exists()


def test_S4_R5_tampered_late_bound_mount_refuses_next_turn(live: LiveGateway) -> None:
    if live.runtime != "runc":
        # gVisor: what a claim bound could not be checked, so nothing is late-bound at all;
        # its conversations start cold, and test_tamper covers a cold sandbox's mounts
        pool = pool_of(live)
        assert pool.refusal is not None and "late-bound" in pool.refusal
        assert "[exit 0]" in live.run("pool-tamper-gv", "true")
        assert not pool.claimed and not pool.ready
        return
    wait_ready(live, 1)
    chat = "pool-tamper"
    assert "[exit 0]" in live.run(chat, "true")
    pool = pool_of(live)
    conv = next(k for k, c in pool.claimed.items() if c.plan.by_target() and chat_in(c, live, chat))
    claimed = pool.claimed[conv]
    chat_target = next(t for t in claimed.plan.by_target() if t.startswith("/workspace/chats/"))
    place = slot_path(claimed.pooled.slot, _p(chat_target))
    decoy = live.state_dir / "decoy"
    decoy.mkdir()
    (decoy / "MEMORY.md").write_text("decoy")
    # the host-side tamper: the late-bound chat dir is swapped for another directory
    subprocess.run(["umount", "-l", str(place)], check=True)
    subprocess.run(["mount", "--bind", str(decoy), str(place)], check=True)
    r = live.say(chat, "echo ran > /workspace/chats/*/ran.txt; echo ran")
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "sandbox_drifted" and err["rule"] == "S4"
    assert not (decoy / "ran.txt").exists()
    assert conv not in pool.claimed  # R5: removed, its slot released
    assert not any(ln.startswith(str(place)) for ln in _mounts())
    assert "ok-again" in live.run(chat, "echo ok-again")


def test_F1_S3_mounts_bound_ahead_show_only_what_the_plan_mounts(live: LiveGateway) -> None:
    """A slot is made with the mountpoints of the last claim's plan, and the app's
    read-only mounts (its persona files) already bound (F3: a claim then binds only the
    conversation's own dirs). A persona file removed since leaves no stub, and one
    replaced since shows its new content, once: the claimed sandbox sees exactly the
    workspace's files as they are at its claim (S3)."""
    if live.runtime != "runc":
        assert pool_of(live).refusal is not None  # nothing is late-bound under gVisor
        return
    pool = pool_of(live)
    ws = live.state_dir / "agents" / live.agent / "workspace"
    removed, replaced = ws / "IDENTITY.md", ws / "AGENTS.md"
    kept = {p: p.read_bytes() for p in (removed, replaced)}
    for i in range(2 * POOL["max"]):  # claims until every ready slot was made after one
        assert "[exit 0]" in live.run(f"pool-skel-{i}", "true")
        wait_ready(live, 1)
        if all(p.slot.made and p.slot.bound for p in pool.ready):
            break
    ready = list(pool.ready)
    assert ready and all(p.slot.made and p.slot.bound for p in ready), "nothing bound ahead"
    ahead = slot_path(ready[0].slot, _p("/workspace/IDENTITY.md"))
    assert ahead.read_bytes() == kept[removed]  # bound ahead of any claim
    removed.unlink()
    new = ws / ".AGENTS.md.new"
    new.write_text("replaced since the slot was made\n")
    new.replace(replaced)  # another inode at the same path
    try:
        reply = live.run(
            "pool-skel-after",
            "ls -A /workspace; echo; cat /workspace/AGENTS.md; "
            "echo mounts=$(grep -c ' /workspace/AGENTS.md ' /proc/self/mountinfo)",
        )
        assert any(c.pooled is ready[0] for c in pool.claimed.values())  # that slot served it
        assert "IDENTITY.md" not in reply
        assert "replaced since the slot was made" in reply
        assert kept[replaced].decode() not in reply
        assert "mounts=1" in reply and "[exit 0]" in reply
    finally:
        for p, data in kept.items():
            p.write_bytes(data)


def test_F3_refill_waits_for_the_claimed_first_turn(live: LiveGateway) -> None:
    """A claimed sandbox's first turn goes first: the pool starts no refill (containers,
    quota images: the same cores) while it runs, and fills up once it is over."""
    if live.runtime != "runc":
        assert pool_of(live).refusal is not None  # no pool under gVisor: nothing to refill
        return
    pool = pool_of(live)
    wait_ready(live, POOL["size"])
    while pool._creating:
        time.sleep(0.05)
    chat = "pool-first-turn-first"
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        turn = ex.submit(live.run, chat, "sleep 2.5; echo slept")
        deadline = time.monotonic() + 30
        while not any(chat_in(c, live, chat) for c in pool.claimed.values()):
            assert time.monotonic() < deadline and not turn.done(), "no claim for the turn"
            time.sleep(0.02)
        # the turn sleeps on well past this; a refill may start REFILL_DEFER after the
        # claim began (a claim slow to bind on a loaded machine used part of that)
        claimed_at = pool._last_claim  # the loop's clock: time.monotonic
        watch_until = min(time.monotonic() + 1.5, claimed_at + REFILL_DEFER - 0.2)
        while time.monotonic() < watch_until:
            assert not pool._creating, (
                "a refill started under the claimed first turn",
                f"{time.monotonic() - claimed_at:.2f} s after the claim began",
            )
            assert len(pool.ready) < POOL["size"]
            time.sleep(0.02)
        assert "slept" in turn.result()
    wait_ready(live, POOL["size"])  # and then it refills


PARENT = "tr '\\0' ' ' < /proc/$PPID/cmdline; echo"
KILL_RUNNER = (  # the runner alone, native or Python ("[n]": not this very command)
    "for p in /proc/[0-9]*; do case \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" in "
    "python3*|'/proc/self/fd/3 cellgate-runner '|*/cellgate-runner.bi[n]*) kill -9 ${p#/proc/};; "
    "esac; done; true"
)


def test_F1_F2_pooled_runner_comes_from_its_slot_and_comes_back_when_killed(
    live: LiveGateway,
) -> None:
    """A claim writes no runner into the conversation's bridge dir: the pooled sandbox's
    runner comes from its slot (opened before the claim). Killed by the sandbox, the
    turns fall back to exec and the runner is installed and started again."""
    if live.runtime != "runc":
        assert pool_of(live).refusal is not None  # cold under gVisor, turns by exec
        return
    wait_ready(live, 1)
    chat = "pool-runner-slot"
    first = live.run(chat, PARENT)
    assert any(chat_in(c, live, chat) for c in pool_of(live).claimed.values())
    assert "cellgate-runner" in first  # the turn ran through the runner
    assert first.startswith("/proc/self/fd/3 cellgate-runner")  # the native one, from the slot
    bridge = live.state_dir / "agents" / live.agent / "bridge"
    own = bridge / ConversationKey(live.agent, "api", chat).digest
    assert own.is_dir() and not [p for p in own.iterdir() if "cellgate-runner" in p.name]
    live.say(chat, KILL_RUNNER)  # the runner dies under its own command: that turn fails
    assert "cellgate-runner" not in live.run(chat, PARENT).split("\n")[0]  # by exec
    deadline = time.monotonic() + 30
    while "cellgate-runner" not in live.run(chat, PARENT).split("\n")[0]:
        assert time.monotonic() < deadline, "the runner did not come back"
        time.sleep(0.2)
    assert [p for p in own.iterdir() if p.name.startswith("cellgate-runner")]  # installed


def test_F1_idle_pooled_sandbox_waits_alone_and_its_claim_has_an_init(live: LiveGateway) -> None:
    """Idle memory (F1): a pooled sandbox waits as one process, no init beside it.
    Claimed, its PID 1 is the engine's init from its slot (as `--init` runs it), and a
    command's orphan is reaped: no zombie is left."""
    if live.runtime != "runc":
        assert pool_of(live).refusal is not None
        return
    wait_ready(live, 1)
    pool = pool_of(live)
    assert pool.binder.own_init
    idle = pool.ready[0].handle.container_id
    procs = live.docker.api.top(idle)["Processes"]
    assert len(procs) == 1 and "/bin/sh" in procs[0][-1], procs
    chat = "pool-own-init"
    reply = live.run(
        chat,
        "sh -c 'sleep 0.3 & exit'; sleep 1.5;"
        " echo INIT:$(tr '\\0' ' ' < /proc/1/cmdline | head -c 40);"
        " echo ZOMBIES:$(for s in /proc/[0-9]*/stat; do cut -d' ' -f3 $s; done 2>/dev/null"
        " | grep -c Z)",
    )
    assert any(chat_in(c, live, chat) for c in pool.claimed.values())
    lines = dict(ln.split(":", 1) for ln in reply.splitlines() if ln.startswith(("INIT:", "ZOM")))
    assert lines["INIT"].startswith(f"/proc/self/fd/{INIT_FD} -- /bin/sh -c"), reply
    assert lines["ZOMBIES"] == "0", reply


def test_F1_reaper_leaves_the_pools_spares_and_reaps_claimed_ones(live: LiveGateway) -> None:
    """A ready pooled sandbox has no last turn: the idle reaper never takes it (it would
    empty the pool every `sandboxIdleMinutes`); a claimed one is a conversation's and is."""
    if live.runtime != "runc":
        return
    wait_ready(live, 1)
    pool = pool_of(live)
    live.run("pool-reapable", "true")
    [claimed] = [c for c in pool.claimed.values() if chat_in(c, live, "pool-reapable")]
    keeper = live.gateway.sandboxes
    labels = {LABEL_APP: live.app}

    def info(name: str) -> SandboxInfo:
        return SandboxInfo(name, "", labels, True)

    assert not any(keeper._reapable(info(p.handle.name)) for p in pool.ready)
    assert keeper._reapable(info(claimed.pooled.handle.name))


def chat_in(c: Any, live: LiveGateway, chat: str) -> bool:
    return any(dir_of(live, chat) in t for t in c.plan.by_target())


def _p(target: str) -> PurePosixPath:
    return PurePosixPath(target)


def _mounts() -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [ln.split(" ")[4] for ln in f]


BURST = 12


def test_F3_burst_of_new_conversations_blocks_no_loop_and_bounds_engine_calls(
    live: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F3: new conversations at once are each answered from a sandbox of their own,
    while no blocking call runs on the gateway's event loop (fsync, sleep, a
    subprocess, the store's sqlite) and the engine never sees more calls at once
    than the backend's bounded workers, nor the pool more claims than `CLAIMS_AT_ONCE`.
    Time is measured in benchmarks/, not here."""
    on_loop: list[str] = []
    seen: set[str] = set()

    def guard(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            seen.add(name)
            if asyncio_running():
                on_loop.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    for owner, name in (
        (os, "fsync"),
        (time, "sleep"),
        (subprocess, "run"),
        (subprocess, "Popen"),
        (Database, "read"),
        (Database, "write"),
    ):
        guard(owner, name)
    backend = live.gateway.backend
    inner = getattr(backend, "inner", backend)
    assert isinstance(inner, DockerBackend)
    api = inner._client.api
    bound = inner._control_pool._max_workers + inner._exec_pool._max_workers
    lock = threading.Lock()
    in_flight, peak = [0], [0]
    real_request = api.request

    def request(*args: Any, **kwargs: Any) -> Any:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            return real_request(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(api, "request", request)
    pool = pool_of(live)
    claiming, claims, claim_peak, here = [0], [0], [0], [0]
    real_claim, real_here = CLAIMER.claim, pool.ops.claim_here

    async def claim_here(*args: Any, **kwargs: Any) -> Any:
        here[0] += 1
        return await real_here(*args, **kwargs)

    async def claim(*args: Any, **kwargs: Any) -> Any:  # on the loop: no lock
        claiming[0] += 1
        claims[0] += 1
        claim_peak[0] = max(claim_peak[0], claiming[0])
        try:
            await asyncio.sleep(0.2)  # long enough that the burst's claims would overlap
            return await real_claim(*args, **kwargs)
        finally:
            claiming[0] -= 1

    monkeypatch.setattr(CLAIMER, "claim", claim)
    monkeypatch.setattr(pool.ops, "claim_here", claim_here)
    pooled = pool.refusal is None  # under runsc the host cannot late-bind: all cold
    if pooled:
        wait_ready(live, POOL["size"])  # two claims at least, that could overlap
    chats = [f"burst-{i}" for i in range(BURST)]
    with concurrent.futures.ThreadPoolExecutor(BURST) as ex:
        replies = list(ex.map(lambda c: live.run(c, f"echo '<{c}>'; hostname"), chats))
    hosts = set()
    for chat, reply in zip(chats, replies, strict=True):
        assert f"<{chat}>" in reply
        assert not any(f"<{o}>" in reply for o in chats if o != chat)
        hosts.add(reply.split(f"<{chat}>")[1].split()[0])
    assert len(hosts) == BURST  # a sandbox each, none shared
    # the guards were in the way of the gateway's calls (no `os.fsync` is left in a first
    # turn: session.json is replaced unsynced; one on the loop would still be caught)
    assert {"read", "write"} <= seen
    assert on_loop == [], f"blocking calls on the event loop: {sorted(set(on_loop))}"
    assert 0 < peak[0] <= bound, (peak[0], bound)
    # a burst's claims go one at a time, each bound and checked in the host worker
    if pooled:
        assert claims[0] >= POOL["size"] and claim_peak[0] == CLAIMS_AT_ONCE, (claims, claim_peak)
        assert here == [0], "a claim was done in the gateway's own process"
    else:
        assert claims[0] == 0


def asyncio_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_F1_S3_two_apps_pools_never_release_each_others_slots(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    """Two app agents, two pools on one gateway: claims and sweeps of one leave the
    other's ready and claimed sandboxes whole (each pool has a slot root of its own).
    With the resident runner off: a claim still ends the pooled shell's wait, and its
    sandbox's PID 1 is the init from its slot (orphans are reaped)."""
    apps = ("mpa", "mpb")
    config = install_test_app(
        tmp_path, docker_client, base_image, apps[0], {"pool": POOL, "residentRunner": False}
    )
    state = config.parent
    install_app(
        _prepare_app(tmp_path, apps[1]),
        config,
        state,
        docker_client,
        lambda _: None,
        build_args={"BASE_IMAGE": base_image},
    )
    doc = json.loads(config.read_text())
    doc["apiKeys"][0]["agents"] = [f"{a}-bot" for a in apps]
    write_config_document(config, doc)
    try:
        with served_gateway(config, DockerBackend.from_env, background=True) as (url, gw):
            lives = {
                a: LiveGateway(url, CONFIG_KEY, state, a, f"{a}-bot", docker_client, gw, "runc")
                for a in apps
            }
            pools = {p.sandboxes.app.name: p for p in gw.pools.pools}
            assert set(pools) == set(apps)
            roots = {p.binder.root for p in pools.values()}
            assert len(roots) == 2  # a slot root each

            def ready(a: str) -> None:
                deadline = time.monotonic() + 60
                while not pools[a].ready:
                    assert time.monotonic() < deadline, f"the pool of {a} did not fill"
                    time.sleep(0.1)

            for a in apps:
                ready(a)
            first = {}
            for round_ in range(2):  # each claims, each sweeps after its claim
                for a in apps:
                    reply = lives[a].run(f"{a}-chat", f"echo {a}-{round_}; hostname")
                    assert f"{a}-{round_}" in reply and "[exit 0]" in reply
                    host = reply.split(f"{a}-{round_}")[1].split()[0]
                    assert first.setdefault(a, host) == host  # the same claimed sandbox
                time.sleep(1.0)  # the pools refill and sweep after those claims
            for a in apps:
                [claimed] = pools[a].claimed.values()
                assert "-agent-p-" in claimed.pooled.handle.name
                assert claimed.pooled.slot.root.is_dir()
                ready(a)
                assert all(p.slot.root.is_dir() for p in pools[a].ready)
                reply = lives[a].run(f"{a}-chat", "tr '\\0' ' ' < /proc/1/cmdline")
                assert reply.startswith(f"/proc/self/fd/{INIT_FD} -- /bin/sh -c"), reply
    finally:
        for a in apps:
            remove_app_containers(docker_client, a)
        LateBinder(state / "pool" / RUN_ID).teardown()
