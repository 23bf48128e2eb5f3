"""The bridge's tool catalogue: the one place tool names, descriptions and schemas are written.

Every view of the bridge tools is derived from here, so they cannot drift:

- the bridge's own registry (`BuiltinTools.install` registers each handler
  under its `ToolDef`) and its `list_tools` answer;
- the in-sandbox MCP server (`cellgate-mcp`), which asks the bridge for
  `list_tools` over the conversation's socket, so it shows what this scope is
  offered (T1, T2) and a channel's own tools as soon as they are registered;
- the OpenAI-compatible harness, which is handed the scope's offered tools in
  `TurnRequest.tools` (H1) and turns each into a Chat Completions function.

A channel module's tools are registered with their own `ToolDef` the same way.
Pure data: no I/O, no imports from the rest of the gateway.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTIN_TOOLS", "CRON_TOOLS", "MEMORY_TOOLS", "ToolDef", "builtin", "object_schema"]


@dataclass(frozen=True, slots=True)
class ToolDef:
    """One tool as every client sees it. `module` is its MCP module (T1); None: always loaded."""

    name: str
    description: str = ""
    input_schema: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    module: str | None = None

    def schema(self) -> dict[str, Any]:
        """A copy of the JSON schema of the arguments (callers may not change the catalogue)."""
        return copy.deepcopy(dict(self.input_schema))

    def describe(self) -> dict[str, Any]:
        """The bridge's `list_tools` entry."""
        return {"name": self.name, "description": self.description, "input_schema": self.schema()}

    def as_openai(self) -> dict[str, Any]:
        """A Chat Completions `tools[]` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.schema(),
            },
        }

    def as_mcp(self) -> dict[str, Any]:
        """An MCP `tools/list` entry (what `cellgate-mcp` builds from `describe`)."""
        return {"name": self.name, "description": self.description, "inputSchema": self.schema()}


def object_schema(required: tuple[str, ...], **props: str) -> dict[str, Any]:
    """An object of string arguments (ids may also be integers), each with its description."""
    return {
        "type": "object",
        "properties": {
            name: {"type": ["string", "integer"] if name.endswith("_id") else "string",
                   "description": text}
            for name, text in props.items()
        },
        "required": list(required),
        "additionalProperties": False,
    }  # fmt: skip


_CHAT = "omit: this conversation's chat (the only one allowed)"
_THREAD = "omit: this conversation's thread"

BUILTIN_TOOLS: tuple[ToolDef, ...] = (
    ToolDef(
        "reply",
        "Send a text message into this conversation's chat.",
        object_schema(
            ("text",),
            text="the message",
            chat_id=_CHAT,
            thread_id=_THREAD,
            reply_to="message id to reply to",
        ),
    ),
    ToolDef(
        "react",
        "React with an emoji to a message in this chat.",
        object_schema(
            ("emoji", "message_id"),
            emoji="one emoji",
            message_id="the message to react to",
            chat_id=_CHAT,
        ),
    ),
    ToolDef(
        "edit",
        "Edit a message the bot sent in this chat.",
        object_schema(
            ("message_id", "text"),
            message_id="the bot's message",
            text="the new text",
            chat_id=_CHAT,
        ),
    ),
    ToolDef(
        "send_file",
        "Send a file from this conversation's media directory into its chat.",
        object_schema(
            ("path",),
            path="a file in the media directory (absolute /workspace/media/... or relative to it)",
            caption="optional",
        ),
        module="share-file",
    ),
    ToolDef(
        "share_file",
        "Make a share link for a file in this conversation's media directory.",
        object_schema(("path",), path="a file in the media directory"),
        module="share-file",
    ),
    ToolDef(
        "revoke_share",
        "Revoke a share this session made, by its token or id.",
        object_schema(("share",), share="the share token or its id (sh_...)"),
        module="share-file",
    ),
    ToolDef(
        "task_memory_append",
        "Append a note to this conversation's MEMORY.md (default) or USER.md.",
        object_schema(
            ("text",),
            text="the note; never a key, token or password",
            target="MEMORY.md (default) or USER.md",
        ),
    ),
    ToolDef(
        "narrate",
        "Tell this conversation what the task is doing.",
        object_schema(("text",), text="a short progress note"),
        module="narrate",
    ),
    ToolDef(
        "list_tools",
        "The tools this session may call.",
        {"type": "object", "properties": {}, "additionalProperties": False},
    ),
)

_BY_NAME = {t.name: t for t in BUILTIN_TOOLS}


def builtin(name: str) -> ToolDef:
    """The catalogue entry of a standard tool; KeyError for any other name."""
    return _BY_NAME[name]


# The cron and archive tools (C1, A1): offered to a non-isolated agent only
# (`policies.tools`, T2), the archive tools only while its archive is on (A2).
# Registered by `bridge.cron_tools` and `bridge.memory_tools`.

_SCHEDULE = {
    "cron": "a cron expression of five fields, e.g. '0 9 * * 1-5' (in 'timezone')",
    "timezone": "IANA time zone of 'cron' or a bare 'at' time, e.g. 'Asia/Bangkok'; omit: UTC",
    "every": "seconds between runs, at least 60",
    "at": "once, at an ISO 8601 time ('2026-12-24T18:00') or relative ('+15m', '+2h')",
}
_JOB_ID = "the job's id (cron_...), as cron_list shows it"

CRON_TOOLS: tuple[ToolDef, ...] = (
    ToolDef(
        "cron_create",
        "Schedule a prompt to be sent to you in this conversation later, once or repeatedly. "
        "Give exactly one of cron, every or at.",
        object_schema(
            ("prompt",),
            prompt="what you will be told when the job runs",
            name="a short name for the job",
            type="'prompt' (the default); 'command' runs on the host and is refused for app agents",
            **_SCHEDULE,
        ),
    ),
    ToolDef(
        "cron_list",
        "The agent's scheduled jobs and when each runs next.",
        {"type": "object", "properties": {}, "additionalProperties": False},
    ),
    ToolDef("cron_pause", "Pause a scheduled job.", object_schema(("job_id",), job_id=_JOB_ID)),
    ToolDef("cron_resume", "Resume a paused job.", object_schema(("job_id",), job_id=_JOB_ID)),
    ToolDef("cron_delete", "Delete a scheduled job.", object_schema(("job_id",), job_id=_JOB_ID)),
)

MEMORY_TOOLS: tuple[ToolDef, ...] = (
    ToolDef(
        "memory_search",
        "Search the memory archive (MEMORY.md, USER.md, memory/*.md) for notes; ranked "
        "snippets, each with its file and line.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "words to look for"},
                "limit": {"type": ["integer", "string"], "description": "hits, 1-20 (8)"},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    ),
    ToolDef(
        "memory_get",
        "Read an excerpt of a memory file (MEMORY.md, USER.md or memory/<name>.md).",
        {
            "type": "object",
            "properties": {
                "file": {"type": "string", "description": "the file a memory_search hit names"},
                "line": {"type": ["integer", "string"], "description": "first line (1)"},
                "lines": {"type": ["integer", "string"], "description": "how many, up to 200"},
            },
            "required": ["file"],
            "additionalProperties": False,
        },
    ),
)
