"""`/v1/shares`: share a file of a session's media by a link, list, revoke, fetch (P5, P6, K3).

- `POST /v1/shares` `{agent, session, path}`: `path` is relative to that
  session's media directory and must resolve inside it (P5). Needs a key
  naming the agent with `write: true` (K2), and for an isolated agent's
  channel chat an admin key (K3: a share would publish that chat's media).
  The answer holds the token once; only its hash is stored.
- `GET /v1/shares?agent=`: the shares a key may see, without tokens.
- `DELETE /v1/shares/{share}`: revoke by share id or token, only as the
  session that made it (P6) or with an admin key. The session is the share's
  own, never one the caller names: over the API a session acts through the
  key its API chat is bound to, so that key may revoke the shares of its
  sessions; a channel chat's share only an admin key (or its session, through
  the bridge). A `?session=` claim is ignored.

An API chat and its sessions belong to the key that started it (K4): another
non-admin key, even one naming the same agent, neither lists, shares from
nor revokes them.
- `GET /v1/shares/{token}`: the file, with no key (the token is the
  capability); an unknown token is 404, a revoked one 410.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.api.auth import (
    CallerKey,
    Principal,
    api_chat_facts,
    require,
    require_key,
    sees_conversation,
)
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import AccessRefused, ApiError
from orchestrator.api.ids import agent_id, relative_file, session_id, share_ref, share_token
from orchestrator.api.media_files import (
    MediaDir,
    file_response,
    media_dir_of_session,
    open_in,
    open_stored,
)
from orchestrator.bridge.safefiles import SafeFile
from orchestrator.store import Conversation, Session, SessionId, Share, ShareId
from orchestrator.store.queries import shares_of_agent
from policies.api_access import RequestFacts, decide
from policies.shares import revoke_share
from policies.status import refused

__all__ = ["ShareIn", "ShareOut", "create_share_checked", "router", "visible_shares"]

router = APIRouter(tags=["shares"])

Ctx = Annotated[ApiContext, Depends(context)]
AGENT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"


class ShareIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent: str = Field(max_length=40, json_schema_extra={"pattern": AGENT_PATTERN})
    session: str = Field(max_length=64, json_schema_extra={"pattern": r"^[A-Za-z0-9_-]{1,64}$"})
    path: str = Field(max_length=1024, description="Relative to the session's media directory.")


class ShareOut(BaseModel):
    id: str
    agent: str
    session: str
    conversation: str
    path: str
    created_at: float
    revoked_at: float | None
    revoked_by: str | None
    token: str | None = Field(None, description="Only in the answer that created the share.")
    url: str | None = Field(None, description="Only in the answer that created the share.")

    @classmethod
    def of(cls, s: Share, agent: str, token: str | None = None) -> ShareOut:
        return cls(id=s.id, agent=agent, session=s.session_id, conversation=s.conversation_id,
                   path=s.path, created_at=s.created_at, revoked_at=s.revoked_at,
                   revoked_by=s.revoked_by, token=token,
                   url=None if token is None else f"/v1/shares/{token}")  # fmt: skip


def _session_of(ctx: ApiContext, agent: str, sid: str) -> Session:
    session = ctx.store.get_session(SessionId(sid))
    if session is None or session.agent != agent:
        raise ApiError(404, "not_found", f"agent {agent!r} has no session {sid!r}")
    return session


def create_share_checked(
    ctx: ApiContext,
    who: Principal,
    body: ShareIn,
    kind: str,
    check: Callable[[SafeFile], None] | None = None,
) -> tuple[Share, str, MediaDir, SafeFile]:
    """Validate, decide (K2, K3), open the file (P5), run `check`, record the share.

    Returns the open file too; the caller closes it.
    """
    agent_id(body.agent)
    session_id(body.session)
    relative_file(body.path, "file path")
    require(ctx, who, body.agent, "shares" if kind == "share" else "image_artifacts",
            is_write=True)  # fmt: skip
    if not ctx.agent_known(body.agent):
        raise ApiError(404, "unknown_agent", f"no agent {body.agent!r} is configured")
    session = _session_of(ctx, body.agent, body.session)
    media = media_dir_of_session(ctx, session)
    require(ctx, who, body.agent, "media", media_owner=media.owner,
            api_chat=api_chat_facts(ctx, media.conversation))  # fmt: skip
    f = open_in(media, body.path)
    try:
        if check is not None:
            check(f)
        share, token = ctx.store.create_share(session.id, body.path)
    except BaseException:
        f.close()
        raise
    return share, token, media, f


@router.post("/v1/shares", response_model=ShareOut, status_code=201)
def create_share(body: ShareIn, who: CallerKey, ctx: Ctx) -> ShareOut:
    """Share one file of a session's media; the token in the answer is shown only once."""
    share, token, _media, f = create_share_checked(ctx, who, body, "share")
    f.close()
    return ShareOut.of(share, body.agent, token)


