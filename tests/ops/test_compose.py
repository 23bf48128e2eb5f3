"""O1: compose.yaml brings the gateway up in a container, behind the Docker API proxy.

The stack is built from the local base image (no registry) and brought up on
the local engine under a project name carrying this run's id; its images are
tagged with the run id too. A turn goes through the containerised gateway over
HTTP with an API key; the gateway holds no engine socket; the proxy refuses
what cellgate never calls; a sandbox cannot even reach the proxy. Down removes
the project's containers, network and images, and this run's sandboxes: only
what the test made.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.config import write_config_document
from sandbox.spec import LABEL_APP, LABEL_GATEWAY
from tests.e2e.conftest import CONFIG_KEY, install_test_app, remove_app_containers
from tests.support.run_id import RUN_ID
from tests.support.served import free_port

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
CANARY_OPENAI = "sk-canaryCOMPOSEenv0123456789abcdef"
# What the probe asks the proxy from inside the gateway container: plain calls
# (their status), then raw bytes on one connection each (all that came back).
PROBE = """
import http.client, json, socket, sys
out = {}
for method, path in json.loads(sys.argv[1]):
    c = http.client.HTTPConnection("docker-api", 2375, timeout=10)
    c.request(method, path)
    out[method + " " + path] = c.getresponse().status
    c.close()
for name, data in json.loads(sys.argv[2]).items():
    s = socket.create_connection(("docker-api", 2375), timeout=5)
    s.sendall(data.encode("latin-1"))
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except socket.timeout:
        got += b"<open>"
    s.close()
    out[name] = got.decode("latin-1")
