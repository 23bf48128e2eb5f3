"""Real workspaces, real specs, and cleanup of every container a test created.

Each test (or module, for shared containers) gets its own app name; every
sandbox and hand-made container carries it as the `io.cellgate.app` label and
this run's gateway id (R1) as `io.cellgate.gateway`; teardown force-removes only
containers with both.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from cellgate.models import ConversationKey
from orchestrator.conversations import ConversationPaths, conversation_paths, ensure_conversation
from sandbox.backends.docker import DockerBackend
from sandbox.mountplan import own_dirs, plan_mounts, scan_workspace
from sandbox.spec import SandboxLimits, SandboxSpec, sandbox_name
from tests.support.run_id import RUN_ID, remove_run_containers

UID = 65532
USER = f"{UID}:{UID}"
CHAT_ID = "-1001234"
FAST_PIDS = 48


@dataclass(frozen=True)
class Built:
    """One conversation's sandbox spec and the host paths behind it."""

    spec: SandboxSpec
    paths: ConversationPaths
    key: ConversationKey

    @property
    def chat_target(self) -> str:
        return f"/workspace/chats/{self.key.dir_name}"

    def with_limits(self, **changes: int) -> Built:
        limits = replace(self.spec.limits, **changes)
        return replace(self, spec=replace(self.spec, limits=limits))


def make_workspace(agent_root: Path) -> Path:
    """A realistic workspace: persona, skills, root memory, another conversation's chat."""
    ws = agent_root / "workspace"
    (ws / "skills" / "greet").mkdir(parents=True)
    (ws / "skills" / "greet" / "SKILL.md").write_text("# greet\n")
    (ws / ".claude" / "skills" / "lookup").mkdir(parents=True)
    (ws / ".claude" / "skills" / "lookup" / "SKILL.md").write_text("# lookup\n")
    (ws / ".claude" / "settings.local.json").write_text("{}\n")
    (ws / "AGENTS.md").write_text("You are a helpful bot.\n")
    (ws / "SOUL.md").write_text("Calm.\n")
    (ws / "MEMORY.md").write_text("operator-private root memory\n")
    (ws / "USER.md").write_text("operator-private root user profile\n")
    other = ws / "chats" / "other-conv"
    other.mkdir(parents=True)
    (other / "MEMORY.md").write_text("someone else's memory\n")
    (ws / "memory").mkdir()
    (ws / "memory" / "topic.md").write_text("archive\n")
    return ws


def build_spec(
    root: Path,
    app: str,
    image_id: str,
    *,
    runtime: str | None = None,
    limits: SandboxLimits | None = None,
    chat_id: str = CHAT_ID,
) -> Built:
    """Plan and spec one conversation's sandbox the way the gateway would."""
    agent_root = root / "agents" / "helper"
    ws = agent_root / "workspace" if (agent_root / "workspace").exists() else None
    ws = ws or make_workspace(agent_root)
    key = ConversationKey("helper", "telegram", chat_id)
    paths = conversation_paths(agent_root, ws, key, session_id="s1")
    ensure_conversation(paths, UID, UID)
    own = own_dirs(paths.chat_dir, paths.media_dir, paths.home_dir, paths.bridge_dir)
    plan = plan_mounts(scan_workspace(ws), own)
    spec = SandboxSpec(
        name=sandbox_name(app, key.digest, gateway=RUN_ID),
        image="cellgate-base:bookworm",
        image_id=image_id,
        user=USER,
        env={"LANG": "C.UTF-8", "APP_MODE": "test"},
        networks=(),
        plan=plan,
        limits=limits or SandboxLimits(),
        runtime=runtime,
        app=app,
        agent="helper",
        conversation=key.dir_name,
        gateway=RUN_ID,
    )
    return Built(spec, paths, key)


def remove_app_containers(client: docker.DockerClient, app: str) -> None:
    """Force-remove this run's containers of `app`, whatever state they are in."""
    remove_run_containers(client, app)


def new_app_name() -> str:
    return f"cgt{secrets.token_hex(4)}"


@pytest.fixture
def app_name(docker_client: docker.DockerClient) -> Iterator[str]:
    """A fresh app label for one test; its containers are removed afterwards."""
    name = new_app_name()
    yield name
    remove_app_containers(docker_client, name)


@pytest.fixture(scope="module")
def module_app(docker_client: docker.DockerClient) -> Iterator[str]:
    """A fresh app label for one module's shared containers."""
    name = new_app_name()
    yield name
    remove_app_containers(docker_client, name)


@pytest.fixture(scope="session")
def image_id(docker_client: docker.DockerClient, base_image: str) -> str:
    attrs: dict[str, Any] = docker_client.images.get(base_image).attrs
    image: str = attrs["Id"]
    return image


@pytest.fixture
async def backend(docker_client: docker.DockerClient) -> AsyncIterator[DockerBackend]:
    """A backend with its own client, closed after the test."""
    b = DockerBackend.from_env()
    yield b
    await b.close()


@pytest.fixture
def spec_factory(tmp_path: Path, app_name: str, image_id: str) -> Callable[..., Built]:
    """Build specs under this test's tmp dir and app label."""

    def factory(**kwargs: Any) -> Built:
        return build_spec(tmp_path, app_name, image_id, **kwargs)

    return factory


def _create_shared(root: Path, app: str, image: str, runtime: str | None) -> Built:
    built = build_spec(root, app, image, runtime=runtime, limits=SandboxLimits(pids=FAST_PIDS))

    async def go() -> None:
        b = DockerBackend.from_env()
        try:
            await b.ensure(built.spec)
        finally:
            await b.close()

    asyncio.run(go())
    return built


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, module_app: str, image_id: str) -> Built:
    """One runc sandbox a module's read-mostly tests share."""
    return _create_shared(tmp_path_factory.mktemp("shared"), module_app, image_id, None)


@pytest.fixture(scope="module")
def runsc_shared(
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: docker.DockerClient,
    image_id: str,
) -> Iterator[Built]:
    """The same sandbox under gVisor; skipped only when `runsc` is not registered."""
    if "runsc" not in (docker_client.info().get("Runtimes") or {}):
        pytest.skip("the engine has no runsc runtime registered")
    app = new_app_name()
    try:
        yield _create_shared(tmp_path_factory.mktemp("gvisor"), app, image_id, "runsc")
    finally:
        remove_app_containers(docker_client, app)
