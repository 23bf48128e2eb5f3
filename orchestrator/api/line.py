"""The LINE webhook and the pictures `line_image` publishes (W2, W3, P5).

    POST /v1/line/{agent}/webhook                        (the Webhook URL set in LINE's console)
    GET  /v1/line/{agent}/images/{share}/{expires}/{sig} (what LINE fetches for a line_image)

Webhook: a request without `X-Line-Signature`, or for an agent without a
LINE channel, is answered 403 before its body is read. The body is read
bounded (413), then the signature is checked over those exact bytes, in
constant time (a re-serialised body with the same content fails); a mismatch
is 403 and nothing is parsed, stored or run. The events are stored
(idempotent on `webhookEventId`, W3) before the 200 that acknowledges them; a
failure to store answers 500, so LINE delivers them again.

Pictures: the URL names a share the session made and its expiry, signed by
the channel (a key derived from the channel secret). It is served only while
it has not expired, the share is not revoked (P6: the session may revoke it)
and the session that made it is still live (it is revoked with the session),
and the file is checked again now (P5). Everything else is 404 or 410.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from channels.base import ChannelFailed
from channels.line import LineChannel
from orchestrator.api.context import context
from orchestrator.api.errors import ApiError
from orchestrator.api.media_files import file_response, media_dir_of_session, open_stored
from orchestrator.store import SessionState, ShareId
from policies.line_images import ImageLinkFacts, image_link

__all__ = ["MAX_WEBHOOK_BYTES", "router"]

router = APIRouter(tags=["line"])

MAX_WEBHOOK_BYTES = 1024 * 1024  # a webhook is a few KB; content is fetched by message id
_FORBIDDEN = "missing or wrong X-Line-Signature"


class WebhookAck(BaseModel):
    ok: bool
    events: int


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_WEBHOOK_BYTES:
        raise ApiError(413, "too_large", f"a webhook is at most {MAX_WEBHOOK_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_WEBHOOK_BYTES:
            raise ApiError(413, "too_large", f"a webhook is at most {MAX_WEBHOOK_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _channel(request: Request, agent: str) -> LineChannel | None:
    channel = context(request).gateway.channels.get((agent, "line"))
    return channel if isinstance(channel, LineChannel) else None


@router.post(
    "/v1/line/{agent}/webhook",
    response_model=WebhookAck,
    responses={403: {"description": "missing or wrong X-Line-Signature (W2)"}},
)
async def webhook(
    agent: str,
    request: Request,
    signature: Annotated[str | None, Header(alias="X-Line-Signature", max_length=256)] = None,
) -> WebhookAck:
    channel = _channel(request, agent)
    if channel is None or not signature:
        raise ApiError(403, "forbidden", _FORBIDDEN, "W2")
    raw = await _body(request)
    if not channel.signature_valid(raw, signature):
        raise ApiError(403, "forbidden", _FORBIDDEN, "W2")
    try:
        data: Any = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, "bad_request", "the body is not JSON") from exc
    if not isinstance(data, dict) or not isinstance(data.get("events"), list):
        raise ApiError(400, "bad_request", "the body is not a LINE webhook")
    try:
        taken = await channel.process_body(raw, signature)
    except ChannelFailed as exc:  # pragma: no cover - the signature was checked above
        raise ApiError(403, "forbidden", _FORBIDDEN, "W2") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, "bad_request", "the body is not a LINE webhook") from exc
    return WebhookAck(ok=True, events=taken)


@router.get(
    "/v1/line/{agent}/images/{share}/{expires}/{sig}",
    response_class=StreamingResponse,
    responses={200: {"content": {"image/png": {}, "image/jpeg": {}}, "description": "The image."}},
    openapi_extra={"security": []},
)
def image(
    agent: str,
    share: Annotated[str, Path(max_length=64, pattern=r"^sh_[0-9a-f]{1,32}$")],
    expires: Annotated[int, Path(ge=0, le=2**40)],
    sig: Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9_-]{1,64}$")],
    request: Request,
) -> StreamingResponse:
    """A picture a LINE session published; the signed URL is the capability, and it expires."""
    channel = _channel(request, agent)
    signed = channel is not None and channel.image_url_valid(share, expires, sig)
    ctx = context(request)
    row = ctx.store.get_share(ShareId(share)) if signed else None
    session = ctx.store.get_session(row.session_id) if row is not None else None
    media = media_dir_of_session(ctx, session) if session is not None else None
    decision = image_link(
        ImageLinkFacts(
            signed=signed,
            now=time.time(),
            expires=expires,
            share_found=media is not None
            and (media.conversation.agent, media.conversation.channel) == (agent, "line"),
            share_revoked=row is not None and not row.active,
            session_live=session is not None and session.state == SessionState.LIVE,
        )
    )
    if not decision.allowed:
        if decision.reason == "no such image":
            raise ApiError(404, "not_found", decision.reason)
        raise ApiError(410, "gone", decision.reason, decision.rule)
    assert media is not None and row is not None
    return file_response(open_stored(media, row.path))
