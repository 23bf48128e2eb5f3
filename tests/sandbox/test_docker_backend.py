"""DockerBackend against the real engine: hardening, mounts, exec, tamper, reaping (S1-S5, K1)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import pytest

from cellgate.errors import EngineUnavailable, ImageError, MountVerificationFailed
from sandbox.backends.base import SandboxHandle, SandboxInfo, SandboxNotFound
from sandbox.backends.docker import OUTPUT_CAP, DockerBackend, create_kwargs
from sandbox.reaper import Reaper
from sandbox.spec import LABEL_APP, LABEL_GATEWAY, LABEL_MANAGED, LABEL_SPEC_HASH, SandboxLimits
from sandbox.verify import violations
from tests.sandbox.conftest import FAST_PIDS, Built, new_app_name, remove_app_containers
from tests.support.run_id import RUN_ID

pytestmark = pytest.mark.docker


async def sh(
    backend: DockerBackend, handle: SandboxHandle, script: str, **kwargs: Any
) -> tuple[int, str, str]:
    r = await backend.exec(handle, ["sh", "-c", script], **kwargs)
    return r.exit_code, r.stdout.decode(), r.stderr.decode()


# -- creation, verification, reuse (S2, S4, S5) ------------------------------


async def test_S2_S4_fresh_sandbox_has_no_violations(backend: DockerBackend, shared: Built) -> None:
    handle = await backend.ensure(shared.spec)
    observed = await backend.inspect(handle.name)
    assert violations(shared.spec, observed) == []
    assert observed.running
    assert observed.tmpfs == ("/home/agent", "/tmp")
    assert observed.network_mode == "none"
    assert observed.cap_drop == ("ALL",)
    assert observed.readonly_rootfs
    targets = {m.target for m in observed.mounts}
    assert targets == set(shared.spec.plan.by_target())
    assert all("docker.sock" not in m.source for m in observed.mounts)


async def test_S3_plan_mounts_only_what_S3_allows(shared: Built) -> None:
    targets = set(shared.spec.plan.by_target())
    assert {"/workspace/AGENTS.md", "/workspace/SOUL.md", "/workspace/skills"} <= targets
    assert "/workspace/.claude/skills" in targets
    assert "/workspace/MEMORY.md" not in targets
    assert "/workspace/chats/other-conv" not in targets
    assert shared.spec.plan.writable_targets() == tuple(
        sorted([shared.chat_target, "/home/agent/.claude", *_media_target(shared)])
    )


def _media_target(built: Built) -> list[str]:
    return [f"/workspace/media/{built.key.media_dir_name('s1')}"]


async def test_S5_reuses_sandbox_when_spec_unchanged(
    backend: DockerBackend, spec_factory: Callable[..., Built]
) -> None:
    built = spec_factory()
    first = await backend.ensure(built.spec)
    again = await backend.ensure(built.spec)
    assert again.container_id == first.container_id


async def test_S5_recreates_sandbox_when_spec_changes(
    backend: DockerBackend, spec_factory: Callable[..., Built], docker_client: docker.DockerClient
) -> None:
    built = spec_factory()
    first = await backend.ensure(built.spec)
    changed = built.with_limits(memory_bytes=256 * 1024 * 1024)
    assert changed.spec.spec_hash() != built.spec.spec_hash()
    second = await backend.ensure(changed.spec)
    assert second.container_id != first.container_id
    attrs = docker_client.api.inspect_container(second.container_id)
    assert attrs["Config"]["Labels"][LABEL_SPEC_HASH] == changed.spec.spec_hash()
    assert attrs["HostConfig"]["Memory"] == 256 * 1024 * 1024
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(first.container_id)


async def test_S5_R7_recreates_a_sandbox_that_is_not_running(
    backend: DockerBackend, spec_factory: Callable[..., Built], docker_client: docker.DockerClient
) -> None:
    """A dead sandbox (OOM, a crashed gVisor sentry, stopped by hand) is not restarted."""
    built = spec_factory()
    first = await backend.ensure(built.spec)
    docker_client.api.stop(first.container_id, timeout=0)
    again = await backend.ensure(built.spec)
    assert again.container_id != first.container_id
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(first.container_id)
    assert (await backend.inspect(again.name)).running
    code, out, _ = await sh(backend, again, "echo back")
    assert (code, out) == (0, "back\n")


async def test_S5_remove_is_idempotent_and_list_finds_by_label(
    backend: DockerBackend, spec_factory: Callable[..., Built]
) -> None:
    built = spec_factory()
    handle = await backend.ensure(built.spec)
    found = await backend.list({LABEL_APP: built.spec.app})
    assert [(i.name, i.container_id, i.running) for i in found] == [
        (built.spec.name, handle.container_id, True)
    ]
    await backend.remove(built.spec.name)
    await backend.remove(built.spec.name)
    assert await backend.list({LABEL_APP: built.spec.app}) == []
    with pytest.raises(SandboxNotFound):
        await backend.inspect(built.spec.name)


async def test_F3_S4_the_lean_inspect_is_the_sdks(
    backend: DockerBackend, shared: Built, docker_client: docker.DockerClient
) -> None:
    handle = await backend.ensure(shared.spec)
    assert backend._engine is not None  # the engine of this run is on a unix socket
    lean = await backend._call("inspect", lambda: backend._lookup(handle.name))
    sdk = docker_client.api.inspect_container(handle.name)
    assert lean is not None
    for key in ("Id", "Name", "Config", "HostConfig", "Image"):
        assert lean[key] == sdk[key], key

    def by_target(doc: dict[str, Any]) -> list[Any]:  # the engine lists mounts in any order
        return sorted(doc["Mounts"], key=lambda m: str(m["Destination"]))

    assert by_target(lean) == by_target(sdk)
    assert lean["State"]["Pid"] == sdk["State"]["Pid"]
    missing = f"{shared.spec.name}-missing"
    assert await backend._call("inspect", lambda: backend._lookup(missing)) is None


def test_S1_no_engine_is_engine_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(EngineUnavailable) as caught:
        DockerBackend.from_env()
    assert "no-engine.sock" in caught.value.reason


async def test_S1_image_facts(backend: DockerBackend, image_id: str) -> None:
    facts = await backend.image_facts("cellgate-base:bookworm")
    assert facts.id == image_id
    assert "PATH" in facts.env
    with pytest.raises(ImageError):
        await backend.image_facts("cellgate-no-such-image:never")


# -- exec ------------------------------------------------------------------


async def test_S1_exec_returns_output_and_exit_code(backend: DockerBackend, shared: Built) -> None:
    handle = await backend.ensure(shared.spec)
    r = await backend.exec(
        handle,
        ["sh", "-c", 'echo "out $GREETING $(pwd)"; echo err >&2; exit 3'],
        env={"GREETING": "hi"},
        workdir="/tmp",
    )
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out hi /tmp\n", b"err\n", False)


async def test_S1_exec_pipes_stdin(backend: DockerBackend, shared: Built) -> None:
    handle = await backend.ensure(shared.spec)
    r = await backend.exec(handle, ["cat"], stdin=b"a prompt\nwith lines\n")
    assert (r.exit_code, r.stdout) == (0, b"a prompt\nwith lines\n")
    big = bytes(range(256)) * 8192  # 2 MiB, more than any pipe buffer
    r = await backend.exec(handle, ["wc", "-c"], stdin=big)
    assert r.stdout.strip() == str(len(big)).encode()
    r = await backend.exec(handle, ["wc", "-c"], stdin=b"")
    assert r.stdout.strip() == b"0"


async def test_S2_exec_timeout_kills_and_reports(backend: DockerBackend, shared: Built) -> None:
    handle = await backend.ensure(shared.spec)
    started = time.monotonic()
    r = await backend.exec(
        handle, ["sh", "-c", "trap '' TERM; echo started; while :; do sleep 1; done"], timeout=1
    )
    assert r.timed_out
    assert r.stdout == b"started\n"
    assert time.monotonic() - started < 8
    _, out, _ = await sh(backend, handle, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "trap" not in out
    r = await backend.exec(handle, ["sh", "-c", "sleep 0.2; exit 124"], timeout=5)
    assert (r.exit_code, r.timed_out) == (124, False)


async def test_S2_exec_timeout_when_a_child_leaves_the_process_group(
    backend: DockerBackend, shared: Built
) -> None:
    handle = await backend.ensure(shared.spec)
    started = time.monotonic()
    r = await backend.exec(handle, ["sh", "-c", "setsid sleep 97 & sleep 98"], timeout=1)
    assert r.timed_out
    assert time.monotonic() - started < 12
    await asyncio.sleep(0.5)
    _, out, _ = await sh(backend, handle, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "sleep 97" not in out


async def test_S2_exec_output_is_capped(backend: DockerBackend, shared: Built) -> None:
    handle = await backend.ensure(shared.spec)
    r = await backend.exec(
        handle, ["sh", "-c", "head -c 3000000 /dev/zero; head -c 2000000 /dev/zero >&2"]
    )
    assert r.exit_code == 0
    assert len(r.stdout) == OUTPUT_CAP
    assert len(r.stderr) == OUTPUT_CAP
    r = await backend.exec(handle, ["yes"], timeout=1)
    assert r.timed_out
    assert len(r.stdout) == OUTPUT_CAP


async def test_S4_exec_in_a_removed_sandbox_is_not_found(
    backend: DockerBackend, spec_factory: Callable[..., Built]
) -> None:
    built = spec_factory()
    handle = await backend.ensure(built.spec)
    await backend.remove(handle.name)
    with pytest.raises(SandboxNotFound):
        await backend.exec(handle, ["true"])


# -- from inside (S2, S3, K1) ----------------------------------------------

HARDENING_PROBE = r"""
set -u
echo "caps=$(grep CapEff /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "uid=$(id -u) gid=$(id -g)"
touch /x 2>/dev/null && echo "rootfs=writable" || echo "rootfs=readonly"
touch /usr/x 2>/dev/null && echo "usr=writable" || echo "usr=readonly"
echo t > /tmp/t && echo "tmp=ok"
echo h > "$HOME/h" && echo "home=ok"
echo "home_is=$HOME"
echo c > "$HOME/.claude/c" && echo "claude=ok"
echo m >> "$CHAT/MEMORY.md" && echo "chat=ok"
for f in /workspace/AGENTS.md /workspace/SOUL.md /workspace/skills/greet/SKILL.md \
         /workspace/.claude/skills/lookup/SKILL.md; do
  (echo evil >> "$f") 2>/dev/null && echo "rw:$f" || echo "ro:$f"
