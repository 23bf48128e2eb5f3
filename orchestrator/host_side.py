"""A conversation's sandbox host side, in one blocking call (R2, M3, S3).

`host_side` takes the conversation's quota image and binds it onto its dirs,
makes the dirs, and plans its mounts from the workspace as it is now. It runs
in the host worker (`orchestrator.host_worker`, F3) and, when that cannot be
had, in this process; both run this same function. What it needs crosses a
process boundary, so it takes plain values: the quota as a `QuotaRef`, which
the worker turns back into a quota object of its own.
"""

from __future__ import annotations

import secrets
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from orchestrator.conversations import ConversationPaths, ensure_conversation
from orchestrator.spare_quota import SparedQuota
from sandbox.mountplan import MountPlan, own_dirs, plan_mounts, scan_workspace
from sandbox.quota import LoopQuota, QuotaLimits, QuotaTarget

QUOTAS_KEPT = 64  # quota objects a worker keeps (one per app agent in use)


def quota_targets(paths: ConversationPaths, agent_root: Path) -> tuple[QuotaTarget, ...]:
    return (
        QuotaTarget("chat", paths.workspace, paths.chat_dir),
        QuotaTarget(f"media/{paths.media_dir.name}", paths.workspace, paths.media_dir),
        QuotaTarget("home", agent_root, paths.home_dir),
    )


@dataclass(frozen=True, slots=True)
class QuotaRef:
    """A quota object as plain values: its root, limits, whether it keeps spares (F1),
    and `token`, the object's own id (a quota made anew, e.g. for a reinstalled app,
    is a new object in the worker too: nothing it cached is carried over)."""

    root: Path
    limits: QuotaLimits
    spared: bool
    token: str


_TOKENS: weakref.WeakKeyDictionary[LoopQuota, str] = weakref.WeakKeyDictionary()


def quota_ref(quota: LoopQuota) -> QuotaRef:
    token = _TOKENS.get(quota)
    if token is None:
        token = _TOKENS.setdefault(quota, secrets.token_hex(8))
    return QuotaRef(quota.root, quota.limits, isinstance(quota, SparedQuota), token)


class Quotas:
    """A worker's quota objects, by `QuotaRef` (the most recently used `QUOTAS_KEPT`)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[QuotaRef, LoopQuota] = OrderedDict()

    def get(self, ref: QuotaRef) -> LoopQuota:
        quota = self._kept.get(ref)
        if quota is None:
            quota = LoopQuota(ref.root, ref.limits)
            if ref.spared:  # it takes spares; the gateway's own quota object makes them
                quota = SparedQuota(quota, 0)
            self._kept[ref] = quota
            while len(self._kept) > QUOTAS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(ref)
        return quota


@dataclass(frozen=True, slots=True)
class HostJob:
    """One conversation's host side, as plain values (it crosses to the worker)."""

    agent: str
    digest: str
    paths: ConversationPaths
    agent_root: Path
    owner: tuple[int, int]  # uid, gid of the sandbox's user


def host_side(quota: LoopQuota | None, job: HostJob, *, quick: bool) -> MountPlan:
    """The conversation's quota image on its dirs (R2), its dirs made (M3) and its mounts
    planned (S3). Blocking; `quick` as `LoopQuota.ensure` (raises `Busy`)."""
    paths = job.paths
    if quota is not None:
        targets = quota_targets(paths, job.agent_root)
        quota.ensure(job.agent, job.digest, targets, job.owner, quick=quick)
    ensure_conversation(paths, *job.owner)
    snap = scan_workspace(paths.workspace)
    own = own_dirs(paths.chat_dir, paths.media_dir, paths.home_dir, paths.bridge_dir)
    return plan_mounts(snap, own)
