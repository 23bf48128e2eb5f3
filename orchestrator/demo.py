"""`cellgate demo`: the main job on an embedded default.

Installs the sample isolated app (shell harness) into a state directory of its
own, serves the HTTP endpoint on loopback and prints example `curl` lines for
two chats. With `--once` it plays a short tour itself instead of serving: chat
A writes a memory, chat B tries to read it, and both see only their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from cellgate.errors import AppError
from cellgate.models import ConversationKey
from orchestrator.apps import InstalledApp, install_app
from orchestrator.config import load_config, write_config_document
from orchestrator.store.messages import conversation_id
from sandbox.images import docker_client, image_exists

logger = logging.getLogger(__name__)

DEFAULT_BASE = "python:3.12-slim"
LOCAL_BASE = "cellgate-base:bookworm"
DEMO_APP = "demo"
DEMO_AGENT = "demo-bot"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sample_app_dir() -> Path:
    return Path(str(resources.files("orchestrator") / "demo" / "sample-app"))


def choose_base_image(client: Any, requested: str | None, say: Callable[[str], None]) -> str:
    """The sample image's base: the one asked for, else the official image, else a local one."""
    if requested:
        return requested
    if image_exists(client, DEFAULT_BASE):
        return DEFAULT_BASE
    if image_exists(client, LOCAL_BASE):
        say(f"using the local base image {LOCAL_BASE} ({DEFAULT_BASE} is not on this engine)")
        return LOCAL_BASE
    say(f"pulling {DEFAULT_BASE} ...")
    try:
        client.images.pull(DEFAULT_BASE)
    except Exception as exc:  # the registry is unreachable or refuses: say what to do
        raise AppError(
            DEMO_APP,
            f"cannot pull {DEFAULT_BASE} ({exc.__class__.__name__}); with no registry, build a "
            "local base with `bash scripts/build-base-image.sh` and run the demo again",
        ) from exc
    return DEFAULT_BASE


def prepare_state(state_dir: Path, base_image: str | None) -> tuple[Path, str]:
    """Write the demo config (with a fresh API key) and install the sample app once."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config_path = state_dir / "config.json"
    if config_path.exists():
        doc = json.loads(config_path.read_text(encoding="utf-8"))
        key = doc["apiKeys"][0]["key"]
    else:
        key = "cg_demo_" + secrets.token_urlsafe(24)
        write_config_document(
            config_path,
            {
                "gateway": {"stateDir": str(state_dir), "listen": {"host": "127.0.0.1"}},
                "apiKeys": [{"name": "demo", "key": key, "agents": [DEMO_AGENT]}],
                "agents": [],
            },
        )
    client = docker_client()
    try:
        try:
            app = InstalledApp.load(state_dir, DEMO_APP)
            if not image_exists(client, app.image_id):
                raise AppError(DEMO_APP, "image gone")
        except AppError:
            shutil.rmtree(state_dir / "apps" / DEMO_APP, ignore_errors=True)
            shutil.rmtree(state_dir / "agents" / DEMO_AGENT / "workspace", ignore_errors=True)
            base = choose_base_image(client, base_image, _say)
            _say(f"installing the demo app (base image {base}) ...")
            install_app(
                sample_app_dir(),
                config_path,
                state_dir,
                client,
                lambda line: _say(f"  {line}"),
                build_args={"BASE_IMAGE": base},
            )
    finally:
        client.close()
    return config_path, key


def curl_examples(host: str, port: int, key: str) -> str:
    url = f"http://{host}:{port}/v1/agents/{DEMO_AGENT}/chats"
    lines = [
        "# chat alice writes a memory in its own conversation:",
        f"curl -s -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\",
        '  -d \'{"text": "cd chats/*/ && echo likes tea >> MEMORY.md; ls .."}\' '
        f"{url}/alice/messages",
        "# chat bob looks for it and finds only its own, empty, memory:",
        f"curl -s -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\",
        f'  -d \'{{"text": "ls chats; cat chats/*/MEMORY.md; id -u"}}\' {url}/bob/messages',
    ]
    return "\n".join(lines)


TOUR = (
    ("alice", "cd chats/*/ && echo 'alice likes tea' >> MEMORY.md; ls ..; cat MEMORY.md"),
    ("bob", "ls chats; cat chats/*/MEMORY.md; grep -r tea /workspace 2>/dev/null; id -u"),
    ("bob", "touch /workspace/AGENTS.md 2>&1; grep CapEff /proc/self/status"),
)


async def run_tour(config_path: Path) -> int:
    from orchestrator.api.auth import config_key_ref
    from orchestrator.gateway import Gateway
    from sandbox.backends.docker import DockerBackend

    cfg = load_config(config_path)
    gateway = Gateway(cfg, DockerBackend.from_env())
    key = config_key_ref(cfg.api_keys[0].name)
    try:
        for chat, cmd in TOUR:
            # the tour's chats are the demo key's, as the served demo's `curl` lines make them:
            # bound to none, that key could not go on with them after the tour (K4)
            conv = conversation_id(ConversationKey(DEMO_AGENT, "api", chat))
            await asyncio.to_thread(gateway.store.bind_api_chat, conv, key)
            _say(f"\n[{chat}] $ {cmd}")
            outcome = await gateway.turn(DEMO_AGENT, "api", chat, cmd)
            print(f"[{chat}] ({outcome.sandbox})\n{outcome.result.reply}", flush=True)
        # a tour serves nobody after it: no reaper would ever remove its sandboxes
        # (their memory stays in the state directory, for the next tour or `demo`)
        removed = [s.name for s in await gateway.sandboxes.live()]
        for name in removed:
            await gateway.sandboxes.evict(name)
        where = cfg.gateway.state_dir
        _say(f"\nremoved the tour's {len(removed)} sandboxes; their memory stays in {where}")
    finally:
        await gateway.close()
    return 0
