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
LABEL_GATEWAY = "io.cellgate.gateway"
LABEL_PREFIX = "io.cellgate."

# R3: the sandbox's stdout/stderr go nowhere on the host. Nothing reads them (exec
# output comes back on the exec stream), and a capped json-file log would still
# cost the host a write and a rotation per chunk of a flood.
LOG_DRIVER = "none"
# R5: set explicitly (not inherited from the engine's defaults) and checked each turn.
ULIMITS: tuple[tuple[str, int, int], ...] = (("core", 0, 0), ("nofile", 1024, 1024))
SECURITY_OPT: tuple[str, ...] = ("no-new-privileges:true",)
CGROUPNS_MODE = "private"
# gVisor's Sentry runs inside the container's pids cgroup and needs host threads
# of its own (several per task on the ptrace platform); hitting the cgroup limit
# crashes the whole sandbox. Under runsc the task limit is RLIMIT_NPROC, counted
# by gVisor's own kernel for this sandbox only, and the host cgroup gets headroom.
RUNSC_HOST_THREADS_PER_TASK = 16
RUNSC_HOST_THREADS_BASE = 256

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
    gateway: str = ""

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
            "host": host_config(self).doc(),
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
            LABEL_GATEWAY: self.gateway,
        }


def sandbox_name(app: str, conversation_digest: str, *, gateway: str) -> str:
    """`<app>-agent-c-<hash>` (S1); the hash mixes in the gateway id (R1).

    Two gateways serving an app of the same name on one engine get different
    names for the same chat, so neither can reuse or replace the other's sandbox.
    """
    raw = f"{gateway}\0{conversation_digest}".encode()
    mixed = hashlib.sha256(raw).hexdigest()[: max(16, len(conversation_digest))]
    return f"{app}-agent-c-{mixed}"


def shared_sandbox_name(app: str) -> str:
    """`<app>-agent` (S6): the one container of an app agent without isolate mode.

    The gateway id is on its label; a container of that name carrying another
    gateway's id is never reused or removed (R1): the turn is refused instead.
    """
    return f"{app}-agent"


def _numeric_user(user: str) -> tuple[int, int] | None:
    uid, _, gid = user.partition(":")
    if uid.isdigit() and (gid.isdigit() or not gid):
        return int(uid), int(gid or uid)
    return None


@dataclass(frozen=True, slots=True)
class HostConfig:
    """The engine-side settings a sandbox is created with and checked against (S2, R3, R5)."""

    pids_limit: int
    memory: int
    memory_swap: int
    nano_cpus: int
    ulimits: tuple[tuple[str, int, int], ...]
    tmpfs: Mapping[str, str]
    network_mode: str
    security_opt: tuple[str, ...]
    log_driver: str
    cgroupns_mode: str

    def doc(self) -> list[object]:
        return [
            self.pids_limit,
            self.memory,
            self.memory_swap,
            self.nano_cpus,
            [list(u) for u in self.ulimits],
            sorted(self.tmpfs.items()),
            self.network_mode,
            list(self.security_opt),
            self.log_driver,
            self.cgroupns_mode,
        ]


def tmpfs_options(spec: SandboxSpec) -> dict[str, str]:
    """A private /tmp and home directory; the home is owned by (and only open to) the user."""
    limits = spec.limits
    ids = _numeric_user(spec.user)
    home = f"size={limits.home_bytes},nosuid,nodev"
    home += f",uid={ids[0]},gid={ids[1]},mode=0700" if ids else ",mode=1777"
    return {"/tmp": f"size={limits.tmp_bytes},mode=1777,nosuid,nodev", spec.home: home}


def host_config(spec: SandboxSpec) -> HostConfig:
    """What `spec` asks of the engine: one source for creating and for checking (R5)."""
    lim = spec.limits
    pids, ulimits = lim.pids, ULIMITS
    if spec.runtime == "runsc":
        pids = lim.pids * RUNSC_HOST_THREADS_PER_TASK + RUNSC_HOST_THREADS_BASE
        ulimits = tuple(sorted((*ULIMITS, ("nproc", lim.pids, lim.pids))))
    return HostConfig(
        pids_limit=pids,
        memory=lim.memory_bytes,
        memory_swap=lim.memory_bytes,  # swap = memory: no swap at all
        nano_cpus=lim.nano_cpus,
        ulimits=ulimits,
        tmpfs=tmpfs_options(spec),
        network_mode=spec.networks[0] if spec.networks else "none",
        security_opt=SECURITY_OPT,
        log_driver=LOG_DRIVER,
        cgroupns_mode=CGROUPNS_MODE,
    )
