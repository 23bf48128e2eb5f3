"""A hostile stranger against the gateway itself, and the faults it must survive (R4, R7).

Each test serves its own gateway over real HTTP on a real engine, attacks it
the way a stranger (or a failing host) would, and measures another chat's
answer while it happens. Figures are printed (`-s` shows them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from sandbox.backends.docker import DockerBackend
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.support.engine_proxy import engine_proxy
from tests.support.run_id import run_labels
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker


class Client:
    def __init__(self, url: str, agent: str) -> None:
        self.url = url
        self.agent = agent
        self.headers = {"Authorization": f"Bearer {CONFIG_KEY}"}

    def say(
        self, chat: str, text: str, *, sender: str = "", wait: bool = True, timeout: float = 180
    ) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages",
            params={"wait": str(wait).lower()},
            json={"text": text, "sender": sender},
            headers=self.headers,
            timeout=timeout,
        )

    def later(self, chat: str, text: str, message_id: str) -> httpx.Response:
        """Send without waiting for the reply (202 once stored)."""
        return httpx.post(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages",
            params={"wait": "false"},
            json={"text": text, "message_id": message_id},
            headers=self.headers,
            timeout=60,
        )

    def state(self, chat: str, message_id: str) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages/{message_id}",
            headers=self.headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return dict(r.json())


@contextlib.contextmanager
def serve(
    tmp: Path,
    docker_client: Any,
    base_image: str,
    app: str,
    gateway: dict[str, Any],
    backend: Any = DockerBackend.from_env,
) -> Iterator[tuple[Client, Any]]:
    config = install_test_app(tmp, docker_client, base_image, app, gateway)
    try:
        with served_gateway(config, backend) as (url, gw):
            yield Client(url, f"{app}-bot"), gw
    finally:
        remove_app_containers(docker_client, app)


def app_containers(docker_client: Any, app: str) -> list[Any]:
    """This run's containers of `app` (R1: never another gateway's)."""
    return list(docker_client.containers.list(all=True, filters={"label": run_labels(app)}))


def count_containers(docker_client: Any, app: str) -> int:
    """How many: one list call, no inspect of each (one evicted meanwhile is no error)."""
    filters = {"label": run_labels(app)}
    return len(docker_client.containers.list(all=True, sparse=True, filters=filters))


def test_R4_three_times_max_sandboxes_new_chats_are_capped_and_answered_politely(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    app = "abusecap"
    cap = 3
    with serve(tmp_path, docker_client, base_image, app, {"limits": {"maxSandboxes": cap}}) as (
        client,
        _,
    ):
        peak = 0
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, count_containers(docker_client, app))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        results: list[httpx.Response] = []

        def chat(i: int) -> None:
            results.append(client.say(f"new-{i}", "sleep 4; echo served", sender=f"s{i}"))

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(3 * cap)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stop.set()
        watcher.join(5)
        statuses = sorted(r.status_code for r in results)
        served = [r for r in results if r.status_code == 200]
        busy = [r for r in results if r.status_code == 503]
        print(f"\n[R4 cap] {3 * cap} new chats, cap {cap}: peak containers {peak}, {statuses}")
        assert peak <= cap
        assert len(served) + len(busy) == 3 * cap, statuses  # nothing crashed
        assert len(served) >= cap and busy
        for r in busy:
            err = r.json()["error"]
            assert err["code"] == "busy" and err["rule"] == "R4" and "/" not in err["message"]
        # idle sandboxes make room: a newcomer now evicts the longest idle one
        r = client.say("late-comer", "echo welcome", sender="late")
        assert r.status_code == 200 and "welcome" in r.json()["reply"]
        assert count_containers(docker_client, app) <= cap


def test_R4_slow_turn_flood_from_one_sender_does_not_starve_another_chat(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    """8 chats of one sender run 20 s turns; another chat is answered within 10 s."""
    app = "abusefair"
    with serve(tmp_path, docker_client, base_image, app, {"maxConcurrentTurns": 4}) as (
        client,
        _,
    ):
        for i in range(8):
            r = client.say(f"flood-{i}", "sleep 20; echo slow", sender="mallory", wait=False)
            assert r.status_code == 202, r.text
        time.sleep(3)
        waits = []
        for i in range(3):
            t0 = time.monotonic()
            r = client.say(f"alice-{i}", "echo hi", sender=f"alice-{i}")
            waits.append(time.monotonic() - t0)
            assert r.status_code == 200 and "hi" in r.json()["reply"], r.text
        print(f"\n[R4 fair] other chats answered in {[round(w, 2) for w in waits]} s")
        assert max(waits) < 10.0


def test_R4_a_flood_from_one_sender_is_refused_at_the_door(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    app = "abuserate"
    gateway = {"admission": {"senderPerMinute": 1, "burst": 3}}  # no refill within the test
    with serve(tmp_path, docker_client, base_image, app, gateway) as (client, gw):
        codes = [client.say(f"c{i}", "true", sender="mallory", wait=False) for i in range(40)]
        accepted = [r for r in codes if r.status_code == 202]
        refused = [r for r in codes if r.status_code == 429]
        assert len(accepted) == 3 and len(refused) == 37
        assert refused[0].headers["Retry-After"] and refused[0].json()["error"]["rule"] == "R4"
        # the header and the body name the same wait: the rate's, not a fixed default
        said = re.search(r"wait (\d+) s", refused[-1].json()["error"]["message"])
        assert said is not None, refused[-1].text
        assert abs(int(refused[-1].headers["Retry-After"]) - int(said[1])) <= 1
        assert int(said[1]) > 30  # one message a minute, the bucket empty
        assert len([r for r in gw.store.refusals() if r.action == "message"]) == 1
        r = client.say("other", "echo still-here", sender="alice")
        assert r.status_code == 200 and "still-here" in r.json()["reply"]


def wait_all(client: Client, sent: dict[str, tuple[str, str]], within: float) -> dict[str, str]:
    """message id -> reply, once every message has one."""
    deadline = time.monotonic() + within
    replies: dict[str, str] = {}
    while time.monotonic() < deadline and len(replies) < len(sent):
        for mid, (chat, _) in sent.items():
            if mid not in replies:
                doc = client.state(chat, mid)
                if doc["reply"] is not None:
                    replies[mid] = doc["reply"]
        time.sleep(0.5)
    return replies


def test_R7_engine_dies_mid_turn_nothing_lost_or_misrouted_and_it_recovers(
    tmp_path: Path, docker_client: Any, base_image: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = "r7engine"
    sock_dir = Path(tempfile.mkdtemp(prefix="cg-r7-"))
    caplog.set_level(logging.INFO)
    try:
        with engine_proxy(sock_dir / "engine.sock") as proxy:

            def backend() -> DockerBackend:
                return DockerBackend(docker.DockerClient(base_url=proxy.url, max_pool_size=16))

            with serve(tmp_path, docker_client, base_image, app, {}, backend) as (client, _):
                for i in range(3):
                    assert client.say(f"warm-{i}", "true").status_code == 200
                sent: dict[str, tuple[str, str]] = {}
                for i in range(3):
                    for chat in (f"warm-{i}", f"cold-{i}"):
                        mid = f"{chat}-m"
                        r = client.later(chat, f"sleep 2; echo answer-for-{chat}", mid)
                        assert r.status_code == 202, r.text
                        sent[mid] = (chat, f"answer-for-{chat}")
                time.sleep(1.0)
                proxy.down()  # the engine dies with turns in flight ...
                for c in app_containers(docker_client, app):
                    with contextlib.suppress(docker.errors.APIError):
                        c.kill()  # ... and takes its containers with it
                time.sleep(4)
                proxy.up()
                replies = wait_all(client, sent, within=180)
                assert set(replies) == set(sent), f"unanswered: {set(sent) - set(replies)}"
                for mid, (_, expected) in sent.items():
                    assert expected in replies[mid], (mid, replies[mid])  # its own, not another's
                assert "answer-for-warm-0" in client.say("warm-0", "echo answer-for-warm-0").text
        logs = [r.getMessage() for r in caplog.records]
        assert any("engine is unavailable" in m for m in logs)
        assert any("engine answers again" in m for m in logs)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 256 MB tmpfs of the test's own, as the gateway's state disk."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small state disk needs root")
    where = Path(tempfile.mkdtemp(prefix="cg-disk-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m,mode=0755", "tmpfs", str(where)], check=True
    )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def fill(path: Path) -> Path:
    """Write until the disk says no (ENOSPC), unbuffered: nothing left to flush at close."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    chunk = b"\0" * (1 << 20)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, chunk):
                pass
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    return filler


