"""Does a running container match its spec? A pure comparison (S2, S4).

The backend gathers the facts (what the engine reports, and an `lstat` of each
bind source); this module only compares. Any difference is a violation with a
message that names the offending mount or setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from sandbox.mountplan import EntryKind
from sandbox.spec import LABEL_PREFIX, LABEL_SPEC_HASH, SandboxSpec, host_config

# What the engine reports as the AppArmor profile when none was asked for: its
# default profile, or nothing on a host without AppArmor. Anything else (above
# all "unconfined") was asked for by someone other than the gateway.
ENGINE_DEFAULT_APPARMOR = ("", "docker-default")


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
    pids_limit: int | None
    memory: int
    memory_swap: int
    nano_cpus: int
    ulimits: tuple[tuple[str, int, int], ...]
    tmpfs_options: Mapping[str, str]
    networks: tuple[str, ...]
    apparmor_profile: str
    log_type: str
    log_options: Mapping[str, str]
    cgroupns_mode: str


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


def _options(value: str) -> frozenset[str]:
    return frozenset(o.strip() for o in value.split(",") if o.strip())


def _differs(out: list[str], what: str, seen: object, want: object) -> None:
    if seen != want:
        out.append(f"{what} is {seen!r}, the spec says {want!r}")


def limit_violations(spec: SandboxSpec, observed: ObservedContainer) -> list[str]:
    """R5: every engine-side limit and setting as the spec created it; a `docker update`
    or a container made by other hands shows up here, named."""
    want = host_config(spec)
    out: list[str] = []
    _differs(out, "pids limit", observed.pids_limit, want.pids_limit)
    _differs(out, "memory limit", observed.memory, want.memory)
    _differs(out, "memory+swap limit", observed.memory_swap, want.memory_swap)
    _differs(out, "CPU limit (NanoCpus)", observed.nano_cpus, want.nano_cpus)
    _differs(out, "ulimits", tuple(sorted(observed.ulimits)), tuple(sorted(want.ulimits)))
    _differs(out, "network mode", observed.network_mode, want.network_mode)
    want_nets = tuple(sorted(spec.networks)) or ("none",)
    _differs(out, "attached networks", tuple(sorted(observed.networks)), want_nets)
    extra = sorted(set(observed.security_opt) - set(want.security_opt))
    missing = sorted(set(want.security_opt) - set(observed.security_opt))
    if extra:
        out.append(f"security options added: {', '.join(extra)}")
    if missing:
        out.append(f"security options missing: {', '.join(missing)}")
    if observed.apparmor_profile not in ENGINE_DEFAULT_APPARMOR:
        out.append(f"AppArmor profile is {observed.apparmor_profile!r}, not the engine default")
    _differs(out, "log driver", observed.log_type, want.log_driver)
    if observed.log_options:
        out.append(f"log options set: {dict(observed.log_options)!r}")
    _differs(out, "cgroup namespace", observed.cgroupns_mode, want.cgroupns_mode)
    for target, options in sorted(want.tmpfs.items()):
        seen = observed.tmpfs_options.get(target)
        if seen is None:
            out.append(f"tmpfs at {target} is missing")
        elif _options(seen) != _options(options):
            out.append(f"tmpfs at {target} has options {seen!r}, the spec says {options!r}")
    labels = spec.labels()
    for name, value in sorted(labels.items()):
        if name != LABEL_SPEC_HASH and observed.labels.get(name) != value:
            out.append(f"label {name} is {observed.labels.get(name)!r}, the spec says {value!r}")
    for name in sorted(set(observed.labels) - set(labels)):
        if name.startswith(LABEL_PREFIX):
            out.append(f"unexpected label {name}")
    return out


def violations(spec: SandboxSpec, observed: ObservedContainer) -> list[str]:
    return (
        mount_violations(spec, observed)
        + hardening_violations(spec, observed)
        + limit_violations(spec, observed)
    )
