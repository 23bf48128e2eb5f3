"""The gateway refuses to serve an agent whose runtime fails the start check (S2).

A runtime the engine does not know, or one whose containers cannot run `ls`
(an old gVisor), makes that agent unavailable with what failed and how to fix
it; the gateway itself keeps serving. runc and the installed runsc pass.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cellgate.errors import AgentUnavailable
from orchestrator.config import load_config
from orchestrator.gateway import Gateway
from sandbox.backends.docker import LABEL_PROBE, DockerBackend
from tests.e2e.conftest import install_test_app, remove_app_containers

pytestmark = pytest.mark.docker


@pytest.fixture
def app_with_runtime(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    base_image: str,
) -> Iterator[tuple[Path, str]]:
    """An installed app whose gateway config names `request.param` as its runtime."""
    runtime: str = request.param
    if runtime.startswith("fake-"):
        runtime = f"cellgate-{runtime}-{secrets.token_hex(4)}"  # the engine never knew it
    elif runtime not in (docker_client.info().get("Runtimes") or {}):
        pytest.skip(f"the engine has no {runtime} runtime registered")
    app = f"rtc{secrets.token_hex(4)}"
    config = install_test_app(
        tmp_path_factory.mktemp(app), docker_client, base_image, app, {"runtime": runtime}
    )
    try:
        yield config, runtime
    finally:
        remove_app_containers(docker_client, app)


def _probes(docker_client: Any) -> set[str]:
    return {c.name for c in docker_client.containers.list(all=True, filters={"label": LABEL_PROBE})}


@pytest.mark.parametrize("app_with_runtime", ["fake-runtime"], indirect=True)
async def test_S2_unknown_runtime_makes_the_agent_unavailable(
    app_with_runtime: tuple[Path, str], docker_client: Any
) -> None:
    config, runtime = app_with_runtime
    gw = Gateway(load_config(config), DockerBackend.from_env())
    try:
        agent = next(iter(gw.agents))
        with pytest.raises(AgentUnavailable) as refused:
            await gw.submit(agent, "api", "someone", "echo hi")
        text = str(refused.value)
        assert f"runtime {runtime} failed the start check" in text
        assert "the engine does not know it" in text
        assert "gateway.runtime" in text  # how to fix it
        assert gw.store.conversations() == []  # refused before anything was accepted
        # Refused again without a new check; the gateway did not crash.
        with pytest.raises(AgentUnavailable):
            await gw.submit(agent, "api", "someone", "echo hi")
    finally:
        await gw.close()


@pytest.mark.parametrize("app_with_runtime", ["runc", "runsc"], indirect=True)
async def test_S2_working_runtime_serves_and_leaves_no_probe(
    app_with_runtime: tuple[Path, str], docker_client: Any
) -> None:
    config, runtime = app_with_runtime
    before = _probes(docker_client)
    gw = Gateway(load_config(config), DockerBackend.from_env())
    try:
        agent = next(iter(gw.agents))
        outcome = await gw.turn(agent, "api", "someone", "ls -la / && stat -c %F /tmp")
        assert gw.agents[agent].unavailable is None
        assert "directory" in outcome.result.reply and "[exit 0]" in outcome.result.reply
        assert docker_client.containers.get(outcome.sandbox).attrs["HostConfig"]["Runtime"] == (
            runtime
        )
    finally:
        await gw.close()
    assert _probes(docker_client) <= before  # the probe container was removed
