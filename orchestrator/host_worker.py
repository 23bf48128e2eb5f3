"""The host worker: a conversation's sandbox host side in a helper process (F3).

A new conversation's host side (`orchestrator.host_side`: its quota image taken
and bound, its dirs made, its mounts planned) is some 160 short system calls.
On the host lane each one hands Python's interpreter lock to the event loop,
the store's lane and the engine threads and waits to get it back, so 64 new
conversations at once queued behind it. Here it runs in a process of its own,
with its own interpreter lock, on a core the gateway's one lock leaves idle:
the host lane sends one request and waits for one reply.

The worker is `python -m orchestrator.host_worker FD LEVEL NAME`, started by the
gateway (as the same user, with a minimal environment) and reached over a
private socket pair, never a path a sandbox could reach. Frames are a 4-byte
length and a pickle, both ends this same code. It runs only `host_side`, one
request at a time (the host lane is one thread), with quota objects of its
own: every take of a spare and every bind is under the same file locks as in
the gateway (`sandbox.quota.locked`), so the two never step on each other.
Its log records come back over the socket and are logged by the gateway's
own loggers; an error comes back as the same exception (class, message and
attributes). When the worker cannot be started, dies, sends garbage or does
not answer within `REPLY_TIMEOUT`, the gateway kills it, says so once in the
log, and runs `host_side` itself (it is idempotent) until `RETRY_AFTER` has
passed. The worker ends when the gateway closes its end (or dies).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cellgate.errors import CellgateError, SandboxError
from orchestrator.conversations import ConversationPaths
from orchestrator.host_side import QuotaRef, Quotas, host_side, quota_ref
from sandbox.mountplan import MountPlan
from sandbox.quota import LoopQuota

logger = logging.getLogger(__name__)

REPLY_TIMEOUT = 60.0  # seconds for one host side (a quick one takes milliseconds)
RETRY_AFTER = 30.0  # seconds in this process after the worker failed
MAX_FRAME = 16 << 20
_HEADER = struct.Struct("!I")
_PACKAGES = str(Path(__file__).resolve().parent.parent)  # where `orchestrator` is found


class Broken(Exception):
    """The worker or its socket failed (not the host side it ran)."""


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
    """The gateway's handle on its worker process; used from the host lane (one thread
    at a time: a lock makes sure)."""

    def __init__(
        self,
        name: str = "cellgate",
        *,
        reply_timeout: float = REPLY_TIMEOUT,
        retry_after: float = RETRY_AFTER,
    ) -> None:
        self.name = name  # on its command line, for `ps`
        self.reply_timeout = reply_timeout
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._down_until = 0.0

    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the worker now, if none runs (it imports for a moment: ahead of the
        first new conversation). Blocking."""
        with self._lock:
            self._connected()

    def host_side(
        self,
        quota: LoopQuota | None,
        agent: str,
        digest: str,
        paths: ConversationPaths,
        agent_root: Path,
        owner: tuple[int, int],
        quick: bool,
    ) -> MountPlan:
        """`orchestrator.host_side.host_side`, run by the worker; here when it cannot be.
        Raises what `host_side` raises. Blocking."""
        ref = quota_ref(quota) if quota is not None else None
        with self._lock:
            sock = self._connected()
            if sock is not None:
                try:
                    reply = self._ask(sock, (ref, agent, digest, paths, agent_root, owner, quick))
                except Broken as exc:
                    self._failed(str(exc))
                else:
                    if isinstance(reply, BaseException):
                        raise reply
                    if not isinstance(reply, MountPlan):
                        raise SandboxError(f"the host worker answered a {type(reply).__name__}")
                    return reply
        return host_side(quota, agent, digest, paths, agent_root, owner, quick)

    def close(self) -> None:
        """Close its socket (the worker ends) and reap it."""
        with self._lock:
            self._stop()

    def _ask(self, sock: socket.socket, request: object) -> object:
        sock.settimeout(self.reply_timeout)
        try:
            send_frame(sock, request)
            while True:
                kind, body = _pair(recv_frame(sock))
                if kind == "log":
                    _relog(body)
                elif kind == "ok":
                    return body
                elif kind == "err":
                    return _rebuilt(body)
                else:
                    raise Broken(f"an unknown frame {kind!r}")
        except TimeoutError:
            raise Broken(f"no answer in {self.reply_timeout:g} s") from None
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise Broken(f"{type(exc).__name__}: {exc}") from None

    def _connected(self) -> socket.socket | None:
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        if self._proc is not None:
            self._failed(f"it exited ({self._proc.returncode})")
        if time.monotonic() < self._down_until:
            return None
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(_level()), self.name],
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
        self._sock = ours
        return ours

    def _failed(self, why: str) -> None:
        logger.warning(
            "host worker (F3): %s; the gateway runs new conversations' host side itself "
            "for %g s, then starts a new worker",
            why,
            self.retry_after,
        )
        self._stop()
        self._down_until = time.monotonic() + self.retry_after

    def _stop(self) -> None:
        sock, proc = self._sock, self._proc
        self._sock = self._proc = None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _pair(frame: object) -> tuple[str, Any]:
    if not (isinstance(frame, tuple) and len(frame) == 2 and isinstance(frame[0], str)):
        raise Broken("a frame that is not (kind, body)")
    return frame[0], frame[1]


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
            send_frame(self.sock, ("log", fields))


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
    """Answer requests on `sock` with `run(*request)` until the gateway closes it."""
    while True:
        try:
            request = recv_frame(sock)
        except Broken:
            return
        try:
            if not isinstance(request, tuple):
                raise SandboxError("the host worker got a request that is not a tuple")
            reply: tuple[str, object] = ("ok", run(*request))
        except Exception as exc:  # every failure goes back to the gateway
            if not isinstance(exc, CellgateError | OSError):
                logger.exception("host worker (F3): host side failed")
            reply = ("err", _portable(exc))
        try:
            send_frame(sock, reply)
        except OSError:
            return  # the gateway is gone


def _run(quotas: Quotas) -> Callable[..., MountPlan]:
    def run(
        ref: QuotaRef | None,
        agent: str,
        digest: str,
        paths: ConversationPaths,
        agent_root: Path,
        owner: tuple[int, int],
        quick: bool,
    ) -> MountPlan:
        quota = quotas.get(ref) if ref is not None else None
        return host_side(quota, agent, digest, paths, agent_root, owner, quick)

    return run


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    sock.setblocking(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C at a terminal: the gateway closes us
    root = logging.getLogger()
    root.handlers[:] = [_Forward(sock)]
    root.setLevel(int(argv[1]))
    serve(sock, _run(Quotas()))


WORKER = HostWorker()  # the gateway's (module-wide, as the lanes are)


if __name__ == "__main__":
    main(sys.argv[1:])
