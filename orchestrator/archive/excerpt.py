"""`memory_get`: a bounded excerpt of one memory file (A1), traversal-guarded.

Which file may be read is `policies.memory.archive_file` (MEMORY.md, USER.md,
`memory/<name>.md`; `../` and other paths refused). The file is read through
`orchestrator.safefs`: a symlink, FIFO, device, hard link or directory in
its place is refused, and at most `READ_CAP_BYTES` of it is read, whatever
its size. The excerpt is at most `MAX_LINES` lines and `MAX_CHARS` characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import PolicyDenied, UnsafePath
from orchestrator.safefs import SafeDir
from policies.memory import archive_file, mask_secret_lines

__all__ = ["MAX_CHARS", "MAX_LINES", "READ_CAP_BYTES", "Excerpt", "excerpt"]

READ_CAP_BYTES = 1024 * 1024
MAX_LINES = 200
MAX_CHARS = 16_000


@dataclass(frozen=True, slots=True)
class Excerpt:
    file: str
    start: int
    end: int
    """The last line shown (`start - 1` when nothing is)."""
    total_lines: int
    text: str
    truncated: bool


def excerpt(workspace: Path, path: str, start: int = 1, lines: int = 60) -> Excerpt:
    """Lines `start`.. of the memory file `path` (blocking: call off the loop).

    Raises `PolicyDenied("A1", ...)` for a path outside the archive or a file
    that is not a plain regular file; `FileNotFoundError` for a missing one.
    """
    decision = archive_file(path)
    if not decision:
        raise PolicyDenied(decision.rule, decision.reason)
    rel = decision.reason
    start = max(1, start)
    lines = max(1, min(lines, MAX_LINES))
    try:
        with SafeDir.trusted(workspace) as ws:
            raw = ws.read(rel, cap=READ_CAP_BYTES)
    except UnsafePath as exc:
        raise PolicyDenied(
            "A1", f"{rel!r} {exc.reason}; memory_get reads only plain memory files"
        ) from exc
    if raw is None:
        raise FileNotFoundError(rel)
    all_lines = mask_secret_lines(raw.decode("utf-8", "replace"))[0].splitlines()  # M8
    chosen = all_lines[start - 1 : start - 1 + lines]
    text = "\n".join(chosen)
    truncated = len(text) > MAX_CHARS or start - 1 + lines < len(all_lines)
    if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS] + "\n[excerpt truncated]"
    return Excerpt(
        file=rel,
        start=start,
        end=start - 1 + len(chosen),
        total_lines=len(all_lines),
        text=text,
        truncated=truncated,
    )
