"""The key before the body, and a body bounded in size and time (R6, K2).

An ASGI middleware in front of every route. A request that carries a body
(a `Content-Length` above zero, any `Transfer-Encoding`, or POST, PUT, PATCH)
is authenticated from its `Authorization` header first: no key, an unknown
key or a revoked one is answered 401, and a key that does not name the agent
in the path (or a non-admin key on `/v1/keys`) 403, before one byte of the
body is read. Such an answer closes the connection (`Connection: close`), so
a client streaming a huge body is cut off rather than drained.

Only then is the body read, counted while it streams (chunked bodies without
a `Content-Length` included): past `MAX_BODY_BYTES` the answer is 413, a
declared length past it is 413 at once, and a body that has not fully
arrived within `BODY_SECONDS` is 408. The body read is handed to the app
from memory; the principal found is kept for the endpoint
(`auth.CallerKey`), so the key is looked up once.
"""

from __future__ import annotations

import asyncio
import logging
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.api.auth import PRINCIPAL_STATE, Principal, authenticate, bearer_secret
from orchestrator.api.context import ApiContext
from orchestrator.api.errors import ApiError, error_response, new_ref
from orchestrator.config import AGENT_ID_RE
from policies.api_access import RequestFacts, decide

logger = logging.getLogger(__name__)

__all__ = ["BODY_SECONDS", "MAX_BODY_BYTES", "BodyGuard"]

MAX_BODY_BYTES = 1024 * 1024
"""The largest request body: every body is JSON, and a 100,000-character message fits."""
BODY_SECONDS = 30.0
"""How long a body may take to arrive, in all."""

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SELF_AUTHENTICATED = re.compile(
    r"^/(?:v1/(?:telegram|line)/[^/]+/webhook|dashboard/log(?:in|out))$"
)
"""Routes that prove who calls them before they read a bounded body themselves: the
Telegram webhook (its secret token header, W2), the LINE webhook (its signature, W2)
and the dashboard's sign-in form."""
_AGENT_PATH = re.compile(r"^/v1/agents/([^/]+)(?:/|$)")
_AGENT = re.compile(AGENT_ID_RE)


class _TooLarge(Exception):
    pass


def _has_body(scope: Scope, headers: Headers) -> bool:
    if scope["method"] in _BODY_METHODS or "transfer-encoding" in headers:
        return True
    length = headers.get("content-length")
    return length is not None and length.strip() not in ("", "0")


def scope_refusal(who: Principal, path: str) -> ApiError | None:
    """K2 on what the path alone tells: the key, the agent it names, or an admin-only endpoint.

    The endpoint decides the rest (write, K3, K4) once the body is read.
    """
    admin_only = path in ("/v1/keys", "/api/v1/apps") or path.startswith(
        ("/v1/keys/", "/api/v1/apps/")
    )
    if not who.facts.present or who.facts.revoked or admin_only:
        decision = decide(who.facts, RequestFacts("", False, "admin"))
    else:
        m = _AGENT_PATH.match(path)
        if m is None or not _AGENT.fullmatch(m.group(1)):
            return None  # the agent is named in the body
        decision = decide(who.facts, RequestFacts(m.group(1), False, "message"))
    if decision.allowed:
        return None
    code = "unauthorized" if decision.status == 401 else "forbidden"
    return ApiError(decision.status, code, decision.reason, decision.rule)


class BodyGuard:
    def __init__(self, app: ASGIApp, ctx: ApiContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not _has_body(scope, headers) or SELF_AUTHENTICATED.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        refusal: ApiError | None
        who: Principal | None = None
        try:
            who = await asyncio.to_thread(
                authenticate, self.ctx, bearer_secret(headers.get("authorization"))
            )
            refusal = scope_refusal(who, scope["path"])
        except ApiError as exc:
            refusal = exc
        if refusal is not None:
            await self._refuse(scope, receive, send, refusal)
            return
        body = await self._read(scope, receive, send, headers)
        if body is None:
            return
        scope.setdefault("state", {})[PRINCIPAL_STATE] = who
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, exc: ApiError) -> None:
        """Answer without reading the body, and close: the rest of it is not drained."""
        ref = new_ref()
        logger.info("ref=%s %s %s refused before its body: %d %s", ref, scope["method"],
                    scope["path"], exc.status, exc.message)  # fmt: skip
        response = error_response(exc.status, exc.code, exc.message, exc.rule, ref=ref,
                                  headers={"Connection": "close"})  # fmt: skip
        await response(scope, receive, send)

    async def _read(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers
    ) -> bytes | None:
        """The whole body, or None once an error was answered (or the client left)."""
        limit = MAX_BODY_BYTES
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await self._refuse(scope, receive, send, ApiError(
                    400, "bad_content_length", "Content-Length is not a number"))  # fmt: skip
                return None
            if int(declared) > limit:
                await self._refuse(scope, receive, send, _too_large(limit))
                return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(BODY_SECONDS):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _TooLarge
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except _TooLarge:
            await self._refuse(scope, receive, send, _too_large(limit))
            return None
        except TimeoutError:
            await self._refuse(scope, receive, send, ApiError(
                408, "body_timeout", f"the request body did not arrive within {BODY_SECONDS:g} s; "
                "send it at once"))  # fmt: skip
            return None
        return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        "body_too_large",
        f"the request body is larger than {limit} bytes; every body here is a small JSON "
        "document (a message's text is at most 100,000 characters)",
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
