"""One unix socket per conversation; identity by connection (P1, T4).

`BridgeServer.open(scope)` listens on `<bridge_dir>/bridge.sock`, the directory
mounted read-only at `/run/cellgate` into that conversation's sandbox alone.
Every call on the socket runs in the scope bound to it; nothing a call sends
names its conversation, chat, session or directories.

Protocol: newline-delimited JSON, any number of requests per connection,
answered in order.

    -> {"id": "c1", "tool": "reply", "args": {"text": "hi"}}
    <- {"id": "c1", "ok": true, "result": {...}}
    <- {"id": "c1", "ok": false, "error": {"code": "refused", "message": "...", "rule": "P1"}}

Bounds (`BridgeLimits`; a sandbox may be hostile, R3, R4):

- a request is at most `max_request_bytes` (256 KiB; the largest honest
  request, a 16,000-character reply, is under 64 KiB): a longer line is
  answered `too_large` and the connection closed, having buffered at most
  that much;
- once its first byte arrived, a request must end (newline) within
  `frame_timeout` (10 s), else `timeout` and close: a slow loris holds a
  connection for seconds, not forever; a connection idle past `idle_timeout`
  is closed; an answer the client does not read within `write_timeout` closes
  the connection;
- a socket (one per conversation) serves at most `max_connections`
  connections at once; the next is answered `busy` and closed;
- calls are rate-limited per conversation by a token bucket
  (`policies.bridge.take_call`, `rate`): a call past it is answered `busy`
  before its request is parsed, so a flood costs a read and a short write;
- a call running past `call_timeout` is answered `timeout`.

Malformed input is answered, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cellgate.errors import BridgeError, PolicyDenied
from orchestrator.bridge.scope import BridgeScope, ScopeState
from orchestrator.bridge.tools import JSONObject, ToolHandlers
from policies.bridge import Bucket, RateLimit, take_call
from sandbox.unix_listener import UnixListener

__all__ = ["SOCKET_NAME", "BridgeLimits", "BridgeServer"]

logger = logging.getLogger(__name__)

SOCKET_NAME = "bridge.sock"
_ID_MAX = 128
_THROTTLE_LOG_EVERY = 60.0


@dataclass(frozen=True, slots=True)
class BridgeLimits:
    """What one conversation's socket allows (see the module docstring)."""

    max_request_bytes: int = 256 * 1024
    max_connections: int = 16
    idle_timeout: float = 60.0
    frame_timeout: float = 10.0
    write_timeout: float = 10.0
    call_timeout: float = 120.0
    rate: RateLimit = field(default_factory=RateLimit)


@dataclass(slots=True)
class _Binding:
    scope: BridgeScope
    server: UnixListener
    path: Path
    inode: tuple[int, int]
    state: ScopeState = field(default_factory=ScopeState)
    active: int = 0
    closed: bool = False
    bucket: Bucket | None = None
    throttle_logged: float | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


def _error(call_id: Any, code: str, message: str, rule: str | None = None) -> JSONObject:
    return {"id": call_id, "ok": False, "error": {"code": code, "message": message, "rule": rule}}


