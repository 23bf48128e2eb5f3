"""M8: a key the sandbox's own shell writes into MEMORY.md never reaches the next CLAUDE.md.

`task_memory_append` refuses a secret (M8), but a sandbox can write its memory
file directly. The gateway checks the file when it composes the next session:
the line is left out with a banner, an audit row names M8, and the file on
disk is kept as the sandbox wrote it. Both modes: the conversation's own
MEMORY.md (isolated) and the workspace-root one (the shared app container, S6).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from cellgate.models import ConversationKey
from orchestrator.gateway import Gateway
from orchestrator.store import conversation_id
from tests.support.app_gateways import MakeGateway, app_gateways

pytestmark = pytest.mark.docker

KEY = "sk_live_" + "51HqLyjWDarjtT1zdp7dcQx"
FACT = "Bob likes green tea"


@pytest.fixture
async def gateways(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> AsyncIterator[MakeGateway]:
    async with app_gateways(tmp_path_factory, docker_client, base_image) as make:
        yield make


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "shared-container"])
async def test_M8_a_key_the_shell_wrote_into_memory_never_reaches_the_next_claude_md(
    gateways: MakeGateway, isolated: bool
) -> None:
    gw: Gateway = await gateways(isolated)
    agent = next(iter(gw.agents))
    key = ConversationKey(agent, "api", "bob")
    memory = f"/workspace/chats/{key.dir_name}/MEMORY.md" if isolated else "/workspace/MEMORY.md"
    wrote = await gw.turn(
        agent, "api", "bob", f"printf '%s\\n' '{FACT}' 'stripe: {KEY}' >> {memory} && echo ok"
    )
    assert "ok" in wrote.result.reply and "[exit 0]" in wrote.result.reply, wrote.result.reply
    seen = await gw.turn(agent, "api", "bob", f"cat ~/.claude/CLAUDE.md; grep -c sk_live {memory}")
    reply = seen.result.reply
    assert FACT in reply and "(M8)" in reply, reply
    assert KEY not in reply.replace(f"grep -c sk_live {memory}", "")
    assert reply.rstrip().endswith("1\n[exit 0]")  # the file itself still holds it
    rows = [
        r
        for r in gw.store.refusals(conversation_id(key), limit=50)
        if r.rule == "M8" and r.detail.get("kind") == "secret"
    ]
    assert rows and all(KEY not in r.reason for r in rows)
    path = rows[0].detail["path"]  # relative to the workspace, never a host path
    assert path == (f"chats/{key.dir_name}/MEMORY.md:2" if isolated else path)
    assert path.startswith("MEMORY.md:") or isolated
