"""The one contract every sandbox backend implements.

Cross-cutting work lives in the final public methods (`ensure` verifies what
the hook created; `exec` bounds the time); backends implement the `_` hooks.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from cellgate.errors import CellgateError, MountVerificationFailed, SandboxError
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer, violations

logger = logging.getLogger(__name__)

# What a shell or an interpreter prints when a fork fails (dash, bash, Python, busybox):
# a command that says so and fails makes the gateway probe whether its sandbox can still
# start a process (R7).
FORK_FAILED = (b"Cannot fork", b"can't fork", b"fork: ", b"Resource temporarily unavailable")
FORK_PROBE = ("/bin/sh", "-c", "true | true")  # two processes, one of them a fork of sh
PROBE_SECONDS = 10.0
PROBES = 3  # a sandbox is judged saturated only when each of them cannot fork
PROBE_PAUSE = 0.5
SPENT_KEPT = 256  # saturated sandboxes not yet retired (their turns still running)


class SandboxNotFound(SandboxError):
    """The engine reports that the sandbox does not exist (it may be recreated with ensure)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"sandbox {name} does not exist; `ensure` recreates it")


@dataclass(frozen=True, slots=True)
class SandboxHandle:
    name: str
    container_id: str
    spec_hash: str


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False


def _fork_failed(result: ExecResult) -> bool:
    if result.exit_code == 0 or result.timed_out:
        return False
    said = result.stderr[-4096:] + result.stdout[-4096:]
    return any(m in said for m in FORK_FAILED)


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    name: str
    container_id: str
    labels: Mapping[str, str]
    running: bool


class SandboxBackend(abc.ABC):
    """ensure(spec) → handle; exec; inspect; remove; list by label."""

    _spent_ids: OrderedDict[str, None] | None = None  # saturated, to retire (R7)

    confined: ClassVar[bool] = True
    """False when `exec` runs on the gateway's host: what such a process prints may hold
    host paths, so a chat is shown a reference, never its error output."""

    async def ensure(self, spec: SandboxSpec) -> SandboxHandle:
        """Create or reuse the sandbox for `spec`, then verify it; refuse on any difference.

        A sandbox that fails the check is removed before the refusal is raised
        (R5): the turn is refused, and the next `ensure` creates a fresh one to
        spec, so nobody keeps a loosened sandbox by retrying.
        """
        handle = await self._ensure(spec)
        try:
            await self.verify(spec, handle)
        except MountVerificationFailed as exc:
            logger.warning("sandbox %s refused and removed: %s", handle.name, exc.violations)
            await self.remove(handle.name)
            raise
        return handle

    async def verify(self, spec: SandboxSpec, handle: SandboxHandle) -> None:
        """S4: compare what the engine reports against the plan; raise on any difference."""
        observed = await self.inspect(handle.name)
        found = violations(spec, observed)
        if found:
            raise MountVerificationFailed(handle.name, found)

    async def exec(
        self,
        handle: SandboxHandle,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout: float = 60.0,  # noqa: ASYNC109 - bounded by the backend, inside the sandbox
        workdir: str | None = None,
    ) -> ExecResult:
        if not argv:
            raise ValueError("argv is empty")
        env = dict(env or {})
        result = await self._exec(handle, list(argv), env, stdin, timeout, workdir)
        if self.confined and _fork_failed(result) and await self._saturated(handle, env, workdir):
            spent = self._spent()
            spent[handle.container_id] = None
            while len(spent) > SPENT_KEPT:
                spent.popitem(last=False)
        return result

    async def _saturated(
        self, handle: SandboxHandle, env: dict[str, str], workdir: str | None
    ) -> bool:
        """R7: the command started but could not fork. Is its sandbox saturated (its pids
        kept by a process that holds them), not merely busy a moment? Only if a probe,
        `PROBES` times a little apart, cannot fork either. A probe that timed out, failed
        otherwise or could not reach the sandbox is no proof: the sandbox is kept."""
        for attempt in range(PROBES):
            if attempt:
                await asyncio.sleep(PROBE_PAUSE)
            try:
                probe = await self._exec(
                    handle, list(FORK_PROBE), env, None, PROBE_SECONDS, workdir
                )
            except CellgateError:
                return False  # gone already (nothing could start: spent, removed) or away
            if not _fork_failed(probe):
                return False
        return True

    def _spent(self) -> OrderedDict[str, None]:
        if self._spent_ids is None:  # made at first use: a backend's __init__ is its own
            self._spent_ids = OrderedDict()
        return self._spent_ids

    async def retire_if_spent(self, handle: SandboxHandle) -> bool:
        """R7: remove the sandbox (by its container id) when a command of the turn that
        has just ended found it saturated; the chat's next turn runs in a fresh one, its
        memory being on the host. Called once the turn is over: a harness may exec more
        than once in a turn, and the command's own result stands (part of it ran)."""
        spent = self._spent()
        if handle.container_id not in spent:
            return False
        del spent[handle.container_id]
        logger.warning("sandbox %s cannot start processes any more; removing it", handle.name)
        try:
            await self.remove(handle.container_id)
        except CellgateError as exc:
            logger.warning("could not remove the spent sandbox %s: %s", handle.name, exc)
        return True

    @abc.abstractmethod
    async def _ensure(self, spec: SandboxSpec) -> SandboxHandle: ...

    @abc.abstractmethod
    async def _exec(
        self,
        handle: SandboxHandle,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109
        workdir: str | None,
    ) -> ExecResult: ...

    @abc.abstractmethod
    async def inspect(self, name: str) -> ObservedContainer: ...

    @abc.abstractmethod
    async def remove(self, name: str) -> None: ...

    @abc.abstractmethod
    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]: ...

    @abc.abstractmethod
    async def image_facts(self, image: str) -> ImageFacts: ...

    @abc.abstractmethod
    async def probe(
        self,
        runtime: str | None,
        image: str,
        argv: Sequence[str],
        *,
        run_id: str,
        timeout: float,  # noqa: ASYNC109 - bounded by the backend
    ) -> ExecResult:
        """Run `argv` once in a throwaway hardened container of `runtime`, removed after.

        Its name and labels carry `run_id`; it is not a sandbox (no managed label).
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the backend's connections."""


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """What the engine knows of an image: its id, user and environment."""

    id: str
    user: str
    env: Mapping[str, str]
