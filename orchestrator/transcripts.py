"""A conversation's transcript and harness session id, kept in its own directory (D3).

`chats/<conversation>/transcript.jsonl` gets one line per message and reply;
`chats/<conversation>/session.json` holds the harness session id, so a
restarted gateway resumes instead of starting cold. The sandbox can write this
directory, so every touch goes through `orchestrator.safefs`: no link is
followed, no FIFO waited on, reads are capped, and the session id is
validated. A file planted in place of either is left out with a log line
(`LeftOut` reports it to a caller that records an audit row).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from cellgate.errors import UnsafePath
from orchestrator.safefs import LeftOut, SafeDir, left_out

__all__ = [
    "MAX_SESSION_BYTES",
    "SESSION",
    "TRANSCRIPT",
    "append_transcript",
    "load_session_id",
    "recent_history",
    "save_session_id",
]

TRANSCRIPT = "transcript.jsonl"
SESSION = "session.json"
MAX_SESSION_BYTES = 4096
_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def append_transcript(
    chat_dir: Path, entries: list[dict[str, Any]], *, report: LeftOut | None = None
) -> bool:
    """Append entries (O_APPEND, no link followed); False if the file was left out.

    A symlink, FIFO, hard link or other non-file planted at the name is left
    untouched and logged; the turn itself is recorded in the store regardless.
    """
    data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()
    try:
        with SafeDir.open(chat_dir) as d:
            d.append(TRANSCRIPT, data)
    except UnsafePath as exc:
        left_out(chat_dir.name, "transcript", exc, report)
        return False
    return True


def save_session_id(
    chat_dir: Path,
    session_id: str,
    harness_session_id: str | None,
    *,
    report: LeftOut | None = None,
) -> bool:
    """Replace session.json atomically (a planted link is replaced, never written through).

    Without an fsync (F3: two per turn, each a journal commit of the conversation's
    quota image, waited for on the turn lane): the harness session it names is in
    files the harness writes inside the sandbox, which nothing syncs, and the
    transcript is appended unsynced too. After a power cut a lost or torn session.json
    reads as no id, and the next turn starts a fresh harness session from the
    transcript (`recent_history`)."""
    doc = json.dumps({"session": session_id, "harness_session_id": harness_session_id}).encode()
    try:
        with SafeDir.open(chat_dir) as d:
            d.write_atomic(SESSION, doc, durable=False)
    except UnsafePath as exc:
        left_out(chat_dir.name, "session id", exc, report)
        return False
    return True


def load_session_id(chat_dir: Path, *, report: LeftOut | None = None) -> str | None:
    """The saved harness session id, or None when absent, unsafe, unreadable or not plausible."""
    try:
        with SafeDir.open(chat_dir) as d:
            raw = d.read(SESSION, cap=MAX_SESSION_BYTES + 1)
    except UnsafePath as exc:
        left_out(chat_dir.name, "session id", exc, report)
        return None
    except OSError:
        return None
    if raw is None or len(raw) > MAX_SESSION_BYTES:
        return None
    try:
        value = json.loads(raw).get("harness_session_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and _SESSION_ID_RE.fullmatch(value) else None


def recent_history(
    chat_dir: Path, limit: int = 40, cap: int = 256 * 1024, *, report: LeftOut | None = None
) -> list[dict[str, str]]:
    """The last user/assistant texts of the transcript, for a harness resuming cold (D3).

    Only the last `cap` bytes are read, whatever the file's size.
    """
    try:
        with SafeDir.open(chat_dir) as d:
            raw = d.read(TRANSCRIPT, cap=cap, tail=True)
    except UnsafePath as exc:
        left_out(chat_dir.name, "transcript", exc, report)
        return []
    except OSError:
        return []
    if raw is None:
        return []
    out: list[dict[str, str]] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(entry, dict)
            and entry.get("role") in ("user", "assistant")
            and isinstance(entry.get("text"), str)
        ):
            out.append({"role": entry["role"], "text": entry["text"]})
    return out[-limit:]
