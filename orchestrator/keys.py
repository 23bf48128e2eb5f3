"""API keys minted into the store: for operators (`cellgate keys`) and for host agents (K2).

A key has a name, the agents it may use (named, or `*`), and `admin` and
`write` flags; the store keeps only a hash, and the secret is shown once.
`mint_host_agent_key` is the only way a host agent's MCP server gets a key:
non-admin, naming exactly that agent, `write` only when one of its channels
replies through the API (WhatsApp, WeChat). Such keys are never placed in a
sandbox (K1): an app agent's sandbox gets no key at all.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from cellgate.errors import PolicyDenied, StoreError
from orchestrator.config import is_valid_agent_id
from orchestrator.store import ApiKey, Store
from policies.api_access import (
    WILDCARD,
    host_agent_needs_write,
    key_spec_ok_for_host_agent,
    mcp_key_for_host_agent,
)

__all__ = ["create_operator_key", "mint_host_agent_key"]

MCP_KEY_PREFIX = "mcp:"


def mint_host_agent_key(store: Store, agent_id: str, channels: Iterable[str]) -> tuple[ApiKey, str]:
    """K2: a new key for host agent `agent_id`'s MCP server; returns the row and the secret."""
    if not is_valid_agent_id(agent_id):
        raise PolicyDenied("K2", f"cannot mint a key for agent id {agent_id!r}: name one agent")
    needs_write = host_agent_needs_write(list(channels))
    spec = mcp_key_for_host_agent(agent_id, needs_write)
    decision = key_spec_ok_for_host_agent(spec, agent_id, needs_write=needs_write)
    if not decision.allowed:
        raise PolicyDenied(decision.rule, decision.reason)
    return store.create_key(
        f"{MCP_KEY_PREFIX}{agent_id}", sorted(spec.agents), admin=spec.admin, write=spec.write
    )


def create_operator_key(
    store: Store,
    name: str,
    agents: Sequence[str],
    *,
    all_agents: bool = False,
    admin: bool = False,
    write: bool = False,
    known: Collection[str] | None = None,
) -> tuple[ApiKey, str]:
    """A key for an operator or an API client; `agents` are ids, or `all_agents` for `*`.

    `known`: the configured agents; a key naming any other is refused (a typo would
    otherwise make a key that quietly reaches nothing).
    """
    name = name.strip()
    if not name or len(name) > 100:
        raise StoreError("a key needs a name of 1-100 characters (--name)")
    if all_agents and agents:
        raise StoreError("give either --agent ids or --all-agents, not both")
    if not all_agents and not agents:
        raise StoreError("name the agents the key may use (--agent ID, repeatable) or --all-agents")
    for a in agents:
        if a == WILDCARD:
            raise StoreError("use --all-agents for a key that may use every agent, not --agent '*'")
        if not is_valid_agent_id(a):
            raise StoreError(f"{a!r} is not an agent id (1-40 lowercase letters, digits, '-')")
        if known is not None and a not in known:
            have = ", ".join(sorted(known)[:20]) or "none"
            raise StoreError(
                f"no agent {a!r} in this gateway's config (configured: {have}); "
                "check the id, or install its app first"
            )
    chosen = [WILDCARD] if all_agents else sorted(set(agents))
    return store.create_key(name, chosen, admin=admin, write=write)