def visible_shares(
    ctx: ApiContext, who: Principal, agent: str | None, *, include_revoked: bool
) -> list[tuple[Share, Conversation]]:
    """The shares this key may see: every one for admin; else those of its agent, K3 applied."""
    if agent is None:
        if not who.admin:
            require_key(who)
            raise ApiError(400, "missing_agent", "name the agent: /v1/shares?agent=<id> "
                           "(only an admin key lists every agent's shares)")  # fmt: skip
    else:
        agent_id(agent)
        require(ctx, who, agent, "shares")
    rows = shares_of_agent(ctx.store, agent, include_revoked=include_revoked)
    if who.admin:
        return rows
    owners = ctx.store.api_chat_owners(agent)
    return [
        (s, c) for s, c in rows
        if sees_conversation(who, c, owners) and decide(who.facts, RequestFacts(
            agent=c.agent, agent_isolated=ctx.isolated(c.agent), kind="media",
            media_owner="api_session" if c.channel == "api" else "channel_chat")).allowed
    ]  # fmt: skip


@router.get("/v1/shares", response_model=list[ShareOut])
def list_shares(
    who: CallerKey,
    ctx: Ctx,
    agent: Annotated[str | None, Query(max_length=40)] = None,
    include_revoked: bool = False,
) -> list[ShareOut]:
    rows = visible_shares(ctx, who, agent, include_revoked=include_revoked)
    return [ShareOut.of(s, c.agent) for s, c in rows]


@router.delete("/v1/shares/{share}", response_model=ShareOut)
def delete_share(
    share: Annotated[str, Path(description="The share id (`sh_...`) or its token.")],
    who: CallerKey,
    ctx: Ctx,
) -> ShareOut:
    """Revoke a share: only the session that made it may (P6), or an admin key."""
    share_ref(share)
    require_key(who)
    row = (
        ctx.store.get_share(ShareId(share))
        if share.startswith("sh_")
        else ctx.store.get_share_by_token(share, include_revoked=True)
    )
    conv = None if row is None else ctx.store.get_conversation(row.conversation_id)
    if row is None or conv is None:
        raise ApiError(404, "not_found", "no such share")
    require(ctx, who, conv.agent, "shares", is_write=True)
    require(ctx, who, conv.agent, "media",
            media_owner="api_session" if conv.channel == "api" else "channel_chat")  # fmt: skip
    chat = api_chat_facts(ctx, conv)
    if chat is not None:  # P6: the key its API chat is bound to acts as its session
        require(ctx, who, conv.agent, "shares", is_write=True, api_chat=chat, revoking=True)
        acting = row.session_id if who.facts.ref == chat.owner else None
    else:  # a channel chat's session acts only through the bridge
        acting = None
    decision = revoke_share(row.session_id, acting, who.admin)
    if not decision.allowed:
        raise AccessRefused(refused(decision.rule, decision.reason, 403),
                            who.key_id or who.name or None)  # fmt: skip
    by = f"{who.source}:{who.key_id or who.name}" + (f" session:{acting}" if acting else "")
    return ShareOut.of(ctx.store.revoke_share(row.id, revoked_by=by), conv.agent)


@router.get(
    "/v1/shares/{share}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "The file."}},
    openapi_extra={"security": []},
)
def fetch_share(
    share: Annotated[str, Path(description="The share token: the link is the capability.")],
    ctx: Ctx,
) -> StreamingResponse:
    """The shared file; no key needed. Revoked: 410. The file is re-checked now (P5)."""
    share_token(share)
    row = ctx.store.get_share_by_token(share, include_revoked=True)
    if row is None:
        raise ApiError(404, "not_found", "no share has this token")
    if not row.active:
        raise ApiError(410, "gone", "this share has been revoked")
    session = ctx.store.get_session(row.session_id)
    if session is None:
        raise ApiError(410, "gone", "the session that made this share is gone")
    return file_response(open_stored(media_dir_of_session(ctx, session), row.path))
