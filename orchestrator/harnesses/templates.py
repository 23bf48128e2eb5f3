"""Command harness templates: how a CLI turn starts and resumes, and the presets.

A leaf the config validates against and the command harness runs from; it
imports neither, so the two do not import each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

OutputFormat = Literal["text", "claude-json", "codex-jsonl"]
PLACEHOLDER = re.compile(r"\{(prompt|session_id)\}")
ANY_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True, slots=True)
class CommandTemplate:
    """How to start a turn (`argv`), how to resume one (`resume_argv`), how to read it."""

    argv: tuple[str, ...]
    resume_argv: tuple[str, ...] | None = None
    output: OutputFormat = "text"

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("argv is empty: give the command to run")
        for part in (*self.argv, *(self.resume_argv or ())):
            for name in ANY_PLACEHOLDER.findall(part):
                if name not in ("prompt", "session_id"):
                    raise ValueError(
                        f"unknown placeholder {{{name}}} in {part!r}: use {{prompt}} or "
                        "{session_id}"
                    )
        if self.resume_argv is not None and not any("{session_id}" in p for p in self.resume_argv):
            raise ValueError("resumeArgv must contain {session_id}: it names the session to resume")

    def prompt_on_stdin(self, resume: bool) -> bool:
        argv = self.resume_argv if resume and self.resume_argv else self.argv
        return not any("{prompt}" in p for p in argv)


# T1, K1: the one MCP server a preset session gets is the bridge's `cellgate-mcp`, at a
# fixed path in every sandbox (its socket decides the conversation and the tools); the
# operator's own servers and connectors are never loaded: Claude Code with
# --strict-mcp-config, Codex with its `mcp_servers` table given on the command line.
MCP_COMMAND = ("python3", "/run/cellgate/cellgate-mcp")
CLAUDE_MCP_FLAGS: tuple[str, ...] = (
    "--mcp-config",
    json.dumps(
        {"mcpServers": {"cellgate": {"command": MCP_COMMAND[0], "args": list(MCP_COMMAND[1:])}}},
        separators=(",", ":"),
    ),
    "--strict-mcp-config",
)
CODEX_MCP_FLAGS: tuple[str, ...] = (
    "-c",
    f"mcp_servers.cellgate.command={json.dumps(MCP_COMMAND[0])}",
    "-c",
    f"mcp_servers.cellgate.args={json.dumps(list(MCP_COMMAND[1:]))}",
)

PRESETS: dict[str, CommandTemplate] = {
    "claude": CommandTemplate(
        argv=("claude", "-p", "--output-format", "json", *CLAUDE_MCP_FLAGS),
        resume_argv=(
            "claude",
            "-p",
            "--output-format",
            "json",
            "--resume",
            "{session_id}",
            *CLAUDE_MCP_FLAGS,
        ),
        output="claude-json",
    ),
    "codex": CommandTemplate(
        argv=("codex", "exec", "--json", "--skip-git-repo-check", *CODEX_MCP_FLAGS, "-"),
        resume_argv=(
            "codex",
            "exec",
            "--json",
            "--skip-git-repo-check",
            *CODEX_MCP_FLAGS,
            "resume",
            "{session_id}",
            "-",
        ),
        output="codex-jsonl",
    ),
}
