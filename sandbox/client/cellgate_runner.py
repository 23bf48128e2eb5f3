#!/usr/bin/env python3
"""cellgate-runner: runs the gateway's commands inside this sandbox (F2).

Started once per sandbox (a detached exec, or by a pooled sandbox's first
process when it is claimed), as the sandbox's user, with its environment and
working directory, it connects to the gateway's socket in the bridge
directory and runs one request at a time, exactly as an exec would (`timeout
-k 2 <s> <command>`): the command in a session of its own, the request's
environment (with the exec marker) over the sandbox's, its working directory,
stdin written then closed, stdout and stderr kept up to the request's cap
(the rest read and dropped); after `<s>` whole seconds its process group gets
SIGTERM (and SIGCONT), 2 s later SIGKILL, and the exit code is then 124 or
137, as `timeout`'s would be (the runner keeps that clock itself: one process
fewer to start per command); past the deadline its process group and every
process carrying the marker are killed.

Frames both ways: a 4-byte big-endian length, a header, then raw bytes (the
request's stdin; the reply's stdout then stderr). The request's header is a
list of NUL-terminated fields (it comes from the gateway; see
`runner_client.encode_request`, which the native runner, `cellgate_runner.c`,
reads too); the reply's is JSON (the gateway parses what a sandbox sends with
its bounded JSON reader). Only built-in modules are imported (`_socket`,
`select`, `os`, `time`): the runner of a pooled sandbox starts at its claim,
and its start-up is on the first turn's path.
"""

from __future__ import annotations

import _socket
import os
import select
import sys
import time

TYPE_CHECKING = False  # no `typing` at run time: 20 ms of start-up
if TYPE_CHECKING:
    from typing import Any

SOCKET = "/run/cellgate/runner.sock"
HEADER_SIZE = 4
MAX_HEADER = 1024 * 1024
MAX_STDIN = 64 * 1024 * 1024
KILL_AFTER = 2
GRACE = 1.0
AFTER_EXIT = 0.05
CONNECT_WAIT = 5.0
CONNECT_POLL = 0.002
SIGKILL = 9
SIGPIPE = 13
SIGTERM = 15
SIGCONT = 18
SIGXFSZ = 25
CHUNK = 65536


def read_exact(sock: _socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def started_env() -> dict[str, str]:
    """The environment this process was started with, which a command gets (as from an
    exec or the native runner). Python's locale coercion (PEP 538) adds LC_CTYPE to
    os.environ when the locale is C; /proc/self/environ still shows the original."""
    env = dict(os.environ)
    if "LC_CTYPE" in env:
        try:
            with open("/proc/self/environ", "rb") as f:
                started = f.read(1 << 20).split(b"\0")
        except OSError:
            return env
        if not any(e.startswith(b"LC_CTYPE=") for e in started):
            del env["LC_CTYPE"]
    return env


STARTED_ENV = started_env()


def kill_marked(marker: str) -> None:
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as f:
                if needle in f.read(1 << 20).split(b"\0"):
                    os.kill(int(name), SIGKILL)
        except OSError:
            continue


def spawn(
    argv: list[str], env: dict[str, str], workdir: str | None, stdin: bytes | None
) -> tuple[int, int, int, int]:
    """Start `argv` in a new session (posix_spawn: no copy of this process); returns
    (pid, out fd, err fd, in fd or -1). Raises OSError when nothing could start (no
    process to spare, no such directory or program)."""
    program: str | None = None
    if "/" in argv[0]:
        program = argv[0]  # as execvp: a path, from the working directory if relative
    else:
        program = next(
            (
                os.path.join(d, argv[0])
                for d in os.get_exec_path(env)
                if d.startswith("/") and os.access(os.path.join(d, argv[0]), os.X_OK)
            ),
            None,
        )
    if program is None:  # never one in the (sandbox-writable) working directory
        raise FileNotFoundError(2, f"{argv[0]} is not on PATH")
    here = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    if stdin is not None:
        r_in, w_in = os.pipe()
    else:
        r_in, w_in = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
    try:
        if workdir:
            os.chdir(workdir)  # the child starts where this process is
        pid = os.posix_spawn(
            program,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, r_in, 0),
                (os.POSIX_SPAWN_DUP2, w_out, 1),
                (os.POSIX_SPAWN_DUP2, w_err, 2),
            ],
            setsid=True,
            setsigdef=(SIGPIPE, SIGXFSZ),  # Python ignores them; a command expects neither
        )
    except BaseException:  # OSError, or ValueError (an empty program name): nothing ran
        for fd in (r_out, r_err, w_in):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.fchdir(here)
        os.close(here)
        for fd in (w_out, w_err, r_in):
            os.close(fd)
    return pid, r_out, r_err, w_in


