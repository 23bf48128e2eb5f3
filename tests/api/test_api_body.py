"""The key before the body, and a bounded body (R6, K2), over real HTTP.

Bodies are streamed over a raw socket while the answer is read concurrently,
as a hostile client would send them: a 400 MB unauthenticated POST is
answered 401 without the server reading it (its RSS stays flat, and the
connection is closed, so the upload is cut off), an authenticated body past
the limit is 413 whether it declares its length or arrives chunked, and a
body that trickles in is 408.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from dataclasses import dataclass

import pytest

from orchestrator.api import bodyguard
from tests.api.conftest import Live

MB = 1024 * 1024
RSS_GROWTH_LIMIT = 16 * MB


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@dataclass
class Streamed:
    status: int
    body: bytes
    sent: int
    seconds: float


def stream_post(
    live: Live,
    path: str,
    total: int,
    *,
    key: str | None = None,
    chunked: bool = False,
    chunk: int = MB,
    pause: float = 0.0,
) -> Streamed:
    """POST `total` bytes of zeros, sending and reading at once; stops sending on any error."""
    host, port = live.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n"
    sock = socket.create_connection((host, int(port)), timeout=60)
    sent = 0
    done = threading.Event()
    payload = b"\x00" * chunk

    def send() -> None:
        nonlocal sent
        try:
            sock.sendall((head + "\r\n").encode())
            while sent < total and not done.is_set():
                n = min(chunk, total - sent)
                data = payload[:n]
                sock.sendall(f"{n:x}\r\n".encode() + data + b"\r\n" if chunked else data)
                sent += n
                if pause:
                    time.sleep(pause)
            if chunked and not done.is_set():
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server closed the connection: the upload is cut off

    started = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n\r\n" not in data or not _complete(data):
            got = sock.recv(65536)
            if not got:
                break
            data += got
    finally:
        done.set()
        sender.join(120)
        sock.close()
    head_part, _, body = data.partition(b"\r\n\r\n")
    assert head_part, "no answer"
    return Streamed(int(head_part.split(b" ", 2)[1]), body, sent, time.monotonic() - started)


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_R6_K2_a_400MB_unauthenticated_post_is_401_without_reading_the_body(
    live: Live, chunked: bool, record_property: pytest.RecordProperty
) -> None:
    gc.collect()
    before = rss_bytes()
    r = stream_post(live, "/v1/shares", 400 * MB, chunked=chunked)
    grown = rss_bytes() - before
    assert r.status == 401, r.body
    assert b'"rule":"K2"' in r.body and b'"ref":"r-' in r.body
    assert grown < RSS_GROWTH_LIMIT, f"RSS grew by {grown / MB:.1f} MB"
    assert r.sent < 400 * MB, "the server read the whole body instead of closing"
    record_property("rss_growth_bytes", grown)
    record_property("bytes_sent_before_close", r.sent)
    print(f"\n400 MB unauthenticated POST ({'chunked' if chunked else 'content-length'}): "
          f"401 in {r.seconds:.2f} s, client sent {r.sent / MB:.0f} MB before the close, "
          f"RSS growth {grown / MB:.2f} MB")  # fmt: skip


def test_K2_a_wrong_key_or_another_agents_key_is_refused_before_the_body(live: Live) -> None:
    r = stream_post(live, "/v1/agents/iso/chats/c1/messages", 100 * MB, key="cg_" + "x" * 43)
    assert r.status == 401 and r.sent < 100 * MB
    r = stream_post(live, "/v1/agents/iso/chats/c1/messages", 100 * MB,
                    key=live.seed.keys["open"])  # fmt: skip
    assert r.status == 403 and b'"rule":"K2"' in r.body and r.sent < 100 * MB
    r = stream_post(live, "/v1/keys", 100 * MB, key=live.seed.keys["open"])
    assert r.status == 403 and b"admin key" in r.body and r.sent < 100 * MB


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_R6_an_authenticated_oversize_body_is_413(live: Live, chunked: bool) -> None:
    r = stream_post(live, "/v1/shares", 8 * MB, key=live.seed.keys["admin"], chunked=chunked,
                    chunk=64 * 1024)  # fmt: skip
    assert r.status == 413, r.body
    assert b"body_too_large" in r.body and str(bodyguard.MAX_BODY_BYTES).encode() in r.body
    assert r.sent < 8 * MB


def test_R6_a_body_at_the_limit_reaches_the_endpoint(live: Live) -> None:
    import httpx

    doc = b'{"agent": "open", "session": "s", "path": "x"}'
    body = doc + b" " * (bodyguard.MAX_BODY_BYTES - len(doc))
    r = httpx.post(f"{live.url}/v1/shares", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {live.seed.keys['admin']}",
                            "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 404, r.text  # parsed and handled: no such session
    r = httpx.post(f"{live.url}/v1/shares", content=body + b" ", timeout=60,
                   headers={"Authorization": f"Bearer {live.seed.keys['admin']}"})  # fmt: skip
    assert r.status_code == 413


def test_R6_a_body_that_trickles_in_is_408(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodyguard, "BODY_SECONDS", 1.0)
    r = stream_post(live, "/v1/shares", 1000, key=live.seed.keys["admin"], chunk=10, pause=0.5)
    assert r.status == 408 and b"body_timeout" in r.body
    assert r.seconds < 10
