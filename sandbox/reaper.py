"""The idle reaper: sandboxes go away when nobody uses them (S5).

A sandbox is removed `idle_minutes` after its last session ended, never while
one of its sessions is busy; all of an app's sandboxes go when the app is
updated or uninstalled. What "last active" and "busy" mean is the caller's
(the store's) business: the reaper asks through small callables, sync or
async, and reads time only through `now`, so a test drives it with a fake clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from cellgate.errors import CellgateError
from sandbox.backends.base import SandboxBackend, SandboxInfo
from sandbox.gateway_id import valid_gateway_id
from sandbox.spec import LABEL_APP, LABEL_GATEWAY, LABEL_MANAGED

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_IDLE_MINUTES = 30.0

LastActive = Callable[[str], float | Awaitable[float | None] | None]
Busy = Callable[[str], bool | Awaitable[bool]]
Guard = Callable[[SandboxInfo], AbstractAsyncContextManager[object]]
Scope = Callable[[SandboxInfo], bool]
Removed = Callable[[str], Awaitable[None]]


async def _resolve(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


def _no_guard(info: SandboxInfo) -> AbstractAsyncContextManager[object]:
    return contextlib.nullcontext()


def _everything(info: SandboxInfo) -> bool:
    return True


async def _nothing(name: str) -> None:
    return None


class Reaper:
    """Removes managed sandboxes idle past the threshold; keeps busy and recent ones.

    `last_active(name)` is the time (as `now()` reports it) the sandbox's last
    session ended, or None when unknown: then the reaper counts from when it
    first saw the sandbox, so an orphan is still removed eventually. `guard(info)`
    is held around the final check and the removal, and around each removal of
    `remove_app` (the caller's per-conversation lock), so a session cannot start
    in a sandbox that is being removed.

    `gateway_id` is required (R1): the reaper lists only containers labelled with
    it, so it never touches another gateway's sandboxes on the same engine;
    `scope` narrows that further (e.g. to the apps this gateway serves).
    """

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        gateway_id: str,
        last_active: LastActive,
        busy: Busy,
        idle_minutes: float = DEFAULT_IDLE_MINUTES,
        now: Callable[[], float] = time.time,
        guard: Guard = _no_guard,
        scope: Scope = _everything,
        on_removed: Removed = _nothing,
    ) -> None:
        if not valid_gateway_id(gateway_id):
            raise ValueError(f"the reaper needs this gateway's id, got {gateway_id!r}")
        self._backend = backend
        self._labels = {LABEL_MANAGED: "1", LABEL_GATEWAY: gateway_id}
        self._last_active = last_active
        self._busy = busy
        self._idle_seconds = idle_minutes * 60.0
        self._now = now
        self._guard = guard
        self._scope = scope
        self._on_removed = on_removed
        self._first_seen: dict[str, float] = {}

    async def run_once(self) -> list[str]:
        """One pass over this gateway's sandboxes; the names it removed."""
        infos = [i for i in await self._backend.list(self._labels) if self._scope(i)]
        now = self._now()
        present = {i.name for i in infos}
        for gone in set(self._first_seen) - present:
            del self._first_seen[gone]
        removed: list[str] = []
        for info in infos:
            first = self._first_seen.setdefault(info.name, now)
            if await self._reap_if_idle(info, first, now):
                removed.append(info.name)
                self._first_seen.pop(info.name, None)
        return removed

    async def _idle(self, name: str, first_seen: float, now: float) -> bool:
        if await _resolve(self._busy(name)):
            return False
        last = await _resolve(self._last_active(name))
        since = first_seen if last is None else last
        return now - since >= self._idle_seconds

    async def _reap_if_idle(self, info: SandboxInfo, first_seen: float, now: float) -> bool:
        name = info.name
        if not await self._idle(name, first_seen, now):
            return False
        async with self._guard(info):
            if not await self._idle(name, first_seen, self._now()):
                return False
            logger.info("removing idle sandbox %s", name)
            await self._backend.remove(name)
            await self._on_removed(name)
        return True

    async def remove_app(self, app: str, guard: Guard | None = None) -> list[str]:
        """Remove this gateway's sandboxes of `app`, busy or not (S5: updated or uninstalled).

        Each removal holds `guard` (default: the reaper's), so a turn that is
        starting in one waits for it to be gone and then starts a fresh one."""
        infos = await self._backend.list({**self._labels, LABEL_APP: app})
        for info in infos:
            async with (guard or self._guard)(info):
                logger.info("removing sandbox %s of app %s", info.name, app)
                await self._backend.remove(info.name)
                await self._on_removed(info.name)
            self._first_seen.pop(info.name, None)
        return [i.name for i in infos]

    async def run_forever(
        self, interval: float = 60.0, after: Callable[[], Awaitable[object]] | None = None
    ) -> None:
        """Reap every `interval` seconds until cancelled, then run `after` (the caller's
        own sweep); an engine outage or a failed sweep is logged, not fatal."""
        while True:
            try:
                await self.run_once()
            except CellgateError as exc:
                logger.warning("reaper pass failed: %s", exc)
            if after is not None:
                try:
                    await after()
                except Exception:  # the sweep's own failure never stops the reaping
                    logger.exception("the pass after reaping failed")
            await asyncio.sleep(interval)
