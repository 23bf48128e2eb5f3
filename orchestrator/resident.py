"""Resident runners (F2): turns run through a process already inside the sandbox.

`ResidentBackend` wraps the Docker backend for the harnesses: an exec goes to
the sandbox's runner when one is connected (`sandbox.runner_client`), and to
a plain `docker exec` otherwise: before the runner is up, after the sandbox
killed or replaced it, or when the runner is busy. Same user (the runner is
started as the sandbox's user), environment (the sandbox's, then the
request's), working directory, timeout, output cap and kill of what a
timed-out command left (by the same exec marker). `ready` is called once a
turn's sandbox is verified: it serves the runner socket in the conversation's
bridge directory (bound then, or already at the claim of a pooled sandbox,
`prebind`) and, off the turn's path, starts the runner (a detached exec); a
sandbox whose runner never comes is asked again at most `MAX_LAUNCHES` times.
runc only: under gVisor a sandbox saturated by a fork bomb can still start the
runner's child but nothing below it, so it would never show as spent to exec
(and be replaced); its turns keep using exec.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path

from cellgate.errors import CellgateError
from orchestrator.bounded import LruMap
from orchestrator.safefs import SafeDir
from sandbox.backends.base import (
    ExecResult,
    ImageFacts,
    SandboxBackend,
    SandboxHandle,
    SandboxInfo,
    SandboxNotFound,
)
from sandbox.backends.docker import EXEC_MARKER_ENV, DockerBackend
from sandbox.backends.docker_pool import NATIVE_ARGV, RUNNER_ARGV, DockerPoolOps
from sandbox.mounts import noexec
from sandbox.runner_client import (
    NATIVE_NAME,
    RUNNER_CODE_NAME,
    RUNNER_LOST,
    RUNNER_NAME,
    RunnerSocket,
    native_runner,
    runner_code,
)
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer

logger = logging.getLogger(__name__)

MAX_RUNNERS = 4096
MAX_LAUNCHES = 3
TRIGGERED_WAIT = 3.0  # a burst of claims starts many runners at once on few cores
RUNNER_RUNTIMES = (None, "runc")


class ResidentBackend(SandboxBackend):
    def __init__(
        self, inner: DockerBackend, *, max_runners: int = MAX_RUNNERS, native: bool = True
    ) -> None:
        """`native`: run the native runner when it was built (else, or False: the Python one)."""
        self.inner = inner
        self.ops = DockerPoolOps(inner)
        self.max_runners = max_runners
        self._runners: OrderedDict[str, RunnerSocket] = OrderedDict()
        self._by_bridge: dict[Path, str] = {}  # bridge dir -> the container its runner serves
        self._users: dict[str, str] = {}
        self._argv: dict[str, list[str]] = {}  # how each sandbox's runner is started by exec
        self._launches: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._starters: dict[str, Callable[[], bool]] = {}
        self._triggered: set[str] = set()
        # pooled sandboxes whose runner came from their slot: a relaunch installs it first
        self._pooled: LruMap[str, bool] = LruMap(max_runners)
        # F1: runner sockets a claim bound in its control thread, until the turn serves them
        self._prebound: OrderedDict[str, RunnerSocket] = OrderedDict()
        self._prebound_lock = threading.Lock()
        self._script = resources.files("sandbox.client").joinpath("cellgate_runner.py").read_bytes()
        self._code = runner_code(self._script)
        self._native = native_runner() if native else None
        if native and self._native is None:
            logger.info(
                "resident runners start a Python each: build the native one with "
                "scripts/build-runner.sh (a C compiler), then restart"
            )

    async def ready(self, handle: SandboxHandle, bridge_dir: Path, spec: SandboxSpec) -> None:
        """A turn's verified sandbox: its runner socket listens, and a runner is on its way."""
        if spec.runtime not in RUNNER_RUNTIMES:
            return  # under gVisor a saturated sandbox must still show as spent to exec (R7)
        cid = handle.container_id
        rs = self._runners.get(cid)
        if rs is not None and not rs.still_ours():
            await self._close(cid)
            rs = None
        if rs is None:
            await self.close_bridge(bridge_dir)  # that conversation's previous sandbox's
            while len(self._runners) >= self.max_runners:
                await self._close(next(iter(self._runners)))
            argv = None
            try:
                rs = self._take_prebound(cid, bridge_dir)
                if rs is None:
                    if cid not in self._starters:  # a pooled one's comes from its slot (F1)
                        argv = await asyncio.to_thread(self.install, bridge_dir)
                    rs = RunnerSocket(bridge_dir, cid, self.inner._output_cap)
                await rs.listen()
            except (OSError, CellgateError) as exc:
                logger.warning("no resident runner for %s: %s", handle.name, exc)
                return
            self._runners[cid] = rs
            self._by_bridge[bridge_dir] = cid
            self._users[cid] = spec.user
            if argv is not None:
                self._argv[cid] = argv
        self._runners.move_to_end(cid)
        starter = self._starters.pop(cid, None)
        if not rs.ready and starter is not None and starter():
            self._triggered.add(cid)  # a pooled sandbox's runner starts on its own
            return
        if not rs.ready and self._launches.get(cid, 0) < MAX_LAUNCHES:
            self._launches[cid] = self._launches.get(cid, 0) + 1
            task = asyncio.create_task(self._launch(handle, spec.user, bridge_dir))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close_bridge(self, bridge_dir: Path) -> None:
        """Close the runner socket an earlier sandbox of this bridge dir listens on (one
        lookup: a new conversation's first turn does not walk every live runner, F3)."""
        other = self._by_bridge.get(bridge_dir)
        if other is not None:
            await self._close(other)

    def add_starter(self, container_id: str, start: Callable[[], bool]) -> None:
        """How a claimed pooled sandbox's runner is started (its claim FIFO), instead of exec."""
        while len(self._starters) >= self.max_runners:
            self._starters.pop(next(iter(self._starters)))
        self._starters[container_id] = start
        self._pooled.put(container_id, True)

    def prebind(self, bridge_dir: Path, container_id: str) -> None:
        """At a claim, in its control thread: the sandbox's runner socket bound and
        listening before its runner starts (F1, F3: the runner connects at once, and the
        turn's `ready` has no bind of its own to wait for). Raises OSError."""
        rs = RunnerSocket(bridge_dir, container_id, self.inner._output_cap)
        rs.bind()
        with self._prebound_lock:
            stale = [self._prebound.pop(container_id, None)]
            self._prebound[container_id] = rs
            while len(self._prebound) > self.max_runners:
                stale.append(self._prebound.popitem(last=False)[1])
        for old in stale:
            if old is not None:
                old.close_now()

    def drop_prebound(self, container_id: str) -> None:
        """A claim that bound a runner socket failed: close it."""
        with self._prebound_lock:
            rs = self._prebound.pop(container_id, None)
        if rs is not None:
            rs.close_now()

    def _take_prebound(self, container_id: str, bridge_dir: Path) -> RunnerSocket | None:
        with self._prebound_lock:
            rs = self._prebound.pop(container_id, None)
        if rs is not None and rs.bridge_dir != bridge_dir:
            rs.close_now()
            return None
        return rs

    def runner_files(self, root: Path | None = None) -> dict[str, tuple[bytes, int]]:
        """What a slot under `root` holds for its pooled sandbox to start its runner from,
        with modes: the native runner, else (or on a noexec filesystem) the Python
        runner's script and its code."""
        if self._native is not None and (root is None or not noexec(root)):
            return {NATIVE_NAME: (self._native, 0o555)}
        return {RUNNER_NAME: (self._script, 0o755), RUNNER_CODE_NAME: (self._code, 0o644)}

    def install(self, bridge_dir: Path, native: bool = True) -> list[str]:
        """Put the runner into the conversation's bridge directory (read-only inside);
        returns the command that starts it there. The Python one when not `native`, or
        where the directory's filesystem is mounted noexec."""
        with SafeDir.open(bridge_dir) as d:
            if native and self._native is not None and not noexec(bridge_dir):
                d.write_atomic(NATIVE_NAME, self._native, mode=0o555, durable=False)
                return list(NATIVE_ARGV)
            d.write_atomic(RUNNER_NAME, self._script, mode=0o755, durable=False)
            d.write_atomic(RUNNER_CODE_NAME, self._code, mode=0o644, durable=False)
            return list(RUNNER_ARGV)

    async def _launch(self, handle: SandboxHandle, user: str, bridge_dir: Path) -> None:
        cid = handle.container_id
        # a sandbox's first launch starts the native runner; a later one (it did not come,
        # or the sandbox ended it: it may not run here) the Python one
        native = self._launches.get(cid, 0) <= 1
        try:
            argv = self._argv.get(cid)
            pooled = self._pooled.pop(cid)  # its first runner came from its slot
            if pooled or argv is None or (not native and argv == list(NATIVE_ARGV)):
                argv = await asyncio.to_thread(self.install, bridge_dir, native)
                if cid in self._runners:  # bounded with them (closed meanwhile: not kept)
                    self._argv[cid] = argv
            await self.ops.launch(handle, user, argv)
        except CellgateError as exc:
            logger.info("could not start the runner in %s: %s", handle.name, exc)

    async def wait_connected(self, handle: SandboxHandle, timeout: float = 10.0) -> bool:  # noqa: ASYNC109
        rs = self._runners.get(handle.container_id)
        if rs is None:
            return False
        try:
            async with asyncio.timeout(timeout):
                await rs.connected.wait()
        except TimeoutError:
            return False
        return True

    async def _close(self, cid: str) -> None:
        rs = self._runners.pop(cid, None)
        if rs is not None and self._by_bridge.get(rs.bridge_dir) == cid:
            del self._by_bridge[rs.bridge_dir]
        self._users.pop(cid, None)
        self._argv.pop(cid, None)
        self._launches.pop(cid, None)
        self._starters.pop(cid, None)
        self._triggered.discard(cid)
        self._pooled.pop(cid)
        self.drop_prebound(cid)
        if rs is not None:
            await rs.close()

    # -- the backend contract, by delegation ------------------------------

    async def _exec(
        self,
        handle: SandboxHandle,
        argv: builtins.list[str],
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109 - bounded by the runner socket
        workdir: str | None,
    ) -> ExecResult:
        rs = self._runners.get(handle.container_id)
        if rs is not None and handle.container_id in self._triggered:
            self._triggered.discard(handle.container_id)
            with contextlib.suppress(TimeoutError):  # its runner is starting: worth a moment
                async with asyncio.timeout(TRIGGERED_WAIT):
                    await rs.connected.wait()
        if rs is not None and rs.ready:
            marker = secrets.token_hex(12)
            result = await rs.run(argv, env, stdin, timeout, workdir, f"{EXEC_MARKER_ENV}={marker}")
            if result is RUNNER_LOST:
                await self._after_lost(handle)
            if result is not None:
                if result.timed_out:
                    user = self._users.get(handle.container_id, "")
                    await self.ops.kill_marked(handle, user, f"{EXEC_MARKER_ENV}={marker}")
                return result
        # the hook, not `exec`: this backend's own `exec` judges the result (R7), once
        return await self.inner._exec(handle, argv, env, stdin, timeout, workdir)

    async def _after_lost(self, handle: SandboxHandle) -> None:
        """A runner lost mid-command: if the engine is gone too (its containers with it),
        raise `EngineUnavailable` as an exec cut off by it would (R7: the turn waits for
        the engine and runs again); if the engine answers, the sandbox only hurt itself."""
        with contextlib.suppress(SandboxNotFound):
            await self.inner.inspect(handle.name)

    async def _ensure(self, spec: SandboxSpec) -> SandboxHandle:
        return await self.inner.ensure(spec)

    async def verify(self, spec: SandboxSpec, handle: SandboxHandle) -> None:
        await self.inner.verify(spec, handle)

    async def inspect(self, name: str) -> ObservedContainer:
        return await self.inner.inspect(name)

    async def remove(self, name: str) -> None:
        await self.inner.remove(name)

    async def list(self, labels: Mapping[str, str]) -> builtins.list[SandboxInfo]:
        return await self.inner.list(labels)

    async def image_facts(self, image: str) -> ImageFacts:
        return await self.inner.image_facts(image)

    async def probe(
        self,
        runtime: str | None,
        image: str,
        argv: Sequence[str],
        *,
        run_id: str,
        timeout: float,  # noqa: ASYNC109
    ) -> ExecResult:
        return await self.inner.probe(runtime, image, argv, run_id=run_id, timeout=timeout)

    async def close(self) -> None:
        for cid in builtins.list(self._runners):
            await self._close(cid)
        with self._prebound_lock:
            prebound = builtins.list(self._prebound.values())
            self._prebound.clear()
        for rs in prebound:
            rs.close_now()
