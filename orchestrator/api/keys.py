"""`/v1/keys`: API keys in the store, for admin keys only (K2).

The same operations as `cellgate keys create | list | revoke`; a new key's
secret is in the creating answer only, and the store keeps just its hash.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from cellgate.errors import StoreError
from orchestrator.api.auth import CallerKey, require
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import key_id
from orchestrator.keys import create_operator_key
from orchestrator.store import ApiKey, KeyId

__all__ = ["KeyOut", "router"]

router = APIRouter(tags=["keys"])

Ctx = Annotated[ApiContext, Depends(context)]


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    agents: list[str] = Field(default_factory=list, max_length=100)
    all_agents: bool = False
    admin: bool = False
    write: bool = False


class KeyOut(BaseModel):
    id: str
    name: str
    prefix: str
    agents: list[str]
    admin: bool
    write: bool
    created_at: float
    last_used_at: float | None
    revoked_at: float | None
    secret: str | None = Field(None, description="Only in the answer that created the key.")

    @classmethod
    def of(cls, k: ApiKey, secret: str | None = None) -> KeyOut:
        return cls(id=k.id, name=k.name, prefix=k.prefix, agents=list(k.agents), admin=k.admin,
                   write=k.write, created_at=k.created_at, last_used_at=k.last_used_at,
                   revoked_at=k.revoked_at, secret=secret)  # fmt: skip


@router.get("/v1/keys", response_model=list[KeyOut])
def list_keys(who: CallerKey, ctx: Ctx) -> list[KeyOut]:
    require(ctx, who, "", "admin")
    return [KeyOut.of(k) for k in ctx.store.list_keys()]


@router.post("/v1/keys", response_model=KeyOut, status_code=201)
def create_key(body: KeyIn, who: CallerKey, ctx: Ctx) -> KeyOut:
    require(ctx, who, "", "admin", is_write=True)
    try:
        key, secret = create_operator_key(ctx.store, body.name, body.agents,
                                          all_agents=body.all_agents, admin=body.admin,
                                          write=body.write,
                                          known=set(ctx.gateway.agents))  # fmt: skip
    except StoreError as exc:
        raise ApiError(400, "bad_key_request", exc.reason) from exc
    return KeyOut.of(key, secret)


@router.delete("/v1/keys/{key}", response_model=KeyOut)
def revoke_key(
    key: Annotated[str, Path(json_schema_extra={"pattern": r"^key_[0-9a-f]{16}$"})],
    who: CallerKey,
    ctx: Ctx,
) -> KeyOut:
    key_id(key)
    require(ctx, who, "", "admin", is_write=True)
    return KeyOut.of(ctx.store.revoke_key(KeyId(key)))