def _encode(doc: JSONObject) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class BridgeServer:
    """Serves `handlers` on one socket per conversation."""

    def __init__(
        self,
        handlers: ToolHandlers,
        limits: BridgeLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handlers = handlers
        self.limits = limits or BridgeLimits()
        self._clock = clock
        self._bindings: dict[str, _Binding] = {}
        self._lock = asyncio.Lock()

    def scope(self, scope_key: str) -> BridgeScope | None:
        binding = self._bindings.get(scope_key)
        return None if binding is None else binding.scope

    def state(self, scope_key: str) -> ScopeState | None:
        binding = self._bindings.get(scope_key)
        return None if binding is None else binding.state

    async def open(self, scope: BridgeScope) -> Path:
        """Listen for `scope` (idempotent); returns the host path of its socket.

        Called again with a new scope (a new session), the socket stays and
        the next call runs in the new scope. A socket file that vanished or
        was replaced is created anew.
        """
        async with self._lock:
            path = scope.paths.bridge_dir / SOCKET_NAME
            binding = self._bindings.get(scope.scope_key)
            if binding is not None:
                if binding.path == path and self._still_ours(binding):
                    if binding.scope.session_id != scope.session_id:
                        binding.state = ScopeState()
                    binding.scope = scope
                    return path
                await self._shutdown(binding)
                del self._bindings[scope.scope_key]
            self._bindings[scope.scope_key] = await self._listen(scope, path)
            logger.info("bridge open at %s", path, extra={"conversation": scope.conversation_id})
            return path

    @staticmethod
    def _still_ours(binding: _Binding) -> bool:
        try:
            st = os.lstat(binding.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == binding.inode

    async def _listen(self, scope: BridgeScope, path: Path) -> _Binding:
        directory = path.parent
        os.makedirs(directory, mode=0o755, exist_ok=True)
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # the gateway made it; a link or file here is an error
            raise BridgeError(
                "internal", f"bridge directory {directory} is not a real directory"
            ) from exc
        try:
            # traversable by the sandbox's uid, writable by nobody else
            os.fchmod(dfd, 0o755)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    raise BridgeError("internal", f"{path} is a directory, not a socket")
                os.unlink(path.name, dir_fd=dfd)
            # bound through the directory's descriptor: no path length limit (108 bytes)
            # and no symlink on the way
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"/proc/self/fd/{dfd}/{path.name}")
                # the sandbox's uid must connect; the directory is seen by that sandbox alone
                os.chmod(path.name, 0o666, dir_fd=dfd)  # noqa: S103
                sst = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            except BaseException:
                sock.close()
                raise
        finally:
            os.close(dfd)
        holder: dict[str, _Binding] = {}

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # runs inside the protocol's connection_made: every connection is known to
            # its binding at once, and a close aborts it even if its task never started
            binding = holder["b"]
            if binding.closed:
                writer.transport.abort()  # accepted just before the socket closed
                return
            binding.writers.add(writer)
            task = asyncio.get_running_loop().create_task(self._connection(binding, reader, writer))
            binding.tasks.add(task)
            task.add_done_callback(binding.tasks.discard)

        server = UnixListener(sock, on_connect, limit=self.limits.max_request_bytes + 1)
        binding = _Binding(scope=scope, server=server, path=path, inode=(sst.st_dev, sst.st_ino))
        holder["b"] = binding
        server.start()
        return binding

    async def close(self, scope_key: str) -> None:
        """Stop serving a conversation and remove its socket; a no-op if it is not open."""
        async with self._lock:
            binding = self._bindings.pop(scope_key, None)
            if binding is not None:
                await self._shutdown(binding)

    async def close_all(self) -> None:
        async with self._lock:
            bindings = list(self._bindings.values())
            self._bindings.clear()
            for binding in bindings:
                await self._shutdown(binding)

    async def __aenter__(self) -> BridgeServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_all()

    async def _shutdown(self, binding: _Binding) -> None:
        binding.closed = True
        binding.server.close()
        for writer in list(binding.writers):
            writer.transport.abort()  # every connection ends with its bridge
        for task in list(binding.tasks):
            task.cancel()
        if binding.tasks:
            await asyncio.gather(*binding.tasks, return_exceptions=True)
        if self._still_ours(binding):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(binding.path)
        logger.info(
            "bridge closed at %s", binding.path, extra={"conversation": binding.scope.scope_key}
        )

    # -- one connection -------------------------------------------------------

    async def _connection(
        self, binding: _Binding, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            if binding.active >= self.limits.max_connections:
                busy = _error(None, "busy", "too many connections to this bridge; retry")
                await self._send(writer, busy)
                return
            binding.active += 1
            try:
                await self._serve(binding, reader, writer)
            finally:
                binding.active -= 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; nothing to answer
        except TimeoutError:  # it does not read its answers: drop what waits for it
            writer.transport.abort()
        except asyncio.CancelledError:
            # the bridge is closing: end the connection here rather than hand the
            # cancellation to asyncio's callback, which would leave its transport open
            writer.transport.abort()
        finally:
            binding.writers.discard(writer)
            writer.close()
            try:
                async with asyncio.timeout(self.limits.write_timeout):
                    await writer.wait_closed()
            except TimeoutError:
                writer.transport.abort()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def _send(self, writer: asyncio.StreamWriter, doc: JSONObject) -> None:
        """Write one answer; a client that does not read it within `write_timeout` is dropped."""
        writer.write(_encode(doc))
        async with asyncio.timeout(self.limits.write_timeout):
            await writer.drain()

    async def _read_request(self, reader: asyncio.StreamReader) -> bytes | JSONObject:
        """The next request line, b"" at the end, or the error that ends the connection."""
        limit = self.limits.max_request_bytes
        try:
            async with asyncio.timeout(self.limits.idle_timeout):
                first = await reader.read(1)
        except TimeoutError:
            return b""
        if not first or first == b"\n":
            return first
        try:
            async with asyncio.timeout(self.limits.frame_timeout):
                rest = await reader.readline()
        except TimeoutError:
            message = f"a request must arrive whole within {self.limits.frame_timeout:g} s"
            return _error(None, "timeout", message)
        except ValueError:  # the line ran past the StreamReader limit
            rest = b""
            too_long = True
        else:
            too_long = len(first) + len(rest.rstrip(b"\r\n")) > limit
        if too_long:
            message = f"request is over {limit} bytes; send less (files go by path)"
            return _error(None, "too_large", message)
        return first + rest  # without a newline: the client ended the frame by closing

    def _admit(self, binding: _Binding) -> JSONObject | None:
        """R4: None if the conversation may make one more call now, else the `busy` answer."""
        now = self._clock()
        decision, binding.bucket = take_call(binding.bucket, now, self.limits.rate)
        if decision:
            return None
        last = binding.throttle_logged
        if last is None or now - last >= _THROTTLE_LOG_EVERY:  # a flood is one log line a minute
            binding.throttle_logged = now
            logger.warning(
                "bridge calls throttled: %s",
                decision.reason,
                extra={"conversation": binding.scope.conversation_id},
            )
        return _error(None, "busy", decision.reason, decision.rule)

    async def _serve(
        self, binding: _Binding, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            line = await self._read_request(reader)
            if isinstance(line, dict):
                await self._send(writer, line)
                return
            if not line:
                return
            if not line.strip():
                continue
            busy = self._admit(binding)
            await self._send(
                writer, busy if busy is not None else await self._answer(binding, line)
            )

    async def _answer(self, binding: _Binding, line: bytes) -> JSONObject:
        try:
            doc = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error(None, "bad_request", f"request is not JSON: {exc}")
        if not isinstance(doc, dict):
            return _error(None, "bad_request", 'request must be an object {"id","tool","args"}')
        raw_id = doc.get("id")
        if raw_id is None:
            call_id = uuid.uuid4().hex
        elif isinstance(raw_id, str | int) and not isinstance(raw_id, bool):
            call_id = str(raw_id)[:_ID_MAX]
        else:
            return _error(None, "bad_request", "id must be a string or an integer")
        tool = doc.get("tool")
        args = doc.get("args", {})
        if args is None:
            args = {}
        if not isinstance(tool, str) or not tool:
            return _error(raw_id, "bad_request", "tool must be a non-empty string")
        if not isinstance(args, dict):
            return _error(raw_id, "bad_request", "args must be an object")
        scope = binding.scope  # read per call: a new session's scope applies at once
        try:
            async with asyncio.timeout(self.limits.call_timeout):
                result = await self.handlers.call(scope, binding.state, call_id, tool, args)
        except PolicyDenied as exc:
            return _error(raw_id, "refused", exc.reason, exc.rule)
        except BridgeError as exc:
            return _error(raw_id, exc.code, exc.reason)
        except TimeoutError:
            return _error(
                raw_id, "timeout", f"{tool} did not finish in {self.limits.call_timeout:g} s"
            )
        except Exception:  # the boundary: log it, answer, keep serving
            logger.exception(
                "bridge tool %s failed", tool, extra={"conversation": scope.conversation_id}
            )
            return _error(raw_id, "internal", f"{tool} failed inside the gateway; it was logged")
        return {"id": raw_id, "ok": True, "result": result}
