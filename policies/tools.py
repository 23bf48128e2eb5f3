"""Which MCP modules load and which tools are offered to a session (T1-T4, A2).

- T1 `mcp_modules`: for an isolated agent, default-deny. Only the originating
  channel's module and `image`, `video`, `share-file`, `narrate` load; every
  other module, `browser` and any module added later included, stays off; the
  operator's own MCP servers and the agent's connectors are not injected.
  `orchestration_task`: browser and computer tasks are off.
- T2/A2 `offered_tools`, `tool_offered`: the archive, skill, cron, agent and
  app tools are not offered to an isolated agent; the archive tools are not
  offered when the archive is disabled.
- T3 `session_env_flags`: Claude Code auto memory is off.
- T4 `narrate_target`: narrate speaks only through the bridge, into the
  task's own conversation.

Tool names may carry an MCP prefix (`mcp__gateway__cron_create`); the part
after the last `__` is what is matched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from policies.base import Decision, allow, deny

__all__ = [
    "ALWAYS_MODULES",
    "ModuleFacts",
    "ModulePlan",
    "mcp_modules",
    "narrate_target",
    "offered_tools",
    "orchestration_task",
    "session_env_flags",
    "tool_offered",
]

ALWAYS_MODULES: tuple[str, ...] = ("image", "video", "share-file", "narrate")

_ARCHIVE_TOOLS = frozenset({"memory_search", "memory_get"})
_ISOLATED_OFF = frozenset(
    {
        "skill_create",
        "skill_install",
        "skill_delete",
        "skill_metrics",
        "agent_create",
        "agent_update",
    }
)


@dataclass(frozen=True, slots=True)
class ModuleFacts:
    """The gateway's MCP module catalog and the session it would be loaded for."""

    catalog: tuple[str, ...]
    origin_channel: str
    isolated: bool
    operator_servers: tuple[str, ...] = ()
    connectors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModulePlan:
    """What to load: gateway modules, operator MCP servers, connectors (each in catalog order)."""

    modules: tuple[str, ...]
    operator_servers: tuple[str, ...]
    connectors: tuple[str, ...]


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def module_allowed(module: str, origin_channel: str, isolated: bool) -> Decision:
    """T1: may gateway MCP module `module` load for this session?"""
    if not isolated:
        return allow("T1", "the agent is not isolated")
    if module in ALWAYS_MODULES:
        return allow("T1", f"{module} loads for every conversation")
    if module == origin_channel:
        return allow("T1", f"{module} is the originating channel's module")
    return deny(
        "T1",
        f"MCP module {module!r} is off for an isolated agent: only the originating channel's "
        "module and image, video, share-file and narrate load",
    )


def mcp_modules(facts: ModuleFacts) -> ModulePlan:
    """T1: the modules to load for one session of an agent."""
    modules = _unique(
        m for m in facts.catalog if module_allowed(m, facts.origin_channel, facts.isolated)
    )
    if facts.isolated:
        return ModulePlan(modules=modules, operator_servers=(), connectors=())
    return ModulePlan(
        modules=modules,
        operator_servers=_unique(facts.operator_servers),
        connectors=_unique(facts.connectors),
    )


def orchestration_task(kind: str, isolated: bool) -> Decision:
    """T1: may an orchestration task of `kind` run? No browser or computer task if isolated."""
    if isolated and kind in ("browser", "computer"):
        return deny(
            "T1",
            f"{kind} tasks are off for an isolated agent: one {kind} serves every conversation",
        )
    return allow("T1")


def _base_name(tool: str) -> str:
    return tool.rsplit("__", 1)[-1]


def _is_app_tool(name: str) -> bool:
    return name.endswith(("_app", "_apps")) or name.startswith("app_")


def tool_offered(tool: str, isolated: bool, archive_enabled: bool) -> Decision:
    """T2/A2: is `tool` offered to (and callable by) this agent's sessions?"""
    name = _base_name(tool)
    archive_tool = name in _ARCHIVE_TOOLS or name.startswith("memory_shared_")
    if isolated:
        why: str | None = None
        if archive_tool:
            why = "the memory archive is one index over every conversation"
        elif name.startswith("skill_") and name in _ISOLATED_OFF:
            why = "the skill catalog is shared by every conversation"
        elif name in _ISOLATED_OFF:
            why = "agent_create and agent_update rewrite the agent's shared persona files"
        elif name.startswith("cron_"):
            why = "scheduled jobs and their prompts belong to the whole agent"
        elif _is_app_tool(name):
            why = "changing an app rewinds or deletes the memory of every conversation it serves"
        if why is not None:
            return deny("T2", f"{name} is not offered to an isolated agent: {why}")
    if archive_tool and not archive_enabled:
        return deny(
            "A2",
            f"{name} is not offered: the memory archive is turned off for this agent",
        )
    return allow("T2")


def offered_tools(
    isolated: bool, archive_enabled: bool, tool_names: Iterable[str]
) -> tuple[str, ...]:
    """T2/A2: `tool_names` without the tools this agent is not offered, order kept."""
    return tuple(t for t in tool_names if tool_offered(t, isolated, archive_enabled))


def session_env_flags(*, isolated: bool = True) -> dict[str, str]:
    """T3: environment entries every session and worker of an isolated agent runs with."""
    if not isolated:
        return {}
    return {"CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1"}


def narrate_target(
    task_conversation: str | None, target_conversation: str | None, *, via_bridge: bool
) -> Decision:
    """T4: may narrate speak into `target_conversation` (None: the task's own)?"""
    if not via_bridge:
        return deny("T4", "narrate speaks only through the task bridge; this call did not use it")
    if not task_conversation:
        return deny("T4", "narrate refused: the task's conversation is unknown")
    if target_conversation and target_conversation != task_conversation:
        return deny(
            "T4",
            "narrate speaks only into the task's own conversation; omit the target to "
            "narrate there",
        )
    return allow("T4")
