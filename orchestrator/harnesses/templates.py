"""Command harness templates: how a CLI turn starts and resumes, and the presets.

A leaf the config validates against and the command harness runs from; it
imports neither, so the two do not import each other.
"""

from __future__ import annotations

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


PRESETS: dict[str, CommandTemplate] = {
    "claude": CommandTemplate(
        argv=("claude", "-p", "--output-format", "json"),
        resume_argv=("claude", "-p", "--output-format", "json", "--resume", "{session_id}"),
        output="claude-json",
    ),
    "codex": CommandTemplate(
        argv=("codex", "exec", "--json", "--skip-git-repo-check", "-"),
        resume_argv=(
            "codex",
            "exec",
            "--json",
            "--skip-git-repo-check",
            "resume",
            "{session_id}",
            "-",
        ),
        output="codex-jsonl",
    ),
}
