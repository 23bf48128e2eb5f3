"""Who may call the admin API, and the keys minted for host agents (K2, K3, K4).

- K2 key scope: a request needs a key that is present and not revoked (401),
  that names the agent or is an admin key (403), and that may write when the
  endpoint writes (403). A host agent's MCP server gets a key minted by
  `mcp_key_for_host_agent`: non-admin, naming exactly that agent, write only
  when needed (WhatsApp and WeChat replies); `key_spec_ok_for_host_agent`
  refuses any wider key.
- K3 for an isolated agent, the chats endpoints (chat list, sessions,
  messages, search, active days, session inject) and a channel chat's media
  refuse a non-admin key with 403.
- K4 an API session's own media (`media/api-<session>/…`) stays readable with
  the agent's key: with the key that started its API chat. An API chat, and
  every session in it, is bound to that key (`ApiChatFacts`): another
  non-admin key, even one naming the same agent, may not send in it, list
  it, read it or its media, or share from it (K4), nor revoke its shares
  (P6: a share is revoked only by the session that made it, which over the
  API is the key that owns that session). An admin key may. A chat started
  before chats were bound to keys is bound to none: only an admin key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from policies.base import Decision, allow, deny
from policies.status import AccessDecision, granted, refused

__all__ = [
    "WILDCARD",
    "ApiChatFacts",
    "Endpoint",
    "KeyFacts",
    "KeySpec",
    "MediaOwner",
    "RequestFacts",
    "decide",
    "host_agent_needs_write",
    "key_spec_ok_for_host_agent",
    "mcp_key_for_host_agent",
]

WILDCARD = "*"
_WRITE_CHANNELS = frozenset({"whatsapp", "wechat"})

Endpoint = Literal["chats", "media", "shares", "image_artifacts", "message", "agent", "admin"]
"""`chats`: /v1/agents/:id/chats… (list, sessions, messages, search, active days, inject);
`media`: /v1/agents/:id/media/*; `message`: sending to the agent; `agent`: the agent's own
settings; `admin`: gateway-wide endpoints (keys, config) that only an admin key reaches."""

MediaOwner = Literal["api_session", "channel_chat", "other"]
"""Whose directory a media path is in: `media/api-<session>`, `media/<channel>-<chat>`, else."""


@dataclass(frozen=True, slots=True)
class KeyFacts:
    """The API key a request carried, as the key store knows it."""

    present: bool
    revoked: bool = False
    admin: bool = False
    write: bool = False
    agents: frozenset[str] = frozenset()
    ref: str | None = None
    """Who the key is, as API chats are bound to it: a store key id or `config:<name>`."""


@dataclass(frozen=True, slots=True)
class ApiChatFacts:
    """The API chat a request touches (its sessions, media, shares), and its key."""

    owner: str | None
    """The `KeyFacts.ref` it is bound to; None: started before chats were bound to keys."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """The request: which agent, which endpoint, and for media whose directory."""

    agent: str
    agent_isolated: bool
    kind: Endpoint
    media_owner: MediaOwner | None = None
    is_write: bool = False
    api_chat: ApiChatFacts | None = None
    """Set when the request touches an API chat (or one of its sessions)."""
    revoking: bool = False
    """Revoking a share: a refusal on the API chat's key is then P6."""


def decide(key: KeyFacts, request: RequestFacts) -> AccessDecision:
    if not key.present:
        return refused("K2", "this endpoint needs an API key (Authorization: Bearer <key>)", 401)
    if key.revoked:
        return refused("K2", "this API key has been revoked; ask the operator for a new one", 401)
    if key.admin:
        return granted("K2", "admin key")
    if request.kind == "admin":
        return refused("K2", "this endpoint needs an admin key", 403)
    if not request.agent or not (request.agent in key.agents or WILDCARD in key.agents):
        return refused(
            "K2", f"this API key does not name agent {request.agent!r} in its agents list", 403
        )
    if request.is_write and not key.write:
        return refused("K2", "this endpoint writes; it needs a key with write: true", 403)
    if request.api_chat is not None:
        bound = _api_chat_binding(key, request.api_chat, "P6" if request.revoking else "K4")
        if bound is not None:
            return bound
    if request.agent_isolated and request.kind == "chats":
        return refused(
            "K3",
            f"agent {request.agent!r} isolates its conversations: listing or reading its chats, "
            "sessions and messages needs an admin key",
            403,
        )
    if request.kind == "media":
        if request.media_owner == "api_session":
            return granted("K4", "an API session's own media is readable with the agent's key")
        if request.agent_isolated:
            return refused(
                "K3",
                f"agent {request.agent!r} isolates its conversations: a chat's media needs an "
                "admin key; an API session's own media (media/api-<session>/…) stays readable",
                403,
            )
    return granted("K2")


def _api_chat_binding(key: KeyFacts, chat: ApiChatFacts, rule: str) -> AccessDecision | None:
    """K4, P6: a non-admin key reaches only the API chats it started."""
    if chat.owner is None:
        return refused(
            rule,
            "this API chat was started before API chats were bound to the key that started "
            "them, so it is bound to none: only an admin key may reach it; start a new chat id",
            403,
        )
    if key.ref is None or key.ref != chat.owner:
        return refused(
            rule,
            "this API chat and its sessions belong to the API key that started them; another "
            "key may not send in them, list, read, share or revoke anything of them (an admin "
            "key may)",
            403,
        )
    return None


@dataclass(frozen=True, slots=True)
class KeySpec:
    """The scope of an API key to mint."""

    admin: bool
    agents: frozenset[str]
    write: bool


def host_agent_needs_write(channels: Iterable[str]) -> bool:
    """K2: WhatsApp and WeChat replies go through the API, so they need `write: true`."""
    return any(c in _WRITE_CHANNELS for c in channels)


def mcp_key_for_host_agent(agent_id: str, needs_write: bool) -> KeySpec:
    """K2: the key a host agent's MCP server gets: non-admin, naming only `agent_id`."""
    if not agent_id or agent_id == WILDCARD:
        raise ValueError(f"cannot mint a key for agent id {agent_id!r}: name one agent")
    return KeySpec(admin=False, agents=frozenset({agent_id}), write=needs_write)


def key_spec_ok_for_host_agent(
    spec: KeySpec, agent_id: str, *, needs_write: bool | None = None
) -> Decision:
    """K2: may `spec` be handed to the MCP server of host agent `agent_id`?

    With `needs_write` given, the write flag must match it exactly.
    """
    if spec.admin:
        return deny("K2", "a host agent's MCP server never gets an admin key")
    if WILDCARD in spec.agents:
        return deny("K2", "a host agent's MCP server never gets a wildcard (*) key")
    if spec.agents != frozenset({agent_id}):
        return deny("K2", f"the key's agents list must name exactly {agent_id!r}")
    if needs_write is True and not spec.write:
        return deny("K2", "WhatsApp and WeChat replies need the key to have write: true")
    if needs_write is False and spec.write:
        return deny("K2", "this agent has no channel that needs write: true; mint it read-only")
    return allow("K2")
