"""Memory writes and memory budgets of a conversation (M6, M7, M8, A2).

- M6 `memory_target`: `task_memory_append` writes `MEMORY.md` (the default)
  or `USER.md` under the conversation's `chats/` directory, named exactly so;
  `memory/<topic>.md` and every other path are refused.
- M8 `memory_content`: a write carrying a likely API key, token, password
  or private key is refused; nothing secret enters long-term memory.
- M7 `budget_banner`: the banner put above an over-budget file in the
  composed CLAUDE.md; the file on disk is never rewritten.
- A2/T2 `archive_index`: whether the memory archive (kb.sqlite) is built and read.
- M8 `secret_lines` and `secret_banner`: a memory file's lines that seem to
  carry a secret are left out of the composed CLAUDE.md, with a banner saying
  why (a sandbox can write its MEMORY.md with its shell, past
  `task_memory_append`'s check); the file on disk is never rewritten.
- A1 `archive_file`: which file `memory_get` may read: `MEMORY.md`, `USER.md`
  or `memory/<name>.md` of the workspace, named plainly (`/workspace/` may
  lead); `../`, other absolute paths, deeper paths and other names are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from policies.base import Decision, allow, deny
from policies.secrets import secret_in_text

__all__ = [
    "DEFAULT_TARGET",
    "MemoryFile",
    "SecretLine",
    "archive_file",
    "archive_index",
    "budget_banner",
    "mask_secret_lines",
    "memory_content",
    "memory_file_for",
    "memory_target",
    "secret_banner",
    "secret_lines",
]

MemoryFile = Literal["MEMORY.md", "USER.md"]
DEFAULT_TARGET: MemoryFile = "MEMORY.md"
_FILES: dict[str, MemoryFile] = {"MEMORY.md": "MEMORY.md", "USER.md": "USER.md"}
_USE = "use target 'MEMORY.md' (the default) or 'USER.md'"


def _show(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:80] + "…")


def memory_target(target: str | None) -> Decision:
    """M6: may `task_memory_append` write to `target` (None or "" means MEMORY.md)?

    Names are matched exactly: `memory.md`, `./MEMORY.md` or a full path are refused.
    """
    if not target:
        return allow("M6", f"writes {DEFAULT_TARGET}")
    if target in _FILES:
        return allow("M6", f"writes {target}")
    parts = target.replace("\\", "/").split("/")
    if "\0" in target or ".." in parts or target.startswith(("/", "\\", "~")):
        return deny(
            "M6",
            f"{_show(target)} leaves this conversation's memory; {_USE}",
        )
    if parts[0].lower() == "memory" and len(parts) > 1:
        return deny(
            "M6",
            f"{_show(target)} refused: notes under memory/ would never be injected or "
            f"searchable for this conversation; {_USE}",
        )
    if target.upper() in _FILES:
        return deny("M6", f"{_show(target)} refused: names are exact; use {target.upper()!r}")
    return deny("M6", f"{_show(target)} is not a memory file of this conversation; {_USE}")


def memory_file_for(target: str | None) -> MemoryFile | None:
    """The file an allowed `target` writes, or None when `memory_target` refuses it."""
    if not memory_target(target).allowed:
        return None
    return _FILES[target] if target else DEFAULT_TARGET


def memory_content(text: str) -> Decision:
    """M8: may `text` be written to long-term memory?"""
    kind = secret_in_text(text)
    if kind is not None:
        return deny(
            "M8",
            f"memory write refused: it seems to contain {kind}, and nothing secret may enter "
            "long-term memory; write a note without the value (e.g. 'the user keeps the key "
            "in their password manager') and try again",
        )
    return allow("M8")


def budget_banner(
    kind: Literal["memory", "user"], chars: int, budget: int, severity: str
) -> str | None:
    """M7: the banner for a memory file of `chars` characters, or None when within budget.

    A budget of 0 (or less) disables the check. `severity` is `warn` or `error`;
    any other value falls back to `warn`.
    """
    if kind == "memory":
        name, what = "MEMORY.md", "long-term memory"
    elif kind == "user":
        name, what = "USER.md", "user profile"
    else:
        raise ValueError(f"unknown memory file kind {kind!r}: use 'memory' or 'user'")
    if budget <= 0 or chars <= budget:
        return None
    over = chars - budget
    if severity == "error":
        return (
            f"🛑 OVER BUDGET: {name} ({what}) is {chars:,} characters, {over:,} over its "
            f"budget of {budget:,}. Before adding anything else, consolidate it now: merge "
            "duplicates, drop stale or finished entries and shorten the rest until it is "
            "under budget."
        )
    return (
        f"⚠️ {name} ({what}) is {chars:,} characters, over its soft budget of {budget:,}. "
        "Consolidate it soon: merge duplicates and drop stale entries."
    )


def archive_index(agent_isolated: bool, archive_disabled: bool) -> Decision:
    """A2/T2: may the memory archive (kb.sqlite) be indexed at spawn and searched?

    An existing kb.sqlite is left on disk either way; a refusal means it is not read.
    """
    if agent_isolated:
        return deny(
            "T2",
            "the memory archive is one index over every conversation, so an isolated agent "
            "neither builds nor reads it",
        )
    if archive_disabled:
        return deny(
            "A2",
            "the memory archive is turned off (disableArchive); kb.sqlite is not built or read",
        )
    return allow("A1")


@dataclass(frozen=True, slots=True)
class SecretLine:
    """A line (1-based) left out of the composed text, and the kind of secret it seems to hold."""

    line: int
    kind: str


_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----")
_PEM_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----")


def secret_lines(text: str) -> tuple[str, tuple[SecretLine, ...]]:
    """M8: `text` without the lines that seem to carry a secret, and which lines they were.

    A private key's block is left out whole, from its BEGIN line to its END
    line (or to the end of the text when it has none).
    """
    kept: list[str] = []
    dropped: list[SecretLine] = []
    in_key = False
    for n, line in enumerate(text.splitlines(keepends=True), start=1):
        if in_key:
            dropped.append(SecretLine(n, "a private key"))
            in_key = _PEM_END.search(line) is None
            continue
        begin = _PEM_BEGIN.search(line)
        if begin is not None:
            dropped.append(SecretLine(n, "a private key"))
            in_key = _PEM_END.search(line, begin.end()) is None
            continue
        kind = secret_in_text(line)
        if kind is not None:
            dropped.append(SecretLine(n, kind))
            continue
        kept.append(line)
    return "".join(kept), tuple(dropped)


def mask_secret_lines(text: str) -> tuple[str, tuple[SecretLine, ...]]:
    """M8 for the archive: `text` with each secret-looking line replaced by a marker, so
    line numbers still match the file (memory_search hits, memory_get excerpts)."""
    _, dropped = secret_lines(text)
    if not dropped:
        return text, dropped
    kinds = {d.line: d.kind for d in dropped}
    out = [
        f"[line left out: it seems to carry {kinds[n]} (M8)]\n" if n in kinds else line
        for n, line in enumerate(text.splitlines(keepends=True), start=1)
    ]
    return "".join(out), dropped


def secret_banner(name: str, dropped: tuple[SecretLine, ...]) -> str | None:
    """M8: the banner above a memory file some of whose lines were left out, or None."""
    if not dropped:
        return None
    kinds = sorted({d.kind for d in dropped})
    lines = ", ".join(str(d.line) for d in dropped[:20]) + (", ..." if len(dropped) > 20 else "")
    return (
        f"🔒 {len(dropped)} line(s) of {name} (line {lines}) are not shown here: they seem to "
        f"carry {' and '.join(kinds)}, and nothing secret may enter long-term memory (M8). "
        "Remove the value from the file; keep a note without it instead (e.g. 'the key is "
        "in the user's password manager')."
    )


_ARCHIVE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}\.md$")
_WORKSPACE_PREFIX = "/workspace/"


def archive_file(path: str) -> Decision:
    """A1: may `memory_get` read `path`? The reason of an allowed one is the relative path.

    Only the archive's own files: `MEMORY.md`, `USER.md`, `memory/<name>.md`.
    Symlinks and non-regular files are refused by the reader, not here.
    """
    rel = path[len(_WORKSPACE_PREFIX) :] if path.startswith(_WORKSPACE_PREFIX) else path
    parts = rel.replace("\\", "/").split("/")
    if "\0" in rel or "\\" in rel or ".." in parts or rel.startswith(("/", "~")):
        return deny(
            "A1",
            f"{_show(path)} leaves the memory archive; memory_get reads MEMORY.md, USER.md "
            "or memory/<name>.md",
        )
    if rel in ("MEMORY.md", "USER.md"):
        return allow("A1", rel)
    if len(parts) == 2 and parts[0] == "memory" and _ARCHIVE_NAME.fullmatch(parts[1]):
        return allow("A1", rel)
    return deny(
        "A1",
        f"{_show(path)} is not a file of the memory archive; memory_get reads MEMORY.md, "
        "USER.md or memory/<name>.md (use the file a memory_search hit names)",
    )
