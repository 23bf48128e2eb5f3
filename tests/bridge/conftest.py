"""A real bridge on real unix sockets, over a real store, with a recording outbox.

`world` is one agent's state directory (kept short: a unix socket path has
108 bytes) with a `BridgeServer` serving the standard tools; `world.open(chat)`
creates that chat's conversation directories, its store session and its
socket, and returns a handle that calls tools through the real client.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from cellgate.models import ConversationKey, DeliveryReceipt, OutboundMessage
from orchestrator.apps import InstalledApp, install_app
from orchestrator.bridge import (
    BridgeLimits,
    BridgeScope,
    BridgeServer,
    BuiltinTools,
    StoreRefusals,
    ToolHandlers,
    install_client,
)
from orchestrator.config import GatewaySettings, load_config, write_config_document
from orchestrator.conversations import conversation_paths, ensure_conversation
from orchestrator.demo import sample_app_dir
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.store import SessionId, Store
from sandbox.backends.base import ExecResult, SandboxBackend, SandboxHandle
from sandbox.client import cellgate_tool
from sandbox.quota import release_all
from tests.support.run_id import RUN_ID, remove_run_containers, seed_gateway_id

AGENT = "bot"


@dataclass
class RecordingOutbox:
    """Keeps every delivered message; a repeated outbound key is delivered once."""

    messages: list[tuple[BridgeScope, OutboundMessage]] = field(default_factory=list)
    file_bytes: list[bytes] = field(default_factory=list)
    file_modes: list[int] = field(default_factory=list)
    _receipts: dict[str, DeliveryReceipt] = field(default_factory=dict)

    async def deliver(self, scope: BridgeScope, message: OutboundMessage) -> DeliveryReceipt:
        known = self._receipts.get(message.outbound_key)
        if known is not None:
            return known
        if message.file_path:
            self.file_bytes.append(await asyncio.to_thread(Path(message.file_path).read_bytes))
            self.file_modes.append(os.stat(message.file_path).st_mode)
        self.messages.append((scope, message))
        receipt = DeliveryReceipt(f"m{len(self.messages)}")
        self._receipts[message.outbound_key] = receipt
        return receipt

    @property
    def sent(self) -> list[OutboundMessage]:
        return [m for _, m in self.messages]


@dataclass
class Chat:
    world: World
    key: ConversationKey
    scope: BridgeScope
    socket: Path

    @property
    def media(self) -> Path:
        return self.scope.paths.media_dir

    @property
    def chat_dir(self) -> Path:
        return self.scope.paths.chat_dir

    async def call(self, tool: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """One call through the real client, on a thread so the server keeps serving."""
        return await asyncio.to_thread(cellgate_tool.call, tool, args, path=str(self.socket))

    async def ok(self, tool: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        doc = await self.call(tool, args)
        assert doc["ok"], doc
        return dict(doc["result"])

    async def refused(self, tool: str, args: dict[str, Any] | None, rule: str) -> dict[str, Any]:
        doc = await self.call(tool, args)
        assert not doc["ok"], doc
        assert doc["error"]["code"] == "refused", doc
        assert doc["error"]["rule"] == rule, doc
        return dict(doc["error"])


@dataclass
class World:
    root: Path
    store: Store
    outbox: RecordingOutbox
    handlers: ToolHandlers
    server: BridgeServer
    agent_root: Path
    chats: dict[str, Chat] = field(default_factory=dict)

    @property
    def agent(self) -> str:
        return self.agent_root.name

    @property
    def workspace(self) -> Path:
        return self.agent_root / "workspace"

    def session_of(self, key: ConversationKey) -> str:
        return f"s-{key.digest[:12]}"

    async def open(
        self, chat_id: str, channel: str = "telegram", *, isolated: bool = True, **kw: Any
    ) -> Chat:
        key = ConversationKey(self.agent, channel, chat_id)
        sid = kw.pop("session_id", None) or self.session_of(key)
        paths = kw.pop("paths", None) or conversation_paths(
            self.agent_root, self.workspace, key, sid
        )
        ensure_conversation(paths, None, None)
        conv = self.store.upsert_conversation(key)
        if self.store.get_session(SessionId(sid)) is None:
            self.store.open_session(conv.id, "shell", session_id=SessionId(sid))
        scope = BridgeScope.for_conversation(key, sid, paths, isolated=isolated)
        if kw:
            scope = BridgeScope(**{**_fields(scope), **kw})
        install_client(paths.bridge_dir)
        sock = await self.server.open(scope)
        chat = Chat(self, key, scope, sock)
        self.chats[chat_id] = chat
        return chat


def _fields(scope: BridgeScope) -> dict[str, Any]:
    return {name: getattr(scope, name) for name in BridgeScope.__dataclass_fields__}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="cgb-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make_world(
    root: Path, limits: BridgeLimits | None = None, agent_root: Path | None = None
) -> World:
    agent_root = agent_root or root / "agents" / AGENT
    (agent_root / "workspace").mkdir(parents=True, exist_ok=True)
    store = Store.open(root)
    outbox = RecordingOutbox()
    handlers = BuiltinTools(outbox, store, root / "spool").install(
        ToolHandlers(refusals=StoreRefusals(store))
    )
    return World(root, store, outbox, handlers, BridgeServer(handlers, limits), agent_root)


@pytest.fixture
async def world(short_tmp: Path) -> AsyncIterator[World]:
    w = make_world(short_tmp)
    try:
        yield w
    finally:
        await w.server.close_all()
        w.store.close()


# -- real sandboxes --------------------------------------------------------------

SANDBOX_APP = "cgbridge"
SANDBOX_AGENT = "bridge-bot"
TOOL = ["python3", "/run/cellgate/cellgate-tool"]


@dataclass(frozen=True)
class BridgeApp:
    app: InstalledApp
    settings: GatewaySettings
    state: Path


@pytest.fixture(scope="session")
def bridge_app(docker_client: Any, base_image: str) -> Iterator[BridgeApp]:
    """The sample app (image built on the local base) installed under a fresh state dir."""
    state = Path(tempfile.mkdtemp(prefix="cgbs-", dir="/tmp"))
    os.chmod(state, 0o755)
    seed_gateway_id(state)  # R1
    config_path = state / "config.json"
    write_config_document(
        config_path,
        {
            "gateway": {
                "stateDir": str(state),
                "limits": {"pids": 64},
                "admission": {
                    "chatPerMinute": 100_000,
                    "burst": 10_000,
                    "maxQueuedPerChat": 10_000,
                },
            },
            "agents": [],
        },
    )
    src = state / "app-src"
    shutil.copytree(sample_app_dir(), src, symlinks=True)
    manifest = yaml.safe_load((src / "app.yaml").read_text())
    manifest["name"] = SANDBOX_APP
    manifest["services"]["agent"]["name"] = SANDBOX_AGENT
    (src / "app.yaml").write_text(yaml.safe_dump(manifest))
    app = install_app(src, config_path, state, docker_client, lambda _: None,
                      build_args={"BASE_IMAGE": base_image})  # fmt: skip
    try:
        yield BridgeApp(app, load_config(config_path).gateway, state)
    finally:
        remove_run_containers(docker_client, SANDBOX_APP)
        release_all(state)  # R2: the quota images' mounts, before their files go
        shutil.rmtree(state, ignore_errors=True)


@dataclass
class SandboxChat:
    """A chat whose bridge socket is mounted into its own running sandbox."""

    chat: Chat
    handle: SandboxHandle
    backend: SandboxBackend

    @property
    def media(self) -> str:
        return self.chat.scope.media_dir_in_sandbox

    @property
    def chat_dir(self) -> str:
        return f"/workspace/chats/{self.chat.key.dir_name}"

    async def sh(self, script: str, *, limit: float = 120) -> ExecResult:
        return await self.backend.exec(self.handle, ["sh", "-c", script], timeout=limit)

    async def tool(self, name: str, args: dict[str, Any] | None = None) -> ExecResult:
        argv = [*TOOL, name, json.dumps(args or {})]
        return await self.backend.exec(self.handle, argv, timeout=60)


@dataclass
class SandboxWorld:
    world: World
    sandboxes: ConversationSandboxes
    backend: SandboxBackend

    @property
    def outbox(self) -> RecordingOutbox:
        return self.world.outbox

    async def open(self, chat_id: str) -> SandboxChat:
        key = ConversationKey(self.sandboxes.app.agent, "telegram", chat_id)
        sid = self.world.session_of(key)
        prepared = await self.sandboxes.ensure(key, sid)
        chat = await self.world.open(chat_id, paths=prepared.paths, session_id=sid)
        return SandboxChat(chat, prepared.handle, self.backend)


@pytest.fixture
async def sandboxed(bridge_app: BridgeApp) -> AsyncIterator[SandboxWorld]:
    from sandbox.backends.docker import DockerBackend

    backend = DockerBackend.from_env()
    root = Path(tempfile.mkdtemp(prefix="w-", dir=bridge_app.state))
    world = make_world(root, agent_root=bridge_app.app.agent_root)
    try:
        yield SandboxWorld(
            world,
            ConversationSandboxes(bridge_app.app, bridge_app.settings, backend, gateway_id=RUN_ID),
            backend,
        )
    finally:
        await world.server.close_all()
        world.store.close()
        await backend.close()


def chat_id_for(name: str) -> str:
    """A fresh chat id per test, so every test gets fresh directories and a fresh sandbox."""
    return f"{name}-{secrets.token_hex(3)}"
