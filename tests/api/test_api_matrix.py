"""Every endpoint against every kind of key, for an isolated and a non-isolated agent (K2-K4).

Over real HTTP (uvicorn on loopback). Keys: none (401), revoked (401),
another agent's (403, K2), the agent's own non-admin key, and an admin key.
For the isolated agent `iso`, the agent's own key is refused on every chats
endpoint and on a channel chat's media with 403 and rule K3 (covers: K3),
while an API session's own media stays readable (covers: K4). Turns never
run here: the chat endpoint and inject answer 503 agent_unavailable once
access was granted (neither agent can take turns in this gateway), which
shows the access decision came first.

Key binding (K4, P6): each agent's API chat `client-1` is bound to the agent's
own key. `peer` is a second non-admin key naming the same agent: it is
refused (403) on that chat, its session's media, shares from it and the
revocation of its shares, even when it claims the share's session in the
query (P6); an admin key may. An API chat bound to no key (`client-legacy`)
is refused to every non-admin key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.api.conftest import PNG, Live, other

KEYS = ("none", "revoked", "other", "peer", "agent", "admin")


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Live, str], tuple[str, str, dict[str, Any]]]
    agent_key: tuple[int, int]
    """Status for the agent's own non-admin key: (isolated agent, non-isolated agent)."""
    admin: int
    public: bool = False
    """No key needed (a share token is the capability): every key gets `admin`."""
    k3: bool = False
    """The isolated agent's own key is refused by K3 (not K2)."""
    bound: str | None = None
    """The case touches the agent key's own API chat: the peer key is refused by this rule."""
    agent_rule: str | None = None
    """The rule that refuses the agent's own key (and the peer's) when not K2 or K3."""


def _get(path: str) -> tuple[str, str, dict[str, Any]]:
    return "GET", path, {}


def _fresh_share(live: Live, agent: str, chat: str = "api") -> str:
    src = {"api": live.seed.api, "tg": live.seed.tg, "legacy": live.seed.legacy}[chat][agent]
    share, _ = live.store.create_share(src.session.id, "photo.png")
    return share.id


def _fresh_key(live: Live, agent: str) -> str:
    key, _ = live.store.create_key("to-revoke", [agent])
    return key.id


def _share_body(live: Live, agent: str, chat: str, path: str = "photo.png") -> dict[str, Any]:
    src = live.seed.api[agent] if chat == "api" else live.seed.tg[agent]
    return {"json": {"agent": agent, "session": src.session.id, "path": path}}