print(json.dumps(out))
"""


@dataclass
class Stack:
    project: str
    url: str
    agent: str
    app: str
    state: Path
    env: dict[str, str]

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return compose(self.project, self.env, *args, timeout=timeout)

    def container(self, service: str) -> str:
        out = self.compose("ps", "-q", service, timeout=60).stdout.strip()
        assert out, f"no {service} container"
        return out.splitlines()[0]

    def say(self, chat: str, text: str) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages",
            json={"text": text},
            headers={"Authorization": f"Bearer {CONFIG_KEY}"},
            timeout=180,
        )


def compose(
    project: str, env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: run scripts/setup-engine.sh"
    return subprocess.run(
        [exe, "-p", project, "-f", str(REPO / "compose.yaml"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _wait_healthy(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=3).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[Stack]:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is missing: run scripts/setup-engine.sh (as root)")
    app = f"o1c{secrets.token_hex(3)}"
    # the loop-mounted quota needs privileges the Compose gateway does not get (README)
    config_path = install_test_app(
        tmp_path_factory.mktemp(app), docker_client, base_image, app, {"quota": "off"}
    )
    # The message goes to `sh -s` on stdin: a turn ends only when the exec's
    # half-close passes through the proxy's tunnel (the harness's stdin path).
    doc = json.loads(config_path.read_text())
    doc["agents"][0]["harness"] = {"type": "command", "argv": ["sh", "-s"], "timeoutSeconds": 60}
    write_config_document(config_path, doc)
    state = config_path.parent
    port = free_port()
    project = f"cellgate-o1-{RUN_ID}"
    env = {
        **os.environ,
        "CELLGATE_STATE_DIR": str(state),
        "CELLGATE_CONFIG": str(config_path),
        "CELLGATE_IMAGE_TAG": RUN_ID,
        "CELLGATE_PUBLISH": f"127.0.0.1:{port}",
        "CELLGATE_BASE_IMAGE": base_image,
        "CELLGATE_PY": sys.executable,
        "OPENAI_API_KEY": CANARY_OPENAI,
    }
    s = Stack(project, f"http://127.0.0.1:{port}", f"{app}-bot", app, state, env)
    try:
        prep = subprocess.run(
            ["bash", str(REPO / "scripts/compose-prepare.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert prep.returncode == 0, prep.stderr[-3000:]
        up = s.compose("up", "-d", "--build", timeout=1500)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        if not _wait_healthy(s.url, 120):
            logs = s.compose("logs", "--no-color", "--tail", "80", timeout=60)
            pytest.fail(f"the gateway never answered /healthz:\n{logs.stdout[-4000:]}")
        yield s
    finally:
        down = s.compose("down", "--rmi", "all", "--volumes", "--remove-orphans", timeout=300)
        remove_app_containers(docker_client, app)
        assert down.returncode == 0, down.stderr[-2000:]


def test_a_turn_runs_through_the_compose_stack_o1(stack: Stack, docker_client: Any) -> None:
    started = time.monotonic()
    r = stack.say("c1", "echo compose-$((6*7))")
    assert r.status_code == 200, r.text
    assert "compose-42" in r.json()["reply"]
    assert time.monotonic() - started < 50  # stdin's end reached `sh -s`: no timeout

    # the sandbox is this run's, and its bind mounts are the host's state dir paths
    rows = docker_client.api.containers(
        filters={"label": [f"{LABEL_GATEWAY}={RUN_ID}", f"{LABEL_APP}={stack.app}"]}
    )
    assert len(rows) == 1, rows
    mounts = docker_client.api.inspect_container(rows[0]["Id"])["Mounts"]
    binds = [m["Source"] for m in mounts if m["Type"] == "bind"]
    assert binds and all(b.startswith(f"{stack.state}/") for b in binds), binds

    # the gateway got its secret from the environment; it holds no engine socket
    gw = docker_client.api.inspect_container(stack.container("gateway"))
    assert f"OPENAI_API_KEY={CANARY_OPENAI}" in gw["Config"]["Env"]
    assert all("docker.sock" not in m["Source"] for m in gw["Mounts"]), gw["Mounts"]
    assert gw["HostConfig"]["Privileged"] is False
    proxy = docker_client.api.inspect_container(stack.container("docker-api"))
    assert any(m["Destination"] == "/var/run/docker.sock" for m in proxy["Mounts"])

    # ... and the sandbox sees neither the secret nor a way to the proxy
    r = stack.say(
        "c1",
        'env | grep -c canaryCOMPOSE; python3 -c "import socket; socket.create_connection('
        "('docker-api', 2375), timeout=3)\" 2>/dev/null && echo PROXY-REACHED || echo no-proxy",
    )
    assert r.status_code == 200, r.text
    reply = r.json()["reply"]
    assert "no-proxy" in reply and "PROXY-REACHED" not in reply, reply
    assert CANARY_OPENAI not in reply


def test_the_proxy_refuses_what_cellgate_does_not_call_o1(stack: Stack) -> None:
    calls = [
        ("GET", "/_ping"),
        ("GET", "/version"),
        ("GET", "/v1.41/images/json"),
        ("GET", "/v1.41/volumes"),
        ("POST", "/v1.41/build"),
        ("GET", "/v1.41/containers/x/archive?path=/"),
        ("GET", "/v1.41/containers/../images/json"),
    ]
    body = '{"Tty": false, "Detach": false}'
    images = "GET /v1.41/images/json HTTP/1.1\r\nHost: d\r\n\r\n"
    raw = {
        # one connection, one request: a second one sent behind an allowed call is dropped
        "pipelined": "GET /_ping HTTP/1.1\r\nHost: d\r\n\r\n" + images,
        # an exec start that asks to upgrade stays raw only if the engine answers 101:
        # a refused one (no such exec) closes, and what was sent behind it never runs
        "smuggled": (
            f"POST /v1.41/exec/{'0' * 64}/start HTTP/1.1\r\nHost: d\r\n"
            "Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}{images}"
        ),
    }
    out = stack.compose(
        "exec", "-T", "gateway", "python3", "-c", PROBE, json.dumps(calls), json.dumps(raw),
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status["GET /_ping"] == 200
    assert status["GET /version"] == 200
    refused = {k: v for k, v in status.items() if v == 403}
    assert set(refused) == {
        "GET /v1.41/images/json",
        "GET /v1.41/volumes",
        "POST /v1.41/build",
        "GET /v1.41/containers/x/archive?path=/",
        "GET /v1.41/containers/../images/json",
    }, status
    assert status["pipelined"].startswith("HTTP/1.1 200"), status["pipelined"]
    assert status["pipelined"].count("HTTP/1.1") == 1, status["pipelined"]
    assert "RepoTags" not in status["pipelined"] + status["smuggled"]
    assert status["smuggled"] == "", status["smuggled"]


def test_doctor_runs_in_the_gateway_container_through_the_proxy_o1(stack: Stack) -> None:
    out = stack.compose(
        "exec", "-T", "gateway", "cellgate", "doctor", "--config", "/etc/cellgate/config.json",
        "--json", timeout=180,
    )  # fmt: skip
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["engine"]["status"] == "ok", checks["engine"]
    assert checks["runtime runc"]["status"] == "ok", checks["runtime runc"]
    # no loop devices or mount rights in the Compose gateway: R2's quota cannot work (README)
    assert "loop-mounted" not in checks["quota (R2)"]["detail"], checks["quota (R2)"]


def test_the_gateway_refuses_a_state_dir_not_at_its_host_path_o1(stack: Stack) -> None:
    # /tmp is a mount in the container (a tmpfs), but not where the config's state is
    out = stack.compose(
        "run", "--rm", "--no-deps", "-e", "CELLGATE_STATE_DIR=/tmp", "gateway", timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"gateway.stateDir is {stack.state}" in out.stderr, out.stderr
    assert 'under Compose it must be "/tmp"' in out.stderr
