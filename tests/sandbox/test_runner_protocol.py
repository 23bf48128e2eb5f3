"""F2: the native runner (C) and the Python runner are one contract: the same requests
give the same results, exactly as an exec would. Both run here as host processes
against the gateway's own `RunnerSocket` (no engine needed); tests/sandbox/
test_resident.py runs them inside real sandboxes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import pytest

from sandbox.backends.base import ExecResult
from sandbox.runner_client import NATIVE_NAME, RunnerSocket, encode_request

CAP = 4096
MARKER = "CELLGATE_EXEC=probe-1"
CLIENT = resources.files("sandbox.client")


def _argv(kind: str, sock: Path) -> list[str]:
    if kind == "native":
        binary = Path(str(CLIENT.joinpath(NATIVE_NAME)))
        if not binary.is_file():
            pytest.fail(f"{binary} is missing: build it with scripts/build-runner.sh")
        return [str(binary), str(sock)]
    return [sys.executable, "-I", "-S", str(CLIENT.joinpath("cellgate_runner.py")), str(sock)]


@pytest.fixture(params=["native", "python", "native-closed-fds", "python-closed-fds"])
async def runner(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunnerSocket]:
    """A runner of each kind connected to the gateway's socket; the `-closed-fds` ones are
    started with their stdin, stdout and stderr closed."""
    bridge = tmp_path / "bridge"
    bridge.mkdir()
    rs = RunnerSocket(bridge, "probe-container", CAP)
    await rs.listen()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "FROM_RUNNER": "kept", "X": "runner's"}
    kind, _, closed = request.param.partition("-")
    argv = _argv(kind, rs.path)
    if closed:
        argv = ["/bin/sh", "-c", 'exec "$@" <&- >&- 2>&-', "sh", *argv]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path)  # noqa: ASYNC220
    try:
        await asyncio.wait_for(rs.connected.wait(), 10)
        yield rs
    finally:
        await rs.close()
        proc.kill()
        proc.wait()


async def _run(
    rs: RunnerSocket,
    script: str,
    *,
    stdin: bytes | None = None,
    timeout: float = 10,  # noqa: ASYNC109 - the request's own
    workdir: str | None = None,
) -> ExecResult | None:
    return await rs.run(["/bin/sh", "-c", script], {"X": "1"}, stdin, timeout, workdir, MARKER)


async def test_F2_runners_run_as_exec_would(runner: RunnerSocket, tmp_path: Path) -> None:
    r = await _run(runner, "echo out; echo err >&2; exit 7")
    assert r == ExecResult(7, b"out\n", b"err\n")
    r = await _run(runner, 'echo "$X $FROM_RUNNER $CELLGATE_EXEC"; pwd', workdir=str(tmp_path))
    assert r is not None and r.stdout == f"1 kept probe-1\n{tmp_path}\n".encode()
    # the runner's own environment, as it was started: not Python's locale coercion
    r = await _run(runner, 'echo "${LC_CTYPE-unset} ${LC_ALL-unset}"')
    assert r is not None and r.stdout == b"unset unset\n", r
    r = await _run(runner, "kill -9 $$")
    assert r is not None and (r.exit_code, r.timed_out) == (137, False)  # 128 + signal
    r = await runner.run(["printf", "%s", "caf\udce9"], {}, None, 5, None, MARKER)
    assert r is not None and r.stdout == b"caf\xe9"  # bytes that are not UTF-8 pass as they are


async def test_F2_runners_feed_stdin_and_cap_output(runner: RunnerSocket) -> None:
    data = os.urandom(3 * 65536)  # more than a pipe holds: written while it is read
    r = await runner.run(["wc", "-c"], {}, data, 10, None, MARKER)
    assert r is not None and r.stdout.split() == [str(len(data)).encode()]
    r = await runner.run(["cat"], {}, b"", 10, None, MARKER)
    assert r == ExecResult(0, b"", b"")
    r = await _run(runner, "head -c 100000 /dev/zero; head -c 9000 /dev/zero >&2; exit 3")
    assert r is not None and (len(r.stdout), len(r.stderr), r.exit_code) == (CAP, CAP, 3)
    r = await _run(runner, "exec 0<&-; exit 0", stdin=b"x" * 200000)  # stdin left unread
    assert r is not None and r.exit_code == 0


async def test_F2_runners_keep_timeouts_as_timeout_does(runner: RunnerSocket) -> None:
    r = await _run(runner, "trap 'exit 0' TERM; sleep 30 & wait", timeout=1)
    assert r is not None and (r.exit_code, r.timed_out) == (124, True)
    r = await _run(runner, "trap '' TERM; sleep 30", timeout=1)
    assert r is not None and (r.exit_code, r.timed_out) == (137, True)
    r = await _run(runner, "sleep 30 >/dev/null 2>&1 & echo quick")  # a background child
    assert r == ExecResult(0, b"quick\n", b"")  # the command's own end is the turn's
    r = await _run(runner, "echo $$; exec >&- 2>&-; sleep 30", timeout=1)  # output closed early
    assert r is not None and (r.exit_code, r.timed_out) == (124, True)  # its clock ran on
    with pytest.raises(ProcessLookupError):
        os.kill(int(r.stdout), 0)  # ended (and reaped), not left running


async def test_F2_runners_start_nothing_they_cannot_find(
    runner: RunnerSocket, tmp_path: Path
) -> None:
    """A program not on PATH (nor one in the sandbox-writable working directory) starts
    nothing: None, the gateway runs it by exec, which reports it as exec does."""
    planted = tmp_path / "planted"
    planted.write_text("#!/bin/sh\necho ran\n")
    planted.chmod(0o755)
    assert await runner.run(["planted"], {}, None, 5, str(tmp_path), MARKER) is None
    assert await runner.run(["no-such-program"], {}, None, 5, None, MARKER) is None
    assert await runner.run(["/bin/true"], {}, None, 5, str(tmp_path / "gone"), MARKER) is None
    r = await runner.run(["./planted"], {}, None, 5, str(tmp_path), MARKER)  # a path: as asked
    assert r == ExecResult(0, b"ran\n", b"")
    r = await runner.run(["true"], {}, None, 5, None, MARKER)  # and the runner still serves
    assert r == ExecResult(0, b"", b"")


def test_F2_request_fields_no_runner_could_carry_are_refused() -> None:
    ok = encode_request("ab12", ["echo", "hi"], {"A": "1"}, 2.5, None, 10, MARKER, b"in")
    fields = ["ab12", "2.5", "10", MARKER, "", "2", "2", "echo", "hi", "1", "A=1"]
    assert ok == b"".join(f.encode() + b"\0" for f in fields)
    assert encode_request("ab12", ["echo", "a\0b"], {}, 1, None, 10, MARKER, None) is None
    assert encode_request("ab12", ["true"], {"A=B": "1"}, 1, None, 10, MARKER, None) is None
    assert encode_request("ab12", ["true"], {"": "1"}, 1, None, 10, MARKER, None) is None
    assert encode_request("ab12", ["true"], {"A": "\0"}, 1, None, 10, MARKER, None) is None
    # a lone surrogate (a model's JSON can carry one) has no bytes: exec reports it
    assert encode_request("ab12", ["echo", "\ud800"], {}, 1, None, 10, MARKER, None) is None
    for timeout in (-1, 2e9, float("nan")):  # past what either runner takes
        assert encode_request("ab12", ["true"], {}, timeout, None, 10, MARKER, None) is None
    many = {f"V{i}": "" for i in range(70000)}
    assert encode_request("ab12", ["true"], many, 1, None, 10, MARKER, None) is None
    big = ["x" * (2 << 20)]
    assert encode_request("ab12", big, {}, 1, None, 10, MARKER, None) is None
