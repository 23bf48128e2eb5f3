"""What one conversation's sandbox is: image, user, environment, mounts, limits (S1, S2)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from sandbox.mountplan import HOME, MountPlan

LABEL_MANAGED = "io.cellgate.managed"
LABEL_APP = "io.cellgate.app"
LABEL_AGENT = "io.cellgate.agent"
LABEL_CONVERSATION = "io.cellgate.conversation"
LABEL_SPEC_HASH = "io.cellgate.spec-hash"

DEFAULT_UID = 65532


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Safe defaults: a fork bomb, a memory hog or a CPU spinner hurts only itself."""

    pids: int = 128
    memory_bytes: int = 512 * 1024 * 1024
    nano_cpus: int = 1_000_000_000
    tmp_bytes: int = 64 * 1024 * 1024
    home_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    name: str
    image: str
    image_id: str
    user: str
    env: Mapping[str, str]
    networks: tuple[str, ...]
    plan: MountPlan
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    runtime: str | None = None
    app: str = ""
    agent: str = ""
    conversation: str = ""
    workdir: str = "/workspace"
    home: str = str(HOME)

    def spec_hash(self) -> str:
        """Covers everything that, changed, must recreate the container (S5)."""
        doc = {
            "image_id": self.image_id,
            "user": self.user,
            "env": sorted(self.env.items()),
            "networks": list(self.networks),
            "mounts": [
                [m.source, m.target, m.read_only, m.kind.value, m.dev, m.ino]
                for m in self.plan.mounts
            ],
            "limits": [
                self.limits.pids,
                self.limits.memory_bytes,
                self.limits.nano_cpus,
                self.limits.tmp_bytes,
                self.limits.home_bytes,
            ],
            "runtime": self.runtime,
            "workdir": self.workdir,
            "home": self.home,
        }
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:24]

    def labels(self) -> dict[str, str]:
        return {
            LABEL_MANAGED: "1",
            LABEL_APP: self.app,
            LABEL_AGENT: self.agent,
            LABEL_CONVERSATION: self.conversation,
            LABEL_SPEC_HASH: self.spec_hash(),
        }


def sandbox_name(app: str, conversation_digest: str) -> str:
    """`<app>-agent-c-<hash>` (S1)."""
    return f"{app}-agent-c-{conversation_digest}"
