"""A gateway over real HTTP (uvicorn on loopback, a random port), with a seeded store.

Two agents: `iso` (isolateMemory: true; its app is not installed, so no turn
runs) and `open` (not isolated; a host agent, so no turn runs either). Each
has a Telegram chat and an API chat with a session, messages with replies,
media files and a share. Keys of every kind are minted into the store, plus
one key in the config file. Each agent's API chat `client-1` is bound to the
agent's own key (`iso`, `open`), as its first message would have bound it
(K4); `<agent>-peer` is a second key naming the same agent; `client-legacy`
is an API chat bound to no key (started before chats were bound).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from cellgate.models import ConversationKey
from orchestrator.config import write_config_document
from orchestrator.gateway import Gateway
from orchestrator.store import Conversation, Session, Store, conversation_id
from tests.fakes.no_engine import NoEngineBackend
from tests.support.served import served_gateway

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
CONFIG_KEY = "cfg-open-key-0123456789abcdef"
AGENTS = ("iso", "open")


@dataclass
class Chat:
    conv: Conversation
    session: Session
    media: Path
    file: str = "photo.png"

    @property
    def media_name(self) -> str:
        return self.media.name


@dataclass
class Seed:
    """Per agent: its Telegram chat and its API chat; the keys; one share per chat."""

    tg: dict[str, Chat] = field(default_factory=dict)
    api: dict[str, Chat] = field(default_factory=dict)
    legacy: dict[str, Chat] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    key_ids: dict[str, str] = field(default_factory=dict)
    share_tokens: dict[str, str] = field(default_factory=dict)


@dataclass
class Live:
    url: str
    state: Path
    store: Store
    gateway: Gateway
    seed: Seed

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def request(self, method: str, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
        with self.client(key) as c:
            return c.request(method, path, **kw)


def raw_get(url: str, target: str, key: str | None = None) -> tuple[int, bytes]:
    """GET with the request target sent byte for byte (no client-side normalisation)."""
    host, port = url.removeprefix("http://").split(":")
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    req = f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(req.encode("latin-1"))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _chat(store: Store, workspace: Path, agent: str, channel: str, chat_id: str) -> Chat:
    key = ConversationKey(agent, channel, chat_id)
    conv = store.upsert_conversation(key)
    session = store.open_session(conv.id, "shell")
    for i, (text, reply) in enumerate(
        [(f"hello from {chat_id}", f"hi {chat_id}"), (f"secret-{agent}-{chat_id}", "noted")]
    ):
        msg, _ = store.accept_message(conv.id, f"{chat_id}-{i}", sender="u", text=text)
        turn = store.start_turn(session.id, msg.id)
        store.record_reply(msg.id, f"reply:{msg.id}", reply)
        store.mark_delivered(f"reply:{msg.id}")
        store.finish_turn(turn.id, ok=True)
    media = workspace / "media" / key.media_dir_name(session.id)
    media.mkdir(parents=True)
    (media / "photo.png").write_bytes(PNG)
    (media / "notes.txt").write_text(f"notes of {agent} {chat_id}\n")
    return Chat(conv, session, media)


def seed_store(store: Store, state: Path) -> Seed:
    seed = Seed()
    minted = {
        "admin": (["*"], True, True),
        "iso": (["iso"], False, True),
        "open": (["open"], False, True),
        "iso-peer": (["iso"], False, True),
        "open-peer": (["open"], False, True),
        "iso-readonly": (["iso"], False, False),
        "open-readonly": (["open"], False, False),
        "revoked": (["*"], False, True),
        "revoked-admin": (["*"], True, True),
    }
    for name, (agents, admin, write) in minted.items():
        key, secret = store.create_key(name, agents, admin=admin, write=write)
        seed.keys[name] = secret
        seed.key_ids[name] = key.id
    store.revoke_key(seed.key_ids["revoked"])  # type: ignore[arg-type]
    store.revoke_key(seed.key_ids["revoked-admin"])  # type: ignore[arg-type]
    seed.keys["config"] = CONFIG_KEY
    for agent in AGENTS:
        ws = state / "agents" / agent / "workspace"
        seed.tg[agent] = _chat(store, ws, agent, "telegram", "42")
        conv = conversation_id(ConversationKey(agent, "api", "client-1"))
        assert store.bind_api_chat(conv, seed.key_ids[agent]) == seed.key_ids[agent]
        seed.api[agent] = _chat(store, ws, agent, "api", "client-1")
        seed.legacy[agent] = _chat(store, ws, agent, "api", "client-legacy")
        _, token = store.create_share(seed.api[agent].session.id, "photo.png")
        seed.share_tokens[agent] = token
    return seed


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    state = tmp_path_factory.mktemp("api") / "state"
    state.mkdir()
    config_path = state / "config.json"
    write_config_document(
        config_path,
        {
            "gateway": {
                "stateDir": str(state),
                "admission": {
                    "chatPerMinute": 100_000,
                    "burst": 10_000,
                    "maxQueuedPerChat": 10_000,
                },
            },
            "apiKeys": [{"name": "first-run", "key": CONFIG_KEY, "agents": ["open"]}],
            "agents": [
                {"id": "iso", "isolateMemory": True, "app": "isoapp"},
                {"id": "open", "isolateMemory": False},
            ],
        },
    )
    store = Store.open(state)
    seed = seed_store(store, state)
    try:
        with served_gateway(config_path, NoEngineBackend) as (url, gw):
            yield Live(url, state, store, gw, seed)
    finally:
        store.close()


def other(agent: str) -> str:
    return "open" if agent == "iso" else "iso"
