"""K1 for the keys this issue mints: none of them reaches a sandbox's environment or files.

A real gateway serves the sample isolated app on a real engine (app `k1api`,
so its containers never collide with the e2e suite's). Before the first turn
the store holds an admin key, an agent key, a host agent's MCP key
(`mint_host_agent_key`, K2) and a share; the admin secret is also planted in
the gateway's own environment and the config file holds a key. Then a
sandbox is searched from inside (its environment, every file for the key
shape), and from the host (the container's configured environment, every
host directory mounted into it) for the exact secrets.
"""

from __future__ import annotations

import os
import re
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
from orchestrator.keys import create_operator_key, mint_host_agent_key
from orchestrator.store import Store
from tests.support.run_id import remove_run_containers, run_labels, seed_gateway_id
from tests.support.served import served_gateway

pytestmark = pytest.mark.docker

APP, AGENT = "k1api", "k1api-bot"
CONFIG_KEY = "cg_k1CONFIGkey_0123456789abcdefghijklmno"
PLANTED_ENV = "CELLGATE_K1_MINTED_ADMIN"
KEY_SHAPE = r"cg_[A-Za-z0-9_-]{20,}"
CONTROL = "cg_CONTROLnotAkey0123456789"


@dataclass
class Minted:
    url: str
    state: Path
    docker: Any
    secrets: dict[str, str]

    def run(self, chat: str, command: str) -> str:
        r = httpx.post(
            f"{self.url}/v1/agents/{AGENT}/chats/{chat}/messages",
            json={"text": command},
            headers={"Authorization": f"Bearer {self.secrets['agent']}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return str(r.json()["reply"])


def _app_dir(tmp: Path) -> Path:
    app_dir = tmp / "app-src"
    shutil.copytree(sample_app_dir(), app_dir, symlinks=True)
    manifest = yaml.safe_load((app_dir / "app.yaml").read_text())
    manifest["name"] = APP
    manifest["services"]["agent"]["name"] = AGENT
    (app_dir / "app.yaml").write_text(yaml.safe_dump(manifest))
    return app_dir


@pytest.fixture(scope="module")
def minted(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[Minted]:

    from sandbox.backends.docker import DockerBackend

    tmp = tmp_path_factory.mktemp("k1")
    state = tmp / "state"
    state.mkdir()
    seed_gateway_id(state)  # R1
    config_path = state / "config.json"
    write_config_document(
        config_path,
        {
            "gateway": {"stateDir": str(state), "limits": {"pids": 64}},
            "apiKeys": [{"name": "first-run", "key": CONFIG_KEY, "agents": [AGENT]}],
            "agents": [],
        },
    )
    install_app(
        _app_dir(tmp),
        config_path,
        state,
        docker_client,
        lambda _: None,
        build_args={"BASE_IMAGE": base_image},
    )
    with Store.open(state) as store:
        _, admin = create_operator_key(store, "ops", [], all_agents=True, admin=True, write=True)
        _, agent = create_operator_key(store, "client", [AGENT])
        mcp_row, mcp = mint_host_agent_key(store, AGENT, ["whatsapp"])
        assert mcp_row.write and not mcp_row.admin and mcp_row.agents == (AGENT,)
    secrets = {"admin": admin, "agent": agent, "mcp": mcp, "config": CONFIG_KEY}
    saved = os.environ.get(PLANTED_ENV)
    os.environ[PLANTED_ENV] = admin
    try:
        with served_gateway(config_path, DockerBackend.from_env) as (url, _):
            yield Minted(url, state, docker_client, secrets)
    finally:
        if saved is None:
            os.environ.pop(PLANTED_ENV, None)
        else:
            os.environ[PLANTED_ENV] = saved
        remove_run_containers(docker_client, APP)


def test_K1_minted_keys_are_not_in_the_sandbox_env_or_files(minted: Minted) -> None:
    # a control string of the key shape proves the search looks where it claims to
    minted.run("alice", f"echo {CONTROL[:3]}''{CONTROL[3:]} > /tmp/control.txt; echo made")
    reply = minted.run(
        "alice",
        f"env; echo ==; grep -rhoE '{KEY_SHAPE}' / --exclude-dir=proc --exclude-dir=sys "
        "2>/dev/null | sort -u; echo ==; find / -name 'cellgate.sqlite3*' -not -path '/proc/*' "
        "2>/dev/null; echo ==; echo searched",
    )
    assert "searched" in reply
    env, found, db, _ = reply.split("==\n")
    for name, secret in minted.secrets.items():
        assert secret not in reply, f"the {name} key is visible in the sandbox"
    assert PLANTED_ENV not in env
    assert re.findall(KEY_SHAPE, found) == [CONTROL], found  # no API key of any kind
    assert db.strip() == "", "the state database (key hashes) is visible in the sandbox"


def test_K1_minted_keys_are_not_in_the_container_config_or_its_mounts(minted: Minted) -> None:
    minted.run("bob", "echo ok")
    containers = minted.docker.containers.list(filters={"label": run_labels(APP)})
    assert containers, "no sandbox is running"
    for container in containers:
        attrs = container.attrs
        env = "\n".join(attrs["Config"]["Env"] or [])
        for name, secret in minted.secrets.items():
            assert secret not in env, f"the {name} key is in {container.name}'s environment"
        for mount in attrs["Mounts"]:
            source = Path(mount["Source"])
            files = [source] if source.is_file() else [p for p in source.rglob("*") if p.is_file()]
            for f in files:
                data = f.read_bytes()
                for name, secret in minted.secrets.items():
                    assert secret.encode() not in data, f"the {name} key is in {f}"
