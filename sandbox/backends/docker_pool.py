"""The Docker side of the warm pool (F1): create a pooled sandbox, check a claimed one.

Every call runs on the backend's control threads, under its limiter (F3: the
event loop never blocks). A claim (`claim_side`: the plan bound into the slot,
then the sandbox checked) takes plain values (`ClaimJob`) and inspects through
a function it is given, so that the gateway's host worker can run it in another
process (`orchestrator.host_worker`); `claim_here` runs it on a control thread.
A pooled sandbox is `create_kwargs` of its pooled spec with its slot mounts
`rslave`: what the host binds under the slot later appears inside, nothing
flows back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import docker.types

from cellgate.errors import MountVerificationFailed, SandboxError
from sandbox.backends.base import SandboxHandle, SandboxNotFound
from sandbox.backends.docker import DockerBackend, _ExecJob, _translated, create_kwargs, observe
from sandbox.backends.engine_http import EngineRef
from sandbox.latebind import CLAIM_FIFO, INIT_NAME, LateBinder, Slot
from sandbox.mountplan import BRIDGE, MountPlan
from sandbox.pool import read_view, view_violations
from sandbox.runner_client import (
    CODE_FD,
    NATIVE_NAME,
    RUNNER_CODE_NAME,
    RUNNER_NAME,
    SOURCE_FD,
    runner_fd_loader,
    runner_loader,
)
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer, violations

T = TypeVar("T")

SUPPORTED_RUNTIMES = (None, "runc")
RUNNER_ARGV = ("python3", "-I", "-S", "-c", runner_loader(str(BRIDGE)))
NATIVE_ARGV = (f"{BRIDGE}/{NATIVE_NAME}",)
POOL_RUNNER_ARGV = ("python3", "-I", "-S", "-c", runner_fd_loader())
# the native runner from its descriptor, named (its command line is the descriptor's path)
POOL_NATIVE_ARGV = (f"/proc/self/fd/{CODE_FD}", RUNNER_NAME)
# A pooled sandbox's first process: it opens the runner its slot holds (none
# when the resident runner is off: nothing then triggers it), the native one or the
# Python one's code and source, waits (reading the slot's claim FIFO, no CPU) until
# its claim is complete, runs the resident runner from those descriptors (the claim's
# bind hides the slot's files), and keeps the sandbox alive if the runner ends.
_NATIVE = f"{BRIDGE}/{NATIVE_NAME}"
_CODE, _SOURCE = f"{BRIDGE}/{RUNNER_CODE_NAME}", f"{BRIDGE}/{RUNNER_NAME}"
_OPEN = (
    f"r=; if [ -r {_NATIVE} ]; then exec {CODE_FD}< {_NATIVE} && r=n; "
    f"elif [ -r {_CODE} ]; then exec {CODE_FD}< {_CODE} {SOURCE_FD}< {_SOURCE} && r=p; fi; "
)
_WAIT = f"read _ < {BRIDGE}/{CLAIM_FIFO}; "


def _run(flag: str) -> str:
    """The runner its slot held (`flag`: n native, p Python, empty none), then the
    keep-alive."""
    return (
        f'case "{flag}" in n) {shlex.join(POOL_NATIVE_ARGV)};; '
        f"p) {shlex.join(POOL_RUNNER_ARGV)};; esac 2>/dev/null; "
        f"exec {CODE_FD}<&- {SOURCE_FD}<&- sleep infinity"
    )


POOL_COMMAND = ("/bin/sh", "-c", _OPEN + _WAIT + _run("$r"))
# The same, created without the engine's init when the slot holds one (F1, idle
# memory): the waiting shell is PID 1 alone, and at its claim it execs the init
# (as PID 1, as `--init` runs it) with the rest as its child.
INIT_FD = 5
POOL_COMMAND_OWN_INIT = (
    "/bin/sh",
    "-c",
    f"{_OPEN}exec {INIT_FD}< {BRIDGE}/{INIT_NAME}; {_WAIT}"
    f"exec /proc/self/fd/{INIT_FD} -- /bin/sh -c "
    f'{shlex.quote(f"exec {INIT_FD}<&-; " + _run("$1"))} sh "$r"',
)
# How long a new pooled sandbox's first shell may take to wait on its claim FIFO
WAITING_TIMEOUT = 10.0


def _pid(attrs: Mapping[str, Any]) -> int:
    """The host pid of the sandbox's first process, 0 when it is not running."""
    return int((attrs.get("State") or {}).get("Pid") or 0)