def signal_group(pid: int, sig: int) -> None:
    """Signal the command's session (started with setsid: its group is its pid)."""
    try:  # noqa: SIM105 - no contextlib: every import is start-up time
        os.killpg(pid, sig)
    except OSError:
        pass


def wait_exit(pid: int, block_for: float, pidfd: int = -1) -> int | None:
    """The child's exit code (128+N for signal N), or None while it runs after
    `block_for` seconds (woken by its pidfd where the kernel has them)."""
    end = time.monotonic() + block_for
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)
        left = end - time.monotonic()
        if left <= 0:
            return None
        if pidfd >= 0:
            p = select.poll()
            p.register(pidfd, select.POLLIN)
            p.poll(int(left * 1000) + 1)
        else:
            time.sleep(0.001)


def open_pidfd(pid: int) -> int:
    """A descriptor that polls readable when `pid` exits, or -1 (Python < 3.9, Linux < 5.3)."""
    try:
        return int(os.pidfd_open(pid))
    except (AttributeError, OSError):
        return -1


def run(req: dict[str, Any], stdin: bytes | None) -> tuple[dict[str, Any], bytes, bytes]:
    timeout = float(req["timeout"])
    cap = int(req["cap"])
    marker = str(req["marker"])
    args = req["argv"]
    extra = req["env"]
    if not isinstance(args, list) or not isinstance(extra, dict):
        return {"code": 126, "timed_out": False}, b"", b"cellgate-runner: bad request\n"
    argv = [str(a) for a in args]
    if not argv:
        return {"code": 126, "timed_out": False}, b"", b"cellgate-runner: bad request\n"
    env = dict(STARTED_ENV)
    env.update({str(k): str(v) for k, v in extra.items()})
    name, _, value = marker.partition("=")
    env[name] = value
    workdir = str(req["workdir"]) if req.get("workdir") else None
    try:
        pid, r_out, r_err, w_in = spawn(argv, env, workdir, stdin)
    except Exception as exc:  # nothing ran (no process, no such dir, no posix_spawn or
        # setsid here): the gateway runs it by exec instead
        return {"spawn_failed": True, "code": 126}, b"", f"cellgate-runner: {exc}\n".encode()
    out, err = bytearray(), bytearray()
    bufs = {r_out: out, r_err: err}
    poll = select.poll()
    poll.register(r_out, select.POLLIN)
    poll.register(r_err, select.POLLIN)
    pending = memoryview(stdin or b"")
    if w_in >= 0:
        os.set_blocking(w_in, False)
        if pending:
            poll.register(w_in, select.POLLOUT)
        else:
            os.close(w_in)
            w_in = -1
    pidfd = open_pidfd(pid)
    if pidfd >= 0:
        poll.register(pidfd, select.POLLIN)  # wakes the loop the moment it exits
    started = time.monotonic()
    term_at = started + max(1, -int(-timeout // 1))  # whole seconds, as `timeout` counts
    kill_at = term_at + KILL_AFTER
    deadline = started + timeout + KILL_AFTER + GRACE
    open_fds = {r_out, r_err} | ({w_in} if w_in >= 0 else set())
    exited_at = None
    code = None
    deadline_hit = False
    signalled = 0
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            deadline_hit = True
            break
        if code is None:
            code = wait_exit(pid, 0)
            if code is not None:
                exited_at = now
        if code is None and signalled != SIGKILL:
            if now >= kill_at:
                signal_group(pid, SIGKILL)
                signalled = SIGKILL
            elif now >= term_at and not signalled:
                signal_group(pid, SIGTERM)
                signal_group(pid, SIGCONT)  # a stopped command gets it too
                signalled = SIGTERM
        if exited_at is not None and now - exited_at > AFTER_EXIT:
            break  # a background child holds the pipes: the command itself is done
        wake = min(deadline, kill_at if signalled else term_at) - now
        for fd, _ in poll.poll(int(min(max(wake, 0), 0.05) * 1000) + 1):
            if fd == pidfd:
                poll.unregister(fd)  # it exited: the next round reaps it
                continue
            if fd == w_in:
                try:
                    sent = os.write(fd, pending[:CHUNK])
                except BlockingIOError:
                    continue
                except OSError:
                    sent = len(pending)
                pending = pending[sent:]
                if not pending:
                    poll.unregister(fd)
                    open_fds.discard(fd)
                    os.close(fd)
                    w_in = -1
                continue
            chunk = os.read(fd, CHUNK)
            if not chunk:
                poll.unregister(fd)
                open_fds.discard(fd)
                continue
            buf = bufs[fd]
            room = cap - len(buf)
            if room > 0:
                buf += chunk[:room]
    while code is None and not deadline_hit:  # its output closed, it runs on: the clock too
        now = time.monotonic()
        if now >= deadline:
            deadline_hit = True
            break
        if now >= kill_at:
            if signalled != SIGKILL:
                signal_group(pid, SIGKILL)
                signalled = SIGKILL
        elif now >= term_at and not signalled:
            signal_group(pid, SIGTERM)
            signal_group(pid, SIGCONT)
            signalled = SIGTERM
        wake = (deadline if signalled == SIGKILL else kill_at if signalled else term_at) - now
        code = wait_exit(pid, max(wake, 0.001), pidfd)
    if deadline_hit:
        try:  # noqa: SIM105 - no contextlib: every import is start-up time
            os.killpg(pid, SIGKILL)
        except OSError:
            pass
        kill_marked(marker)
    if code is None:
        code = wait_exit(pid, GRACE, pidfd)
    if code is None:
        code = -1
    if pidfd >= 0:
        os.close(pidfd)
    if signalled and not deadline_hit:
        code = 137 if signalled == SIGKILL else 124  # as `timeout` exits
    timed_out = deadline_hit or bool(signalled)
    if timed_out and not deadline_hit:
        kill_marked(marker)
    for fd in (r_out, r_err, w_in):
        if fd >= 0:
            try:  # noqa: SIM105 - as above
                os.close(fd)
            except OSError:
                pass
    return {"code": -1 if deadline_hit else code, "timed_out": timed_out}, bytes(out), bytes(err)


def reply_header(head: dict[str, Any]) -> bytes:
    """The reply's JSON: its values are ints, booleans and the request's hex id."""
    parts = []
    for key, value in head.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = '"' + "".join(c for c in str(value) if c.isalnum()) + '"'
        parts.append(f'"{key}": {text}')
    return ("{" + ", ".join(parts) + "}").encode()


def parse(body: bytes) -> dict[str, Any] | None:
    """The request's fields (id, timeout, cap, marker, workdir, stdin length, argc,
    argv..., envc, env...), each NUL-terminated; None when they are not that."""
    parts = [p.decode("utf-8", "surrogateescape") for p in body.split(b"\0")]
    if len(parts) < 9 or parts.pop() != "":
        return None
    argc = int(parts[6])
    if not 0 <= argc <= len(parts) - 8 or int(parts[7 + argc]) != len(parts) - 8 - argc:
        return None
    env = {}
    for entry in parts[8 + argc :]:
        name, _, value = entry.partition("=")
        env[name] = value
    return {
        "id": parts[0],
        "timeout": float(parts[1]),
        "cap": int(parts[2]),
        "marker": parts[3],
        "workdir": parts[4] or None,
        "stdin_len": int(parts[5]) if parts[5] else None,
        "argv": parts[7 : 7 + argc],
        "env": env,
    }


def serve(sock: _socket.socket) -> None:
    while True:
        raw = read_exact(sock, HEADER_SIZE)
        if raw is None:
            return
        size = int.from_bytes(raw, "big")
        if size > MAX_HEADER:
            return
        body = read_exact(sock, size)
        if body is None:
            return
        req = parse(body)
        if req is None:
            return
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
        data = reply_header(head)
        sock.sendall(len(data).to_bytes(HEADER_SIZE, "big") + data + bytes(out) + bytes(err))


def main() -> int:
    # SIGPIPE stays ignored (Python's default): a command that leaves its stdin unread,
    # or a gateway gone, is an EPIPE here, never the end of the runner
    null = os.open(os.devnull, os.O_RDWR)  # 0-2 open: a pipe made later is never one of them
    while null <= 2:
        null = os.open(os.devnull, os.O_RDWR)
    os.close(null)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    deadline = time.monotonic() + CONNECT_WAIT
    while True:  # a pooled sandbox's runner starts while its claim is still being checked
        try:
            sock.connect(sys.argv[1] if len(sys.argv) > 1 else SOCKET)
            break
        except (FileNotFoundError, ConnectionRefusedError, PermissionError):
            # not yet bound, not yet listening, or bound but not yet opened to us
            if time.monotonic() > deadline:
                return 1
            time.sleep(CONNECT_POLL)
        except OSError:
            return 1
    try:
        serve(sock)
    except (OSError, ValueError, EOFError, TypeError, KeyError):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
