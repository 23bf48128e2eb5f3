"""The gateway's end of a sandbox's resident runner (F2).

`RunnerSocket` listens on `<bridge_dir>/runner.sock` (bound through the
directory's descriptor, like the bridge socket: no symlink on the way); the
runner inside the sandbox (`sandbox/client/cellgate_runner.py`) connects to it
and runs one request at a time. Everything the connection sends is hostile:
the reply's header is bounded, its output lengths are bounded by the cap, it
must arrive before the deadline, and it must answer the request's id. Any
breach drops the connection (the sandbox only hurts itself: the gateway falls
back to exec and starts a new runner).

`run` returns None when no runner is connected or the request could not be
sent whole (nothing ran: exec it instead), else the `ExecResult`; a runner
lost after the request was sent gives a failed result, never a second run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import marshal
import os
import secrets
import socket
import stat
import struct
import sys
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TypeGuard

from sandbox.backends.base import ExecResult
from sandbox.unix_listener import UnixListener

logger = logging.getLogger(__name__)

SOCKET_NAME = "runner.sock"
RUNNER_NAME = "cellgate-runner"
# Beside it, its code compiled by this gateway's Python, named by the bytecode's tag
# (`cpython-311`): a sandbox whose python3 has the same tag skips the compile (6 ms of
# every first turn's CPU, F1/F3); any other compiles the source as before.
RUNNER_CODE_NAME = f"{RUNNER_NAME}.{sys.implementation.cache_tag}"
# The native runner (`sandbox/client/cellgate_runner.c`, built by scripts/build-runner.sh
# into the package beside its source): the same protocol with no Python to start, about
# 7 ms of CPU less per first turn of a pooled sandbox (F3). Gateways without it use the
# Python one.
NATIVE_NAME = f"{RUNNER_NAME}.bin"
MAX_NATIVE_SIZE = 16 << 20
# What both runners accept (a request past them would end the runner: exec runs it)
MAX_REQUEST_HEADER = 1024 * 1024
MAX_REQUEST_STDIN = 64 * 1024 * 1024
MAX_REQUEST_FIELDS = 65535
MAX_REQUEST_TIMEOUT = 1e9
HEADER = struct.Struct(">I")
MAX_REPLY_HEADER = 4096
LISTEN_BACKLOG = 128  # as `UnixListener`'s
KILL_AFTER = 2
HOST_GRACE = 3.0
SEND_TIMEOUT = 5.0
SPAWN_FAILED = ExecResult(126, b"", b"")
# The connection broke after the request was sent: the command may have run in part.
# The caller asks the engine what became of the sandbox (R7: an engine gone requeues).
RUNNER_LOST = ExecResult(-1, b"", b"cellgate: the sandbox's runner was lost\n")


class RunnerSocket:
    """One sandbox's runner socket on the host, and the runner connected to it (if any)."""

    def __init__(self, bridge_dir: Path, container_id: str, output_cap: int) -> None:
        self.bridge_dir = bridge_dir
        self.container_id = container_id
        self.output_cap = output_cap
        self.connected = asyncio.Event()
        self._server: UnixListener | None = None
        self._closed = False
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._inode: tuple[int, int] | None = None
        self._bound: socket.socket | None = None

    @property
    def path(self) -> Path:
        return self.bridge_dir / SOCKET_NAME

    def bind(self) -> None:
        """Bind and listen now, in the caller's thread (F1: a claim does it before the
        pooled sandbox's runner starts, so the runner connects at its first try instead
        of polling for the socket); `listen` then serves it. Raises OSError."""
        sock = self._bind()
        sock.listen(LISTEN_BACKLOG)
        self._bound = sock

    async def listen(self) -> None:
        sock, self._bound = self._bound, None
        if sock is None:
            sock = await asyncio.to_thread(self._bind)
        self._server = UnixListener(sock, self._on_connect, limit=MAX_REPLY_HEADER + 1)
        self._server.start()

    def _bind(self) -> socket.socket:
        dfd = os.open(self.bridge_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.stat(SOCKET_NAME, dir_fd=dfd, follow_symlinks=False).st_mode):
                    raise OSError(f"{self.path} is a directory")
                os.unlink(SOCKET_NAME, dir_fd=dfd)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"/proc/self/fd/{dfd}/{SOCKET_NAME}")
                os.chmod(SOCKET_NAME, 0o666, dir_fd=dfd)  # noqa: S103 - the sandbox's uid connects
                st = os.stat(SOCKET_NAME, dir_fd=dfd, follow_symlinks=False)
                self._inode = (st.st_dev, st.st_ino)
            except BaseException:
                sock.close()
                raise
            return sock
        finally:
            os.close(dfd)

    def still_ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._inode

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # runs inside the protocol's connection_made (see sandbox.unix_listener)
        if self._closed or self.ready:
            writer.close()  # closed, or one runner at a time: a second caller is turned away
            return
        self._conn = (reader, writer)
        self.connected.set()

    @property
    def ready(self) -> bool:
        """A runner is connected and has not hung up (its EOF arrives as soon as it dies)."""
        if self._conn is None:
            return False
        reader, writer = self._conn
        if writer.is_closing() or reader.at_eof():
            self.drop()
            return False
        return True

    def drop(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
        self._conn = None
        self.connected.clear()

    async def close(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        """`close`, callable from any thread while the socket is only bound (never served)."""
        self._closed = True
        self.drop()
        if self._bound is not None:
            self._bound.close()
            self._bound = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.still_ours():
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109 - bounded below
        workdir: str | None,
        marker: str,
    ) -> ExecResult | None:
        if not self.ready or self._lock.locked():
            return None
        async with self._lock:
            conn = self._conn
            if conn is None:
                return None
            reader, writer = conn
            rid = secrets.token_hex(8)
            data = encode_request(rid, argv, env, timeout, workdir, self.output_cap, marker, stdin)
            if data is None:
                return None  # nothing a runner can carry: exec says what is wrong with it
            try:
                async with asyncio.timeout(SEND_TIMEOUT):
                    writer.write(HEADER.pack(len(data)) + data + (stdin or b""))
                    await writer.drain()
            except (OSError, TimeoutError):
                self.drop()
                return None
            try:
                async with asyncio.timeout(timeout + KILL_AFTER + HOST_GRACE):
                    result = await self._reply(reader, rid)
            except TimeoutError:
                self.drop()
                return ExecResult(-1, b"", b"", timed_out=True)
            except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                logger.info("runner in %s lost: %s", self.container_id[:12], exc)
                self.drop()
                return RUNNER_LOST
            return None if result is SPAWN_FAILED else result

    async def _reply(self, reader: asyncio.StreamReader, rid: str) -> ExecResult:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > MAX_REPLY_HEADER:
            raise ValueError(f"reply header of {size} bytes")
        try:  # hostile bytes: deep nesting (RecursionError) is a lost runner too
            head = json.loads(await reader.readexactly(size))
        except RecursionError as exc:
            raise ValueError("a reply nested too deep") from exc
        if not isinstance(head, dict) or head.get("id") != rid:
            raise ValueError("a reply to another request")
        out_len, err_len = head.get("out_len"), head.get("err_len")
        if not (_count(out_len, self.output_cap) and _count(err_len, self.output_cap)):
            raise ValueError("reply lengths missing, not counts, or over the output cap")
        out = await reader.readexactly(out_len)
        err = await reader.readexactly(err_len)
        if head.get("spawn_failed") is True:
            return SPAWN_FAILED  # it started nothing: the caller runs it by exec
        code = head.get("code")
        if not isinstance(code, int) or isinstance(code, bool):
            raise ValueError("reply without an exit code")
        return ExecResult(code, out, err, timed_out=head.get("timed_out") is True)


def encode_request(
    rid: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    workdir: str | None,
    cap: int,
    marker: str,
    stdin: bytes | None,
) -> bytes | None:
    """A request's header, as both runners read it (the native one in C, so no
    `marshal`): NUL-terminated fields, namely id, timeout (seconds), output cap, exec
    marker (`NAME=VALUE`), working directory (empty: the runner's), stdin length
    (empty: no stdin), argc, the argv, the number of environment entries, the entries
    (`NAME=VALUE`). Strings are UTF-8, with `surrogateescape` for the bytes that are not
    (as the sandbox's file names and environment are). None when the request cannot be
    carried (a NUL in a field, an empty or `=` in a variable's name, a lone surrogate,
    past either runner's limits): no process could get it, or exec says what is wrong."""
    if any(not k or "=" in k for k in env):
        return None
    if not 0 <= timeout <= MAX_REQUEST_TIMEOUT or len(stdin or b"") > MAX_REQUEST_STDIN:
        return None
    fields = [
        rid,
        repr(float(timeout)),
        str(cap),
        marker,
        workdir or "",
        "" if stdin is None else str(len(stdin)),
        str(len(argv)),
        *argv,
        str(len(env)),
        *(f"{k}={v}" for k, v in env.items()),
    ]
    if len(fields) > MAX_REQUEST_FIELDS:
        return None
    try:
        encoded = [f.encode("utf-8", "surrogateescape") for f in fields]
    except UnicodeEncodeError:  # a lone surrogate (JSON can carry one): no byte string
        return None
    data = b"".join(f + b"\0" for f in encoded)
    if any(b"\0" in f for f in encoded) or len(data) > MAX_REQUEST_HEADER:
        return None
    return data


def _count(value: object, cap: int) -> TypeGuard[int]:
    """Is `value` a plain int in 0..cap (not a bool, a float, a string or a list)?"""
    return type(value) is int and 0 <= value <= cap


def runner_loader(bridge: str) -> str:
    """The `python3 -c` program that starts the runner installed in `bridge`: its
    precompiled code when this Python's tag matches, else its source (one line)."""
    src = f"{bridge}/{RUNNER_NAME}"
    if '"' in src or "\\" in src:
        raise ValueError(f"unusable bridge path {bridge!r}")
    return (
        f'import sys,marshal,posix;s="{src}";b=s+"."+sys.implementation.cache_tag;'
        'c=marshal.loads(open(b,"rb").read()) if posix.access(b,0) '
        'else compile(open(s,"rb").read(),s,"exec");'
        'exec(c,{"__name__":"__main__"})'
    )


CODE_FD, SOURCE_FD = 3, 4


def runner_fd_loader() -> str:
    """The `python3 -c` program of a pooled sandbox: the runner's code on descriptor 3
    (compiled by this gateway's Python: used when the sandbox's has the same tag) or its
    source on descriptor 4, both opened from the sandbox's slot before its claim. A claim
    then writes no runner into the conversation's bridge directory (F3)."""
    tag = sys.implementation.cache_tag
    return (
        "import sys,marshal,posix\n"
        "def r(fd):\n"
        " b=b''\n"
        " while 1:\n"
        "  c=posix.read(fd,65536)\n"
        "  if not c:posix.close(fd);return b\n"
        "  b+=c\n"
        f"k,s=r({CODE_FD}),r({SOURCE_FD})\n"
        f"c=marshal.loads(k) if sys.implementation.cache_tag=={tag!r} "
        f"else compile(s,{RUNNER_NAME!r},'exec')\n"
        "del k,s,r\n"
        "exec(c,{'__name__':'__main__'})"
    )


def native_runner() -> bytes | None:
    """The built native runner's bytes, or None when it was not built, or is not an ELF
    executable for this machine (class, byte order and machine as this Python's own,
    `/proc/self/exe`: the sandboxes run on this host's kernel): the Python runner then."""
    try:
        with resources.files("sandbox.client").joinpath(NATIVE_NAME).open("rb") as f:
            data = f.read(MAX_NATIVE_SIZE + 1)
    except OSError:
        return None
    try:
        with open("/proc/self/exe", "rb") as f:
            own = f.read(ELF_IDENT)
    except OSError:
        own = b""
    if len(data) > MAX_NATIVE_SIZE or not _same_machine(data, own):
        logger.warning(
            "%s is not a runner for this machine: ignored (rebuild it with "
            "scripts/build-runner.sh)",
            NATIVE_NAME,
        )
        return None
    return data


ELF_IDENT = 20  # e_ident (16 bytes), e_type (2), e_machine (2)


def _same_machine(data: bytes, own: bytes) -> bool:
    """ELF files of one class (32/64-bit), byte order and machine; `data` an executable."""
    if len(data) < ELF_IDENT or len(own) < ELF_IDENT:
        return False
    if not (data.startswith(b"\x7fELF") and own.startswith(b"\x7fELF")):
        return False
    e_type = int.from_bytes(data[16:18], "little" if data[5] == 1 else "big")
    executable = e_type in (2, 3)  # ET_EXEC, or ET_DYN (static-pie)
    return executable and data[4:6] == own[4:6] and data[18:20] == own[18:20]


def runner_code(source: bytes) -> bytes:
    """The runner's code object, marshalled for `runner_loader` (same tag only)."""
    return marshal.dumps(compile(source, RUNNER_NAME, "exec", dont_inherit=True))
