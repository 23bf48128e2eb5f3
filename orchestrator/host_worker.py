"""The host worker: a conversation's sandbox host side in a helper process (F3).

A new conversation's host side (`orchestrator.host_side`: its quota image taken
and bound, its dirs made, its mounts planned) is some 160 short system calls.
On the host lane each one hands Python's interpreter lock to the event loop,
the store's lane and the engine threads and waits to get it back, so 64 new
conversations at once queued behind it. Here it runs in a process of its own,
with its own interpreter lock, on a core the gateway's one lock leaves idle:
the host lane only sends the request (one system call), and the caller's
event loop gets the reply from a reader thread.

The worker is `python -m orchestrator.host_worker FD LEVEL NAME [MODULE...]`, started by the
gateway (as the same user, with a minimal environment) and reached over a
private socket pair, never a path a sandbox could reach. Frames are a 4-byte
length and a pickle, both ends this same code; a request carries an id, and
its reply the same. It runs only `host_side` and pool claims
(`sandbox.backends.docker_pool.claim_side`: the binds into a slot, the
engine's inspect over its unix socket, the checks), one request after the
other in the order sent, with quota objects of its own: every take of a spare
and every bind is under the same file locks as in the gateway
(`sandbox.quota.locked`), so the two never step on each other. The gateway
runs two: `WORKER` for host sides and `CLAIMER` for claims, so that a burst's
claims do not queue behind its host sides.
Its log records come back over the socket and are logged by the gateway's
own loggers; an error comes back as the same exception (class, message and
attributes). When the worker cannot be started, dies, sends garbage or
answers nothing for `REPLY_TIMEOUT` while asked, the gateway kills it, says so
in the log, and runs `host_side` itself on the host lane (it is idempotent:
the requests in flight too) until `RETRY_AFTER` has passed; a claim in flight
fails instead (it is not idempotent: a slot may be half bound), and new ones
run on an engine thread meanwhile. The worker ends when the gateway closes its
end (or dies).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellgate.errors import CellgateError, SandboxError
from orchestrator.host_side import HostJob, Quotas, host_side, quota_ref
from orchestrator.lane import in_host_lane
from orchestrator.spare_quota import SparedQuota
from sandbox.mountplan import MountPlan
from sandbox.quota import LoopQuota

if TYPE_CHECKING:  # the claims' worker imports them at its first claim: a host sides'
    # worker never needs the engine's client (its memory, F1)
    from sandbox.backends.docker_pool import ClaimJob
    from sandbox.backends.engine_http import EngineHTTP, EngineRef

logger = logging.getLogger(__name__)

REPLY_TIMEOUT = 60.0  # seconds for one host side (a quick one takes milliseconds)
RETRY_AFTER = 30.0  # seconds in this process after the worker failed
ENGINES_KEPT = 4  # engine connections a worker keeps (one per engine in use)
MAX_FRAME = 16 << 20
_HEADER = struct.Struct("!I")
_PACKAGES = str(Path(__file__).resolve().parent.parent)  # where `orchestrator` is found


class Broken(Exception):
    """The worker or its socket failed (not the host side it ran)."""


class NotSent(Broken):
    """No worker to send the request to: nothing of it was done."""


def send_frame(sock: socket.socket, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> object:
    """One frame; `Broken` at end of stream, on a short or oversized frame."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise Broken(f"a {size}-byte frame")
    # a frame of this same code, from the other end of a private socket pair
    return pickle.loads(_recv_exactly(sock, size))  # noqa: S301


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise Broken("the worker closed its socket")
        got += k
    return bytes(buf)


# -- the gateway's side ----------------------------------------------------------


