"""The HTTP API: the chat endpoint of the `api` channel (and, later, the admin API).

`POST /v1/agents/{agent}/chats/{chat_id}/messages` with `{"text": ...}` and
`Authorization: Bearer <key>` runs one turn in that chat's conversation and
answers with the agent's reply. Errors are JSON `{"error": {code, message, rule}}`,
mapped from cellgate's own exceptions in one place.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.errors import (
    AgentUnavailable,
    CellgateError,
    ConfigError,
    ConversationError,
    EngineUnavailable,
    MountVerificationFailed,
    PolicyDenied,
    SandboxError,
    TurnTimeout,
    UnknownAgent,
)
from orchestrator.gateway import Gateway

logger = logging.getLogger(__name__)


class ApiError(CellgateError):
    def __init__(self, status: int, code: str, message: str, rule: str | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.rule = rule
        super().__init__(message)


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=100_000)


class MessageOut(BaseModel):
    ok: bool
    reply: str
    turn_id: str
    conversation: str
    meta: dict[str, Any]


def _error(status: int, code: str, message: str, rule: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if rule:
        body["rule"] = rule
    return JSONResponse({"error": body}, status_code=status)


_STATUS: tuple[tuple[type[CellgateError], int, str], ...] = (
    (UnknownAgent, 404, "unknown_agent"),
    (ConversationError, 400, "bad_conversation"),
    (PolicyDenied, 403, "policy_denied"),
    (TurnTimeout, 504, "turn_timeout"),
    (AgentUnavailable, 503, "agent_unavailable"),
    (EngineUnavailable, 503, "engine_unavailable"),
    (MountVerificationFailed, 500, "sandbox_drifted"),
    (SandboxError, 502, "sandbox_error"),
    (ConfigError, 500, "config_error"),
)


def _map_error(exc: CellgateError) -> JSONResponse:
    if isinstance(exc, ApiError):
        return _error(exc.status, exc.code, exc.message, exc.rule)
    rule = exc.rule if isinstance(exc, PolicyDenied) else None
    if isinstance(exc, MountVerificationFailed):
        rule = "S4"
    for cls, status, code in _STATUS:
        if isinstance(exc, cls):
            return _error(status, code, str(exc), rule)
    return _error(500, "internal", str(exc))


def _authorize(gateway: Gateway, request: Request, agent: str) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret:
        raise ApiError(401, "unauthorized", "send `Authorization: Bearer <api key>`")
    for key in gateway.config.api_keys:
        if hmac.compare_digest(key.key.get_secret_value().encode(), secret.encode()):
            if "*" in key.agents or agent in key.agents:
                return
            raise ApiError(403, "forbidden", f"this key may not use agent {agent!r}")
    raise ApiError(401, "unauthorized", "unknown or revoked API key")


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="cellgate", version="0.1.0")

    @app.exception_handler(CellgateError)
    async def _cellgate_error(_: Request, exc: CellgateError) -> JSONResponse:
        response = _map_error(exc)
        if response.status_code >= 500:
            logger.error("request failed: %s", exc)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        where = ".".join(str(p) for p in errs[0]["loc"]) if errs else "request"
        msg = errs[0]["msg"] if errs else "invalid request"
        return _error(422, "invalid_request", f"{where}: {msg}")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/agents/{agent}/chats/{chat_id}/messages", response_model=MessageOut)
    async def post_message(agent: str, chat_id: str, body: MessageIn, request: Request) -> MessageOut:
        _authorize(gateway, request, agent)
        if "\x00" in chat_id or len(chat_id) > 512:
            raise ApiError(400, "bad_chat_id", "chat id must be 1-512 characters without NUL")
        outcome = await gateway.turn(agent, "api", chat_id, body.text)
        r = outcome.result
        return MessageOut(
            ok=r.ok,
            reply=r.reply,
            turn_id=r.turn_id,
            conversation=outcome.conversation.dir_name,
            meta=dict(r.meta),
        )

    return app