done
touch /workspace/skills/new /workspace/.claude/skills/new /workspace/new 2>/dev/null \
  && echo "skills=writable" || echo "skills=readonly"
for p in /workspace/MEMORY.md /workspace/USER.md /workspace/chats/other-conv /workspace/memory \
         /workspace/.claude/settings.local.json /var/run/docker.sock /run/docker.sock; do
  [ -e "$p" ] && echo "present:$p" || echo "absent:$p"
done
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\n' ',')"
python3 -c "
import errno, socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.connect(('192.0.2.1', 53)); print('net=reachable')
except OSError as e:
    print('net=' + errno.errorcode.get(e.errno or 0, str(e)))
"
echo "pid1=$(cat /proc/1/cmdline | tr '\0' ' ')"
set -- /proc/[0-9]*; echo "procs=$#"
env | grep -E '^(GATEWAY_API_URL|TELEGRAM_|CELLGATE_ADMIN)' || echo "no-gateway-env"
"""


def _probe_lines(out: str) -> set[str]:
    return set(out.splitlines())


async def _probe(backend: DockerBackend, built: Built) -> set[str]:
    handle = await backend.ensure(built.spec)
    code, out, err = await sh(backend, handle, HARDENING_PROBE, env={"CHAT": built.chat_target})
    assert code == 0, err
    return _probe_lines(out)


def _assert_isolated(lines: set[str], built: Built) -> None:
    assert "uid=65532 gid=65532" in lines
    assert "rootfs=readonly" in lines and "usr=readonly" in lines
    assert {"tmp=ok", "home=ok", "claude=ok", "chat=ok", "home_is=/home/agent"} <= lines
    for f in ("AGENTS.md", "SOUL.md", "skills/greet/SKILL.md", ".claude/skills/lookup/SKILL.md"):
        assert f"ro:/workspace/{f}" in lines
    assert "skills=readonly" in lines
    for p in ("MEMORY.md", "USER.md", "chats/other-conv", "memory", ".claude/settings.local.json"):
        assert f"absent:/workspace/{p}" in lines
    assert "absent:/var/run/docker.sock" in lines and "absent:/run/docker.sock" in lines
    assert "net=reachable" not in lines
    assert "no-gateway-env" in lines
    host = built.paths
    assert (host.chat_dir / "MEMORY.md").read_text() == "m\n"
    assert (host.home_dir / "c").read_text() == "c\n"
    assert (host.workspace / "AGENTS.md").read_text() == "You are a helpful bot.\n"


async def test_S2_S3_K1_isolation_from_inside(backend: DockerBackend, shared: Built) -> None:
    lines = await _probe(backend, shared)
    assert "caps=0000000000000000" in lines
    assert "nnp=1" in lines
    assert "ifaces=lo," in lines
    assert "net=ENETUNREACH" in lines
    _assert_isolated(lines, shared)


async def test_S2_pids_limit_stops_a_fork_loop(
    backend: DockerBackend, spec_factory: Callable[..., Built], shared: Built
) -> None:
    await _fork_loop_is_bounded(backend, spec_factory(limits=SandboxLimits(pids=FAST_PIDS)), shared)


FORK_LOOP = (
    "(n=0; while [ $n -lt 1000 ]; do sleep 5 >/dev/null 2>&1 </dev/null & n=$((n+1)); done)"
    " 2>/dev/null; set -- /proc/[0-9]*; echo procs=$#"
)


async def _fork_loop_is_bounded(backend: DockerBackend, victim: Built, other: Built) -> None:
    """A fork loop stops at the limit, quickly; other sandboxes do not notice; it recovers."""
    handle = await backend.ensure(victim.spec)
    started = time.monotonic()
    code, out, err = await sh(backend, handle, FORK_LOOP, timeout=20)
    assert time.monotonic() - started < 15, "the fork loop was not stopped by the limit"
    assert out.startswith("procs="), (code, out, err)
    assert int(out.strip().removeprefix("procs=")) <= FAST_PIDS
    other_handle = await backend.ensure(other.spec)
    code, out, _ = await sh(backend, other_handle, "echo alive")
    assert (code, out) == (0, "alive\n")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        code, out, _ = await sh(backend, handle, "echo recovered", timeout=5)
        if out == "recovered\n":
            break
        await asyncio.sleep(0.5)
    assert out == "recovered\n"
    assert (await backend.inspect(handle.name)).running


# -- tampering (S4) --------------------------------------------------------


def _recreate_by_hand(
    client: docker.DockerClient, built: Built, edit: Callable[[list[Any]], list[Any]]
) -> None:
    """Replace the sandbox with a look-alike (same name and labels) whose mounts `edit` changed."""
    client.api.remove_container(built.spec.name, force=True)
    kwargs = create_kwargs(built.spec)
    kwargs["mounts"] = edit(list(kwargs["mounts"]))
    client.containers.create(**kwargs).start()


async def test_S4_extra_bind_is_refused_by_verify_and_ensure(
    backend: DockerBackend, spec_factory: Callable[..., Built], docker_client: docker.DockerClient
) -> None:
    built = spec_factory()
    await backend.ensure(built.spec)
    root_memory = str(built.paths.workspace / "MEMORY.md")

    def add_root_memory(mounts: list[Any]) -> list[Any]:
        extra = docker.types.Mount("/workspace/MEMORY.md", root_memory, type="bind")
        return [*mounts, extra]

    _recreate_by_hand(docker_client, built, add_root_memory)
    handle = SandboxHandle(built.spec.name, "", built.spec.spec_hash())
    with pytest.raises(MountVerificationFailed) as caught:
        await backend.verify(built.spec, handle)
    assert any("/workspace/MEMORY.md" in v for v in caught.value.violations)
    with pytest.raises(MountVerificationFailed) as again:
        await backend.ensure(built.spec)
    assert any("/workspace/MEMORY.md" in v for v in again.value.violations)


async def test_S4_L6_writable_persona_is_refused(
    backend: DockerBackend, spec_factory: Callable[..., Built], docker_client: docker.DockerClient
) -> None:
    built = spec_factory()
    await backend.ensure(built.spec)

    def persona_rw(mounts: list[Any]) -> list[Any]:
        return [
            docker.types.Mount(m["Target"], m["Source"], type="bind", read_only=False)
            if m["Target"] == "/workspace/AGENTS.md"
            else m
            for m in mounts
        ]

    _recreate_by_hand(docker_client, built, persona_rw)
    with pytest.raises(MountVerificationFailed) as caught:
        await backend.ensure(built.spec)
    assert [v for v in caught.value.violations if "AGENTS.md" in v] == [
        f"{built.paths.workspace / 'AGENTS.md'} -> /workspace/AGENTS.md is read-write;"
        " the plan has it read-only"
    ]


async def test_S4_swapped_bind_source_is_refused(
    backend: DockerBackend, spec_factory: Callable[..., Built]
) -> None:
    built = spec_factory()
    await backend.ensure(built.spec)
    skills = built.paths.workspace / "skills"
    skills.rename(skills.with_name("skills-old"))
    skills.mkdir()
    with pytest.raises(MountVerificationFailed) as caught:
        await backend.ensure(built.spec)
    assert any("skills" in v and "inode" in v for v in caught.value.violations)


# -- gVisor (S2) -----------------------------------------------------------


async def test_S2_S3_gvisor_sandbox_is_hardened_and_isolated(
    backend: DockerBackend, runsc_shared: Built
) -> None:
    handle = await backend.ensure(runsc_shared.spec)
    observed = await backend.inspect(handle.name)
    assert observed.runtime == "runsc"
    assert violations(runsc_shared.spec, observed) == []
    lines = await _probe(backend, runsc_shared)
    assert "caps=0000000000000000" in lines
    # gVisor's /proc/self/status has no NoNewPrivs line; the engine's report (checked by
    # verify above) is the proof there. Its netstack answers EHOSTUNREACH.
    assert "nnp=1" in lines or "nnp=" in lines
    assert "ifaces=lo," in lines
    assert lines & {"net=ENETUNREACH", "net=EHOSTUNREACH"}
    _assert_isolated(lines, runsc_shared)


async def test_S2_gvisor_task_limit_stops_a_fork_loop(
    backend: DockerBackend, runsc_shared: Built, shared: Built
) -> None:
    await _fork_loop_is_bounded(backend, runsc_shared, shared)


# -- reaping (S5) ----------------------------------------------------------


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _plain_sandbox(
    client: docker.DockerClient, name: str, app: str, base_image: str, gateway: str = RUN_ID
) -> None:
    client.containers.create(
        base_image,
        ["sleep", "infinity"],
        name=name,
        labels={LABEL_MANAGED: "1", LABEL_APP: app, LABEL_GATEWAY: gateway},
        network_mode="none",
    )


@pytest.fixture
def foreign(docker_client: docker.DockerClient, base_image: str, app_name: str) -> Iterator[str]:
    """R1: another gateway's idle sandbox of the same app on this engine (removed after)."""
    name = f"{app_name}-agent-c-foreign"
    _plain_sandbox(docker_client, name, app_name, base_image, gateway=f"other-{RUN_ID}")
    yield name
    docker_client.api.remove_container(name, force=True)


