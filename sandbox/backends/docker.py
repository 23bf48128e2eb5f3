"""The Docker engine backend: one hardened container per conversation (S1-S5).

The Docker SDK is synchronous. Every call runs on the backend's own worker
threads, under a bounded limiter, so the event loop never blocks and a burst of
long commands cannot starve the short control calls (create, inspect, remove):
those two kinds have separate pools. Docker errors are translated here, once,
into cellgate's own errors.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import math
import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import docker.types
import requests.exceptions

from cellgate.errors import EngineUnavailable, ImageError, SandboxError, SandboxSpent
from sandbox.backends.base import (
    ExecResult,
    ImageFacts,
    SandboxBackend,
    SandboxHandle,
    SandboxInfo,
    SandboxNotFound,
)
from sandbox.backends.engine_http import EngineHTTP, EngineRef
from sandbox.mountplan import EntryKind, MountPlan, identity
from sandbox.spec import (
    DEFAULT_UID,
    LABEL_GATEWAY,
    LABEL_SPEC_HASH,
    SandboxSpec,
    host_config,
    tmpfs_options,
)
from sandbox.verify import ObservedContainer, ObservedMount

logger = logging.getLogger(__name__)

T = TypeVar("T")

CONTROL_CONCURRENCY = 8
EXEC_CONCURRENCY = 16
OUTPUT_CAP = 1024 * 1024
USER_CACHE_MAX = 4096
KEEPALIVE_COMMAND = ("sleep", "infinity")
EXEC_MARKER_ENV = "CELLGATE_EXEC"
# In-sandbox `timeout` sends SIGKILL this long after SIGTERM; the gateway itself
# stops waiting `HOST_GRACE` seconds after the deadline, whatever the sandbox does.
KILL_AFTER = 2
HOST_GRACE = 3.0

DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
LABEL_PROBE = "io.cellgate.probe"
# What the engine prints (exit 126) when the runtime cannot start an exec's process.
# How an exec says its command never started: the runtime could not start our
# `timeout` wrapper (126), or the wrapper could not fork the command (125).
_NEVER_STARTED = {126: b"OCI runtime exec failed", 125: b"timeout: fork system call failed"}

_STREAM_HEADER = struct.Struct(">BxxxL")
_KILL_MARKED = (
    'for p in /proc/[0-9]*; do grep -qzxF "$1" "$p/environ" 2>/dev/null'
    ' && kill -KILL "${p#/proc/}" 2>/dev/null; done; exit 0'
)


class DockerBackend(SandboxBackend):
    """Sandboxes as Docker containers. The backend owns (and closes) its client."""

    def __init__(
        self,
        client: docker.DockerClient,
        *,
        control_concurrency: int = CONTROL_CONCURRENCY,
        exec_concurrency: int = EXEC_CONCURRENCY,
        output_cap: int = OUTPUT_CAP,
    ) -> None:
        self._client = client
        self._engine = EngineHTTP.for_client(client)
        self._output_cap = output_cap
        self._control_pool = ThreadPoolExecutor(control_concurrency, "cellgate-docker")
        self._exec_pool = ThreadPoolExecutor(exec_concurrency, "cellgate-docker-exec")
        self._control_limit = asyncio.Semaphore(control_concurrency)
        self._exec_limit = asyncio.Semaphore(exec_concurrency)
        self._users: dict[str, str] = {}

    @classmethod
    def from_env(cls, **kwargs: Any) -> DockerBackend:
        """Connect as the `docker` CLI would (DOCKER_HOST, the default socket)."""
        pool = kwargs.get("control_concurrency", CONTROL_CONCURRENCY) + kwargs.get(
            "exec_concurrency", EXEC_CONCURRENCY
        )
        _probe_unix_socket(os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST)
        try:
            client = docker.from_env(max_pool_size=pool)
        except docker.errors.DockerException as exc:
            raise EngineUnavailable(str(exc)) from exc
        try:
            client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            client.close()
            raise EngineUnavailable(str(exc)) from exc
        return cls(client, **kwargs)

    async def close(self) -> None:
        """Close the client and the worker threads."""
        self._client.close()
        if self._engine is not None:
            self._engine.close()
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        self._exec_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def engine_ref(self) -> EngineRef | None:
        """The engine's unix socket for another process's lean GETs (F3); None when the
        engine is reached some other way."""
        return self._engine.ref if self._engine is not None else None

    # -- the boundary ------------------------------------------------------

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run a blocking SDK call on a control thread; translate engine failures."""
        async with self._control_limit:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._control_pool, _translated, what, fn)

    # -- contract ----------------------------------------------------------

    async def _ensure(self, spec: SandboxSpec) -> SandboxHandle:
        handle, user = await self._call(f"ensure {spec.name}", lambda: self._ensure_sync(spec))
        self._remember_user(handle.container_id, user)
        return handle

    def _remember_user(self, container_id: str, user: str) -> None:
        """A small cache: a container's user never changes, but containers come and go."""
        if len(self._users) >= USER_CACHE_MAX:
            self._users.clear()
        self._users[container_id] = user

    async def inspect(self, name: str) -> ObservedContainer:
        return await self._call(f"inspect {name}", lambda: self._inspect_sync(name))

    async def remove(self, name: str) -> None:
        await self._call(f"remove {name}", lambda: self._remove_sync(name))

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        return await self._call("list sandboxes", lambda: self._list_sync(labels))

    async def image_facts(self, image: str) -> ImageFacts:
        return await self._call(f"inspect image {image}", lambda: self._image_facts_sync(image))

    async def _exec(
        self,
        handle: SandboxHandle,
        argv: builtins.list[str],
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109 - the contract's hook; bounded in the worker
        workdir: str | None,
    ) -> ExecResult:
        user = self._users.get(handle.container_id)
        if user is None:
            user = await self._call(
                f"inspect {handle.name}", lambda: self._container_user(handle.container_id)
            )
            self._remember_user(handle.container_id, user)
        job = _ExecJob(handle.container_id, user, argv, env, stdin, timeout, workdir)
        async with self._exec_limit:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(
                self._exec_pool,
                _translated,
                f"exec in {handle.name}",
                lambda: self._exec_sync(job),
            )
        if result.timed_out:
            logger.info("exec in %s timed out after %.1fs", handle.name, timeout)
        return result

    # -- blocking implementations (run on worker threads) -----------------

    def _lookup(self, name: str) -> dict[str, Any] | None:
        """The container's inspect document, or None when the engine says it does not exist."""
        if self._engine is not None:  # one kept connection per thread (F3)
            return self._engine.inspect(name)
        try:
            attrs: dict[str, Any] = self._client.api.inspect_container(name)
        except docker.errors.NotFound:
            return None
        return attrs

    def _ensure_sync(self, spec: SandboxSpec) -> tuple[SandboxHandle, str]:
        want = spec.spec_hash()
        attrs = self._reuse_or_clear(spec, want)
        if attrs is None:
            attrs = self._create_sync(spec)
        if attrs is None:  # another caller created it between our look and our create
            attrs = self._reuse_or_clear(spec, want) or self._create_sync(spec)
        if attrs is None:
            raise SandboxError(f"{spec.name} keeps being created by someone else; retry")
        return SandboxHandle(spec.name, attrs["Id"], want), attrs["Config"]["User"]

    def _reuse_or_clear(self, spec: SandboxSpec, want: str) -> dict[str, Any] | None:
        """The existing container if it is fresh (started if stopped); else remove it."""
        attrs = self._lookup(spec.name)
        if attrs is None:
            return None
        labels = attrs["Config"].get("Labels") or {}
        if labels.get(LABEL_GATEWAY, "") != spec.gateway:
            # R1: a name this gateway did not make (e.g. another gateway's `<app>-agent`)
            raise SandboxError(f"{spec.name} exists and belongs to another gateway; not touched")
        if labels.get(LABEL_SPEC_HASH) != want:
            logger.info("sandbox %s is stale; recreating it", spec.name)
            self._remove_sync(spec.name)
            return None
        if not attrs["State"]["Running"]:
            # Dead (OOM, a crashed gVisor sentry, killed by hand): a restart may
            # come back half-broken, so start over; the mounts keep the memory.
            logger.warning(
                "sandbox %s is not running (%s); recreating it", spec.name, _death(attrs["State"])
            )
            self._remove_sync(spec.name)
            return None
        return attrs

    def _create_sync(self, spec: SandboxSpec) -> dict[str, Any] | None:
        """Create and start the container; None when the name was taken meanwhile."""
        logger.info("creating sandbox %s", spec.name, extra={"conversation": spec.conversation})
        try:
            container = self._client.containers.create(**create_kwargs(spec))
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                return None
            raise
        cid = container.id or spec.name
        try:
            for net in spec.networks[1:]:
                self._client.api.connect_container_to_network(cid, net)
            container.start()
        except BaseException:
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)
            raise
        attrs = self._lookup(cid)
        if attrs is None:
            raise SandboxNotFound(spec.name)
        return attrs

    def _inspect_sync(self, name: str) -> ObservedContainer:
        attrs = self._lookup(name)
        if attrs is None:
            raise SandboxNotFound(name)
        return observe(attrs)

    def _remove_sync(self, name: str) -> None:
        try:
            self._client.api.remove_container(name, force=True, v=True)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if exc.status_code == 409 and "already in progress" in str(exc):
                return
            raise

    def _list_sync(self, labels: Mapping[str, str]) -> builtins.list[SandboxInfo]:
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        rows = self._client.api.containers(all=True, filters=filters)
        return [
            SandboxInfo(
                name=row["Names"][0].lstrip("/") if row.get("Names") else row["Id"],
                container_id=row["Id"],
                labels=dict(row.get("Labels") or {}),
                running=row.get("State") == "running",
            )
            for row in rows
        ]

    def _image_facts_sync(self, image: str) -> ImageFacts:
        try:
            attrs = self._client.images.get(image).attrs
        except docker.errors.NotFound as exc:
            raise ImageError(
                image, "the engine does not have it; build or load it first (`docker images`)"
            ) from exc
        config = attrs.get("Config") or {}
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in config.get("Env") or [])
        return ImageFacts(id=attrs["Id"], user=config.get("User") or "", env=env)

    def _container_user(self, container_id: str) -> str:
        attrs = self._lookup(container_id)
        if attrs is None:
            raise SandboxNotFound(container_id)
        user: str = attrs["Config"]["User"]
        return user

    def _exec_sync(self, job: _ExecJob) -> ExecResult:
        api = self._client.api
        marker = secrets.token_hex(12)
        env = {**job.env, EXEC_MARKER_ENV: marker}
        try:
            created = api.exec_create(
                job.container_id,
                job.wrapped_argv(),
                stdin=job.stdin is not None,
                user=job.user,
                environment=env,
                workdir=job.workdir,
            )
        except docker.errors.NotFound as exc:
            raise SandboxNotFound(job.container_id) from exc
        exec_id: str = created["Id"]
        started = time.monotonic()
        host_deadline = started + job.timeout + KILL_AFTER + HOST_GRACE
        with _exec_stream(api, exec_id) as (reader, sock):
            out = _pump(reader, sock, job.stdin, host_deadline, self._output_cap)
        if out.deadline_hit:
            self._kill_marked(job, marker)
            return ExecResult(-1, bytes(out.stdout), bytes(out.stderr), timed_out=True)
        code = self._exit_code(exec_id)
        said = _NEVER_STARTED.get(code) if code is not None else None
        if said is not None and said in bytes(out.stdout) + bytes(out.stderr):
            # No process could start in it (its pids are exhausted, its gVisor sentry
            # is wedged): the sandbox is spent and nothing of the command ran.
            logger.warning(
                "sandbox %s cannot start processes any more; removing it", job.container_id[:12]
            )
            self._remove_sync(job.container_id)
            raise SandboxSpent
        elapsed = time.monotonic() - started
        timed_out = elapsed >= job.timeout and code in (124, 137)
        if timed_out:
            self._kill_marked(job, marker)
        return ExecResult(code, bytes(out.stdout), bytes(out.stderr), timed_out=timed_out)

    def _exit_code(self, exec_id: str) -> int:
        """The exec's exit code; the engine may need a moment after the stream closes."""
        for _ in range(50):
            info = self._client.api.exec_inspect(exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                code: int = info["ExitCode"]
                return code
            time.sleep(0.05)
        raise SandboxError(f"exec {exec_id[:12]} ended its output but never reported an exit code")

    def _kill_marked(self, job: _ExecJob, marker: str) -> None:
        """Best effort: kill what escaped the in-sandbox `timeout` (it kept its marker)."""
        api = self._client.api
        try:
            created = api.exec_create(
                job.container_id,
                ["sh", "-c", _KILL_MARKED, "sh", f"{EXEC_MARKER_ENV}={marker}"],
                user=job.user,
            )
            api.exec_start(created["Id"], detach=True)
        except docker.errors.APIError as exc:
            logger.warning("could not kill a timed-out exec in %s: %s", job.container_id[:12], exc)

    # -- runtime probe (sandbox.runtime_check) -----------------------------

    async def probe(
        self,
        runtime: str | None,
        image: str,
        argv: Sequence[str],
        *,
        run_id: str,
        timeout: float,  # noqa: ASYNC109 - bounded by the engine's wait
    ) -> ExecResult:
        name = f"cellgate-probe-{run_id}"
        return await self._call(
            f"probe runtime {runtime or 'default'}",
            lambda: self._probe_sync(runtime, image, list(argv), name, run_id, timeout),
        )

    def _probe_sync(
        self,
        runtime: str | None,
        image: str,
        argv: builtins.list[str],
        name: str,
        run_id: str,
        timeout: float,
    ) -> ExecResult:
        """A sandbox's hardening (no mounts, no network), `argv` as its command; always removed."""
        spec = SandboxSpec(
            name=name,
            image=image,
            image_id=image,
            user=f"{DEFAULT_UID}:{DEFAULT_UID}",
            env={},
            networks=(),
            plan=MountPlan(()),
            runtime=runtime,
            workdir="/",
        )
        kwargs = {
            **create_kwargs(spec),
            "command": argv,
            "labels": {LABEL_PROBE: run_id},
            # the probe's verdict is its output: a small readable log, removed with it
            "log_config": {"Type": "json-file", "Config": {"max-size": "64k", "max-file": "1"}},
        }
        try:
            container = self._client.containers.create(**kwargs)
            container.start()
            try:
                status = container.wait(timeout=timeout)
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                if self._lookup(name) is None:
                    raise
                return ExecResult(-1, b"", b"", timed_out=True)
            cap = self._output_cap
            out = self._client.api.logs(name, stdout=True, stderr=False)[:cap]
            err = self._client.api.logs(name, stdout=False, stderr=True)[:cap]
            return ExecResult(int(status.get("StatusCode", -1)), out, err)
        finally:
            self._remove_sync(name)


def _death(state: Mapping[str, Any]) -> str:
    """Why a container stopped, from its inspect `State`, for the log."""
    parts = [f"status {state.get('Status', '?')}", f"exit {state.get('ExitCode', '?')}"]
    if state.get("OOMKilled"):
        parts.append("OOM-killed")
    if state.get("Error"):
        parts.append(f"error {str(state['Error'])[:200]!r}")
    return ", ".join(parts)


def _probe_unix_socket(host: str) -> None:
    """Fail early, and cleanly, when nothing listens on a unix DOCKER_HOST.

    docker-py leaks the socket of a failed unix connect; probing first keeps
    that (and a ResourceWarning) out of the gateway.
    """
    if not host.startswith(("unix://", "http+unix://")):
        return
    path = host.split("://", 1)[1]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect(path)
        except OSError as exc:
            raise EngineUnavailable(f"nothing answers on {path}: {exc.strerror or exc}") from exc


# -- creation ------------------------------------------------------------


def create_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    """Everything `containers.create` gets; nothing the spec and plan do not ask for (S2, S3).

    The limits and settings come from `host_config`, the same record the pre-turn
    check compares the running container with (R5).
    """
    host = host_config(spec)
    mounts = [
        docker.types.Mount(
            m.target, m.source, type="bind", read_only=m.read_only, propagation="rprivate"
        )
        for m in spec.plan.mounts
    ]
    kwargs: dict[str, Any] = {
        "image": spec.image_id,
        "command": list(KEEPALIVE_COMMAND),
        "name": spec.name,
        "user": spec.user,
        "environment": {**spec.env, "HOME": spec.home},
        "working_dir": spec.workdir,
        "labels": spec.labels(),
        "init": True,
        "cap_drop": ["ALL"],
        "security_opt": list(host.security_opt),
        "read_only": True,
        "tmpfs": dict(host.tmpfs),
        "mounts": mounts,
        "pids_limit": host.pids_limit,
        "ulimits": [docker.types.Ulimit(name=n, soft=s, hard=h) for n, s, h in host.ulimits],
        "mem_limit": host.memory,
        "memswap_limit": host.memory_swap,
        "nano_cpus": host.nano_cpus,
        "log_config": docker.types.LogConfig(type=host.log_driver),
        "cgroupns": host.cgroupns_mode,
        "ipc_mode": "private",
        "restart_policy": {"Name": "no"},
        "detach": True,
    }
    if spec.runtime:
        kwargs["runtime"] = spec.runtime
    if spec.networks:
        kwargs["network"] = host.network_mode
    else:
        kwargs["network_mode"] = host.network_mode
    return kwargs


# -- observation ---------------------------------------------------------


def _bind_identity(source: str) -> tuple[EntryKind, int, int] | None:
    try:
        return identity(Path(source))
    except FileNotFoundError:
        return None


def observe(attrs: Mapping[str, Any]) -> ObservedContainer:
    """What the engine reports about a container, plus an `lstat` of each bind source."""
    host = attrs.get("HostConfig") or {}
    config = attrs.get("Config") or {}
    log = host.get("LogConfig") or {}
    mounts = tuple(
        ObservedMount(
            type=m.get("Type", ""),
            source=m.get("Source", ""),
            target=m.get("Destination", ""),
            read_write=bool(m.get("RW")),
            identity=_bind_identity(m["Source"]) if m.get("Type") == "bind" else None,
        )
        for m in attrs.get("Mounts") or []
    )
    return ObservedContainer(
        name=str(attrs.get("Name", "")).lstrip("/"),
        id=attrs["Id"],
        image_id=attrs.get("Image", ""),
        labels=dict(config.get("Labels") or {}),
        user=config.get("User") or "",
        mounts=mounts,
        tmpfs=tuple(sorted((host.get("Tmpfs") or {}).keys())),
        cap_add=tuple(host.get("CapAdd") or ()),
        cap_drop=tuple(host.get("CapDrop") or ()),
        privileged=bool(host.get("Privileged")),
        readonly_rootfs=bool(host.get("ReadonlyRootfs")),
        security_opt=tuple(host.get("SecurityOpt") or ()),
        network_mode=host.get("NetworkMode") or "",
        pid_mode=host.get("PidMode") or "",
        ipc_mode=host.get("IpcMode") or "",
        devices=len(host.get("Devices") or ()),
        runtime=host.get("Runtime") or "",
        running=bool((attrs.get("State") or {}).get("Running")),
        pids_limit=host.get("PidsLimit"),
        memory=int(host.get("Memory") or 0),
        memory_swap=int(host.get("MemorySwap") or 0),
        nano_cpus=int(host.get("NanoCpus") or 0),
        ulimits=tuple(
            (str(u.get("Name")), int(u.get("Soft", -1)), int(u.get("Hard", -1)))
            for u in host.get("Ulimits") or ()
        ),
        tmpfs_options=dict(host.get("Tmpfs") or {}),
        networks=tuple(sorted((attrs.get("NetworkSettings") or {}).get("Networks") or {})),
        apparmor_profile=str(attrs.get("AppArmorProfile") or ""),
        log_type=str(log.get("Type") or ""),
        log_options={str(k): str(v) for k, v in (log.get("Config") or {}).items()},
        cgroupns_mode=str(host.get("CgroupnsMode") or ""),
    )


# -- exec ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ExecJob:
    container_id: str
    user: str
    argv: list[str]
    env: dict[str, str]
    stdin: bytes | None
    timeout: float
    workdir: str | None

    def wrapped_argv(self) -> list[str]:
        """The command under coreutils `timeout`, which kills its whole process group."""
        seconds = max(1, math.ceil(self.timeout))
        return ["timeout", "-k", str(KILL_AFTER), str(seconds), *self.argv]


@dataclass
class _Output:
    cap: int
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    deadline_hit: bool = False
    _pending: bytearray = field(default_factory=bytearray)
    _stream: int = 0
    _left: int = 0

    def feed(self, data: bytes) -> None:
        """Demultiplex Docker's framed stream; keep at most `cap` bytes of each output."""
        view = memoryview(data)
        while view:
            if self._left == 0:
                need = _STREAM_HEADER.size - len(self._pending)
                self._pending += view[:need]
                view = view[need:]
                if len(self._pending) == _STREAM_HEADER.size:
                    self._stream, self._left = _STREAM_HEADER.unpack(self._pending)
                    self._pending.clear()
                continue
            chunk, view = view[: self._left], view[self._left :]
            self._left -= len(chunk)
            target = self.stderr if self._stream == 2 else self.stdout
            room = self.cap - len(target)
            if room > 0:
                target += chunk[:room]


@contextlib.contextmanager
def _exec_stream(api: Any, exec_id: str) -> Iterator[tuple[Any, socket.socket]]:
    """Start the exec attached; yield its buffered reader and the raw socket, closed after.

    The reader matters: bytes the HTTP layer read past the 101 headers sit in its
    buffer, not in the socket.
    """
    response = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    try:
        api._raise_for_status(response)
        reader = response.raw._fp.fp
        raw = reader.raw
        sock: socket.socket = getattr(raw, "_sock", raw)
        if not isinstance(sock, socket.socket):
            raise SandboxError("exec needs a unix or tcp Docker connection (not ssh)")
        sock.setblocking(False)
        try:
            yield reader, sock
        finally:
            response.close()
            sock.close()
    finally:
        response.close()


def _pump(
    reader: Any, sock: socket.socket, stdin: bytes | None, deadline: float, cap: int
) -> _Output:
    """Write stdin and read output until the stream ends or the deadline passes."""
    out = _Output(cap)
    pending = memoryview(stdin) if stdin is not None else None
    if pending is not None and not pending:
        sock.shutdown(socket.SHUT_WR)
        pending = None
    while True:
        data = reader.read1(65536)
        if data:
            out.feed(data)
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            out.deadline_hit = True
            return out
        wlist = [sock] if pending is not None else []
        readable, writable, _ = select.select([sock], wlist, [], min(remaining, 1.0))
        if writable and pending is not None:
            pending = _send_some(sock, pending)
        if readable:
            data = reader.read1(65536)
            if not data:
                return out
            out.feed(data)


def _send_some(sock: socket.socket, pending: memoryview) -> memoryview | None:
    """Send what the socket takes; half-close once stdin is all written (the process sees EOF)."""
    try:
        sent = sock.send(pending[:65536])
    except BlockingIOError:
        return pending
    except (BrokenPipeError, ConnectionResetError):
        return None  # the process closed its stdin; its output still arrives
    rest = pending[sent:]
    if rest:
        return rest
    sock.shutdown(socket.SHUT_WR)
    return None


# -- error translation ----------------------------------------------------


def _translated(what: str, fn: Callable[[], T]) -> T:
    """Run `fn`; an unreachable engine or a daemon error becomes a cellgate error."""
    try:
        return fn()
    except SandboxError:
        raise
    except docker.errors.APIError as exc:  # before RequestException: it is an HTTPError
        raise SandboxError(f"{what}: the Docker engine refused: {exc.explanation or exc}") from exc
    except requests.exceptions.RequestException as exc:
        raise EngineUnavailable(f"{what}: {exc}") from exc
    except docker.errors.DockerException as exc:
        raise EngineUnavailable(f"{what}: {exc}") from exc
    except OSError as exc:
        raise SandboxError(f"{what}: {exc}") from exc


__all__ = ["DockerBackend", "create_kwargs", "observe", "tmpfs_options"]
