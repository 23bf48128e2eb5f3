"""F2, F1: the resident runner starts from code this gateway compiled when the sandbox's
python3 reads the same bytecode (no compile on a first turn), and from its source when
it does not. Run here with the host's python3 in place of a sandbox's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.backends.docker_pool import POOL_COMMAND, POOL_COMMAND_OWN_INIT, engine_init
from sandbox.latebind import CLAIM_FIFO, INIT_NAME
from sandbox.mountplan import BRIDGE
from sandbox.runner_client import (
    RUNNER_CODE_NAME,
    RUNNER_NAME,
    runner_code,
    runner_fd_loader,
    runner_loader,
)

SOURCE = (Path(__file__).parents[2] / "sandbox" / "client" / "cellgate_runner.py").read_bytes()


def _start(bridge: Path, python: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    sock_path = bridge / "runner.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    listener.settimeout(20)
    proc = subprocess.Popen([python, "-I", "-S", "-c", runner_loader(str(bridge)), str(sock_path)])
    conn, _ = listener.accept()
    listener.close()
    return proc, conn


def test_F2_runner_starts_from_its_source_when_no_code_of_this_tag_is_there(
    tmp_path: Path,
) -> None:
    (tmp_path / RUNNER_NAME).write_bytes(SOURCE)
    (tmp_path / f"{RUNNER_NAME}.cpython-00").write_bytes(b"not code")  # another Python's
    proc, conn = _start(tmp_path, sys.executable)
    conn.close()  # the gateway is gone: the runner ends
    assert proc.wait(20) in (0, 1)


def test_F2_runner_starts_from_the_precompiled_code_of_its_tag(tmp_path: Path) -> None:
    (tmp_path / RUNNER_NAME).write_bytes(b"raise SystemExit('the source was compiled')\n")
    marker = b"import _socket,sys\ns=_socket.socket(1,1); s.connect(sys.argv[1]); s.send(b'code')\n"
    (tmp_path / RUNNER_CODE_NAME).write_bytes(runner_code(marker))
    proc, conn = _start(tmp_path, sys.executable)
    assert conn.recv(16) == b"code"
    conn.close()
    assert proc.wait(20) == 0


def _start_from_fds(
    tmp: Path, code: bytes, source: bytes
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """As a pooled sandbox's shell does: the runner's code on fd 3, its source on fd 4."""
    sock_path = tmp / "runner.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    listener.settimeout(20)
    (tmp / "k").write_bytes(code)
    (tmp / "s").write_bytes(source)
    proc = subprocess.Popen(
        ["/bin/sh", "-c", 'exec 3<"$1" 4<"$2"; exec "$0" -I -S -c "$3" "$4"',
         sys.executable, str(tmp / "k"), str(tmp / "s"), runner_fd_loader(), str(sock_path)],
    )  # fmt: skip
    conn, _ = listener.accept()
    listener.close()
    return proc, conn


def test_F1_F2_pooled_runner_starts_from_its_slots_descriptors(tmp_path: Path) -> None:
    """The code on fd 3 when the tag matches (its source is never compiled), and both
    descriptors closed before the runner runs (no command it starts inherits them)."""
    marker = (
        b"import _socket,sys,posix\n"
        b"fds=bytes([posix.access('/proc/self/fd/3', 0), posix.access('/proc/self/fd/4', 0)])\n"
        b"s=_socket.socket(1,1); s.connect(sys.argv[1])\n"
        b"s.send(b'code' + fds)\n"
    )
    source = b"raise SystemExit('the source was compiled')\n"
    proc, conn = _start_from_fds(tmp_path, runner_code(marker), source)
    assert conn.recv(16) == b"code\0\0"
    conn.close()
    assert proc.wait(20) == 0


@pytest.mark.parametrize("with_runner", [True, False])
def test_F1_pooled_first_process_waits_and_outlives_its_runner(
    tmp_path: Path, with_runner: bool
) -> None:
    """The pooled sandbox's first shell, run here with the slot's bridge dir in place of
    /run/cellgate: with or without a runner in its slot (the resident runner off) it
    waits on the claim FIFO, and once claimed it keeps the sandbox alive whatever the
    runner does."""
    bridge = tmp_path / "bridge"
    bridge.mkdir()
    os.mkfifo(bridge / CLAIM_FIFO)
    if with_runner:
        (bridge / RUNNER_NAME).write_bytes(SOURCE)
        (bridge / RUNNER_CODE_NAME).write_bytes(runner_code(b"raise SystemExit(0)\n"))
    shell, flag, script = POOL_COMMAND
    script = script.replace(str(BRIDGE), str(bridge)).replace("python3 ", f"{sys.executable} ")
    proc = subprocess.Popen([shell, flag, script])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)  # waiting for its claim
        with open(bridge / CLAIM_FIFO, "w") as fifo:
            fifo.write("\n")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.0)  # the runner ended (or never was): the sandbox lives on
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.docker  # the engine's init binary comes with the engine
@pytest.mark.parametrize("with_runner", [True, False])
def test_F1_pooled_first_process_waits_alone_and_becomes_init_at_claim(
    tmp_path: Path, with_runner: bool
) -> None:
    """With its slot holding the engine's init, the pooled first shell waits as the one
    process (idle memory: no init beside it), and at its claim the same process becomes
    that init, which keeps the runner and then the keep-alive as its children."""
    init = engine_init()
    assert init is not None, "no docker-init (tini) on this host"
    bridge = tmp_path / "bridge"
    bridge.mkdir()
    os.mkfifo(bridge / CLAIM_FIFO)
    (bridge / INIT_NAME).write_bytes(init.read_bytes())
    os.chmod(bridge / INIT_NAME, 0o555)
    if with_runner:
        (bridge / RUNNER_NAME).write_bytes(SOURCE)
        (bridge / RUNNER_CODE_NAME).write_bytes(runner_code(b"raise SystemExit(0)\n"))
    shell, flag, script = POOL_COMMAND_OWN_INIT
    script = script.replace(str(BRIDGE), str(bridge)).replace("python3 ", f"{sys.executable} ")
    proc = subprocess.Popen([shell, flag, script], stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)  # waiting for its claim, alone
        assert os.path.realpath(f"/proc/{proc.pid}/exe") == os.path.realpath(shell)
        assert not _children(proc.pid)
        with open(bridge / CLAIM_FIFO, "w") as fifo:
            fifo.write("\n")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.0)  # the runner ended: the sandbox lives on
        # the same pid, now the init
        assert os.path.realpath(f"/proc/{proc.pid}/exe") == str(bridge / INIT_NAME)
        deadline = time.monotonic() + 20  # a loaded machine: the runner may still be starting
        while True:
            [keeper] = _children(proc.pid)
            argv = Path(f"/proc/{keeper}/cmdline").read_bytes().split(b"\0")
            if argv[:2] == [b"sleep", b"infinity"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert argv[:2] == [b"sleep", b"infinity"], argv
        held = {os.readlink(f"/proc/{keeper}/fd/{fd}") for fd in os.listdir(f"/proc/{keeper}/fd")}
        assert str(bridge / INIT_NAME) not in held  # the init's descriptor is not handed down
    finally:
        proc.kill()
        proc.wait()


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path, encoding="ascii") as f:
        return [int(c) for c in f.read().split()]
