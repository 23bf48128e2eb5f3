"""`GET /v1/agents/{agent}/media/{path}`: a file from a chat's or an API session's media.

For an isolated agent a channel chat's media needs an admin key (K3), while an
API session's own media (`api-<session>/...`, where reply attachment URLs
point) stays readable with the agent's key that started that API chat, and
only with it or an admin key (K4). The path is checked
lexically (400), the decision is taken on its shape before any lookup (so a
refused key learns nothing about what exists), the directory is resolved
through the store (404), and the file is opened safely (P5).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from fastapi.responses import StreamingResponse

from orchestrator.api.auth import CallerKey, api_chat_facts, require
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import agent_id, media_path
from orchestrator.api.media_files import file_response, media_dir_of_path, open_in, owner_of

__all__ = ["router"]

router = APIRouter(tags=["media"])


@router.get(
    "/v1/agents/{agent}/media/{path:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "The file."}},
)
def get_media(
    agent: Annotated[str, Path(json_schema_extra={"pattern": r"^[a-z0-9][a-z0-9-]{0,39}$"})],
    path: Annotated[str, Path(description="`<media dir>/<file>`, e.g. `api-<session>/a.png`.")],
    who: CallerKey,
    ctx: Annotated[ApiContext, Depends(context)],
) -> StreamingResponse:
    agent_id(agent)
    mp = media_path(path)
    require(ctx, who, agent, "media", media_owner=owner_of(mp))
    if not ctx.agent_known(agent):
        raise ApiError(404, "unknown_agent", f"no agent {agent!r} is configured")
    media = media_dir_of_path(ctx, agent, mp)
    if media.session is not None:  # an API session's: only the key its chat is bound to (K4)
        require(ctx, who, agent, "media", media_owner=media.owner,
                api_chat=api_chat_facts(ctx, media.conversation))  # fmt: skip
    return file_response(open_in(media, mp.file))
