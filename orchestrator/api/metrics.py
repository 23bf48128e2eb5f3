"""`/metrics`: the gateway's Prometheus series (O2), for admin keys only (K2)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Response

from orchestrator.api.auth import CallerKey, require
from orchestrator.api.context import ApiContext, context
from orchestrator.metrics import CONTENT_TYPE

__all__ = ["router"]

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(ctx: Annotated[ApiContext, Depends(context)], who: CallerKey) -> Response:
    """The Prometheus text format; send an admin key as a Bearer token."""
    require(ctx, who, "", "admin")
    body = await asyncio.to_thread(ctx.gateway.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