class HostWorker:
    """The gateway's handle on its worker process.

    A request is sent from the host lane and not waited for there: the lane sends the
    next one while the worker works, so the worker goes from one to the next without
    waiting for the gateway's interpreter lock in between. A reader thread takes the
    replies and settles each caller's future on the caller's own event loop."""

    def __init__(
        self,
        name: str = "cellgate",
        *,
        reply_timeout: float = REPLY_TIMEOUT,
        retry_after: float = RETRY_AFTER,
        preload: tuple[str, ...] = (),
    ) -> None:
        self.name = name  # on its command line, for `ps`
        self.preload = preload  # modules it imports as it starts (not at its first request)
        self.reply_timeout = reply_timeout
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[object]]] = {}
        self._ids = itertools.count()
        self._progress = 0.0  # when the worker last answered, or was first asked after that
        self._down_until = 0.0

    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def start(self) -> None:
        """Start the worker now, if none runs (it imports for a moment: ahead of the
        first new conversation). Blocking."""
        with self._lock:
            self._connected()

    async def host_side(self, quota: LoopQuota | None, job: HostJob) -> MountPlan:
        """`orchestrator.host_side.host_side`, quick, run by the worker; on the host lane
        when it cannot be. Raises what `host_side` raises (`Busy` for anything slow)."""
        ref = quota_ref(quota) if quota is not None else None
        hint = quota.known(job.agent) if isinstance(quota, SparedQuota) else ()
        try:
            answer = await self._ask(("plan", ref, job, hint))
        except Broken:  # idempotent: whatever the worker did of it is done again, the same
            return await in_host_lane(host_side, quota, job, quick=True)
        if not isinstance(answer, MountPlan):
            raise SandboxError(f"the host worker answered a {type(answer).__name__}")
        return answer

    async def claim(
        self, job: ClaimJob, here: Callable[[ClaimJob], Awaitable[list[str]]]
    ) -> list[str]:
        """`sandbox.backends.docker_pool.claim_side` run by the worker (its binds and checks
        off this process's interpreter lock, F3); by `here` when no worker runs or `job`
        cannot be inspected from another process. A worker that fails once it was sent
        the claim raises `SandboxError`: the claim may be half bound, so it is not done
        again; the pooled sandbox is retired."""
        if job.engine is None:
            return await here(job)
        try:
            answer = await self._ask(("claim", job))
        except NotSent:
            return await here(job)
        except Broken as exc:
            raise SandboxError(f"the host worker failed during a claim: {exc}") from None
        if not (isinstance(answer, list) and all(isinstance(v, str) for v in answer)):
            raise SandboxError(f"the host worker answered a {type(answer).__name__}")
        return answer

    async def _ask(self, request: tuple[object, ...]) -> object:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[object] = loop.create_future()
        await in_host_lane(self._send, request, loop, reply)
        return await reply

    def close(self) -> None:
        """Close its socket (the worker ends) and reap it. Blocking."""
        with self._lock:
            self._stop(Broken("the gateway closed the host worker"), graceful=True)

    def _send(
        self,
        request: tuple[object, ...],
        loop: asyncio.AbstractEventLoop,
        reply: asyncio.Future[object],
    ) -> None:
        with self._lock:
            sock = self._connected()
            if sock is None:
                raise NotSent("no worker")
            rid = next(self._ids)
            if not self._waiting:
                self._progress = time.monotonic()
            self._waiting[rid] = (loop, reply)
        try:  # not under the lock: the reader takes it for every reply while this waits
            send_frame(sock, (rid, *request))
        except OSError as exc:
            with self._lock:
                self._waiting.pop(rid, None)  # answered here: by this `Broken`
                if self._sock is sock:
                    self._failed(f"{type(exc).__name__}: {exc}")
            raise Broken(str(exc)) from None

    def _read(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        """The reader thread of one worker process (`sock`: its own handle on the socket,
        with a short timeout): replies to their callers, log records to the loggers; the
        worker declared failed when it breaks or stalls."""
        try:
            while True:
                try:
                    kind, rid, body = _triple(recv_frame(sock))
                except TimeoutError:
                    with self._lock:
                        stalled = self._waiting and (
                            time.monotonic() - self._progress > self.reply_timeout
                        )
                    if stalled:
                        raise Broken(f"no answer in {self.reply_timeout:g} s") from None
                    continue
                if kind == "log":
                    _relog(body)
                    continue
                with self._lock:
                    self._progress = time.monotonic()
                    waiting = self._waiting.pop(rid, None)
                if waiting is None:
                    raise Broken(f"an answer to no request ({rid})")
                if kind == "ok":
                    _settle(waiting, body, None)
                elif kind == "err":
                    _settle(waiting, None, _rebuilt(body))
                else:
                    raise Broken(f"an unknown frame {kind!r}")
        except Exception as exc:  # a broken socket, a frame that does not unpickle, ...
            with self._lock:
                if self._proc is proc:  # not one stopped or replaced meanwhile
                    self._failed(str(exc) if isinstance(exc, Broken) else repr(exc))
        finally:
            sock.close()

    def _connected(self) -> socket.socket | None:
        """The running worker's socket; a new worker when none runs (not while the last
        failure's `retry_after` lasts). Under the lock."""
        proc = self._proc
        if proc is not None and proc.poll() is None and self._sock is not None:
            return self._sock
        if proc is not None:
            self._failed(f"it exited ({proc.returncode})")
        if time.monotonic() < self._down_until:
            return None
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    str(theirs.fileno()),
                    str(_level()),
                    self.name,
                    *self.preload,
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_environment(),
                cwd="/",
            )
        except OSError as exc:
            ours.close()
            self._failed(f"it could not start: {exc}")
            return None
        finally:
            theirs.close()
        ours.settimeout(self.reply_timeout)  # a send: the worker reads no more
        reader = ours.dup()
        reader.settimeout(min(1.0, self.reply_timeout))  # it checks for a stall
        self._proc, self._sock = proc, ours
        name = f"cellgate-host-worker-{proc.pid}"
        threading.Thread(target=self._read, args=(proc, reader), name=name, daemon=True).start()
        return ours

    def _failed(self, why: str) -> None:
        """Under the lock: the worker is stopped, its callers are answered `Broken` (they run
        their host side in this process), and none is started for `retry_after`."""
        logger.warning(
            "host worker (F3): %s; the gateway runs new conversations' host side itself "
            "for %g s, then starts a new worker",
            why,
            self.retry_after,
        )
        self._stop(Broken(why))
        self._down_until = time.monotonic() + self.retry_after

    def _stop(self, why: Broken, *, graceful: bool = False) -> None:
        """The worker gone (`graceful`: given 2 s to end on its own; else killed now), then
        its callers answered `why`."""
        sock, proc = self._sock, self._proc
        self._sock = self._proc = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the reader thread's recv returns
            sock.close()
        if proc is not None:
            if not graceful:
                proc.kill()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        waiting, self._waiting = self._waiting, {}
        for w in waiting.values():
            _settle(w, None, why)


