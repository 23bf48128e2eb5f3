"""T1-T4, A2: MCP modules, offered tools, auto memory, narrate."""

from __future__ import annotations

import pytest

from policies.tools import (
    ModuleFacts,
    mcp_modules,
    module_allowed,
    narrate_target,
    offered_tools,
    orchestration_task,
    session_env_flags,
    tool_offered,
)

CATALOG = (
    "telegram",
    "discord",
    "line",
    "image",
    "video",
    "share-file",
    "narrate",
    "browser",
    "memory",
    "cron",
    "apps",
    "some-future-module",
)


@pytest.mark.parametrize(
    ("channel", "isolated", "expected"),
    [
        ("telegram", True, ("telegram", "image", "video", "share-file", "narrate")),
        ("discord", True, ("discord", "image", "video", "share-file", "narrate")),
        ("line", True, ("line", "image", "video", "share-file", "narrate")),
        ("api", True, ("image", "video", "share-file", "narrate")),  # no module for api
        ("browser", True, ("image", "video", "share-file", "narrate", "browser")),
        ("telegram", False, CATALOG),
        ("api", False, CATALOG),
    ],
)
def test_T1_mcp_modules_table(channel: str, isolated: bool, expected: tuple[str, ...]) -> None:
    plan = mcp_modules(
        ModuleFacts(
            catalog=CATALOG,
            origin_channel=channel,
            isolated=isolated,
            operator_servers=("github", "postgres"),
            connectors=("gdrive",),
        )
    )
    assert plan.modules == expected
    if isolated:
        assert plan.operator_servers == () and plan.connectors == ()
    else:
        assert plan.operator_servers == ("github", "postgres")
        assert plan.connectors == ("gdrive",)


def test_T1_only_catalog_modules_load() -> None:
    plan = mcp_modules(ModuleFacts(catalog=("image",), origin_channel="telegram", isolated=True))
    assert plan.modules == ("image",)  # neither telegram nor video is invented


def test_T1_duplicates_load_once() -> None:
    plan = mcp_modules(
        ModuleFacts(
            catalog=("image", "image"),
            origin_channel="x",
            isolated=False,
            operator_servers=("a", "a"),
        )
    )
    assert plan.modules == ("image",) and plan.operator_servers == ("a",)


@pytest.mark.parametrize(
    ("module", "channel", "allowed"),
    [
        ("browser", "telegram", False),
        ("discord", "telegram", False),  # another channel's module
        ("Telegram", "telegram", False),  # exact names
        ("narrate", "telegram", True),
        ("share-file", "line", True),
        ("computer", "line", False),
        ("brand-new", "line", False),
    ],
)
def test_T1_module_allowed_isolated_table(module: str, channel: str, allowed: bool) -> None:
    d = module_allowed(module, channel, isolated=True)
    assert (d.allowed, d.rule) == (allowed, "T1")


@pytest.mark.parametrize(
    ("kind", "isolated", "allowed"),
    [
        ("browser", True, False),
        ("computer", True, False),
        ("code", True, True),
        ("browser", False, True),
        ("computer", False, True),
    ],
)
def test_T1_orchestration_task_table(kind: str, isolated: bool, allowed: bool) -> None:
    assert orchestration_task(kind, isolated).allowed is allowed


ALL_TOOLS = (
    "telegram_reply",
    "task_memory_append",
    "memory_search",
    "memory_get",
    "memory_shared_search",
    "memory_shared_write",
    "skill_create",
    "skill_install",
    "skill_delete",
    "skill_metrics",
    "skill_list",
    "cron_create",
    "cron_list",
    "agent_create",
    "agent_update",
    "agent_status",
    "install_app",
    "update_app",
    "restore_app",
    "uninstall_app",
    "inspect_app",
    "list_apps",
    "app_logs",
    "share_file",
    "mcp__gateway__cron_delete",
    "mcp__gateway__memory_get",
    "mcp__gateway__share_file",
    "send_whatsapp",
)

ISOLATED_KEEP = (
    "telegram_reply",
    "task_memory_append",
    "skill_list",
    "agent_status",
    "share_file",
    "mcp__gateway__share_file",
    "send_whatsapp",
)
ARCHIVE = {
    "memory_search",
    "memory_get",
    "memory_shared_search",
    "memory_shared_write",
    "mcp__gateway__memory_get",
}


@pytest.mark.parametrize(
    ("isolated", "archive", "expected"),
    [
        (True, True, ISOLATED_KEEP),
        (True, False, ISOLATED_KEEP),
        (False, True, ALL_TOOLS),
        (False, False, tuple(t for t in ALL_TOOLS if t not in ARCHIVE)),
    ],
)
def test_T2_A2_offered_tools_table(
    isolated: bool, archive: bool, expected: tuple[str, ...]
) -> None:
    assert offered_tools(isolated, archive, ALL_TOOLS) == expected


@pytest.mark.parametrize(
    ("tool", "isolated", "archive", "rule", "needle"),
    [
        ("memory_search", True, True, "T2", "one index over every conversation"),
        ("skill_install", True, True, "T2", "skill catalog"),
        ("agent_update", True, True, "T2", "persona"),
        ("cron_create", True, True, "T2", "whole agent"),
        ("restore_app", True, True, "T2", "memory of every conversation"),
        ("memory_get", False, False, "A2", "archive is turned off"),
    ],
)
def test_T2_tool_offered_reasons(
    tool: str, isolated: bool, archive: bool, rule: str, needle: str
) -> None:
    d = tool_offered(tool, isolated, archive)
    assert (d.allowed, d.rule) == (False, rule)
    assert needle in d.reason


def test_T3_session_env_flags() -> None:
    assert session_env_flags() == {"CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1"}
    assert session_env_flags(isolated=True)["CLAUDE_CODE_DISABLE_AUTO_MEMORY"] == "1"
    assert session_env_flags(isolated=False) == {}


@pytest.mark.parametrize(
    ("task", "target", "bridge", "allowed"),
    [
        ("c1", None, True, True),
        ("c1", "", True, True),
        ("c1", "c1", True, True),
        ("c1", "c2", True, False),
        (None, None, True, False),
        ("", "c1", True, False),
        ("c1", None, False, False),
        ("c1", "c1", False, False),
    ],
)
def test_T4_narrate_target_table(
    task: str | None, target: str | None, bridge: bool, allowed: bool
) -> None:
    d = narrate_target(task, target, via_bridge=bridge)
    assert (d.allowed, d.rule) == (allowed, "T4")
