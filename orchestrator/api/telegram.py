"""The Telegram webhook on the gateway's own HTTP server (W2, W3).

    POST /v1/telegram/{agent}/webhook      (what `setWebhook` points Telegram at)

A request without the agent's `X-Telegram-Bot-Api-Secret-Token`, or with
another one, is answered 403 before its body is read, and nothing is stored
or run (an unknown agent, or one without a webhook, gets the same 403, so the
route tells a stranger nothing). The update is stored (idempotent on its
ids) before the 200 that acknowledges it; a failure to store answers 500, so
Telegram delivers it again.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from pydantic import BaseModel

from channels.telegram import TelegramChannel
from orchestrator.api.context import context
from orchestrator.api.errors import ApiError

__all__ = ["MAX_UPDATE_BYTES", "router"]

router = APIRouter(tags=["telegram"])

MAX_UPDATE_BYTES = 1024 * 1024  # an update is a few KB; files are fetched by id


class WebhookAck(BaseModel):
    ok: bool


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_UPDATE_BYTES:
        raise ApiError(413, "too_large", f"an update is at most {MAX_UPDATE_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_UPDATE_BYTES:
            raise ApiError(413, "too_large", f"an update is at most {MAX_UPDATE_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post(
    "/v1/telegram/{agent}/webhook",
    response_model=WebhookAck,
    responses={403: {"description": "missing or wrong secret token (W2)"}},
)
async def webhook(
    agent: str,
    request: Request,
    secret: Annotated[str | None, Header(alias="X-Telegram-Bot-Api-Secret-Token")] = None,
) -> WebhookAck:
    channel = context(request).gateway.channels.get((agent, "telegram"))
    if (
        not isinstance(channel, TelegramChannel)
        or channel.options.mode != "webhook"
        or not channel.secret_matches(secret)
    ):
        raise ApiError(403, "forbidden", "missing or wrong X-Telegram-Bot-Api-Secret-Token", "W2")
    raw = await _body(request)
    try:
        data: Any = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, "bad_request", "the body is not JSON") from exc
    if not isinstance(data, dict) or not isinstance(data.get("update_id"), int):
        raise ApiError(400, "bad_request", "the body is not a Telegram update")
    try:
        await channel.process_update(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, "bad_request", "the body is not a Telegram update") from exc
    return WebhookAck(ok=True)