def test_R7_state_disk_fills_no_accepted_message_is_lost_and_it_recovers(
    small_disk: Path, docker_client: Any, base_image: str
) -> None:
    app = "r7disk"
    with serve(small_disk, docker_client, base_image, app, {}) as (client, _):
        assert client.say("before", "echo up").status_code == 200
        sent: dict[str, tuple[str, str]] = {}
        for i in range(3):
            chat = f"early-{i}"
            r = client.later(chat, f"sleep 1; echo answer-for-{chat}", f"{chat}-m")
            assert r.status_code == 202
            sent[f"{chat}-m"] = (chat, f"answer-for-{chat}")
        filler = fill(small_disk)
        refused = 0
        for i in range(5):
            chat = f"full-{i}"
            r = client.later(chat, f"echo answer-for-{chat}", f"{chat}-m")
            assert r.status_code in (202, 503), r.text
            if r.status_code == 202:
                sent[f"{chat}-m"] = (chat, f"answer-for-{chat}")
            else:
                refused += 1
                err = r.json()["error"]
                assert err["code"] == "storage_full" and str(small_disk) not in err["message"]
        time.sleep(3)
        filler.unlink()
        replies = wait_all(client, sent, within=180)
        print(f"\n[R7 disk] accepted {len(sent)}, refused while full {refused}")
        assert set(replies) == set(sent), f"unanswered: {set(sent) - set(replies)}"
        assert client.say("after", "echo recovered").status_code == 200


def test_R7_engine_proxy_is_only_ours() -> None:
    """The proxy cuts only its own connections: the real engine answers throughout."""
    sock_dir = Path(tempfile.mkdtemp(prefix="cg-r7-"))
    try:
        with engine_proxy(sock_dir / "e.sock") as proxy:
            client = docker.DockerClient(base_url=proxy.url)
            assert client.ping()
            proxy.down()
            with pytest.raises((docker.errors.DockerException, Exception)):
                client.ping()
            real = docker.from_env()
            assert real.ping()
            real.close()
            proxy.up()
            assert client.ping()
            client.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
