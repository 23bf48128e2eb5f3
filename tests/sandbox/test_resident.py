"""F2: a turn through the resident runner behaves as an exec, and a hostile sandbox
that kills or replaces its runner only hurts itself (the gateway falls back to exec)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from orchestrator.resident import ResidentBackend
from sandbox.backends.base import SandboxHandle
from sandbox.backends.docker import DockerBackend
from sandbox.runner_client import NATIVE_NAME
from tests.sandbox.conftest import Built, build_spec
from tests.support.run_id import RUN_ID

pytestmark = pytest.mark.docker

CAP = 4096
ANCESTRY = (
    "tr '\\0' ' ' < /proc/$PPID/cmdline; echo; "
    'id -u; id -g; pwd; echo "mode=$APP_MODE x=$X home=$HOME"'
)
# the pattern is split so that this script's own command line does not match it
KILL_RUNNER = (
    "for p in /proc/[0-9]*; do grep -q 'cellgate-''runner' $p/cmdline 2>/dev/null "
    "&& kill -9 ${p#/proc/}; done; true"
)
FAKE_RUNNER = (
    "import socket,struct,sys,time\n"
    "s=socket.socket(socket.AF_UNIX); s.connect('/run/cellgate/runner.sock')\n"
    "s.recv(65536)\n"
    "s.sendall(struct.pack('>I', int(sys.argv[1])) + b'{' * 8192)\n"
    "time.sleep(60)\n"
)

# answers the request's own id with a header the gateway must refuse (argv[1] says how)
HOSTILE_REPLY = (
    "import json,socket,struct,sys,time\n"
    "s=socket.socket(socket.AF_UNIX); s.connect('/run/cellgate/runner.sock')\n"
    "def rx(n):\n b=b''\n while len(b)<n: b+=s.recv(n-len(b))\n return b\n"
    "rid=rx(struct.unpack('>I',rx(4))[0]).split(b'\\0')[0].decode()\n"
    "head={'id':rid,'out_len':0,'err_len':0,'code':0}\n"
    "m=sys.argv[1]\n"
    "if m=='inf': head['out_len']=float('inf')\n"
    "if m=='missing': del head['out_len']\n"
    "if m=='list': head['out_len']=[1]\n"
    "if m=='bool': head['err_len']=True\n"
    "body=b'['*4000 if m=='deep' else json.dumps(head).encode()\n"
    "s.sendall(struct.pack('>I',len(body))+body)\n"
    "time.sleep(60)\n"
)


@pytest.fixture(params=["native", "python"])
async def sandbox(
    request: pytest.FixtureRequest,
    spec_factory: Callable[..., Built],
) -> AsyncIterator[tuple[DockerBackend, ResidentBackend, SandboxHandle, Built]]:
    """A running sandbox and its resident runner: the native one, or the Python one."""
    inner = DockerBackend.from_env(output_cap=CAP)
    built = spec_factory()
    handle = await inner.ensure(built.spec)
    residents = ResidentBackend(inner, native=request.param == "native")
    if request.param == "native":
        assert residents.runner_files().keys() == {NATIVE_NAME}, "scripts/build-runner.sh"
    await residents.ready(handle, built.paths.bridge_dir, built.spec)
    assert await residents.wait_connected(handle, 20), "the runner never connected"
    try:
        yield inner, residents, handle, built
    finally:
        await residents.close()
        await inner.close()


async def _exec(backend: Any, handle: SandboxHandle, script: str, limit: float = 20) -> Any:
    return await backend.exec(
        handle, ["/bin/sh", "-c", script], env={"X": "1"}, timeout=limit, workdir="/workspace"
    )


async def test_F2_runner_runs_as_exec_would(sandbox: Any) -> None:
    inner, residents, handle, _ = sandbox
    via_runner = await _exec(residents, handle, ANCESTRY)
    via_exec = await _exec(inner, handle, ANCESTRY)
    assert via_runner.exit_code == via_exec.exit_code == 0
    ran_by, *rest = via_runner.stdout.decode().splitlines()
    assert "cellgate-runner" in ran_by  # it did go through the runner
    assert "cellgate-runner" not in via_exec.stdout.decode().splitlines()[0]
    # same user, group, working directory, environment (sandbox's + request's)
    assert rest == via_exec.stdout.decode().splitlines()[1:]
    assert rest[0] == "65532" and rest[2] == "/workspace" and "mode=test x=1" in rest[3]
    code = await _exec(residents, handle, "echo out; echo err >&2; exit 7")
    assert (code.exit_code, code.stdout, code.stderr) == (7, b"out\n", b"err\n")
    data = await residents.exec(handle, ["cat"], stdin=b"hello stdin", timeout=10)
    assert data.stdout == b"hello stdin"


async def test_F2_output_cap_and_timeout_kill_the_group(sandbox: Any) -> None:
    inner, residents, handle, _ = sandbox
    big = await _exec(residents, handle, "head -c 100000 /dev/zero; head -c 9000 /dev/zero >&2")
    assert len(big.stdout) == CAP and len(big.stderr) == CAP and big.exit_code == 0
    slow = await _exec(residents, handle, "sleep 301 & setsid sleep 302 & sleep 303", limit=1)
    assert slow.timed_out
    await asyncio.sleep(0.5)
    left = await _exec(
        inner, handle, "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
    )
    assert b"sleep 30" not in left.stdout, left.stdout


async def test_F2_timeout_ends_the_command_as_exec_does(sandbox: Any) -> None:
    """The runner keeps `timeout -k 2`'s clock itself (no `timeout` process per command):
    a command that ends on SIGTERM exits 124, one that ignores it is killed 2 s later
    (137); both timed out, exactly as through exec."""
    inner, residents, handle, _ = sandbox
    cases = (("trap 'exit 0' TERM; sleep 30 & wait", 124), ("trap '' TERM; sleep 4; sleep 4", 137))
    for script, code in cases:
        via_runner = await _exec(residents, handle, script, limit=1)
        via_exec = await _exec(inner, handle, script, limit=1)
        assert (via_runner.exit_code, via_runner.timed_out) == (code, True), script
        assert (via_exec.exit_code, via_exec.timed_out) == (code, True), script
    quick = await _exec(residents, handle, "exit 124", limit=5)  # its own 124: no timeout
    assert (quick.exit_code, quick.timed_out) == (124, False)


async def test_F2_killed_runner_falls_back_to_exec_and_comes_back(sandbox: Any) -> None:
    inner, residents, handle, built = sandbox
    killed = await _exec(inner, handle, KILL_RUNNER)
    assert killed.exit_code == 0
    await asyncio.sleep(0.3)
    after = await _exec(residents, handle, ANCESTRY)
    assert after.exit_code == 0 and "cellgate-runner" not in after.stdout.decode().split("\n")[0]
    await residents.ready(handle, built.paths.bridge_dir, built.spec)  # the next turn's start
    assert await residents.wait_connected(handle, 20)
    again = await _exec(residents, handle, ANCESTRY)
    assert "cellgate-runner" in again.stdout.decode().split("\n")[0]


@pytest.mark.parametrize("claimed_size", [1 << 31, 10])
async def test_F2_hostile_runner_is_bounded_and_dropped(sandbox: Any, claimed_size: int) -> None:
    inner, residents, handle, built = sandbox
    await _exec(inner, handle, KILL_RUNNER)
    await asyncio.sleep(0.3)
    assert not residents._runners[handle.container_id].ready
    await residents.ops.launch(
        handle, built.spec.user, ["python3", "-c", FAKE_RUNNER, str(claimed_size)]
    )
    assert await residents.wait_connected(handle, 20)
    started = asyncio.get_running_loop().time()
    lied = await _exec(residents, handle, "echo should-not-matter")
    assert lied.exit_code == -1 and b"runner was lost" in lied.stderr
    assert asyncio.get_running_loop().time() - started < 5
    # dropped: the next exec goes the plain way, and works
    fine = await _exec(residents, handle, "echo fine")
    assert fine.exit_code == 0 and fine.stdout == b"fine\n"


@pytest.mark.parametrize("how", ["inf", "missing", "list", "bool", "deep"])
async def test_F2_hostile_reply_header_is_a_lost_runner(sandbox: Any, how: str) -> None:
    """A runner answering with the right id but lengths that are not counts (Infinity,
    missing, a list, a bool) or JSON nested past the parser's depth: the turn gets
    'runner was lost', the connection is dropped, the next exec goes the plain way."""
    inner, residents, handle, built = sandbox
    await _exec(inner, handle, KILL_RUNNER)
    await asyncio.sleep(0.3)
    assert not residents._runners[handle.container_id].ready
    await residents.ops.launch(handle, built.spec.user, ["python3", "-c", HOSTILE_REPLY, how])
    assert await residents.wait_connected(handle, 20)
    lied = await _exec(residents, handle, "echo should-not-matter")
    assert lied.exit_code == -1 and b"runner was lost" in lied.stderr
    assert not residents._runners[handle.container_id].ready
    fine = await _exec(residents, handle, "echo fine")
    assert fine.exit_code == 0 and fine.stdout == b"fine\n"


def _listening(path: Path) -> bool:
    """Does something listen at `path` (a connection is taken into its backlog)?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        probe.connect(f"/proc/self/fd/{dfd}/{path.name}")  # a tmp path can be too long
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    finally:
        probe.close()
        os.close(dfd)
    return True