def _exists(client: docker.DockerClient, name: str) -> bool:
    try:
        client.api.inspect_container(name)
    except docker.errors.NotFound:
        return False
    return True


async def test_S5_R1_reaper_removes_idle_keeps_busy_and_recent_and_foreign(
    backend: DockerBackend,
    app_name: str,
    docker_client: docker.DockerClient,
    base_image: str,
    foreign: str,
) -> None:
    names = {k: f"{app_name}-agent-c-{k}" for k in ("idle", "busy", "recent", "unknown")}
    for n in names.values():
        _plain_sandbox(docker_client, n, app_name, base_image)
    clock = Clock(10_000.0)
    last = {names["idle"]: 0.0, names["busy"]: 0.0, names["recent"]: 10_000.0 - 30}
    busy = {names["busy"]}
    reaper = Reaper(
        backend,
        gateway_id=RUN_ID,
        last_active=last.get,
        busy=lambda n: n in busy,
        idle_minutes=30,
        now=clock,
    )
    removed = await reaper.run_once()
    mine = {i.name for i in await backend.list({LABEL_APP: app_name, LABEL_GATEWAY: RUN_ID})}
    assert names["idle"] in removed
    assert mine == {names["busy"], names["recent"], names["unknown"]}
    clock.t += 29 * 60
    assert not set(await reaper.run_once()) & set(names.values())
    clock.t += 2 * 60
    removed = await reaper.run_once()
    assert {names["recent"], names["unknown"]} <= set(removed)
    mine = {i.name for i in await backend.list({LABEL_APP: app_name, LABEL_GATEWAY: RUN_ID})}
    assert mine == {names["busy"]}
    # R1: the other gateway's sandbox of the same app, idle "forever", is untouched.
    assert foreign not in removed and _exists(docker_client, foreign)


