"""Real sandboxes for harness tests: one test image with fake `claude` and `codex`.

`sandboxes(chat_id)` makes a conversation's sandbox through the gateway's own
`ConversationSandboxes` (directories, mount plan, spec, create, verify) on the
real engine; each test gets a fresh `DockerBackend` to exec through. Every
container of the session's app is force-removed at the end, and so is the image.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cellgate.models import ConversationKey
from orchestrator.apps import InstalledApp
from orchestrator.config import GatewaySettings
from orchestrator.harnesses.base import SessionContext
from orchestrator.sandboxes import ConversationSandboxes, PreparedSandbox
from policies.tools import session_env_flags
from sandbox.backends.docker import DockerBackend
from tests.support.run_id import RUN_ID, remove_run_containers

FAKES = Path(__file__).resolve().parent.parent / "fakes"
AGENT = "hx-bot"
PERSONA = {"AGENTS.md": "Be brief.", "IDENTITY.md": "I am Hexbot.", "SOUL.md": "Calm."}


@dataclass
class Sandboxed:
    key: ConversationKey
    session_id: str
    prepared: PreparedSandbox
    docker: Any

    def ctx(self, backend: DockerBackend) -> SessionContext:
        """The context the gateway gives a harness (env as `Gateway.session_env` builds it)."""
        return SessionContext(
            conversation=self.key,
            session_key=self.session_id,
            backend=backend,
            sandbox=self.prepared.handle,
            env={
                "HOME": self.prepared.spec.home,
                "GATEWAY_ORIGIN_CHANNEL": self.key.channel,
                "GATEWAY_ORIGIN_CHAT_ID": self.key.chat_id,
                **session_env_flags(),
            },
            workdir=self.prepared.spec.workdir,
        )

    def sh(self, command: str) -> tuple[int, str]:
        """Run a command in the sandbox directly through the engine (a test's own eyes)."""
        c = self.docker.containers.get(self.prepared.handle.container_id)
        code, out = c.exec_run(["/bin/sh", "-c", command], user=self.prepared.spec.user)
        return int(code), out.decode("utf-8", "replace")


@pytest.fixture(scope="session")
def fake_cli_image(docker_client: Any, base_image: str, tmp_path_factory: Any) -> Iterator[str]:
    tag = f"cellgate-test-fakecli:{uuid.uuid4().hex[:8]}"
    ctx = tmp_path_factory.mktemp("fakecli-image")
    shutil.copy(FAKES / "fake_cli.py", ctx / "fake_cli.py")
    (ctx / "Dockerfile").write_text(
        f"FROM {base_image}\n"
        "COPY fake_cli.py /usr/local/bin/claude\n"
        "COPY fake_cli.py /usr/local/bin/codex\n"
        "RUN chmod 0755 /usr/local/bin/claude /usr/local/bin/codex\n"
        "USER 10001:10001\n"
        "WORKDIR /workspace\n"
    )
    docker_client.images.build(path=str(ctx), tag=tag, rm=True, network_mode="none")
    yield tag
    docker_client.images.remove(tag, force=True)


@pytest.fixture(scope="session")
def sandboxes(
    docker_client: Any, fake_cli_image: str, tmp_path_factory: Any
) -> Iterator[Callable[[str], Sandboxed]]:
    app_name = f"hx{uuid.uuid4().hex[:6]}"
    root = tmp_path_factory.mktemp("harness-state")
    workspace = root / "agents" / AGENT / "workspace"
    (workspace / "skills").mkdir(parents=True)
    for name, text in PERSONA.items():
        (workspace / name).write_text(text)
    app = InstalledApp(
        name=app_name,
        version="1",
        agent=AGENT,
        image=fake_cli_image,
        image_id=docker_client.images.get(fake_cli_image).id,
        user=None,
        environment={"APP_MODE": "test"},
        networks=(),
        isolate_memory=True,
        disable_archive=True,
        workspace=workspace,
        agent_root=root / "agents" / AGENT,
    )
    made: dict[str, Sandboxed] = {}
    pool = ThreadPoolExecutor(1)

    async def create(key: ConversationKey, session_id: str) -> PreparedSandbox:
        backend = DockerBackend.from_env()
        try:
            return await ConversationSandboxes(
                app, GatewaySettings(), backend, gateway_id=RUN_ID
            ).ensure(key, session_id)
        finally:
            await backend.close()

    def make(chat_id: str) -> Sandboxed:
        if chat_id not in made:
            key = ConversationKey(AGENT, "telegram", chat_id)
            session_id = f"s-{key.digest[:12]}"
            prepared = pool.submit(asyncio.run, create(key, session_id)).result()
            made[chat_id] = Sandboxed(key, session_id, prepared, docker_client)
        return made[chat_id]

    try:
        yield make
    finally:
        pool.shutdown()
        remove_run_containers(docker_client, app_name)


@pytest.fixture
async def backend() -> AsyncIterator[DockerBackend]:
    b = DockerBackend.from_env()
    try:
        yield b
    finally:
        await b.close()
