"""R1: two gateways serving an app of the same name on one engine, side by side.

Each has its own gateway id (state directory), so the same chat gets a different
sandbox under each; one's start (reconciliation) and reaper never touch the
other's sandboxes, and a turn running in one survives the other's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from orchestrator.config import load_config
from orchestrator.gateway import Gateway
from sandbox.backends.docker import DockerBackend
from sandbox.spec import LABEL_GATEWAY
from tests.e2e.conftest import install_test_app
from tests.support.run_id import RUN_ID, remove_run_containers, run_labels

pytestmark = pytest.mark.docker

APP = "twin"
AGENT = f"{APP}-bot"
OTHER_ID = f"{RUN_ID}-b"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def configs(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[tuple[Path, Path]]:
    a = install_test_app(tmp_path_factory.mktemp("twin-a"), docker_client, base_image, APP)
    b = install_test_app(
        tmp_path_factory.mktemp("twin-b"), docker_client, base_image, APP, gateway_id=OTHER_ID
    )
    yield a, b
    remove_run_containers(docker_client, APP)
    for row in docker_client.api.containers(
        all=True, filters={"label": [f"{LABEL_GATEWAY}={OTHER_ID}"]}
    ):
        docker_client.api.remove_container(row["Id"], force=True)
    for path in (a, b):
        shutil.rmtree(path.parent / "agents", ignore_errors=True)


def _ids(docker_client: Any, gateway_id: str) -> dict[str, str]:
    labels = [f"{LABEL_GATEWAY}={gateway_id}", *run_labels(APP)[1:]]
    rows = docker_client.api.containers(all=True, filters={"label": labels})
    return {row["Names"][0].lstrip("/"): row["Id"] for row in rows}


@pytest.fixture
async def pair(configs: tuple[Path, Path]) -> AsyncIterator[tuple[Gateway, Gateway, Clock]]:
    clock = Clock()
    a = Gateway(load_config(configs[0]), DockerBackend.from_env(), clock=clock)
    b = Gateway(load_config(configs[1]), DockerBackend.from_env(), clock=clock)
    try:
        yield a, b, clock
    finally:
        await a.close()
        await b.close()


async def test_R1_two_gateways_same_app_keep_their_own_sandboxes(
    pair: tuple[Gateway, Gateway, Clock], docker_client: Any
) -> None:
    a, b, clock = pair
    assert (a.gateway_id, b.gateway_id) == (RUN_ID, OTHER_ID)
    await a.start()
    await b.start()
    # The same chat id under both gateways: two sandboxes, two names.
    out_a = await a.turn(AGENT, "api", "same-chat", "echo from-a")
    out_b = await b.turn(AGENT, "api", "same-chat", "echo from-b")
    assert "from-a" in out_a.result.reply and "from-b" in out_b.result.reply
    assert out_a.sandbox != out_b.sandbox
    assert out_a.sandbox.startswith(f"{APP}-agent-c-") and out_b.sandbox.startswith(
        f"{APP}-agent-c-"
    )
    mine_a, mine_b = _ids(docker_client, RUN_ID), _ids(docker_client, OTHER_ID)
    assert set(mine_a) == {out_a.sandbox} and set(mine_b) == {out_b.sandbox}

    # B restarts (reconciliation) while a turn runs in A's sandbox: A's turn finishes in it.
    restarted_b = Gateway(b.config, DockerBackend.from_env(), clock=clock)
    try:
        slow = asyncio.create_task(a.turn(AGENT, "api", "same-chat", "sleep 3; echo survived"))
        await asyncio.sleep(1)
        await restarted_b.start()
        assert "survived" in (await slow).result.reply
        assert _ids(docker_client, RUN_ID) == mine_a
        assert _ids(docker_client, OTHER_ID) == mine_b  # B keeps its own known sandbox too

        # A restarts: B's sandbox stays.
        restarted_a = Gateway(a.config, DockerBackend.from_env(), clock=clock)
        try:
            await restarted_a.start()
        finally:
            await restarted_a.close()
        assert _ids(docker_client, OTHER_ID) == mine_b and _ids(docker_client, RUN_ID) == mine_a

        # B's reaper, with every sandbox idle for a day: only B's goes.
        clock.t += 24 * 3600
        removed = await restarted_b.reaper().run_once()
        assert removed == [out_b.sandbox]
        assert _ids(docker_client, OTHER_ID) == {}
        assert _ids(docker_client, RUN_ID) == mine_a
    finally:
        await restarted_b.close()


def test_R1_an_uninstall_in_one_gateway_keeps_the_other_s_image(
    tmp_path: Path, docker_client: Any, base_image: str
) -> None:
    """Image tags name their gateway: one gateway's update, uninstall or restore touches its
    own tag, never the tag (and so, maybe, the image) another gateway's install runs."""
    from orchestrator.app_backup import backup_app, restore_app
    from orchestrator.app_ops import uninstall_app
    from orchestrator.apps import InstalledApp
    from orchestrator.config import write_config_document
    from sandbox.gateway_id import write_gateway_id

    app, quiet = "twintag", lambda _: None
    for side in ("a", "b", "c"):
        (tmp_path / side).mkdir()
    a = install_test_app(tmp_path / "a", docker_client, base_image, app)
    b = install_test_app(tmp_path / "b", docker_client, base_image, app, gateway_id=OTHER_ID)
    c_state, c_id = tmp_path / "c" / "state", f"{RUN_ID}-c"
    c_state.mkdir()
    write_gateway_id(c_state, c_id)
    c = c_state / "config.json"
    write_config_document(c, {"gateway": {"stateDir": str(c_state)}, "agents": []})
    ours, theirs = (InstalledApp.load(p.parent, app) for p in (a, b))
    made = [ours.image, theirs.image, f"cellgate-app-{app}:{ours.version}-{c_id}"]
    try:
        assert ours.image != theirs.image and ours.image.endswith(f"-{RUN_ID}")
        # a restore next to the backed-up gateway tags the image as its own
        backup = backup_app(app, a.parent, tmp_path / "a.tgz", quiet)
        restored = restore_app(backup, c, c_state, docker_client, quiet)
        assert restored.image == made[2] and restored.image_id == ours.image_id
        uninstall_app(app, c, c_state, docker_client, quiet)
        assert docker_client.images.get(ours.image).id == ours.image_id
        uninstall_app(app, a, a.parent, docker_client, quiet)
        assert docker_client.images.get(theirs.image).id == theirs.image_id
        with pytest.raises(docker.errors.ImageNotFound):
            docker_client.images.get(ours.image)
    finally:
        for ref in made:
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(ref, force=True)
