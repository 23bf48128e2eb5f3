"""Ids and media paths in requests: traversal and malformed ids are a 400, never a file (P5).

Requests are sent byte for byte over a socket, so no client normalises `..`
away before the server sees it. Also: files that resolve outside the media
directory through a symlink or hard link are refused by P5 at the API, for
media, shares and image artifacts; and P6 for revoking shares.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.api.conftest import PNG, Live, raw_get

SECRET_FILE = b"root:x:0:0"  # /etc/passwd; never served


def _targets(live: Live) -> list[str]:
    api = live.seed.api["iso"].media_name
    tg = live.seed.tg["open"].conv.id
    return [
        f"/v1/agents/iso/media/{api}/../../../../etc/passwd",
        f"/v1/agents/iso/media/{api}/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        f"/v1/agents/iso/media/{api}/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        f"/v1/agents/iso/media/{api}/..%252f..%252f..%252fetc%252fpasswd",
        f"/v1/agents/iso/media/{api}/%252e%252e/%252e%252e/etc/passwd",
        f"/v1/agents/iso/media/{api}/photo.png%00.txt",
        f"/v1/agents/iso/media/{api}/./photo.png",
        "/v1/agents/iso/media/..%2f..%2fetc/passwd",
        "/v1/agents/iso/media/api-..%2f..%2f/passwd",
        "/v1/agents/%2e%2e/chats",
        "/v1/agents/..%252f/chats",
        "/v1/agents/iso%00/chats",
        f"/v1/agents/{'a' * 300}/chats",
        f"/v1/agents/open/chats/{tg}%2f..%2f..",
        "/v1/agents/open/chats/..%2f..%2fetc",
        "/v1/agents/open/chats/%2e%2e/sessions",
        "/v1/agents/open/chats/not-a-chat/messages",
        f"/v1/agents/open/chats/{'f' * 600}",
        "/v1/agents/open/chats/a%00b",
        "/v1/shares/..%2f..%2fetc%2fpasswd",
        "/v1/shares/%2e%2e",
        "/v1/shares/short",
        f"/v1/shares/{'x' * 300}",
        "/v1/shares/abc%00defghijklmnopqrstuvwxyz",
        "/v1/keys/..%2f",
    ]


@pytest.mark.parametrize("who", ["admin", "iso", None])
def test_P5_traversal_and_malformed_ids_are_400_with_a_reason(live: Live, who: str | None) -> None:
    key = live.seed.keys[who] if who else None
    for target in _targets(live):
        method_targets = [target]
        for t in method_targets:
            status, body = raw_get(live.url, t, key)
            assert status == 400, f"{t}: {status} {body[:200]!r}"
            assert SECRET_FILE not in body and PNG not in body
            err = json.loads(body)["error"]
            assert err["code"].startswith("bad_"), (t, err)
            assert len(err["message"]) > 10


def test_P5_malformed_ids_in_write_endpoints_are_400(live: Live) -> None:
    admin = live.seed.keys["admin"]
    sid = live.seed.api["open"].session.id
    bodies = [
        {"agent": "open", "session": sid, "path": "../../../etc/passwd"},
        {"agent": "open", "session": sid, "path": "/etc/passwd"},
        {"agent": "open", "session": sid, "path": "a/../../photo.png"},
        {"agent": "open", "session": sid, "path": "..%2fphoto.png"},
        {"agent": "open", "session": sid, "path": "photo.png\x00.txt"},
        {"agent": "open", "session": "../x", "path": "photo.png"},
        {"agent": "../open", "session": sid, "path": "photo.png"},
        {"agent": "open", "session": sid, "path": "x" * 2000},
    ]
    for endpoint in ("/v1/shares", "/v1/image-artifacts"):
        for body in bodies:
            r = live.request("POST", endpoint, admin, json=body)
            assert r.status_code in (400, 422), (endpoint, body, r.text)
            assert SECRET_FILE not in r.content
            assert "error" in r.json()


def test_P5_symlink_out_of_the_media_dir_is_refused(live: Live) -> None:
    chat = live.seed.api["open"]
    link = chat.media / "escape.txt"
    link.symlink_to("/etc/passwd")
    (chat.media / "sub").mkdir(exist_ok=True)
    dir_link = chat.media / "up"
    dir_link.symlink_to(chat.media.parent.parent)  # the workspace
    admin = live.seed.keys["admin"]
    try:
        for path in (f"{chat.media_name}/escape.txt", f"{chat.media_name}/up/AGENTS.md"):
            r = live.request("GET", f"/v1/agents/open/media/{path}", admin)
            assert r.status_code in (403, 404), r.text
            assert SECRET_FILE not in r.content
        r = live.request("GET", f"/v1/agents/open/media/{chat.media_name}/escape.txt", admin)
        assert r.status_code == 403 and r.json()["error"]["rule"] == "P5"
        body = {"agent": "open", "session": chat.session.id, "path": "escape.txt"}
        for endpoint in ("/v1/shares", "/v1/image-artifacts"):
            r = live.request("POST", endpoint, admin, json=body)
            assert r.status_code == 403 and r.json()["error"]["rule"] == "P5", r.text
    finally:
        link.unlink()
        dir_link.unlink()


def test_P5_hard_link_and_fifo_are_refused(live: Live) -> None:
    chat = live.seed.api["open"]
    hard = chat.media / "hard.png"
    os.link(chat.media / "photo.png", hard)
    fifo = chat.media / "pipe"
    os.mkfifo(fifo)
    admin = live.seed.keys["admin"]
    try:
        for name in ("hard.png", "pipe"):
            r = live.request("GET", f"/v1/agents/open/media/{chat.media_name}/{name}", admin)
            assert r.status_code == 403 and r.json()["error"]["rule"] == "P5", r.text
    finally:
        hard.unlink()
        fifo.unlink()


def test_P5_a_share_swapped_for_a_symlink_after_creation_is_not_served(live: Live) -> None:
    chat = live.seed.api["open"]
    target = chat.media / "later.png"
    target.write_bytes(PNG)
    admin = live.seed.keys["admin"]
    r = live.request(
        "POST",
        "/v1/shares",
        admin,
        json={"agent": "open", "session": chat.session.id, "path": "later.png"},
    )
    assert r.status_code == 201
    url = r.json()["url"]
    assert live.request("GET", url).content == PNG
    target.unlink()
    target.symlink_to("/etc/passwd")
    try:
        r = live.request("GET", url)
        assert r.status_code == 403 and r.json()["error"]["rule"] == "P5"
        assert SECRET_FILE not in r.content
    finally:
        target.unlink()


def test_image_artifact_must_be_an_image(live: Live) -> None:
    chat = live.seed.api["open"]
    r = live.request(
        "POST",
        "/v1/image-artifacts",
        live.seed.keys["open"],
        json={"agent": "open", "session": chat.session.id, "path": "notes.txt"},
    )
    assert r.status_code == 415 and r.json()["error"]["code"] == "not_an_image"
    r = live.request(
        "POST",
        "/v1/image-artifacts",
        live.seed.keys["open"],
        json={"agent": "open", "session": chat.session.id, "path": "photo.png"},
    )
    assert r.status_code == 201
    art = r.json()
    assert art["media_type"] == "image/png" and art["size"] == len(PNG)
    assert live.request("GET", art["url"]).content == PNG
    listed = live.request("GET", "/v1/image-artifacts?agent=open", live.seed.keys["open"]).json()
    assert art["id"] in {a["id"] for a in listed}
    assert all(a["token"] is None for a in listed)  # the token is shown once


def test_P6_share_revoked_only_by_its_session_or_an_admin(live: Live) -> None:
    # P6: the session is the share's own; over the API it acts through the key its API
    # chat is bound to. A peer key of the same agent claiming that session is refused.
    mine = live.seed.api["open"]
    key, peer = live.seed.keys["open"], live.seed.keys["open-peer"]
    r = live.request(
        "POST",
        "/v1/shares",
        key,
        json={"agent": "open", "session": mine.session.id, "path": "photo.png"},
    )
    share, url = r.json()["id"], r.json()["url"]
    r = live.request("DELETE", f"/v1/shares/{share}?session={mine.session.id}", peer)
    assert r.status_code == 403 and r.json()["error"]["rule"] == "P6"
    r = live.request("DELETE", f"/v1/shares/{url.rsplit('/', 1)[1]}", peer)  # by token
    assert r.status_code == 403 and r.json()["error"]["rule"] == "P6"
    assert live.request("GET", url).status_code == 200  # still shared
    r = live.request("DELETE", f"/v1/shares/{share}", key)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert r.json()["revoked_by"].endswith(f"session:{mine.session.id}")
    assert live.request("GET", url).status_code == 410  # revoked: gone
    r = live.request("DELETE", f"/v1/shares/{share}", key)
    assert r.status_code == 409


def test_P6_a_channel_chats_share_is_not_revoked_by_a_bare_key(live: Live) -> None:
    theirs = live.seed.tg["open"]
    share, token = live.store.create_share(theirs.session.id, "photo.png")
    r = live.request(
        "DELETE", f"/v1/shares/{share.id}?session={theirs.session.id}", live.seed.keys["open"]
    )
    assert r.status_code == 403 and r.json()["error"]["rule"] == "P6"
    assert live.request("GET", f"/v1/shares/{token}").status_code == 200


def test_P6_admin_may_revoke_any_share(live: Live) -> None:
    share, token = live.store.create_share(live.seed.tg["iso"].session.id, "photo.png")
    assert live.request("GET", f"/v1/shares/{token}").status_code == 200
    r = live.request("DELETE", f"/v1/shares/{share.id}", live.seed.keys["admin"])
    assert r.status_code == 200
    assert live.request("GET", f"/v1/shares/{token}").status_code == 410


def test_K3_isolated_agent_key_cannot_revoke_or_list_a_channel_chats_share(live: Live) -> None:
    share, _ = live.store.create_share(live.seed.tg["iso"].session.id, "photo.png")
    key = live.seed.keys["iso"]
    r = live.request(
        "DELETE", f"/v1/shares/{share.id}?session={live.seed.tg['iso'].session.id}", key
    )
    assert r.status_code == 403 and r.json()["error"]["rule"] == "K3"
    listed = live.request("GET", "/v1/shares?agent=iso", key).json()
    assert share.id not in {s["id"] for s in listed}
    assert all(s["session"] == live.seed.api["iso"].session.id for s in listed)
    admin_listed = live.request("GET", "/v1/shares?agent=iso", live.seed.keys["admin"]).json()
    assert share.id in {s["id"] for s in admin_listed}


def test_unknown_share_token_is_404(live: Live) -> None:
    r = live.request("GET", "/v1/shares/" + "A" * 43)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_errors_have_one_shape(live: Live) -> None:
    for r in (
        live.request("GET", "/nope"),
        live.request("PUT", "/v1/shares"),
        live.request("POST", "/v1/shares", live.seed.keys["admin"], json={"x": 1}),
        live.request("GET", "/v1/agents/open/chats"),
    ):
        err = r.json()["error"]
        assert set(err) <= {"code", "message", "rule", "ref"} and err["code"] and err["message"]
        assert re.fullmatch(r"r-[0-9a-f]{12}", err["ref"])  # R6
