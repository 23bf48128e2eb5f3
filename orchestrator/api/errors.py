"""Every error the HTTP API answers with, mapped in one place.

The body is always `{"error": {"code", "message", "rule"?}}`: `code` is stable
and machine-readable, `message` says what is wrong and how to fix it, and
`rule` names the SPEC id when a rule refused (K2-K4, P5, P6, S4). cellgate's
own exceptions (`cellgate.errors`) stay framework-free; this module is
the only place that turns them into HTTP statuses.

    ApiError(status, code, message, rule)     raised by the API layer itself
    └── AccessRefused(decision)               a `policies` decision refused the request
"""

from __future__ import annotations

import logging
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
)
from policies.status import AccessDecision

logger = logging.getLogger(__name__)

__all__ = ["AccessRefused", "ApiError", "error_response", "install_error_handlers"]


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

    def __init__(self, decision: AccessDecision) -> None:
        self.decision = decision
        code = _ACCESS_CODES.get(decision.status, "refused")
        super().__init__(decision.status, code, decision.reason, decision.rule)


def error_response(status: int, code: str, message: str, rule: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if rule:
        body["rule"] = rule
    return JSONResponse({"error": body}, status_code=status)


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


def map_error(exc: CellgateError) -> JSONResponse:
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.code, exc.message, exc.rule)
    rule = exc.rule if isinstance(exc, PolicyDenied | Throttled) else None
    if isinstance(exc, MountVerificationFailed):
        rule = "S4"
    if isinstance(exc, SandboxesBusy):
        rule = "R4"
    for cls, status, code in _STATUS:
        if isinstance(exc, cls):
            message = exc.public if isinstance(exc, StoreFull) and exc.public else str(exc)
            response = error_response(status, code, message, rule)
            if isinstance(exc, Throttled) and exc.retry_after is not None:
                response.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            return response
    return error_response(500, "internal", str(exc))


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI) -> None:
    """The one mapping from exceptions to JSON errors."""

    @app.exception_handler(CellgateError)
    async def _cellgate_error(_: Request, exc: CellgateError) -> JSONResponse:
        response = map_error(exc)
        if response.status_code >= 500:
            logger.error("request failed: %s", exc)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        where = ".".join(str(p) for p in errs[0]["loc"]) if errs else "request"
        msg = errs[0]["msg"] if errs else "invalid request"
        return error_response(422, "invalid_request", f"{where}: {msg}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        response = error_response(exc.status_code, code, str(exc.detail))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response
