#!/usr/bin/env python3
"""cellgate-tool: call a gateway tool over this sandbox's bridge socket.

    cellgate-tool NAME 'JSON'        e.g. cellgate-tool reply '{"text": "hi"}'
    cellgate-tool NAME -             read the JSON arguments from stdin
    cellgate-tool NAME               no arguments ({})
    cellgate-tool list_tools         what this session may call

The socket is $CELLGATE_BRIDGE, else /run/cellgate/bridge.sock. The gateway
knows which conversation the socket belongs to: nothing here can name another.
Prints the result as JSON on stdout. Exit status: 0 done, 1 refused or failed
(the reason and the rule on stderr), 2 usage or connection error.

Standard library only; runs on Python 3.8 and later.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from typing import Any

DEFAULT_SOCKET = "/run/cellgate/bridge.sock"
MAX_RESPONSE = 16 * 1024 * 1024
EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


class BridgeUnavailable(Exception):
    """The socket could not be reached, or answered something that is not the protocol."""


def socket_path() -> str:
    return os.environ.get("CELLGATE_BRIDGE") or DEFAULT_SOCKET


def _connect(sock: socket.socket, where: str) -> None:
    """Connect; a path past AF_UNIX's ~108 bytes (a host agent's deep state directory)
    is reached through its directory's descriptor, `/proc/self/fd/<n>/<name>`."""
    if len(os.fsencode(where)) < 100:
        sock.connect(where)
        return
    directory, name = os.path.split(where)
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{name}")
    finally:
        os.close(fd)


def call(
    tool: str,
    args: dict[str, Any] | None = None,
    *,
    path: str | None = None,
    timeout: float | None = None,
    call_id: str | None = None,
) -> dict[str, Any]:
    """One request, one response: `{"id", "ok", "result" | "error"}`."""
    if timeout is None:
        timeout = float(os.environ.get("CELLGATE_TIMEOUT") or 130)
    request = {"id": call_id or uuid.uuid4().hex, "tool": tool, "args": args or {}}
    data = json.dumps(request, ensure_ascii=False).encode("utf-8") + b"\n"
    where = path or socket_path()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            _connect(sock, where)
            sock.sendall(data)
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > MAX_RESPONSE:
                    raise BridgeUnavailable("the bridge answer is too large")
        except socket.timeout as exc:  # noqa: UP041 - not TimeoutError before Python 3.10
            raise BridgeUnavailable(
                f"no answer from the bridge at {where} in {timeout:g} s"
            ) from exc
        except OSError as exc:
            raise BridgeUnavailable(f"cannot reach the bridge at {where}: {exc}") from exc
    finally:
        sock.close()
    if not buf:
        raise BridgeUnavailable(f"the bridge at {where} closed without an answer")
    try:
        doc = json.loads(buf.decode("utf-8"))
    except ValueError as exc:
        raise BridgeUnavailable(f"the bridge answered something that is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or "ok" not in doc:
        raise BridgeUnavailable("the bridge answered something that is not a response")
    return doc


def describe_error(doc: dict[str, Any]) -> str:
    err = doc.get("error") or {}
    rule = err.get("rule")
    code = err.get("code", "error")
    message = err.get("message", "")
    if rule:
        return f"refused by {rule}: {message}"
    return f"{code}: {message}"


def _usage() -> str:
    return (__doc__ or "").split("\n\n")[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or len(argv) > 2:
        sys.stderr.write("usage:\n" + _usage() + "\n")
        return EXIT_OK if argv and argv[0] in ("-h", "--help") else EXIT_USAGE
    tool = argv[0]
    raw = argv[1] if len(argv) == 2 else "{}"
    if raw == "-":
        raw = sys.stdin.read()
    try:
        args = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        sys.stderr.write(f"cellgate-tool: the arguments are not JSON: {exc}\n")
        return EXIT_USAGE
    if not isinstance(args, dict):
        sys.stderr.write("cellgate-tool: the arguments must be a JSON object, e.g. '{}'\n")
        return EXIT_USAGE
    try:
        doc = call(tool, args)
    except BridgeUnavailable as exc:
        sys.stderr.write(f"cellgate-tool: {exc}\n")
        return EXIT_USAGE
    if doc.get("ok"):
        sys.stdout.write(json.dumps(doc.get("result"), ensure_ascii=False) + "\n")
        return EXIT_OK
    sys.stderr.write(f"cellgate-tool: {tool} {describe_error(doc)}\n")
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