async def test_S5_R1_reaper_remove_app_removes_only_that_app_of_this_gateway(
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    base_image: str,
    app_name: str,
    foreign: str,
) -> None:
    other = new_app_name()
    try:
        _plain_sandbox(docker_client, f"{app_name}-agent-c-1", app_name, base_image)
        _plain_sandbox(docker_client, f"{app_name}-agent-c-2", app_name, base_image)
        _plain_sandbox(docker_client, f"{other}-agent-c-1", other, base_image)
        reaper = Reaper(backend, gateway_id=RUN_ID, last_active=lambda n: None, busy=lambda n: True)
        removed = await reaper.remove_app(app_name)
        assert sorted(removed) == [f"{app_name}-agent-c-1", f"{app_name}-agent-c-2"]
        assert [i.name for i in await backend.list({LABEL_APP: app_name})] == [foreign]
        assert [i.name for i in await backend.list({LABEL_APP: other})] == [f"{other}-agent-c-1"]
    finally:
        remove_app_containers(docker_client, other)


async def test_S5_reaper_remove_app_holds_each_sandbox_guard_around_its_removal(
    backend: DockerBackend, docker_client: docker.DockerClient, base_image: str, app_name: str
) -> None:
    """An app's removal (L5 restart, update) takes each sandbox's guard, the caller's
    conversation lock, so a turn starting in one waits for it to go instead of
    having its bridge closed under it (on_removed)."""
    names = [f"{app_name}-agent-c-1", f"{app_name}-agent-c-2"]
    for n in names:
        _plain_sandbox(docker_client, n, app_name, base_image)
    held: list[str] = []
    seen: list[tuple[str, bool, list[str]]] = []

    @contextlib.asynccontextmanager
    async def guard(info: SandboxInfo) -> AsyncIterator[None]:
        held.append(info.name)
        try:
            yield
        finally:
            held.remove(info.name)

    async def on_removed(name: str) -> None:
        seen.append((name, _exists(docker_client, name), list(held)))

    reaper = Reaper(
        backend,
        gateway_id=RUN_ID,
        last_active=lambda n: None,
        busy=lambda n: True,
        guard=guard,
        on_removed=on_removed,
    )
    assert sorted(await reaper.remove_app(app_name)) == names
    assert sorted(seen) == [(n, False, [n]) for n in names]
    # a caller's own guard (the keeper's, skipping the conversation it holds) wins
    _plain_sandbox(docker_client, names[0], app_name, base_image)
    own: list[str] = []

    @contextlib.asynccontextmanager
    async def other(info: SandboxInfo) -> AsyncIterator[None]:
        own.append(info.name)
        yield

    assert await reaper.remove_app(app_name, guard=other) == [names[0]]
    assert own == [names[0]] and not held


