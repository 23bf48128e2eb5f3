"""Quota images made ahead (F1): a new conversation's first turn skips `mkfs`.

`SparedQuota` is the app's `LoopQuota` with a few formatted images kept beside
the conversations' (`<agent>/spare-<random>.img`, same size, same inodes). A
conversation without an image yet takes one by renaming it into place (atomic
in one directory: two claims never share a spare), then `LoopQuota.ensure`
mounts it as ever (R2 unchanged: the image is one the quota code made, with
this app's limits). `refill` makes spares up to `count`, in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Sequence

from sandbox.quota import LoopQuota, QuotaTarget, make_image

SPARE = re.compile(r"spare-[0-9a-f]{16}\.img")


class SparedQuota(LoopQuota):
    def __init__(self, quota: LoopQuota, count: int) -> None:
        super().__init__(quota.root, quota.limits)
        self.count = count

    def ensure(
        self,
        agent: str,
        digest: str,
        targets: Sequence[QuotaTarget],
        owner: tuple[int, int] | None,
    ) -> None:
        image = self.image(agent, digest)
        if digest.isalnum() and not image.exists():
            self._take_spare(agent, image.name)
        super().ensure(agent, digest, targets, owner)

    def _spares(self, agent: str) -> list[str]:
        try:
            with os.scandir(self.root / agent) as it:
                return sorted(
                    e.name
                    for e in it
                    if SPARE.fullmatch(e.name) and e.is_file(follow_symlinks=False)
                )
        except FileNotFoundError:
            return []

    def _take_spare(self, agent: str, name: str) -> bool:
        d = self.root / agent
        for spare in self._spares(agent):
            with contextlib.suppress(FileNotFoundError):
                # no replace of an image that appeared meanwhile: link, then drop the spare
                os.link(d / spare, d / name, follow_symlinks=False)
                os.unlink(d / spare)
                return True
        return False

    def refill(self, agent: str, count: int | None = None) -> int:
        """Make spares up to `count` (default: the one given at creation); how many were made."""
        count = self.count if count is None else count
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,39}", agent):
            return 0
        d = self.root / agent
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = 0
        for _ in range(count - len(self._spares(agent))):
            make_image(d / f"spare-{secrets.token_hex(8)}.img", self.limits)
            made += 1
        return made
