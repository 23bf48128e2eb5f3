"""`/v1/image-artifacts`: an image file of a session's media, registered for download (P5).

An image artifact is a share whose file is an image (PNG, JPEG, GIF or WebP
by its first bytes, not by its name): `POST` checks the file like a share
(P5, K2, K3), refuses anything else with 415, and answers with the download
link (`/v1/shares/<token>`), shown once. `GET` lists the active shares of an
agent that are images now, each re-opened safely to tell.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel

from orchestrator.api.auth import CallerKey
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.media_files import image_type, media_dir_of_session, open_stored
from orchestrator.api.shares import ShareIn, create_share_checked, visible_shares
from orchestrator.bridge.safefiles import SafeFile
from orchestrator.store import Share

logger = logging.getLogger(__name__)

__all__ = ["router"]

router = APIRouter(tags=["image-artifacts"])

Ctx = Annotated[ApiContext, Depends(context)]


class ImageArtifactOut(BaseModel):
    id: str
    agent: str
    session: str
    path: str
    media_type: str
    size: int
    created_at: float
    token: str | None = None
    url: str | None = None

    @classmethod
    def of(
        cls, s: Share, agent: str, mime: str, size: int, token: str | None = None
    ) -> ImageArtifactOut:
        return cls(id=s.id, agent=agent, session=s.session_id, path=s.path, media_type=mime,
                   size=size, created_at=s.created_at, token=token,
                   url=None if token is None else f"/v1/shares/{token}")  # fmt: skip


def _must_be_image(f: SafeFile) -> None:
    if image_type(f) is None:
        raise ApiError(415, "not_an_image", f"{f.rel!r} is not a PNG, JPEG, GIF or WebP image; "
                       "share other files with POST /v1/shares")  # fmt: skip


@router.post("/v1/image-artifacts", response_model=ImageArtifactOut, status_code=201)
def create_image_artifact(body: ShareIn, who: CallerKey, ctx: Ctx) -> ImageArtifactOut:
    share, token, _media, f = create_share_checked(ctx, who, body, "image", _must_be_image)
    try:
        mime = image_type(f) or "application/octet-stream"
        return ImageArtifactOut.of(share, body.agent, mime, f.size, token)
    finally:
        f.close()


@router.get("/v1/image-artifacts", response_model=list[ImageArtifactOut])
def list_image_artifacts(
    who: CallerKey, ctx: Ctx, agent: Annotated[str | None, Query(max_length=40)] = None
) -> list[ImageArtifactOut]:
    out: list[ImageArtifactOut] = []
    for share, conv in visible_shares(ctx, who, agent, include_revoked=False):
        session = ctx.store.get_session(share.session_id)
        if session is None:
            continue
        try:
            f = open_stored(media_dir_of_session(ctx, session), share.path)
        except ApiError as exc:  # gone, or refused now (P5): not listed
            logger.debug("share %s not listed as an image: %s", share.id, exc.message)
            continue
        with f:
            mime = image_type(f)
            if mime is not None:
                out.append(ImageArtifactOut.of(share, conv.agent, mime, f.size))
    return out
