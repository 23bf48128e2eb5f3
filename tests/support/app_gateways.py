"""Gateways over the sample app installed with isolate mode on or off (S6, M8 tests).

`gateways(isolated)` installs the sample app under a fresh name (this run's
gateway id, R1) and returns a `Gateway` over a real engine; every gateway and
its containers are removed after the test.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.apps import install_app
from orchestrator.config import load_config, write_config_document
from orchestrator.demo import sample_app_dir
from orchestrator.gateway import Gateway
from sandbox.backends.docker import DockerBackend
from sandbox.gateway_id import write_gateway_id
from tests.e2e.conftest import SUITE_ADMISSION
from tests.support.run_id import RUN_ID, remove_run_containers


def install(
    tmp: Path,
    docker_client: Any,
    base_image: str,
    app: str,
    isolated: bool,
    *,
    gateway_id: str = RUN_ID,
) -> Path:
    src = tmp / "app-src"
    shutil.copytree(sample_app_dir(), src, symlinks=True)
    manifest = yaml.safe_load((src / "app.yaml").read_text())
    manifest["name"] = app
    manifest["services"]["agent"]["name"] = f"{app}-bot"
    manifest["services"]["agent"]["isolate_memory"] = isolated
    (src / "app.yaml").write_text(yaml.safe_dump(manifest))
    state = tmp / "state"
    state.mkdir()
    write_gateway_id(state, gateway_id)
    config = state / "config.json"
    write_config_document(
        config,
        {
            "gateway": {
                "stateDir": str(state),
                "admission": SUITE_ADMISSION,
                "limits": {"pids": 64},
            },
            "agents": [],
        },
    )
    install_app(
        src, config, state, docker_client, lambda _: None, build_args={"BASE_IMAGE": base_image}
    )
    return config


MakeGateway = Callable[[bool], Awaitable[Gateway]]


@contextlib.asynccontextmanager
async def app_gateways(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> AsyncIterator[MakeGateway]:
    """`make(isolated)`: a gateway over a fresh install; all closed and removed after."""
    made: list[tuple[Gateway, str]] = []

    async def make(isolated: bool) -> Gateway:
        app = f"{'iso' if isolated else 'shr'}{secrets.token_hex(3)}"
        config = install(tmp_path_factory.mktemp(app), docker_client, base_image, app, isolated)
        gw = Gateway(load_config(config), DockerBackend.from_env())
        made.append((gw, app))
        return gw

    try:
        yield make
    finally:
        for gw, app in made:
            await gw.close()
            remove_run_containers(docker_client, app)
