"""Put the in-sandbox clients into a bridge directory (`/run/cellgate` in the sandbox).

`cellgate-tool NAME JSON` and `cellgate-mcp` (an MCP stdio server) are stdlib
only, so any image with Python 3.8+ can call the bridge without installing anything.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = ["CLIENT_FILES", "install_client"]

CLIENT_FILES = {"cellgate-tool": "cellgate_tool.py", "cellgate-mcp": "cellgate_mcp.py"}


def install_client(bridge_dir: Path) -> list[Path]:
    """Copy both clients into `bridge_dir` (mode 0755), replacing what is there atomically."""
    out: list[Path] = []
    package = resources.files("sandbox.client")
    for name, source in CLIENT_FILES.items():
        data = package.joinpath(source).read_bytes()
        dest = bridge_dir / name
        tmp = bridge_dir / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o755)  # fmt: skip
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        out.append(dest)
    return out
