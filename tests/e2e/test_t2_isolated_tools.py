"""T2, A3, C1: from inside an isolated sandbox, none of the archive, cron, skill or app tools.

The gateway registers the cron and archive tools (a non-isolated agent is
offered them), so an isolated session's `list_tools` leaving them out is
the gating at work, not their absence. Calling one is refused with T2, and
the isolated agent gets no kb.sqlite.
"""

from __future__ import annotations

from tests.e2e.conftest import LiveGateway

TOOL = "python3 /run/cellgate/cellgate-tool"
NAMES = (
    ' | python3 -c "import json,sys; '
    "print(' '.join(t['name'] for t in json.load(sys.stdin)['tools']))\""
)
T2_TOOLS = {"memory_search", "memory_get", "cron_create", "cron_list", "cron_pause",
            "cron_resume", "cron_delete"}  # fmt: skip


def _forbidden(name: str) -> bool:
    return (
        name in T2_TOOLS
        or name.startswith(("memory_shared_", "skill_", "cron_", "agent_", "app_"))
        or name.endswith(("_app", "_apps"))
    )


def test_T2_A3_isolated_sandbox_lists_none_of_the_shared_tools(live: LiveGateway) -> None:
    registered = set(live.gateway.bridge.handlers.names())
    assert registered >= T2_TOOLS  # offered to non-isolated agents: the gating must hide them
    out = live.run("t2-list", f"{TOOL} list_tools{NAMES}")
    names = set(out.split("\n")[0].split())
    assert {"reply", "task_memory_append", "list_tools"} <= names, out
    assert not {n for n in names if _forbidden(n)}, names
    refused = live.run(
        "t2-list",
        f'{TOOL} cron_create \'{{"prompt": "x", "every": "3600"}}\'; '
        f'{TOOL} memory_search \'{{"query": "x"}}\'; echo end',
    )
    assert refused.count("T2") >= 2 and "end" in refused, refused
    assert live.gateway.store.cron_jobs(live.agent) == []  # C1: nothing was created
    assert not (live.state_dir / "agents" / live.agent / "kb.sqlite").exists()
