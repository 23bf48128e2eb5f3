"""A guard in front of routing: traversal in any path segment is a 400, never a lookup.

The server decodes the path once before routing, so `%2e%2e%2f` arrives as
`../` and would otherwise change which route matches. Refused, for every
endpoint, with the API's error shape: a NUL or control character, a `..`
segment, an encoded `/` or `\\` (which routing would split on), and a
segment that still holds an encoded `.`, `/`, `\\` or NUL after the one
decoding (`..%252f` arrives as `..%2f`: double encoding). Each endpoint still
validates its own ids (`orchestrator.api.ids`).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.api.errors import error_response

__all__ = ["PathGuard", "path_problem"]

MAX_PATH = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_RAW_SEPARATOR = re.compile(rb"%(2[fF]|5[cC])")
_LEFT_ENCODED = re.compile(r"%(2[eEfF]|5[cC]|00|25)")


def path_problem(path: str, raw_path: bytes | None) -> str | None:
    """What is wrong with a request path, or None."""
    if len(path) > MAX_PATH:
        return f"the path is {len(path)} characters long; at most {MAX_PATH}"
    if "\x00" in path:
        return "the path contains a NUL byte"
    if _CONTROL.search(path):
        return "the path contains a control character"
    if raw_path is not None and _RAW_SEPARATOR.search(raw_path.split(b"?", 1)[0]):
        return "the path contains an encoded '/' or '\\'; ids never hold a path separator"
    for segment in path.split("/"):
        if segment in ("..", "."):
            return f"the path contains a {segment!r} segment (path traversal refused)"
        if _LEFT_ENCODED.search(segment):
            return (
                "the path still holds a percent-encoded '.', '/', '\\', '%' or NUL after "
                "decoding (double encoding refused); send ids and file names as they are"
            )
    return None


class PathGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path")
            problem = path_problem(scope["path"], raw if isinstance(raw, bytes) else None)
            if problem is not None:
                response = error_response(400, "bad_path", problem)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
