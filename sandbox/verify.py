"""Does a running container match its spec? A pure comparison (S2, S4).

The backend gathers the facts (what the engine reports, and an `lstat` of each
bind source); this module only compares. Any difference is a violation with a
message that names the offending mount or setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from sandbox.mountplan import EntryKind
from sandbox.spec import LABEL_SPEC_HASH, SandboxSpec


@dataclass(frozen=True, slots=True)
class ObservedMount:
    type: str
    source: str
    target: str
    read_write: bool
    identity: tuple[EntryKind, int, int] | None


@dataclass(frozen=True, slots=True)
class ObservedContainer:
    name: str
    id: str
    image_id: str
    labels: dict[str, str]
    user: str
    mounts: tuple[ObservedMount, ...]
    tmpfs: tuple[str, ...]
    cap_add: tuple[str, ...]
    cap_drop: tuple[str, ...]
    privileged: bool
    readonly_rootfs: bool
    security_opt: tuple[str, ...]
    network_mode: str
    pid_mode: str
    ipc_mode: str
    devices: int
    runtime: str
    running: bool


def _is_parent(parent: str, child: str) -> bool:
    p, c = PurePosixPath(parent), PurePosixPath(child)
    return p != c and p in c.parents


def mount_violations(spec: SandboxSpec, observed: ObservedContainer) -> list[str]:
    """Every way the container's mounts are wider than (or differ from) the plan (S4)."""
    planned = spec.plan.by_target()
    allowed_tmpfs = {"/tmp", spec.home}
    out: list[str] = []
    seen: set[str] = set()
    for m in observed.mounts:
        if m.type == "tmpfs" and m.target in allowed_tmpfs:
            continue
        plan = planned.get(m.target)
        if plan is None:
            out.append(f"unplanned {m.type} mount {m.source or '(anonymous)'} -> {m.target}")
            continue
        seen.add(m.target)
        if m.type != "bind":
            out.append(f"{m.target} is a {m.type} mount; the plan has a bind of {plan.source}")
            continue
        if m.read_write and plan.read_only:
            out.append(f"{m.source} -> {m.target} is read-write; the plan has it read-only")
        if m.source != plan.source:
            if _is_parent(m.source, plan.source):
                out.append(f"{m.target} mounts {m.source}, a parent of the planned {plan.source}")
            else:
                out.append(f"{m.target} mounts {m.source}; the plan has {plan.source}")
        elif m.identity != (plan.kind, plan.dev, plan.ino):
            out.append(
                f"{m.source} -> {m.target} is no longer the planned {plan.kind.value} "
                "(device/inode changed)"
            )
    for target in sorted(set(planned) - seen):
        out.append(f"planned mount {planned[target].source} -> {target} is missing")
    for t in observed.tmpfs:
        if t not in allowed_tmpfs:
            out.append(f"unplanned tmpfs at {t}")
    return out


def hardening_violations(spec: SandboxSpec, observed: ObservedContainer) -> list[str]:
    """Every way the container is less locked down than S2 asks."""
    out: list[str] = []
    if observed.privileged:
        out.append("container is privileged")
    if observed.cap_add:
        out.append(f"capabilities added: {', '.join(observed.cap_add)}")
    if "ALL" not in {c.upper() for c in observed.cap_drop}:
        out.append("not every capability is dropped (CapDrop lacks ALL)")
    if not any(o.replace("=", ":").startswith("no-new-privileges") for o in observed.security_opt):
        out.append("no-new-privileges is not set")
    if not observed.readonly_rootfs:
        out.append("root filesystem is writable")
    if observed.pid_mode or observed.ipc_mode not in ("", "private", "none"):
        out.append(f"shares a namespace (pid={observed.pid_mode!r}, ipc={observed.ipc_mode!r})")
    if observed.devices:
        out.append(f"{observed.devices} host devices are passed through")
    if observed.user != spec.user:
        out.append(f"runs as {observed.user!r}, the spec says {spec.user!r}")
    if observed.user.split(":")[0] in ("", "0", "root"):
        out.append("runs as root")
    if observed.image_id != spec.image_id:
        out.append(f"image {observed.image_id[:19]} is not the spec's {spec.image_id[:19]}")
    if observed.labels.get(LABEL_SPEC_HASH) != spec.spec_hash():
        out.append("spec hash label differs from the current spec")
    want_runtime = spec.runtime or "runc"
    if observed.runtime != want_runtime:
        out.append(f"runtime is {observed.runtime!r}, the spec says {want_runtime!r}")
    return out


def violations(spec: SandboxSpec, observed: ObservedContainer) -> list[str]:
    return mount_violations(spec, observed) + hardening_violations(spec, observed)
