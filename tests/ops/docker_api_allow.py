"""The Docker API proxy's allow-list (deploy/docker-api-proxy/docker-api-allow.lst), as
HAProxy reads it: one regex a line over "METHOD /path", comments and blanks skipped."""

from __future__ import annotations

import re
from pathlib import Path

ALLOW_LIST = Path(__file__).resolve().parents[2] / "deploy/docker-api-proxy/docker-api-allow.lst"


def allow_patterns(path: Path = ALLOW_LIST) -> list[re.Pattern[str]]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [re.compile(line) for line in lines if line and not line.startswith("#")]


def allowed(method: str, path: str, patterns: list[re.Pattern[str]]) -> bool:
    """What the proxy does with a request: the query string is not part of the path."""
    call = f"{method} {path.split('?', 1)[0]}"
    return any(p.search(call) for p in patterns)
