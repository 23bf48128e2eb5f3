"""Turns of a host agent: processes on the gateway host, bounded like a sandbox exec (S6).

NOT an operating-system sandbox. A host agent's commands run as the gateway's
own user, with the host's filesystem and network; what isolates one of its
conversations from another is only what the gateway decides (memory files,
the bridge's tool gating, API key scope), never the kernel.

`HostExec` implements the exec half of `SandboxBackend`, so the command and
OpenAI harnesses run unchanged: `exec` starts `argv` with a clean environment
(`PATH`, `LANG` and what the session gives; nothing else of the gateway's
own environment, so no channel token or provider key leaks), in its own
process group, keeps at most `OUTPUT_CAP` bytes of each output (the rest is
read and dropped), and kills the whole group at the deadline. There is no
container: `ensure`, `inspect`, `list`, `image_facts` and `probe` refuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence

from cellgate.errors import SandboxError
from sandbox.backends.base import ExecResult, ImageFacts, SandboxBackend, SandboxHandle, SandboxInfo
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer

__all__ = ["BASE_ENV", "OUTPUT_CAP", "HostExec", "host_handle"]

logger = logging.getLogger(__name__)

OUTPUT_CAP = 1024 * 1024  # per stream, as the Docker exec path keeps
KILL_GRACE = 2.0
_CHUNK = 65536
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ")
"""What a host turn inherits of the gateway's environment; everything else is dropped."""


def host_handle(agent: str) -> SandboxHandle:
    """The handle a host agent's turns carry: a name, no container."""
    return SandboxHandle(f"host:{agent}", "", "")


def base_env() -> dict[str, str]:
    out = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
    out.setdefault("PATH", DEFAULT_PATH)
    return out


class _Capped:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_CHUNK):
            room = self.cap - len(self.data)
            if room > 0:
                self.data += chunk[:room]


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Until the process itself exits (`wait()` also waits for every holder of its pipes)."""
    delay = 0.005
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class HostExec(SandboxBackend):
    """Runs a host agent's turns as host processes (see the module docstring)."""

    confined = False

    def __init__(self, *, output_cap: int = OUTPUT_CAP) -> None:
        self.output_cap = output_cap

    async def _exec(
        self,
        handle: SandboxHandle,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109 - bounded here: the group is killed at the deadline
        workdir: str | None,
    ) -> ExecResult:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**base_env(), **env},
                cwd=workdir,
                start_new_session=True,  # its own process group: killed whole at the deadline
                close_fds=True,
            )
        except OSError as exc:
            msg = f"cannot start {argv[0]!r} on the host: {exc.strerror or exc}\n"
            return ExecResult(127, b"", msg.encode())
        out, err = _Capped(self.output_cap), _Capped(self.output_cap)
        assert proc.stdout is not None and proc.stderr is not None
        drains = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr))
        feeder = asyncio.ensure_future(self._feed(proc, stdin))
        timed_out = False
        try:
            async with asyncio.timeout(timeout):
                await _exited(proc)
        except TimeoutError:
            timed_out = True
            logger.info("host exec for %s timed out after %.1fs", handle.name, timeout)
        finally:
            # What is left of its process group (the timed-out command, or a child
            # it left behind) is killed; output already in the pipes is still read,
            # and a child that escaped the group cannot hold the turn past the grace.
            _kill_group(proc.pid)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KILL_GRACE):
                    await asyncio.shield(drains)
                    await proc.wait()
            for task in (drains, feeder):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return ExecResult(code, bytes(out.data), bytes(err.data), timed_out=timed_out)

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, stdin: bytes | None) -> None:
        if proc.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()

    # -- no container here ------------------------------------------------------

    async def _ensure(self, spec: SandboxSpec) -> SandboxHandle:
        raise SandboxError("a host agent has no container to ensure")

    async def inspect(self, name: str) -> ObservedContainer:
        raise SandboxError("a host agent has no container to inspect")

    async def remove(self, name: str) -> None:
        """Nothing to remove: a host turn leaves no container."""

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        return []

    async def image_facts(self, image: str) -> ImageFacts:
        raise SandboxError("a host agent has no image")

    async def probe(
        self,
        runtime: str | None,
        image: str,
        argv: Sequence[str],
        *,
        run_id: str,
        timeout: float,  # noqa: ASYNC109
    ) -> ExecResult:
        raise SandboxError("a host agent has no runtime to probe")