async def test_S5_reaper_run_forever_keeps_going(
    backend: DockerBackend, app_name: str, docker_client: docker.DockerClient, base_image: str
) -> None:
    name = f"{app_name}-agent-c-x"
    _plain_sandbox(docker_client, name, app_name, base_image)
    reaper = Reaper(
        backend, gateway_id=RUN_ID, last_active=lambda n: 0.0, busy=lambda n: False, now=lambda: 1e9
    )
    task = asyncio.create_task(reaper.run_forever(interval=0.05))
    try:
        for _ in range(100):
            if not await backend.list({LABEL_APP: app_name}):
                break
            await asyncio.sleep(0.05)
        assert await backend.list({LABEL_APP: app_name}) == []
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- limits checked each turn (R5), logs off (R3) ----------------------------


async def test_R5_S4_docker_update_is_refused_then_recreated_to_spec(
    backend: DockerBackend, spec_factory: Callable[..., Built], docker_client: docker.DockerClient
) -> None:
    built = spec_factory()
    first = await backend.ensure(built.spec)
    await asyncio.to_thread(
        subprocess.run,
        ["docker", "update", "--pids-limit", "100000", "--memory", "4g", "--memory-swap", "4g",
         first.name],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with pytest.raises(MountVerificationFailed) as caught:
        await backend.ensure(built.spec)
    named = [v.split(" is ")[0] for v in caught.value.violations]
    assert named == ["pids limit", "memory limit", "memory+swap limit"], caught.value.violations
    assert "pids limit is 100000" in str(caught.value)
    # The loosened sandbox is gone: retrying cannot keep it.
    assert not _exists(docker_client, first.container_id)
    fresh = await backend.ensure(built.spec)
    assert fresh.container_id != first.container_id
    observed = await backend.inspect(fresh.name)
    assert violations(built.spec, observed) == []
    assert (observed.pids_limit, observed.memory, observed.memory_swap) == (
        built.spec.limits.pids,
        built.spec.limits.memory_bytes,
        built.spec.limits.memory_bytes,
    )


async def test_R5_created_with_every_checked_setting(backend: DockerBackend, shared: Built) -> None:
    """The engine reports what the check expects: explicit ulimits, private cgroupns, no log."""
    observed = await backend.inspect((await backend.ensure(shared.spec)).name)
    assert set(observed.ulimits) == {("core", 0, 0), ("nofile", 1024, 1024)}
    assert observed.cgroupns_mode == "private"
    assert (observed.log_type, dict(observed.log_options)) == ("none", {})
    assert observed.memory_swap == observed.memory  # no swap
    assert observed.labels[LABEL_GATEWAY] == RUN_ID
    code, out, _ = await sh(backend, await backend.ensure(shared.spec), "ulimit -n; ulimit -c")
    assert (code, out) == (0, "1024\n0\n")


def _container_dir_bytes(client: docker.DockerClient, container_id: str) -> int:
    root = Path(client.info()["DockerRootDir"]) / "containers" / container_id
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


async def test_R3_log_flood_to_proc_1_fd_1_leaves_the_host_log_bounded(
    backend: DockerBackend,
    spec_factory: Callable[..., Built],
    docker_client: docker.DockerClient,
    base_image: str,
    app_name: str,
) -> None:
    """200 MB written to the sandbox's stdout costs the host nothing (log driver `none`)."""
    handle = await backend.ensure(spec_factory().spec)
    before = _container_dir_bytes(docker_client, handle.container_id)
    if before == 0:
        pytest.fail("cannot read the engine's container directory (run as root, like CI)")
    code, out, err = await sh(
        backend, handle, "head -c 200000000 /dev/zero > /proc/1/fd/1; echo wrote", timeout=120
    )
    assert (code, out) == (0, "wrote\n"), err
    after = _container_dir_bytes(docker_client, handle.container_id)
    print(f"\nR3: 200 MB to /proc/1/fd/1: container dir {before} -> {after} bytes")
    assert after - before < 1024 * 1024
    assert docker_client.api.inspect_container(handle.container_id)["LogPath"] == ""
    # Control: the same measure sees a default (json-file) container's log grow.
    control = docker_client.containers.run(
        base_image,
        ["sh", "-c", "head -c 20000000 /dev/zero; sleep infinity"],
        labels={LABEL_APP: app_name, LABEL_GATEWAY: RUN_ID},
        log_config={"Type": "json-file", "Config": {}},
        network_mode="none",
        detach=True,
    )
    try:
        grown = 0
        for _ in range(100):
            grown = _container_dir_bytes(docker_client, control.id or "")
            if grown > 20_000_000:
                break
            await asyncio.sleep(0.1)
        assert grown > 20_000_000
    finally:
        control.remove(force=True)
