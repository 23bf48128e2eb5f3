"""Put the in-sandbox clients into a bridge directory (`/run/cellgate` in the sandbox).

`cellgate-tool NAME JSON` and `cellgate-mcp` (an MCP stdio server) are stdlib
only, so any image with Python 3.8+ can call the bridge without installing anything.
"""

from __future__ import annotations

import functools
import stat
from importlib import resources
from pathlib import Path

from cellgate.errors import UnsafePath
from orchestrator.safefs import SafeDir

__all__ = ["CLIENT_FILES", "install_client"]

CLIENT_FILES = {"cellgate-tool": "cellgate_tool.py", "cellgate-mcp": "cellgate_mcp.py"}


def install_client(bridge_dir: Path) -> list[Path]:
    """Copy both clients into `bridge_dir` (mode 0755), replacing what is there atomically.

    Through `orchestrator.safefs`: a temporary file beside each, renamed over
    it between directory descriptors, so a link planted at either name is
    replaced, never written through; a symlinked `bridge_dir` raises `UnsafePath`.
    """
    out: list[Path] = []
    with SafeDir.open(bridge_dir) as d:
        for name, data in _client_files().items():
            if not _installed(d, name, data):  # every turn: most find them in place
                d.write_atomic(name, data, mode=0o755, durable=False)
            out.append(bridge_dir / name)
    return out


@functools.cache
def _client_files() -> dict[str, bytes]:
    package = resources.files("sandbox.client")
    return {name: package.joinpath(source).read_bytes() for name, source in CLIENT_FILES.items()}


def _installed(d: SafeDir, name: str, data: bytes) -> bool:
    """Is `name` already exactly `data`, a plain 0755 file (read without following)?"""
    try:
        st = d.lstat(name)
        if st is None or st.st_size != len(data) or stat.S_IMODE(st.st_mode) != 0o755:
            return False
        return d.read(name, cap=len(data) + 1) == data
    except (OSError, UnsafePath):
        return False
