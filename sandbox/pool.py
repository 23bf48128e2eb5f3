"""What a pooled sandbox is, and whether a claimed one shows exactly its plan (F1, S3, S4).

A pooled sandbox is created before its conversation is known: its spec is the
conversation spec with no conversation, a name of its own and, as its plan,
its three slot directories (`sandbox.latebind`). `pool_key` is everything of a
spec that a pooled sandbox must share with the conversation that claims it
(image, user, env, networks, limits, runtime, workdir, home): a change drains
the pool.

A claim binds the conversation's plan into the slot. `view_violations`
compares what the sandbox's own mount namespace shows (its mountinfo and a
`stat` of each planned target, read through `/proc/<pid>/root` on the host)
with the plan, by device and inode: exactly the planned mounts under the
slots, each with its planned read-only flag, and nothing else. It is pure;
`read_view` gathers the facts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from dataclasses import dataclass

from sandbox.latebind import SLOT_TARGETS, Slot, unescape
from sandbox.mountplan import EntryKind, MountPlan
from sandbox.spec import SandboxSpec, host_config

POOL_NAME_INFIX = "-agent-p-"
MOUNTINFO_MAX = 1024 * 1024


def pool_key(spec: SandboxSpec) -> str:
    """What a pooled sandbox shares with every conversation it may serve."""
    doc = {
        "image_id": spec.image_id,
        "user": spec.user,
        "env": sorted(spec.env.items()),
        "networks": list(spec.networks),
        "limits": dataclasses.astuple(spec.limits),
        "runtime": spec.runtime,
        "host": host_config(spec).doc(),
        "workdir": spec.workdir,
        "home": spec.home,
        "app": spec.app,
        "agent": spec.agent,
        "gateway": spec.gateway,
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:24]


def pool_name(app: str, slot: Slot) -> str:
    return f"{app}{POOL_NAME_INFIX}{slot.id}"


def pooled_spec(template: SandboxSpec, slot: Slot) -> SandboxSpec:
    """The spec a pooled sandbox is created with and checked against (S2, R5)."""
    return dataclasses.replace(
        template, name=pool_name(template.app, slot), conversation="", plan=slot.slot_plan()
    )


@dataclass(frozen=True, slots=True)
class ViewMount:
    """One line of the sandbox's mountinfo: where, read-only or not, which device."""

    target: str
    read_only: bool
    dev: tuple[int, int]


@dataclass(frozen=True, slots=True)
class SandboxView:
    """The sandbox's own view: its mounts, and what each planned target is."""

    mounts: tuple[ViewMount, ...]
    targets: dict[str, tuple[EntryKind, int, int] | None]


_SLOT_BASES = tuple(str(base) for _, base in SLOT_TARGETS)


def _under_slots(target: str) -> bool:
    """Is `target` (a normalised absolute path, as mountinfo gives) a slot dir or under one?
    Plain string tests: this runs for every mount of the sandbox at every claim (F3)."""
    return any(target == b or target.startswith(b + "/") for b in _SLOT_BASES)


def view_violations(plan: MountPlan, view: SandboxView) -> list[str]:
    """Every way the sandbox's view differs from its plan (S3, S4); empty when exact."""
    out: list[str] = []
    slot_roots = {str(base) for _, base in SLOT_TARGETS}
    planned = plan.by_target()
    seen: dict[str, list[ViewMount]] = {}
    for m in view.mounts:
        if _under_slots(m.target):
            seen.setdefault(m.target, []).append(m)
    for target, mounts in sorted(seen.items()):
        want = planned.get(target)
        # a slot root shows its slot mount, and on top of it the planned bind if there is one
        allowed = (1 if target in slot_roots else 0) + (1 if want is not None else 0)
        if len(mounts) > allowed or (want is None and target not in slot_roots):
            out.append(f"unplanned mount at {target}")
            continue
        if want is None:
            continue
        top = mounts[-1]
        if top.read_only != want.read_only:
            state = "read-only" if top.read_only else "read-write"
            out.append(f"{target} is {state}; the plan says otherwise")
        if top.dev != (os.major(want.dev), os.minor(want.dev)):
            out.append(f"{target} is on device {top.dev}, not the planned source's")
    for target, want in sorted(planned.items()):
        if target not in seen or len(seen[target]) < (2 if target in slot_roots else 1):
            out.append(f"planned mount {want.source} -> {target} is missing")
            continue
        got = view.targets.get(target)
        if got != (want.kind, want.dev, want.ino):
            out.append(f"{target} is not the planned {want.kind.value} (device/inode differ)")
    return out


def parse_mountinfo(text: str) -> tuple[ViewMount, ...]:
    out: list[ViewMount] = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 6:
            continue
        major, _, minor = fields[2].partition(":")
        if not (major.isdigit() and minor.isdigit()):
            continue
        options = fields[5].split(",")
        out.append(ViewMount(unescape(fields[4]), "ro" in options, (int(major), int(minor))))
    return tuple(out)


def read_view(pid: int, plan: MountPlan) -> SandboxView:
    """The facts, read from the host through the sandbox's init process (runc only)."""
    if pid <= 0:
        raise ProcessLookupError(f"no process for the sandbox (pid {pid})")
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        raw = f.read(MOUNTINFO_MAX)
    targets: dict[str, tuple[EntryKind, int, int] | None] = {}
    for m in plan.mounts:
        try:
            st = os.lstat(f"/proc/{pid}/root{m.target}")
        except OSError:
            targets[m.target] = None
            continue
        targets[m.target] = (_kind(st.st_mode), st.st_dev, st.st_ino)
    return SandboxView(parse_mountinfo(raw.decode("utf-8", "surrogateescape")), targets)


def _kind(mode: int) -> EntryKind:
    if stat.S_ISLNK(mode):
        return EntryKind.SYMLINK
    if stat.S_ISDIR(mode):
        return EntryKind.DIR
    return EntryKind.FILE if stat.S_ISREG(mode) else EntryKind.OTHER
