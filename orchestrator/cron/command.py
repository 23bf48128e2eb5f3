"""A `type: command` job's shell line, run on the host (C2: never for an app agent).

The command runs in its own process group with `/bin/sh -c`, in the agent's
workspace, with stdin closed and a small fixed environment (never the
gateway's own, which holds tokens). Its output (stdout and stderr together)
is kept up to `output_cap` bytes and the rest is read and dropped, so a
chatty command can neither block on a full pipe nor fill memory. Past
`timeout_seconds` the whole process group is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OUTPUT_CAP_BYTES", "CommandResult", "run_command"]

OUTPUT_CAP_BYTES = 64 * 1024
_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True, slots=True)
class CommandResult:
    exit_code: int | None
    timed_out: bool
    output: str
    truncated: bool

    @property
    def status(self) -> str:
        if self.timed_out:
            return "timed out"
        return f"exit {self.exit_code}"


async def _drain(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept = bytearray()
    dropped = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            dropped = True
    return bytes(kept), dropped


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_command(
    command: str,
    *,
    cwd: Path,
    timeout_seconds: float,
    output_cap: int = OUTPUT_CAP_BYTES,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run `command` with `/bin/sh -c` in `cwd`; never raises for the command's own failure."""
    await asyncio.to_thread(cwd.mkdir, parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        command,
        cwd=cwd,
        env={**_ENV, "HOME": str(cwd), **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    reader = asyncio.create_task(_drain(proc.stdout, output_cap))
    timed_out = False
    try:
        async with asyncio.timeout(timeout_seconds):
            await proc.wait()
            kept, dropped = await reader
    except TimeoutError:
        timed_out = True
        _kill_group(proc.pid)
        await proc.wait()
        try:  # a grandchild may hold the pipe after the group is killed: do not wait long
            async with asyncio.timeout(2):
                kept, dropped = await reader
        except TimeoutError:
            reader.cancel()
            kept, dropped = b"", True
    except BaseException:
        _kill_group(proc.pid)
        reader.cancel()
        raise
    finally:
        _kill_group(proc.pid)  # nothing of the job outlives it
    text = kept.decode("utf-8", "replace")
    if dropped:
        text += f"\n[output truncated at {output_cap} bytes]"
    return CommandResult(
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        output=text,
        truncated=dropped,
    )