CASES = [
    Case("chats list", lambda lv, a: _get(f"/v1/agents/{a}/chats"), (403, 200), 200, k3=True),
    Case("one chat by id",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.tg[a].conv.id}"),
         (403, 200), 200, k3=True),
    Case("one chat by dir name",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.tg[a].conv.dir_name}"),
         (403, 200), 200, k3=True),
    Case("chat sessions",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.tg[a].conv.id}/sessions"),
         (403, 200), 200, k3=True),
    Case("chat messages",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.tg[a].conv.id}/messages"),
         (403, 200), 200, k3=True),
    Case("API chat messages (still a chats endpoint)",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.api[a].conv.id}/messages?q=hello"),
         (403, 200), 200, k3=True, bound="K4"),
    Case("API chat sessions",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.api[a].conv.id}/sessions"),
         (403, 200), 200, k3=True, bound="K4"),
    Case("search", lambda lv, a: _get(f"/v1/agents/{a}/chats/search?q=secret"),
         (403, 200), 200, k3=True),
    Case("active days",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/{lv.seed.tg[a].conv.id}/active-days"),
         (403, 200), 200, k3=True),
    Case("session inject",
         lambda lv, a: ("POST", f"/v1/agents/{a}/chats/{lv.seed.tg[a].conv.id}/inject",
                        {"json": {"text": "operator here"}}),
         (403, 503), 503, k3=True),
    Case("channel chat media",
         lambda lv, a: _get(f"/v1/agents/{a}/media/{lv.seed.tg[a].media_name}/photo.png"),
         (403, 200), 200, k3=True),
    Case("API session media",
         lambda lv, a: _get(f"/v1/agents/{a}/media/{lv.seed.api[a].media_name}/photo.png"),
         (200, 200), 200, bound="K4"),
    Case("API session media of a chat bound to no key",
         lambda lv, a: _get(f"/v1/agents/{a}/media/{lv.seed.legacy[a].media_name}/photo.png"),
         (403, 403), 200, agent_rule="K4"),
    Case("send a message (api channel)",
         lambda lv, a: ("POST", f"/v1/agents/{a}/chats/client-1/messages",
                        {"json": {"text": "hi"}}),
         (503, 503), 503, bound="K4"),
    Case("send a message in an API chat bound to no key",
         lambda lv, a: ("POST", f"/v1/agents/{a}/chats/client-legacy/messages",
                        {"json": {"text": "hi"}}),
         (403, 403), 503, agent_rule="K4"),
    Case("read a message's state in another key's API chat",
         lambda lv, a: _get(f"/v1/agents/{a}/chats/client-1/messages/client-1-0"),
         (200, 200), 200, bound="K4"),
    Case("share from an API session",
         lambda lv, a: ("POST", "/v1/shares", _share_body(lv, a, "api")), (201, 201), 201,
         bound="K4"),
    Case("share from a channel chat",
         lambda lv, a: ("POST", "/v1/shares", _share_body(lv, a, "tg")), (403, 201), 201,
         k3=True),
    Case("list shares", lambda lv, a: _get(f"/v1/shares?agent={a}"), (200, 200), 200),
    Case("revoke a share of its own API session",
         lambda lv, a: ("DELETE", f"/v1/shares/{_fresh_share(lv, a)}", {}),
         (200, 200), 200, bound="P6"),
    Case("revoke a share claiming its session in the query",
         lambda lv, a: ("DELETE",
                        f"/v1/shares/{_fresh_share(lv, a)}?session={lv.seed.api[a].session.id}",
                        {}),
         (200, 200), 200, bound="P6"),
    Case("revoke a channel chat's share",
         lambda lv, a: ("DELETE", f"/v1/shares/{_fresh_share(lv, a, 'tg')}", {}),
         (403, 403), 200, k3=True, agent_rule="P6"),
    Case("revoke a share of an API chat bound to no key",
         lambda lv, a: ("DELETE", f"/v1/shares/{_fresh_share(lv, a, 'legacy')}", {}),
         (403, 403), 200, agent_rule="P6"),
    Case("fetch a share by token",
         lambda lv, a: _get(f"/v1/shares/{lv.seed.share_tokens[a]}"), (200, 200), 200,
         public=True),
    Case("image artifact from an API session",
         lambda lv, a: ("POST", "/v1/image-artifacts", _share_body(lv, a, "api")),
         (201, 201), 201, bound="K4"),
    Case("image artifact from a channel chat",
         lambda lv, a: ("POST", "/v1/image-artifacts", _share_body(lv, a, "tg")),
         (403, 201), 201, k3=True),
    Case("list image artifacts", lambda lv, a: _get(f"/v1/image-artifacts?agent={a}"),
         (200, 200), 200),
    Case("list keys", lambda lv, a: _get("/v1/keys"), (403, 403), 200),
    Case("create a key",
         lambda lv, a: ("POST", "/v1/keys", {"json": {"name": "made", "agents": [a]}}),
         (403, 403), 201),
    Case("revoke a key", lambda lv, a: ("DELETE", f"/v1/keys/{_fresh_key(lv, a)}", {}),
         (403, 403), 200),
]  # fmt: skip


def _k3(case: Case, agent: str) -> bool:
    return case.k3 and agent == "iso"


def expected(case: Case, agent: str, who: str) -> int:
    if case.public:
        return case.admin
    if who in ("none", "revoked"):
        return 401
    if who == "other":
        return 403
    if who == "peer" and case.bound and not _k3(case, agent):
        return 403
    if who in ("agent", "peer"):
        return case.agent_key[0 if agent == "iso" else 1]
    return case.admin


def expected_rule(case: Case, agent: str, who: str) -> str:
    if who in ("agent", "peer") and _k3(case, agent):
        return "K3"
    if who == "peer" and case.bound:
        return case.bound
    if who in ("agent", "peer") and case.agent_rule:
        return case.agent_rule
    return "K2"


def secret_for(live: Live, agent: str, who: str) -> str | None:
    return {
        "none": None,
        "revoked": live.seed.keys["revoked"],
        "other": live.seed.keys[other(agent)],
        "peer": live.seed.keys[f"{agent}-peer"],
        "agent": live.seed.keys[agent],
        "admin": live.seed.keys["admin"],
    }[who]


