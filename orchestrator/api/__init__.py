"""The HTTP API: the `api` channel's chat endpoint and the operator's admin API.

    create_app(gateway) -> FastAPI       OpenAPI schema at /openapi.json

Routers, one per resource: `chat` (send a message), `chats` (an agent's
chats, sessions, messages, search, active days, inject), `media`, `shares`,
`artifacts` (`/v1/image-artifacts`), `keys`, `cron` (an agent's cron jobs, C1, C2),
`telegram` (the webhook, W2), `line`
(the webhook, W2, and the expiring `line_image` URLs, P5), `apps` (`/api/v1/apps`:
install, inspect, update, ..., restore; admin keys).
Who may call what is decided in
`policies.api_access` (K2-K4), `policies.paths` (P5) and `policies.shares`
(P6); `auth` gathers a key's facts, `ids` checks every id in a path (400), and
`pathguard` refuses traversal in any path before routing, `bodyguard` checks
the key before a body is read and bounds the body (413, 408), and `errors`
maps every exception to `{"error": {code, message, ref, rule}}` in one place
(R6: a failure's details go to the log under its ref, never to the caller).
"""

from __future__ import annotations

from fastapi import FastAPI

from orchestrator.api import (
    apps,
    artifacts,
    chat,
    chats,
    cron,
    dashboard,
    keys,
    line,
    media,
    metrics,
    shares,
    telegram,
)
from orchestrator.api.bodyguard import BodyGuard
from orchestrator.api.context import ApiContext
from orchestrator.api.errors import install_error_handlers
from orchestrator.api.pathguard import PathGuard
from orchestrator.gateway import Gateway

__all__ = ["create_app"]


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(
        title="cellgate",
        version="0.1.0",
        description="One sandbox per conversation. Admin API: see README, section Operating.",
    )
    ctx = ApiContext(gateway)
    app.state.cellgate = ctx
    install_error_handlers(app)
    app.add_middleware(BodyGuard, ctx=ctx)
    app.add_middleware(PathGuard)  # outermost: a traversal is refused before anything

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    for module in (
        chat,
        chats,
        cron,
        media,
        shares,
        artifacts,
        keys,
        metrics,
        dashboard,
        telegram,
        line,
        apps,
    ):
        app.include_router(module.router)
    return app
