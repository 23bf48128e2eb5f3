"""Put the in-sandbox clients into a bridge directory (`/run/cellgate` in the sandbox).

`cellgate-tool NAME JSON` and `cellgate-mcp` (an MCP stdio server) are stdlib
only, so any image with Python 3.8+ can call the bridge without installing anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

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
    package = resources.files("sandbox.client")
    with SafeDir.open(bridge_dir) as d:
        for name, source in CLIENT_FILES.items():
            d.write_atomic(name, package.joinpath(source).read_bytes(), mode=0o755)
            out.append(bridge_dir / name)
    return out
