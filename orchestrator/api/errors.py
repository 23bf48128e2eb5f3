"""Every error the HTTP API answers with, mapped in one place (R6).

The body is always `{"error": {"code", "message", "ref", "rule"?}}`: `code` is
stable and machine-readable, `message` says what is wrong and how to fix it,
`ref` (`r-` and 12 hex) names this one answer in the gateway's log, and
`rule` names the SPEC id when a rule refused (K2-K4, P5, P6, S4).

R6: a failure that is not the caller's fault (any 5xx) answers a short fixed
message for its code and the ref; its details (exception text, host paths,
stack) go to the log under that ref and to the audit table (`refusals`, rule
R6). A known key refused past its scope (K3, K4, P6) gets an audit row too.
A caller's own mistake (4xx) keeps its clear message, with every host path
in it replaced (`<state dir>`, `<host path>`): a message may name the
sandbox's paths (`/workspace/...`) and the API's (`/v1/...`), never the host's.

cellgate's own exceptions (`cellgate.errors`) stay framework-free; this module
is the only place that turns them into HTTP statuses.

    ApiError(status, code, message, rule)     raised by the API layer itself
    └── AccessRefused(decision)               a `policies` decision refused the request
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cellgate.errors import (
    AgentUnavailable,
    CellgateError,
    ConfigError,
    ConversationError,
    EngineUnavailable,
    MountVerificationFailed,
    NotFound,
    PolicyDenied,
    SandboxError,
    SandboxesBusy,
    StateConflict,
    StoreFull,
    Throttled,
    TurnTimeout,
    UnknownAgent,
    new_ref,
)
from policies.status import AccessDecision

logger = logging.getLogger(__name__)

__all__ = [
    "AccessRefused",
    "ApiError",
    "error_response",
    "install_error_handlers",
    "new_ref",
    "scrub",
]


class ApiError(CellgateError):
    """An answer the API layer decided on: a status, a stable code, a message, a rule."""

    def __init__(self, status: int, code: str, message: str, rule: str | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.rule = rule
        super().__init__(message)


_ACCESS_CODES = {401: "unauthorized", 403: "forbidden"}


class AccessRefused(ApiError):
    """A refusal by `policies.api_access` (or another policy), with the status it names."""

    def __init__(self, decision: AccessDecision, key: str | None = None) -> None:
        self.decision = decision
        self.key = key
        """The refused key's id or name, for the audit row; never its secret."""
        code = _ACCESS_CODES.get(decision.status, "refused")
        super().__init__(decision.status, code, decision.reason, decision.rule)


_SANDBOX_OR_API = ("/workspace", "/v1/", "/home/agent")
_ABS_PATH = re.compile(r"(?<![\w.~>-])/[\w.@+~-]+(?:/[\w.@+~-]*)+")


def scrub(message: str, roots: Iterable[str] = ()) -> str:
    """`message` with every host path replaced: the known roots first, then any absolute path
    that is not the sandbox's (`/workspace/...`) or the API's (`/v1/...`)."""
    for root in sorted({r.rstrip("/") for r in roots if len(r.rstrip("/")) > 1}, key=len,
                       reverse=True):  # fmt: skip
        message = message.replace(root, "<state dir>")

    def _one(m: re.Match[str]) -> str:
        path = m.group(0)
        return path if path.startswith(_SANDBOX_OR_API) else "<host path>"

    return _ABS_PATH.sub(_one, message)


