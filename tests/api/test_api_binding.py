"""K4, P6: an API chat and its sessions are bound to the key that started them.

Beyond the matrix rows (tests/api/test_api_matrix.py): the first message
binds a new chat; listings (shares, image artifacts, chats, search) show a
non-admin key only its own API chats, session ids included; and a state
database from before the binding opens, migrated, with its API chats bound
to no key.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cellgate.models import ConversationKey
from orchestrator.store import Store, conversation_id
from orchestrator.store.db import DB_FILE
from orchestrator.store.schema import MIGRATIONS, SCHEMA_VERSION
from policies.api_access import ApiChatFacts, Endpoint, KeyFacts, RequestFacts, decide
from tests.api.conftest import Live


def test_K4_the_first_message_binds_a_new_api_chat_to_its_key(live: Live) -> None:
    path = "/v1/agents/open/chats/bind-me/messages"
    r = live.request("POST", path, live.seed.keys["open-peer"], json={"text": "hi"})
    assert r.status_code == 503  # granted; this host agent takes no turns here
    conv = conversation_id(ConversationKey("open", "api", "bind-me"))
    assert live.store.api_chat_owner(conv) == live.seed.key_ids["open-peer"]
    r = live.request("POST", path, live.seed.keys["open"], json={"text": "mine now?"})
    assert r.status_code == 403 and r.json()["error"]["rule"] == "K4"
    ref = r.json()["error"]["ref"]
    (audit,) = [a for a in live.store.refusals(limit=500) if a.detail.get("ref") == ref]
    assert audit.rule == "K4" and audit.detail["key"] == live.seed.key_ids["open"]
    # the path (with its chat id) is in the row's detail; the action, a metrics label (O2),
    # is the route's template
    assert audit.detail["path"] == path
    assert audit.action == "api POST /v1/agents/{agent}/chats/{chat_id}/messages"
    r = live.request("POST", path, live.seed.keys["admin"], json={"text": "op"})
    assert r.status_code == 503
    assert live.store.api_chat_owner(conv) == live.seed.key_ids["open-peer"]


def test_K4_P6_listings_show_a_key_only_its_own_api_chats(live: Live) -> None:
    mine = live.seed.api["open"]
    peer = live.seed.keys["open-peer"]
    for path in ("/v1/shares?agent=open", "/v1/image-artifacts?agent=open"):
        r = live.request("GET", path, peer)
        assert r.status_code == 200
        assert mine.session.id not in r.text, path  # no session id of another key's chat
        own = live.request("GET", path, live.seed.keys["open"]).json()
        assert mine.session.id in {s["session"] for s in own}, path
    chats = live.request("GET", "/v1/agents/open/chats", peer).json()
    assert {c["chat_id"] for c in chats} == {"42"}  # the channel chat; no API chat of others
    found = live.request("GET", "/v1/agents/open/chats/search?q=secret", peer).json()
    assert {m["conversation"] for m in found} == {live.seed.tg["open"].conv.id}
    found = live.request("GET", "/v1/agents/open/chats/search?q=secret",
                         live.seed.keys["open"]).json()  # fmt: skip
    assert mine.conv.id in {m["conversation"] for m in found}


def test_K4_a_database_from_before_the_binding_opens_with_its_api_chats_unbound(
    tmp_path: Path,
) -> None:
    db = sqlite3.connect(tmp_path / DB_FILE)
    for statement in MIGRATIONS[0]:
        db.execute(statement)
    old = conversation_id(ConversationKey("a", "api", "old"))
    db.execute(
        "INSERT INTO conversations VALUES (?, 'a', 'api', 'old', 'api-old-x', 1.0, 1.0)", (old,)
    )
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with Store.open(tmp_path) as store:
        assert SCHEMA_VERSION >= 3  # v2 channels (W3), v3 API chat keys (K4), v4 cron (C1)
        assert store.get_conversation(old) is not None  # kept
        assert store.api_chat_owner(old) is None
        assert store.bind_api_chat(old, "key_0123456789abcdef") is None  # stays unbound
        new = conversation_id(ConversationKey("a", "api", "new"))
        assert store.bind_api_chat(new, "key_0123456789abcdef") == "key_0123456789abcdef"
        assert store.bind_api_chat(new, "config:other") == "key_0123456789abcdef"


OWNER = "key_00000000000000aa"
PEER = "key_00000000000000bb"


@pytest.mark.parametrize(
    ("key", "owner", "revoking", "allowed", "rule"),
    [
        (KeyFacts(True, agents=frozenset({"a"}), ref=OWNER), OWNER, False, True, "K4"),
        (KeyFacts(True, agents=frozenset({"a"}), ref=PEER), OWNER, False, False, "K4"),
        (KeyFacts(True, write=True, agents=frozenset({"a"}), ref=PEER), OWNER, True, False, "P6"),
        (KeyFacts(True, write=True, agents=frozenset({"a"}), ref=OWNER), OWNER, True, True, "K2"),
        (KeyFacts(True, agents=frozenset({"a"}), ref=OWNER), None, False, False, "K4"),
        (KeyFacts(True, agents=frozenset({"*"}), ref=PEER), OWNER, False, False, "K4"),
        (KeyFacts(True, admin=True, ref=PEER), OWNER, True, True, "K2"),
        (KeyFacts(True, admin=True, ref=PEER), None, False, True, "K2"),
        (KeyFacts(True, agents=frozenset({"a"}), ref=None), OWNER, False, False, "K4"),
    ],
)
def test_K4_P6_binding_policy_table(
    key: KeyFacts, owner: str | None, revoking: bool, allowed: bool, rule: str
) -> None:
    kind: Endpoint = "shares" if revoking else "media"
    request = RequestFacts("a", True, kind, media_owner="api_session", is_write=revoking,
                           api_chat=ApiChatFacts(owner), revoking=revoking)  # fmt: skip
    decision = decide(key, request)
    assert decision.allowed is allowed and decision.rule == rule, decision
    if not allowed:
        assert decision.status == 403
