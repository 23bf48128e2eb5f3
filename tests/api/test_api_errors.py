"""R6: an error answer shows a short message and a ref; details go to the log and the audit.

A real failure is fed through the live gateway: a trigger in its own test
database makes recording a share fail with a message that holds host paths
(the database path, a mount path under the state directory). The answer must
show neither, and the log and the audit table must hold both, under the ref.
"""

from __future__ import annotations

import logging
import re
import sqlite3

import pytest

from orchestrator.api.errors import scrub
from tests.api.conftest import PNG, Live

REF = re.compile(r"r-[0-9a-f]{12}")
HOST_PATH = re.compile(r"(?<![\w.~-])/(?!v1/|workspace)[\w.@+~-]+/")


def test_R6_a_failure_shows_a_ref_and_no_host_path(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    chat = live.seed.api["open"]
    (chat.media / "r6-boom.png").write_bytes(PNG)
    mount = live.state / "agents" / "open" / "workspace" / "media" / chat.media_name
    db = sqlite3.connect(live.store.path)
    db.execute(
        "CREATE TRIGGER r6_boom BEFORE INSERT ON shares WHEN NEW.path = 'r6-boom.png' BEGIN "
        f"SELECT RAISE(ABORT, 'mount {mount} went away'); END"
    )
    db.commit()
    try:
        with caplog.at_level(logging.ERROR, logger="orchestrator.api.errors"):
            r = live.request("POST", "/v1/shares", live.seed.keys["open"],
                             json={"agent": "open", "session": chat.session.id,
                                   "path": "r6-boom.png"})  # fmt: skip
    finally:
        db.execute("DROP TRIGGER r6_boom")
        db.commit()
        db.close()
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal" and REF.fullmatch(err["ref"])
    assert err["ref"] in err["message"]  # the one thing to quote to the operator
    for secret in (str(live.state), str(live.state.resolve()), str(live.store.path), "went away"):
        assert secret not in r.text
    assert not HOST_PATH.search(r.text), r.text
    logged = [rec.getMessage() for rec in caplog.records if err["ref"] in rec.getMessage()]
    assert logged and str(mount) in logged[0] and str(live.store.path) in logged[0]
    (audit,) = [a for a in live.store.refusals() if a.detail.get("ref") == err["ref"]]
    assert audit.rule == "R6" and audit.action == "api POST /v1/shares"
    assert str(mount) in audit.detail["message"]


def test_R6_every_error_answer_has_a_ref(live: Live) -> None:
    refs = set()
    for r in (
        live.request("GET", "/v1/agents/open/chats"),  # 401
        live.request("GET", "/v1/agents/iso/chats", live.seed.keys["open"]),  # 403
        live.request("GET", "/v1/nope"),  # 404
    ):
        refs.add(r.json()["error"]["ref"])
    assert len(refs) == 3 and all(REF.fullmatch(x) for x in refs)


def test_R6_a_users_mistake_keeps_its_message_without_host_paths() -> None:
    roots = ["/srv/cellgate/state", "/home/op/.cellgate"]
    msg = (
        "/srv/cellgate/state/agents/a/workspace/media/api-1/x.png is a symbolic link; "
        "send a file under /workspace/media/api-1 instead (see /v1/shares), "
        "or ask about /var/lib/docker/volumes/v/_data"
    )
    out = scrub(msg, roots)
    assert "/srv" not in out and "/var/lib" not in out
    assert "<state dir>/agents/a/workspace/media/api-1/x.png is a symbolic link" in out
    assert "/workspace/media/api-1" in out and "/v1/shares" in out
    assert "<host path>" in out
    assert scrub("a plain message with api-<session>/photo.png and 1/2") == (
        "a plain message with api-<session>/photo.png and 1/2"
    )


def test_R6_an_agent_that_cannot_take_turns_is_one_warning_not_a_traceback(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    # 'open' is a host agent with the shell harness: it takes no turns (a state, like a
    # stopped app); a caller repeating messages must not fill the log with stacks
    with caplog.at_level(logging.DEBUG, logger="orchestrator.api.errors"):
        r = live.request("POST", "/v1/agents/open/chats/r6-state/messages",
                         live.seed.keys["open"], json={"text": "hi"})  # fmt: skip
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "agent_unavailable" and err["ref"] in err["message"]
    (rec,) = [rec for rec in caplog.records if err["ref"] in rec.getMessage()]
    assert rec.levelno == logging.WARNING and rec.exc_info is None