def _settle(
    waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future[object]],
    value: object,
    error: BaseException | None,
) -> None:
    """A caller's future settled on its own loop (from any thread; a closed loop's caller is
    gone)."""
    loop, fut = waiting

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)


def _triple(frame: object) -> tuple[str, int, Any]:
    if not (isinstance(frame, tuple) and len(frame) == 3 and isinstance(frame[0], str)):
        raise Broken("a frame that is not (kind, id, body)")
    return frame[0], frame[1], frame[2]


def _relog(fields: object) -> None:
    """A log record of the worker's, logged here by the logger of its name."""
    if isinstance(fields, dict):
        record = logging.makeLogRecord(fields)
        named = logging.getLogger(record.name)
        if named.isEnabledFor(record.levelno):
            named.handle(record)


def _rebuilt(body: object) -> BaseException:
    """The exception the worker's `host_side` raised."""
    if isinstance(body, tuple) and len(body) == 3 and isinstance(body[0], type):
        cls, args, attrs = body
        if issubclass(cls, CellgateError):  # its own __init__ formats: not called again
            exc: CellgateError = cls.__new__(cls)
            exc.args = tuple(args)
            exc.__dict__.update(attrs)
            return exc
    if isinstance(body, BaseException):
        return body
    return SandboxError(f"the host worker failed: {body}")


