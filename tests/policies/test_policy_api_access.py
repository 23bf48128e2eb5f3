"""K2-K4: key scope on the admin API and the keys minted for host agents."""

from __future__ import annotations

import pytest

from policies.api_access import (
    Endpoint,
    KeyFacts,
    KeySpec,
    MediaOwner,
    RequestFacts,
    decide,
    host_agent_needs_write,
    key_spec_ok_for_host_agent,
    mcp_key_for_host_agent,
)
from policies.base import deny
from policies.status import AccessDecision, refused, status_for

AGENT_KEY = KeyFacts(present=True, agents=frozenset({"shop"}))
WRITE_KEY = KeyFacts(present=True, write=True, agents=frozenset({"shop"}))
WILD_KEY = KeyFacts(present=True, write=True, agents=frozenset({"*"}))
OTHER_KEY = KeyFacts(present=True, write=True, agents=frozenset({"other"}))
ADMIN = KeyFacts(present=True, admin=True)
NO_KEY = KeyFacts(present=False)
REVOKED = KeyFacts(present=True, revoked=True, admin=True, agents=frozenset({"*"}))


def req(
    kind: Endpoint,
    *,
    isolated: bool = True,
    owner: MediaOwner | None = None,
    write: bool = False,
    agent: str = "shop",
) -> RequestFacts:
    return RequestFacts(agent, isolated, kind, owner, write)


@pytest.mark.parametrize(
    ("key", "request_", "status", "rule"),
    [
        (NO_KEY, req("message"), 401, "K2"),
        (NO_KEY, req("chats", isolated=False), 401, "K2"),
        (REVOKED, req("message"), 401, "K2"),  # revoked wins even for an admin key
        (OTHER_KEY, req("message"), 403, "K2"),
        (AGENT_KEY, req("message", agent=""), 403, "K2"),
        (AGENT_KEY, req("message", write=True), 403, "K2"),  # write needs write: true
        (WRITE_KEY, req("message", write=True), 200, "K2"),
        (WILD_KEY, req("message", write=True), 200, "K2"),
        (AGENT_KEY, req("admin", isolated=False), 403, "K2"),
        (WILD_KEY, req("admin", isolated=False), 403, "K2"),
        (ADMIN, req("admin"), 200, "K2"),
        # K3: isolated agent, cross-chat endpoints
        (AGENT_KEY, req("chats"), 403, "K3"),
        (WILD_KEY, req("chats"), 403, "K3"),
        (WRITE_KEY, req("chats", write=True), 403, "K3"),  # session inject
        (ADMIN, req("chats"), 200, "K2"),
        (AGENT_KEY, req("chats", isolated=False), 200, "K2"),
        (AGENT_KEY, req("media", owner="channel_chat"), 403, "K3"),
        (AGENT_KEY, req("media", owner="other"), 403, "K3"),
        (AGENT_KEY, req("media", owner=None), 403, "K3"),
        (ADMIN, req("media", owner="channel_chat"), 200, "K2"),
        (AGENT_KEY, req("media", owner="channel_chat", isolated=False), 200, "K2"),
        # K4: an API session's own media
        (AGENT_KEY, req("media", owner="api_session"), 200, "K4"),
        (AGENT_KEY, req("media", owner="api_session", isolated=False), 200, "K4"),
        (OTHER_KEY, req("media", owner="api_session"), 403, "K2"),
        (NO_KEY, req("media", owner="api_session"), 401, "K2"),
        (AGENT_KEY, req("shares"), 200, "K2"),
        (AGENT_KEY, req("image_artifacts"), 200, "K2"),
    ],
)
def test_K3_K4_api_access_table(
    key: KeyFacts, request_: RequestFacts, status: int, rule: str
) -> None:
    d = decide(key, request_)
    assert (d.status, d.rule, d.allowed) == (status, rule, status == 200), d.reason
    assert status_for(d) == status


def test_K3_refusal_says_admin_key_and_api_media_stays() -> None:
    d = decide(AGENT_KEY, req("media", owner="channel_chat"))
    assert "admin key" in d.reason and "media/api-<session>" in d.reason


def test_status_for_plain_decisions_and_bad_refusals() -> None:
    assert status_for(deny("P1", "x")) == 403
    assert isinstance(refused("A3", "x", 409), AccessDecision)
    with pytest.raises(ValueError, match="4xx"):
        refused("K2", "x", 200)


@pytest.mark.parametrize("needs_write", [True, False])
def test_K2_mcp_key_for_host_agent(needs_write: bool) -> None:
    spec = mcp_key_for_host_agent("family", needs_write)
    assert spec == KeySpec(admin=False, agents=frozenset({"family"}), write=needs_write)
    assert key_spec_ok_for_host_agent(spec, "family", needs_write=needs_write).allowed


@pytest.mark.parametrize("agent_id", ["", "*"])
def test_K2_no_key_minted_for_wildcard_or_empty_agent(agent_id: str) -> None:
    with pytest.raises(ValueError, match="name one agent"):
        mcp_key_for_host_agent(agent_id, False)


@pytest.mark.parametrize(
    ("spec", "needs_write", "allowed", "needle"),
    [
        (KeySpec(False, frozenset({"family"}), False), None, True, ""),
        (KeySpec(False, frozenset({"family"}), True), None, True, ""),
        (KeySpec(True, frozenset({"family"}), False), None, False, "admin"),
        (KeySpec(False, frozenset({"*"}), False), None, False, "wildcard"),
        (KeySpec(False, frozenset({"family", "*"}), False), None, False, "wildcard"),
        (KeySpec(False, frozenset({"family", "shop"}), False), None, False, "exactly"),
        (KeySpec(False, frozenset({"shop"}), False), None, False, "exactly"),
        (KeySpec(False, frozenset(), False), None, False, "exactly"),
        (KeySpec(False, frozenset({"family"}), False), True, False, "write: true"),
        (KeySpec(False, frozenset({"family"}), True), False, False, "read-only"),
    ],
)
def test_K2_key_spec_ok_for_host_agent_table(
    spec: KeySpec, needs_write: bool | None, allowed: bool, needle: str
) -> None:
    d = key_spec_ok_for_host_agent(spec, "family", needs_write=needs_write)
    assert (d.allowed, d.rule) == (allowed, "K2")
    assert needle in d.reason


@pytest.mark.parametrize(
    ("channels", "needs"),
    [
        (("telegram",), False),
        ((), False),
        (("telegram", "whatsapp"), True),
        (("wechat",), True),
        (("WhatsApp",), False),  # channel names are lowercase ids
    ],
)
def test_K2_host_agent_needs_write_table(channels: tuple[str, ...], needs: bool) -> None:
    assert host_agent_needs_write(channels) is needs