def error_response(
    status: int,
    code: str,
    message: str,
    rule: str | None = None,
    *,
    ref: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The one error body; `message` is shown as given (scrub it first if it may hold paths)."""
    body: dict[str, Any] = {"code": code, "message": message, "ref": ref or new_ref()}
    if rule:
        body["rule"] = rule
    return JSONResponse({"error": body}, status_code=status, headers=dict(headers or {}))


_STATUS: tuple[tuple[type[CellgateError], int, str], ...] = (
    (Throttled, 429, "throttled"),
    (SandboxesBusy, 503, "busy"),
    (StoreFull, 503, "storage_full"),
    (UnknownAgent, 404, "unknown_agent"),
    (ConversationError, 400, "bad_conversation"),
    (PolicyDenied, 403, "policy_denied"),
    (TurnTimeout, 504, "turn_timeout"),
    (AgentUnavailable, 503, "agent_unavailable"),
    (EngineUnavailable, 503, "engine_unavailable"),
    (MountVerificationFailed, 500, "sandbox_drifted"),
    (SandboxError, 502, "sandbox_error"),
    (ConfigError, 500, "config_error"),
    (NotFound, 404, "not_found"),
    (StateConflict, 409, "conflict"),
)

_FAILURE_MESSAGES = {
    "turn_timeout": "the agent did not answer in time; try again",
    "agent_unavailable": "this agent cannot take turns right now; try again later",
    "engine_unavailable": "the sandbox engine is not available right now; try again later",
    "sandbox_drifted": "this chat's sandbox failed its safety check and is refused; "
    "it is recreated on the next turn",
    "sandbox_error": "the sandbox could not run this request",
    "config_error": "the gateway is misconfigured",
}


_STATES = (AgentUnavailable, EngineUnavailable, TurnTimeout)
"""Failures that are a state, not a bug: no traceback in the log (a caller repeating
a message to a stopped app must not fill the log with stacks)."""


def classify(exc: CellgateError) -> tuple[int, str, str, str | None]:
    """Status, code, the exception's own message (may hold host paths), rule."""
    if isinstance(exc, ApiError):
        return exc.status, exc.code, exc.message, exc.rule
    rule = exc.rule if isinstance(exc, PolicyDenied | Throttled) else None
    if isinstance(exc, MountVerificationFailed):
        rule = "S4"
    if isinstance(exc, SandboxesBusy):
        rule = "R4"
    for cls, status, code in _STATUS:
        if isinstance(exc, cls):
            return status, code, str(exc), rule
    return 500, "internal", str(exc), rule


def failure_message(code: str, ref: str) -> str:
    """R6: what a stranger reads of a failure: short, fixed, and the ref to quote."""
    what = _FAILURE_MESSAGES.get(code, "the gateway failed to answer this request")
    return f"{what} (ref {ref}; the operator finds the details in the gateway log)"


def _host_roots(request: Request) -> list[str]:
    ctx = getattr(request.app.state, "cellgate", None)
    if ctx is None:
        return []
    roots: list[str] = []
    state = ctx.gateway.config.gateway.state_dir
    roots += [str(state), str(state.expanduser().resolve())]
    for agent in ctx.gateway.agents:
        ws = ctx.workspace(agent)
        roots += [str(ws), str(ws.resolve())]
    return roots


def _api_action(request: Request) -> str:
    """An audit row's action: the method and the route's template, never the path itself
    (a path holds chat ids; the action is a metrics label, so it must come from a fixed set)."""
    route = request.scope.get("route")
    template = getattr(route, "path", None)
    return f"api {request.method[:16]} {template if isinstance(template, str) else '(no route)'}"


def _audit(request: Request, ref: str, status: int, code: str, exc: BaseException) -> None:
    """The R6 audit row of a failure; a store that cannot take it is logged, not raised."""
    ctx = getattr(request.app.state, "cellgate", None)
    if ctx is None:
        return
    try:
        ctx.store.record_refusal(
            rule="R6",
            action=_api_action(request),
            reason=f"{status} {code}",
            detail={
                "ref": ref,
                "path": request.url.path[:300],
                "error": type(exc).__name__,
                "message": str(exc)[:4000],
            },
        )
    except CellgateError as audit_exc:
        logger.error("ref=%s: the audit row could not be written: %s", ref, audit_exc)


_AUDITED_RULES = frozenset({"K3", "K4", "P6"})
"""Refusals of a known key reaching past its scope: each gets an audit row (a key that
is missing or unknown does not, so a stranger's flood writes nothing)."""


def _audit_refusal(request: Request, ref: str, exc: AccessRefused) -> None:
    ctx = getattr(request.app.state, "cellgate", None)
    if ctx is None:
        return
    try:
        ctx.store.record_refusal(
            rule=exc.decision.rule,
            action=_api_action(request),
            reason=exc.decision.reason,
            detail={"ref": ref, "key": exc.key, "path": request.url.path[:300]},
        )
    except CellgateError as audit_exc:
        logger.error("ref=%s: the audit row could not be written: %s", ref, audit_exc)


async def answer_failure(
    request: Request, exc: BaseException, status: int, code: str, rule: str | None = None
) -> JSONResponse:
    """R6: log the details under a fresh ref, audit them, answer the short message.

    A state the operator chose or the engine is in (an app stopped, no engine, a turn
    past its limit) is one warning line; anything else is an error with its traceback.
    """
    ref = new_ref()
    expected = isinstance(exc, _STATES)
    logger.log(
        logging.WARNING if expected else logging.ERROR,
        "ref=%s %s %s failed (%d %s): %s: %s",
        ref, request.method, request.url.path, status, code, type(exc).__name__, exc,
        exc_info=None if expected else exc,
    )  # fmt: skip
    await asyncio.to_thread(_audit, request, ref, status, code, exc)
    return error_response(status, code, failure_message(code, ref), rule, ref=ref)


def answer_error(request: Request, status: int, code: str, message: str,
                 rule: str | None = None, ref: str | None = None) -> JSONResponse:  # fmt: skip
    """A caller's mistake (4xx): its clear message, host paths scrubbed, and a ref."""
    ref = ref or new_ref()
    logger.debug("ref=%s %s %s -> %d %s: %s", ref, request.method, request.url.path, status,
                 code, message)  # fmt: skip
    return error_response(status, code, scrub(message, _host_roots(request)), rule, ref=ref)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


_TRY_AGAIN = (Throttled, SandboxesBusy, StoreFull)
"""Refusals that are nobody's fault and pass (R4, R7): their polite words, and when to retry."""


def _try_again(
    request: Request, exc: CellgateError, status: int, code: str, rule: str | None
) -> JSONResponse:
    message = str(exc) if isinstance(exc, Throttled) else (exc.public or code)
    response = answer_error(request, status, code, message, rule)
    retry = exc.retry_after if isinstance(exc, Throttled) else None
    response.headers["Retry-After"] = str(max(1, round(retry if retry is not None else 30)))
    return response


def install_error_handlers(app: FastAPI) -> None:
    """The one mapping from exceptions to JSON errors."""

    @app.exception_handler(CellgateError)
    async def _cellgate_error(request: Request, exc: CellgateError) -> JSONResponse:
        status, code, message, rule = classify(exc)
        if isinstance(exc, _TRY_AGAIN):
            return _try_again(request, exc, status, code, rule)
        if status >= 500:
            return await answer_failure(request, exc, status, code, rule)
        ref = new_ref()
        if isinstance(exc, AccessRefused) and exc.key and rule in _AUDITED_RULES:
            await asyncio.to_thread(_audit_refusal, request, ref, exc)
        return answer_error(request, status, code, message, rule, ref)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        where = ".".join(str(p) for p in errs[0]["loc"]) if errs else "request"
        msg = errs[0]["msg"] if errs else "invalid request"
        return answer_error(request, 422, "invalid_request", f"{where}: {msg}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code >= 500:
            return await answer_failure(request, exc, exc.status_code, "http_error")
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        response = answer_error(request, exc.status_code, code, str(exc.detail))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return await answer_failure(request, exc, 500, "internal")
