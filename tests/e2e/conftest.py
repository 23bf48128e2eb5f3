"""A real gateway over real HTTP, serving the sample isolated app on a real engine.

Canary secrets are planted in the gateway's own environment, its config file
and the app's declared environment; the tests look for them from inside.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.apps import install_app
from orchestrator.config import write_config_document
from orchestrator.demo import sample_app_dir
from orchestrator.gateway import Gateway
from sandbox.backends.docker import DockerBackend
from sandbox.gateway_id import write_gateway_id
from tests.support.run_id import RUN_ID, remove_run_containers
from tests.support.served import served_gateway

CANARIES = {
    "TELEGRAM_BOT_TOKEN": "123456789:canaryTELEGRAMtokenAAAAAAAAAAAAAAAAAAAA",
    "GATEWAY_API_URL": "http://127.0.0.1:1/canary-gateway-url",
    "OPENAI_API_KEY": "sk-canaryOPENAIkey0123456789abcdef",
    "CELLGATE_ADMIN_KEY": "cg_canaryADMINkey0123456789abcdefgh",
}
CONFIG_KEY = "cg_canaryCONFIGkey0123456789abcdefghij"
APP_SECRETS = {"DB_PASSWORD": "canary-db-password-0123", "SHOP_API_TOKEN": "canary-shop-token-4567"}
CANARY_NEEDLE = "canary"
# Test gateways send many messages to few chats; a test of admission passes its own.
SUITE_ADMISSION = {
    "chatPerMinute": 100_000,
    "senderPerMinute": 100_000,
    "burst": 10_000,
    "maxQueuedPerChat": 10_000,
}
APP_PUBLIC_ENV = {"APP_MODE": "demo-public-setting"}


@dataclass
class LiveGateway:
    url: str
    key: str
    state_dir: Path
    app: str
    agent: str
    docker: Any
    gateway: Gateway
    runtime: str

    def say(self, chat: str, text: str, timeout: float = 120) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/agents/{self.agent}/chats/{chat}/messages",
            json={"text": text},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=timeout,
        )

    def run(self, chat: str, text: str) -> str:
        r = self.say(chat, text)
        assert r.status_code == 200, r.text
        return str(r.json()["reply"])


def _prepare_app(tmp: Path, name: str = "e2e") -> Path:
    app_dir = tmp / f"app-src-{name}"
    shutil.copytree(sample_app_dir(), app_dir, symlinks=True)
    manifest = yaml.safe_load((app_dir / "app.yaml").read_text())
    manifest["name"] = name
    manifest["services"]["agent"]["name"] = f"{name}-bot"
    manifest["services"]["agent"]["environment"] = {**APP_SECRETS, **APP_PUBLIC_ENV}
    (app_dir / "app.yaml").write_text(yaml.safe_dump(manifest))
    return app_dir


def install_test_app(
    tmp: Path,
    docker_client: Any,
    base_image: str,
    name: str,
    gateway: dict[str, Any] | None = None,
    *,
    gateway_id: str = RUN_ID,
) -> Path:
    """A state dir with the sample app installed as `name` (agent `<name>-bot`); its config.

    The state dir's gateway id is this run's (R1), or `gateway_id` (derived from it).
    """
    state = tmp / f"state-{name}"
    state.mkdir()
    write_gateway_id(state, gateway_id)
    config_path = state / "config.json"
    write_config_document(
        config_path,
        {
            "gateway": {"stateDir": str(state), "admission": SUITE_ADMISSION, **(gateway or {})},
            "apiKeys": [{"name": name, "key": CONFIG_KEY, "agents": [f"{name}-bot"]}],
            "agents": [],
        },
    )
    install_app(
        _prepare_app(tmp, name),
        config_path,
        state,
        docker_client,
        lambda _: None,
        build_args={"BASE_IMAGE": base_image},
    )
    return config_path


def remove_app_containers(docker_client: Any, app: str) -> None:
    """This run's containers of `app` only (R1)."""
    remove_run_containers(docker_client, app)


@pytest.fixture(scope="session", params=["runc", "runsc"])
def live(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    base_image: str,
) -> Iterator[LiveGateway]:
    """The gateway under each runtime the engine has: runc, and gVisor where registered."""
    runtime = request.param
    gateway: dict[str, Any] = {"limits": {"pids": 64}}
    if runtime == "runsc":
        if "runsc" not in (docker_client.info().get("Runtimes") or {}):
            pytest.skip("the engine has no runsc runtime registered")
        gateway["runtime"] = "runsc"
    app = "e2e" if runtime == "runc" else "e2egv"
    config_path = install_test_app(
        tmp_path_factory.mktemp(app), docker_client, base_image, app, gateway
    )
    state = config_path.parent
    saved = {k: os.environ.get(k) for k in CANARIES}
    os.environ.update(CANARIES)
    try:
        with served_gateway(config_path, DockerBackend.from_env) as (url, gw):
            yield LiveGateway(url, CONFIG_KEY, state, app, f"{app}-bot", docker_client, gw, runtime)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        remove_app_containers(docker_client, app)


def config_text(live: LiveGateway) -> str:
    return json.dumps(json.loads((live.state_dir / "config.json").read_text()))