def _environment() -> dict[str, str]:
    """What the worker needs of the gateway's environment: no secrets (K1)."""
    env = {"PYTHONPATH": _PACKAGES, "PATH": os.environ.get("PATH", os.defpath)}
    for name in ("LANG", "LC_ALL", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _level() -> int:
    return logging.getLogger().getEffectiveLevel()


# -- the worker's side -----------------------------------------------------------


class _Forward(logging.Handler):
    """The worker's log records, sent to the gateway as plain fields."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(record.__dict__)
        fields["msg"], fields["args"] = record.getMessage(), None
        if record.exc_info:
            fields["exc_text"] = "".join(traceback.format_exception(*record.exc_info))
        fields["exc_info"] = None
        fields = {k: v for k, v in fields.items() if _plain(v)}
        with contextlib.suppress(OSError):  # the gateway is gone: so is the reply
            send_frame(self.sock, ("log", 0, fields))


def _plain(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _portable(exc: BaseException) -> object:
    """An exception as the gateway can rebuild it (see `_rebuilt`)."""
    if isinstance(exc, CellgateError):
        body: object = (type(exc), exc.args, dict(exc.__dict__))
    else:
        body = exc
    try:
        pickle.loads(pickle.dumps(body))  # noqa: S301 - our own, back at once
    except Exception:  # anything that does not cross is sent as text
        return f"{type(exc).__name__}: {exc}"
    return body


def serve(sock: socket.socket, run: Callable[..., object]) -> None:
    """Answer requests `(id, *args)` on `sock` with `run(*args)`, in order, until the
    gateway closes it."""
    while True:
        try:
            request = recv_frame(sock)
        except Broken:
            return
        if not (isinstance(request, tuple) and request and isinstance(request[0], int)):
            return  # not the gateway's: stop
        rid, args = request[0], request[1:]
        try:
            reply: tuple[str, int, object] = ("ok", rid, run(*args))
        except Exception as exc:  # every failure goes back to the gateway
            if not isinstance(exc, CellgateError | OSError):
                logger.exception("host worker (F3): host side failed")
            reply = ("err", rid, _portable(exc))
        try:
            send_frame(sock, reply)
        except OSError:
            return  # the gateway is gone


def _run(quotas: Quotas) -> Callable[..., object]:
    engines: OrderedDict[EngineRef, EngineHTTP] = OrderedDict()

    def lookup(ref: EngineRef) -> Callable[[str], dict[str, Any] | None]:
        engine = engines.get(ref)
        if engine is None:
            from sandbox.backends.engine_http import EngineHTTP

            engine = engines[ref] = EngineHTTP.from_ref(ref)
            while len(engines) > ENGINES_KEPT:
                engines.popitem(last=False)[1].close()
        engines.move_to_end(ref)
        return engine.inspect

    def run(kind: str, *args: Any) -> object:
        if kind == "plan":
            ref, job, hint = args
            quota = quotas.get(ref) if ref is not None else None
            if isinstance(quota, SparedQuota):  # the spares the gateway made: no listing
                quota.hint(job.agent, hint)
            return host_side(quota, job, quick=True)  # anything slow is the gateway's (Busy)
        if kind == "claim":
            from sandbox.backends.docker_pool import claim_side

            (claim,) = args
            return claim_side(claim, lookup(claim.engine))
        raise ValueError(f"no such request {kind!r}")

    return run


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    sock.setblocking(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C at a terminal: the gateway closes us
    root = logging.getLogger()
    root.handlers[:] = [_Forward(sock)]
    root.setLevel(int(argv[1]))
    for module in argv[3:]:  # the gateway's own `preload`
        importlib.import_module(module)
    serve(sock, _run(Quotas()))


WORKER = HostWorker()  # the gateway's (module-wide, as the lanes are)
# pool claims, beside new conversations' host sides
CLAIMER = HostWorker("cellgate-claims", preload=("sandbox.backends.docker_pool",))
atexit.register(WORKER.close)
atexit.register(CLAIMER.close)


if __name__ == "__main__":
    main(sys.argv[1:])
