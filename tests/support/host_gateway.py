"""A gateway with one host agent (a `/bin/sh -c {prompt}` command harness, isolated
memory) and no engine: for tests of the turn path itself (lanes, store, intake)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from orchestrator.config import load_config, write_config_document
from orchestrator.gateway import Gateway
from tests.e2e.conftest import SUITE_ADMISSION
from tests.fakes.no_engine import NoEngineBackend
from tests.support.run_id import seed_gateway_id


@asynccontextmanager
async def host_agent_gateway(root: Path, agent_id: str) -> AsyncIterator[Gateway]:
    state = seed_gateway_id(root / "state")
    config = state / "config.json"
    agent = {
        "id": agent_id,
        "isolateMemory": True,
        "harness": {
            "type": "command",
            "argv": ["/bin/sh", "-c", "{prompt}"],
            "output": "text",
            "timeoutSeconds": 20,
        },
    }
    write_config_document(
        config,
        {"gateway": {"stateDir": str(state), "admission": SUITE_ADMISSION}, "agents": [agent]},
    )
    gw = Gateway(load_config(config), NoEngineBackend())
    try:
        yield gw
    finally:
        await gw.close()