async def test_F1_F2_socket_bound_at_claim_listens_before_the_turn_and_serves_it(
    spec_factory: Callable[..., Built],
) -> None:
    """A claim binds the runner socket (`prebind`) before the pooled sandbox's runner
    starts, so the runner connects at its first try; the turn's `ready` serves that very
    socket. A claim that fails closes it, and nothing listens there any more."""
    inner = DockerBackend.from_env(output_cap=CAP)
    built = spec_factory()
    handle = await inner.ensure(built.spec)
    residents = ResidentBackend(inner)
    path = built.paths.bridge_dir / "runner.sock"
    try:
        await asyncio.to_thread(residents.prebind, built.paths.bridge_dir, handle.container_id)
        assert _listening(path)  # before any turn's `ready` (this probe is never served)
        residents.drop_prebound(handle.container_id)  # the claim failed
        assert not _listening(path) and not os.path.exists(path)
        await asyncio.to_thread(residents.install, built.paths.bridge_dir)
        await asyncio.to_thread(residents.prebind, built.paths.bridge_dir, handle.container_id)
        inode = os.stat(path).st_ino
        await residents.ready(handle, built.paths.bridge_dir, built.spec)
        assert await residents.wait_connected(handle, 20)
        assert os.stat(path).st_ino == inode  # the socket bound at the claim, not a new one
        ran = await _exec(residents, handle, ANCESTRY)
        assert ran.exit_code == 0 and "cellgate-runner" in ran.stdout.decode().split("\n")[0]
    finally:
        await residents.close()
        await inner.close()
    assert not _listening(path)