@pytest.mark.parametrize("who", KEYS)
@pytest.mark.parametrize("agent", ["iso", "open"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_K2_K3_K4_P6_access_matrix(live: Live, case: Case, agent: str, who: str) -> None:
    method, path, kw = case.make(live, agent)
    r = live.request(method, path, secret_for(live, agent, who), **kw)
    want = expected(case, agent, who)
    assert r.status_code == want, f"{method} {path} with {who} key: {r.status_code} {r.text}"
    if want >= 400 and want != 503:
        err = r.json()["error"]
        assert err["code"] and err["message"]
        assert PNG not in r.content  # a refusal never carries the file
        assert err["ref"].startswith("r-") and len(err["ref"]) == 14  # R6
        rule = "K2" if want == 401 else expected_rule(case, agent, who)
        assert err["rule"] == rule, err
        if rule == "K3":  # the body says why, and what would be allowed
            assert "admin key" in err["message"] and "'iso'" in err["message"]
        if who == "peer" and case.bound and rule == case.bound:
            assert "belong to the API key that started them" in err["message"], err
    if want == 503:
        assert r.json()["error"]["code"] == "agent_unavailable"


def test_K3_isolated_agent_admin_sees_strangers_chats(live: Live) -> None:
    r = live.request("GET", "/v1/agents/iso/chats", live.seed.keys["admin"])
    assert {c["chat_id"] for c in r.json()} == {"42", "client-1", "client-legacy"}
    conv = live.seed.tg["iso"].conv
    r = live.request("GET", f"/v1/agents/iso/chats/{conv.id}/messages", live.seed.keys["admin"])
    assert [m["text"] for m in r.json()] == ["secret-iso-42", "hello from 42"]
    assert r.json()[0]["reply"] == "noted"


def test_K4_api_session_media_is_the_file_itself(live: Live) -> None:
    chat = live.seed.api["iso"]
    r = live.request("GET", f"/v1/agents/iso/media/{chat.media_name}/notes.txt",
                     live.seed.keys["iso"])  # fmt: skip
    assert r.status_code == 200
    assert r.text == "notes of iso client-1\n"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["content-disposition"].startswith("attachment")


def test_K4_other_agents_api_session_is_not_reachable_through_this_agent(live: Live) -> None:
    # open's API session media, asked for under iso's URL: not iso's directory.
    r = live.request(
        "GET", f"/v1/agents/iso/media/{live.seed.api['open'].media_name}/photo.png",
        live.seed.keys["iso"],
    )  # fmt: skip
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


def test_K2_config_file_key_still_works_for_first_runs(live: Live) -> None:
    key = live.seed.keys["config"]
    assert live.request("GET", "/v1/agents/open/chats", key).status_code == 200
    r = live.request("GET", "/v1/agents/iso/chats", key)
    assert r.status_code == 403 and r.json()["error"]["rule"] == "K2"


def test_K2_unknown_key_is_401_and_says_how_to_get_one(live: Live) -> None:
    r = live.request("GET", "/v1/agents/open/chats", "cg_" + "x" * 43)
    assert r.status_code == 401
    assert "cellgate keys create" in r.json()["error"]["message"]


def test_K2_revoked_admin_key_is_401(live: Live) -> None:
    r = live.request("GET", "/v1/keys", live.seed.keys["revoked-admin"])
    assert r.status_code == 401
    assert "revoked" in r.json()["error"]["message"]


def test_K2_store_key_records_last_use(live: Live) -> None:
    key, secret = live.store.create_key("fresh", ["open"])
    assert key.last_used_at is None
    assert live.request("GET", "/v1/agents/open/chats", secret).status_code == 200
    (after,) = [k for k in live.store.list_keys() if k.id == key.id]
    assert after.last_used_at is not None


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/agents/open/chats/{conv}/inject", {"text": "x"}),
        ("POST", "/v1/shares", None),
        ("POST", "/v1/image-artifacts", None),
        ("DELETE", "/v1/shares/{share}?session={session}", None),
    ],
)
def test_K2_a_key_without_write_cannot_write(
    live: Live, method: str, path: str, body: dict[str, str] | None
) -> None:
    chat = live.seed.api["open"]
    url = path.format(conv=chat.conv.id, share=_fresh_share(live, "open"), session=chat.session.id)
    payload = body or {"agent": "open", "session": chat.session.id, "path": "photo.png"}
    kw: dict[str, Any] = {} if method == "DELETE" else {"json": payload}
    r = live.request(method, url, live.seed.keys["open-readonly"], **kw)
    assert r.status_code == 403
    assert r.json()["error"]["rule"] == "K2" and "write" in r.json()["error"]["message"]


def test_K2_read_only_key_may_still_read_and_chat(live: Live) -> None:
    key = live.seed.keys["open-readonly"]
    assert live.request("GET", "/v1/agents/open/chats", key).status_code == 200
    r = live.request("POST", "/v1/agents/open/chats/c9/messages", key, json={"text": "hi"})
    assert r.status_code == 503  # granted; this host agent cannot take turns here


def test_unknown_agent_is_404_for_admin_and_403_for_a_scoped_key(live: Live) -> None:
    assert (
        live.request("GET", "/v1/agents/nobody/chats", live.seed.keys["admin"]).status_code == 404
    )
    assert live.request("GET", "/v1/agents/nobody/chats", live.seed.keys["open"]).status_code == 403


def test_unknown_chat_is_404(live: Live) -> None:
    r = live.request("GET", f"/v1/agents/open/chats/{'0' * 32}", live.seed.keys["admin"])
    assert r.status_code == 404
    # a conversation of another agent is not found under this one
    r = live.request("GET", f"/v1/agents/open/chats/{live.seed.tg['iso'].conv.id}",
                     live.seed.keys["admin"])  # fmt: skip
    assert r.status_code == 404


def test_K2_a_key_for_an_agent_not_configured_is_refused(live: Live) -> None:
    r = live.request("POST", "/v1/keys", live.seed.keys["admin"],
                     json={"name": "typo", "agents": ["opne"]})  # fmt: skip
    assert r.status_code == 400, r.text
    assert "no agent 'opne'" in r.json()["error"]["message"]
    assert not [k for k in live.store.list_keys() if k.name == "typo"]
