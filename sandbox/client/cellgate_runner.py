#!/usr/bin/env python3
"""cellgate-runner: runs the gateway's commands inside this sandbox (F2).

Started once per sandbox (a detached exec, as the sandbox's user, with its
environment and working directory), it connects to the gateway's socket in
the bridge directory and runs one request at a time, exactly as an exec
would: `timeout -k 2 <s>` around the command in a session of its own, the
request's environment (with the exec marker) over the sandbox's, its working
directory, stdin written then closed, stdout and stderr kept up to the
request's cap (the rest read and dropped), and on the deadline its process
group and every process carrying the marker killed.

Frames both ways: a 4-byte big-endian length, a JSON header, then raw bytes
(the request's stdin; the reply's stdout then stderr). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time

SOCKET = "/run/cellgate/runner.sock"
HEADER = struct.Struct(">I")
MAX_HEADER = 1024 * 1024
MAX_STDIN = 64 * 1024 * 1024
KILL_AFTER = 2
GRACE = 1.0
AFTER_EXIT = 0.05


def read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def kill_marked(marker: str) -> None:
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read(1 << 20).split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue


def run(req: dict[str, object], stdin: bytes | None) -> tuple[dict[str, object], bytes, bytes]:
    timeout = float(str(req["timeout"]))
    cap = int(str(req["cap"]))
    marker = str(req["marker"])
    args = req["argv"]
    extra = req["env"]
    if not isinstance(args, list) or not isinstance(extra, dict):
        return {"code": 126, "timed_out": False}, b"", b"cellgate-runner: bad request\n"
    argv = ["timeout", "-k", str(KILL_AFTER), str(max(1, math.ceil(timeout)))]
    argv += [str(a) for a in args]
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in extra.items()})
    name, _, value = marker.partition("=")
    env[name] = value
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=str(req["workdir"]) if req.get("workdir") else None,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:  # nothing ran (no process to spare, no such dir): exec decides
        return {"spawn_failed": True, "code": 126}, b"", f"cellgate-runner: {exc}\n".encode()
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            sel.register(proc.stdin, selectors.EVENT_WRITE, None)
        else:
            proc.stdin.close()
    deadline = time.monotonic() + timeout + KILL_AFTER + GRACE
    exited_at: float | None = None
    deadline_hit = False
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            deadline_hit = True
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > AFTER_EXIT:
            break  # a background child holds the pipes: the command itself is done
        for key, _ in sel.select(min(deadline - now, 0.05)):
            if key.data is None:
                try:
                    sent = os.write(key.fd, pending[:65536])
                except BlockingIOError:
                    continue
                except OSError:
                    sent = len(pending)
                pending = pending[sent:]
                if not pending:
                    sel.unregister(key.fileobj)
                    proc.stdin.close()  # type: ignore[union-attr]
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf: bytearray = key.data
            room = cap - len(buf)
            if room > 0:
                buf += chunk[:room]
    if deadline_hit:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        kill_marked(marker)
    try:
        code = proc.wait(timeout=GRACE)
    except subprocess.TimeoutExpired:
        code = -1
    if code < 0:
        code = 128 - code
    spent = time.monotonic() - (deadline - timeout - KILL_AFTER - GRACE)
    timed_out = deadline_hit or (spent >= timeout and code in (124, 137))
    if timed_out and not deadline_hit:
        kill_marked(marker)
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None and not f.closed:
            f.close()
    if code == 125 and not out and bytes(err).startswith(b"timeout: "):
        # `timeout` itself failed (no process to spare): nothing ran, exec decides
        return {"spawn_failed": True, "code": 125}, b"", bytes(err)
    return {"code": -1 if deadline_hit else code, "timed_out": timed_out}, bytes(out), bytes(err)


def serve(sock: socket.socket) -> None:
    while True:
        raw = read_exact(sock, HEADER.size)
        if raw is None:
            return
        (size,) = HEADER.unpack(raw)
        if size > MAX_HEADER:
            return
        body = read_exact(sock, size)
        if body is None:
            return
        req = json.loads(body)
        stdin_len = req.get("stdin_len")
        stdin = None
        if stdin_len is not None:
            if int(stdin_len) > MAX_STDIN:
                return
            stdin = read_exact(sock, int(stdin_len))
            if stdin is None:
                return
        head, out, err = run(req, stdin)
        head.update(out_len=len(out), err_len=len(err), id=req.get("id"))
        data = json.dumps(head).encode()
        sock.sendall(HEADER.pack(len(data)) + data + bytes(out) + bytes(err))


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(sys.argv[1] if len(sys.argv) > 1 else SOCKET)
    except OSError:
        return 1
    try:
        serve(sock)
    except (OSError, ValueError):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