NO_PYTHON = (
    "FROM {base}\n"
    "RUN find / -xdev \\( -name 'python3*' -o -name 'python' \\) \\( -type f -o -type l \\) "
    "-path '*bin/*' -delete && ! command -v python3\n"
)


@pytest.fixture
def image_without_python(docker_client: Any, base_image: str) -> Iterator[str]:
    """The base image with no `python3` at all; its tag is this run's, removed after."""
    tag = f"cellgate-test-nopython:{RUN_ID}"
    dockerfile = io.BytesIO(NO_PYTHON.format(base=base_image).encode())
    image, _ = docker_client.images.build(fileobj=dockerfile, tag=tag, rm=True, forcerm=True)
    try:
        yield str(image.id)
    finally:
        with contextlib.suppress(docker.errors.APIError):
            docker_client.images.remove(tag, noprune=False)


async def test_F2_native_runner_serves_an_image_without_python(
    tmp_path: Path, app_name: str, image_without_python: str
) -> None:
    """The native runner needs nothing in the image: in one without `python3` (where the
    Python runner cannot start and every turn was an exec) turns go through the runner."""
    inner = DockerBackend.from_env(output_cap=CAP)
    built = build_spec(tmp_path, app_name, image_without_python)
    handle = await inner.ensure(built.spec)
    residents = ResidentBackend(inner)
    try:
        await residents.ready(handle, built.paths.bridge_dir, built.spec)
        assert await residents.wait_connected(handle, 20), "the native runner never connected"
        ran = await _exec(residents, handle, "command -v python3 || echo no-python; " + ANCESTRY)
        lines = ran.stdout.decode().splitlines()
        assert ran.exit_code == 0 and lines[0] == "no-python", ran
        assert lines[1].startswith(f"/run/cellgate/{NATIVE_NAME}")  # the runner ran it
        assert lines[2:5] == ["65532", "65532", "/workspace"]
    finally:
        await residents.close()
        await inner.close()


async def test_F2_a_native_runner_that_cannot_run_here_gives_way_to_the_python_one(
    spec_factory: Callable[..., Built],
) -> None:
    """A native runner the sandbox cannot execute (built for another machine, a broken
    file) never connects: the sandbox's next launch starts the Python runner."""
    inner = DockerBackend.from_env(output_cap=CAP)
    built = spec_factory()
    handle = await inner.ensure(built.spec)
    residents = ResidentBackend(inner)
    residents._native = b"\x7fELF" + bytes(60)  # an ELF header and nothing to run
    try:
        await residents.ready(handle, built.paths.bridge_dir, built.spec)
        assert not await residents.wait_connected(handle, 3)
        via_exec = await _exec(residents, handle, ANCESTRY)
        assert via_exec.exit_code == 0 and "cellgate-runner" not in via_exec.stdout.decode()
        await residents.ready(handle, built.paths.bridge_dir, built.spec)  # the next turn
        assert await residents.wait_connected(handle, 20)
        ran = await _exec(residents, handle, ANCESTRY)
        assert ran.stdout.decode().startswith("python3 -I -S -c"), ran.stdout
    finally:
        await residents.close()
        await inner.close()
