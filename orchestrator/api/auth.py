"""Who is calling: the API key of a request, as facts for `policies.api_access` (K2-K4).

Keys are looked up in the store first (`cellgate keys create`; only a sha256
of each secret is kept), then among the config file's `apiKeys` (for first
runs). A store key's last use is recorded, at most once a minute. Whether a
key may do something is never decided here: `require` hands the facts to
`policies.api_access.decide` and applies its decision.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import AccessRefused, ApiError
from orchestrator.store import ApiKey, Conversation, ConversationId, KeyId
from orchestrator.store.queries import key_by_secret
from policies.api_access import ApiChatFacts, Endpoint, KeyFacts, MediaOwner, RequestFacts, decide
from policies.status import AccessDecision

logger = logging.getLogger(__name__)

__all__ = [
    "PRINCIPAL_STATE",
    "CallerKey",
    "Principal",
    "api_chat_facts",
    "authenticate",
    "bearer_secret",
    "require",
    "require_key",
    "sees_conversation",
]

PRINCIPAL_STATE = "cellgate_principal"
"""Where `bodyguard` leaves the principal it found, in the request's state."""
TOUCH_EVERY_SECONDS = 60.0
MAX_SECRET = 512

bearer = HTTPBearer(
    auto_error=False,
    description="An API key: `cellgate keys create` (or `apiKeys` in the config file).",
)


def config_key_ref(name: str) -> str:
    """How the store names a key of the config file (an API chat's binding, K4)."""
    return f"config:{name}"


@dataclass(frozen=True, slots=True)
class Principal:
    """The key a request carried; `facts` is all a policy sees of it."""

    facts: KeyFacts
    name: str = ""
    key_id: KeyId | None = None
    source: Literal["store", "config", "none"] = "none"

    @property
    def admin(self) -> bool:
        return self.facts.present and not self.facts.revoked and self.facts.admin


ANONYMOUS = Principal(KeyFacts(present=False))


def _store_key(key: ApiKey) -> Principal:
    facts = KeyFacts(
        present=True,
        revoked=not key.active,
        admin=key.admin,
        write=key.write,
        agents=frozenset(key.agents),
        ref=key.id,
    )
    return Principal(facts, key.name, key.id, "store")


def authenticate(ctx: ApiContext, secret: str | None) -> Principal:
    """The principal for `secret`; an unknown secret is refused (401) here."""
    if not secret:
        return ANONYMOUS
    if len(secret) > MAX_SECRET:
        raise ApiError(401, "unauthorized", "unknown API key", "K2")
    key = key_by_secret(ctx.store, secret)
    if key is not None:
        if key.active and (
            key.last_used_at is None or time.time() - key.last_used_at > TOUCH_EVERY_SECONDS
        ):
            ctx.store.touch_key(key.id)
        return _store_key(key)
    given = secret.encode("utf-8", "surrogatepass")
    for conf in ctx.gateway.config.api_keys:
        if hmac.compare_digest(conf.key.get_secret_value().encode(), given):
            facts = KeyFacts(
                present=True,
                admin=conf.admin,
                write=conf.write,
                agents=frozenset(conf.agents),
                ref=config_key_ref(conf.name),
            )
            return Principal(facts, conf.name, None, "config")
    raise ApiError(
        401,
        "unauthorized",
        "unknown API key: check the secret, or mint one with `cellgate keys create`",
        "K2",
    )


def bearer_secret(authorization: str | None) -> str | None:
    """The secret of an `Authorization: Bearer <secret>` header, as `HTTPBearer` reads it."""
    if not authorization:
        return None
    scheme, _, secret = authorization.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        return None
    return secret


def _principal(
    request: Request,
    ctx: Annotated[ApiContext, Depends(context)],
    creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> Principal:
    found = request.scope.get("state", {}).get(PRINCIPAL_STATE)
    if isinstance(found, Principal):  # `bodyguard` already looked it up, before the body
        return found
    return authenticate(ctx, creds.credentials if creds is not None else None)


CallerKey = Annotated[Principal, Depends(_principal)]
"""The endpoint parameter that authenticates a request."""


def require(
    ctx: ApiContext,
    who: Principal,
    agent: str,
    kind: Endpoint,
    *,
    media_owner: MediaOwner | None = None,
    is_write: bool = False,
    api_chat: ApiChatFacts | None = None,
    revoking: bool = False,
) -> AccessDecision:
    """Gather the request's facts, ask the policy, and raise its refusal (401/403)."""
    facts = RequestFacts(
        agent=agent,
        agent_isolated=ctx.isolated(agent),
        kind=kind,
        media_owner=media_owner,
        is_write=is_write,
        api_chat=api_chat,
        revoking=revoking,
    )
    decision = decide(who.facts, facts)
    if not decision.allowed:
        logger.info(
            "refused %s on agent %s for key %s: %s (%s)",
            kind, agent, who.key_id or who.name or "-", decision.reason, decision.rule,
        )  # fmt: skip
        raise AccessRefused(decision, who.key_id or who.name or None)
    return decision


def require_key(who: Principal) -> None:
    """401 before any lookup, for endpoints whose agent is known only after one."""
    if not who.facts.present or who.facts.revoked:
        raise AccessRefused(decide(who.facts, RequestFacts("", False, "admin")))


def api_chat_facts(ctx: ApiContext, conv: Conversation) -> ApiChatFacts | None:
    """For an API chat, the key it is bound to (K4, P6); None for a channel chat."""
    if conv.channel != "api":
        return None
    return ApiChatFacts(ctx.store.api_chat_owner(conv.id))


def sees_conversation(
    who: Principal, conv: Conversation, owners: Mapping[ConversationId, str]
) -> bool:
    """In a listing: may this key see `conv`? Every channel chat here; of API chats, its own.

    `owners` is `store.api_chat_owners(...)`, read once for the whole listing.
    """
    if who.admin or conv.channel != "api":
        return True
    owner = owners.get(conv.id)
    return owner is not None and owner == who.facts.ref