def _wait_claimable(name: str, pid: int) -> None:
    """Until the sandbox's first shell waits on its claim FIFO (it has opened what it
    runs from the slot): a claim's bind over the slot before that would leave it
    nothing to open. Read from the host, in the shell's `/proc/<pid>/fd`."""
    fifo = f"{BRIDGE}/{CLAIM_FIFO}"
    deadline = time.monotonic() + WAITING_TIMEOUT
    while pid > 0:
        if any(fifo in _open_files(p) for p in (pid, *_children(pid))):  # under --init: a child
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    raise SandboxError(f"pooled sandbox {name} did not start waiting for its claim")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _open_files(pid: int) -> set[str]:
    """What process `pid` has open, as paths in its own mount namespace."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


@functools.cache
def engine_init() -> Path | None:
    """The engine's init binary on this host (tini, what `--init` runs), if it runs here.

    A pool copies it into its slots (`LateBinder(init=...)`); None: the engine's `--init`."""
    for candidate in (shutil.which("docker-init"), "/usr/libexec/docker/docker-init"):
        if not candidate:
            continue
        try:
            done = subprocess.run(
                [candidate, "--version"], capture_output=True, timeout=5, check=False
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0 and done.stdout.startswith(b"tini version"):
            return Path(os.path.realpath(candidate))
    return None


def late_bind_refusal(runtime: str | None) -> str | None:
    """Why sandboxes of `runtime` cannot be late-bound here, or None.

    Under gVisor the sentry serves a late mount as part of the read-only slot
    mount above it and the host cannot read the sandbox's own mount table, so
    what a claim bound could not be checked: those conversations start cold.
    """
    if runtime in SUPPORTED_RUNTIMES:
        return None
    return f"runtime {runtime!r} cannot take late-bound mounts that the gateway can verify"


class DockerPoolOps:
    """Pool operations on a `DockerBackend`'s client and threads."""

    def __init__(self, backend: DockerBackend) -> None:
        self.backend = backend

    async def create(self, spec: SandboxSpec, *, own_init: bool = False) -> SandboxHandle:
        """Create and start the pooled sandbox of `spec`, verified (S2, R5); removed on failure.

        `own_init`: its slot holds the init it execs at claim (`POOL_COMMAND_OWN_INIT`)."""
        handle = await self.backend._call(
            f"create pooled {spec.name}", lambda: self._create(spec, own_init)
        )
        self.backend._remember_user(handle.container_id, spec.user)

        def verify() -> list[str]:  # one lookup: checked, then waiting for its claim
            attrs = self._attrs(handle)
            found = claimed_violations(spec, handle, None, attrs)
            if not found:
                _wait_claimable(handle.name, _pid(attrs))
            return found

        try:
            found = await self.backend._call(f"verify pooled {handle.name}", verify)
            if found:
                raise MountVerificationFailed(handle.name, found)
        except SandboxError:  # MountVerificationFailed too
            await self.backend.remove(handle.name)
            raise
        return handle

    def _create(self, spec: SandboxSpec, own_init: bool) -> SandboxHandle:
        kwargs: dict[str, Any] = create_kwargs(spec)
        kwargs["command"] = list(POOL_COMMAND_OWN_INIT if own_init else POOL_COMMAND)
        kwargs["init"] = not own_init
        kwargs["mounts"] = [
            docker.types.Mount(
                m.target, m.source, type="bind", read_only=m.read_only, propagation="rslave"
            )
            for m in spec.plan.mounts
        ]
        client = self.backend._client
        container = client.containers.create(**kwargs)
        cid = container.id or spec.name
        try:
            for net in spec.networks[1:]:
                client.api.connect_container_to_network(cid, net)
            container.start()
        except BaseException:
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)
            raise
        return SandboxHandle(spec.name, cid, spec.spec_hash())

    async def exists(self, name: str) -> bool:
        """Whether a container of that name exists (a conversation's own, from before)."""
        attrs = await self.backend._call(f"look up {name}", lambda: self.backend._lookup(name))
        return attrs is not None

    async def launch(self, handle: SandboxHandle, user: str, argv: list[str]) -> None:
        """Start `argv` detached in the sandbox as `user` (its resident runner, F2)."""

        def start() -> None:
            api = self.backend._client.api
            created = api.exec_create(handle.container_id, argv, user=user)
            api.exec_start(created["Id"], detach=True)

        await self.backend._call(f"start the runner in {handle.name}", start)

    async def kill_marked(self, handle: SandboxHandle, user: str, marker: str) -> None:
        """Kill what a runner's timed-out command left, by its exec marker (as exec does)."""
        job = _ExecJob(handle.container_id, user, [], {}, None, 0.0, None)
        await self.backend._call(
            f"kill in {handle.name}", lambda: self.backend._kill_marked(job, marker)
        )

    async def check(self, spec: SandboxSpec, handle: SandboxHandle, plan: MountPlan | None) -> None:
        """S4, R5: the engine's view against the pooled spec, and (with `plan`) the
        sandbox's own mount table against the conversation's plan, by device and inode."""
        found = await self.backend._call(
            f"verify pooled {handle.name}", lambda: self._violations(spec, handle, plan)
        )
        if found:
            raise MountVerificationFailed(handle.name, found)

    def claim_job(
        self,
        spec: SandboxSpec,
        handle: SandboxHandle,
        plan: MountPlan,
        binder_root: Path,
        slot: Slot,
    ) -> ClaimJob:
        """The claim of `handle` (created from `spec`) for `plan`, as plain values."""
        return ClaimJob(binder_root, slot, spec, handle, plan, self.backend.engine_ref)

    async def claim_here(self, job: ClaimJob) -> list[str]:
        """`claim_side` in this process, on a control thread (no host worker to run it)."""
        return await self.backend._call(
            f"claim {job.handle.name}", lambda: claim_side(job, self.backend._lookup)
        )

    def _attrs(self, handle: SandboxHandle) -> Mapping[str, Any]:
        attrs = self.backend._lookup(handle.container_id)
        if attrs is None:
            raise SandboxNotFound(handle.name)
        return attrs

    def _violations(
        self, spec: SandboxSpec, handle: SandboxHandle, plan: MountPlan | None
    ) -> list[str]:
        return claimed_violations(spec, handle, plan, self._attrs(handle))


@dataclass(frozen=True, slots=True)
class ClaimJob:
    """A claim's host side, as plain values (it runs in the host worker, F3): `plan`
    bound into the pooled sandbox's `slot` (of the binder at `binder_root`), then the
    sandbox (created from `spec`) checked against it. `engine`: where to inspect it
    from another process (None: only from the backend's own client)."""

    binder_root: Path
    slot: Slot
    spec: SandboxSpec
    handle: SandboxHandle
    plan: MountPlan
    engine: EngineRef | None


def claim_side(job: ClaimJob, lookup: Callable[[str], Mapping[str, Any] | None]) -> list[str]:
    """Bind the plan into the slot (S3), then every way the sandbox differs from its
    pooled spec and the plan (S4, R5: the engine's view, and its own mount table by
    device and inode); empty when the claim may go on. Blocking; `lookup` inspects."""

    def claim() -> list[str]:
        LateBinder(job.binder_root).bind_plan(job.slot, job.plan)
        attrs = lookup(job.handle.container_id)
        if attrs is None:
            raise SandboxNotFound(job.handle.name)
        return claimed_violations(job.spec, job.handle, job.plan, attrs)

    return _translated(f"claim {job.handle.name}", claim)


def claimed_violations(
    spec: SandboxSpec, handle: SandboxHandle, plan: MountPlan | None, attrs: Mapping[str, Any]
) -> list[str]:
    """The sandbox inspected as `attrs` against its pooled `spec` (S2, R5) and, with
    `plan`, its own mount table against the conversation's plan (S3, S4)."""
    observed = observe(attrs)
    if plan is not None:
        observed = _claimed_view(spec, observed, plan)
    found = violations(spec, observed)
    if not observed.running:
        found.append("the sandbox is not running")
    if plan is not None and not found:
        try:
            found += view_violations(plan, read_view(_pid(attrs), plan))
        except OSError as exc:
            raise SandboxError(f"cannot read {handle.name}'s mounts: {exc}") from exc
    return found


def _claimed_view(
    spec: SandboxSpec, observed: ObservedContainer, plan: MountPlan
) -> ObservedContainer:
    """The host sees a slot directory through the bind a claim put on top of it: such a
    slot mount counts as the slot itself iff it shows exactly the planned source."""
    slots = spec.plan.by_target()
    planned = plan.by_target()
    mounts = []
    for m in observed.mounts:
        slot, want = slots.get(m.target), planned.get(m.target)
        if (
            slot is not None
            and want is not None
            and m.source == slot.source
            and m.identity == (want.kind, want.dev, want.ino)
        ):
            m = dataclasses.replace(m, identity=(slot.kind, slot.dev, slot.ino))
        mounts.append(m)
    return dataclasses.replace(observed, mounts=tuple(mounts))
