"""Fair turn slots (R4): a global bound, shared round-robin between owners.

`FairSlots(bound, per_owner)` lets at most `bound` turns run at once and at
most `per_owner` of them for one owner (a sender, or a conversation when the
sender is unknown). Waiters are served owner by owner in turn, so one
stranger's flood of slow turns queues behind itself and never holds every
slot: another chat's turn starts as soon as any slot frees.

Everything runs on the event loop; the maps hold only owners that hold or
wait for a slot, so they are bounded by the turns in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class FairSlots:
    def __init__(self, bound: int, per_owner: int | None = None) -> None:
        if bound < 1:
            raise ValueError("bound must be at least 1")
        self.bound = bound
        self.per_owner = max(1, min(bound, per_owner if per_owner is not None else bound))
        self._held: dict[str, int] = {}
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._in_use = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @contextlib.asynccontextmanager
    async def slot(self, owner: str) -> AsyncIterator[None]:
        await self.acquire(owner)
        try:
            yield
        finally:
            self.release(owner)

    async def acquire(self, owner: str) -> None:
        if not self._waiting and self._free_for(owner):
            self._take(owner)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, deque()).append(fut)
        self._grant()  # waiters ahead may be at their own share while a slot is free
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(owner)  # granted and cancelled at once: hand it on
            else:
                self._drop(owner, fut)
            raise

    def release(self, owner: str) -> None:
        left = self._held.get(owner, 0) - 1
        if left > 0:
            self._held[owner] = left
        else:
            self._held.pop(owner, None)
        self._in_use -= 1
        self._grant()

    def _free_for(self, owner: str) -> bool:
        return self._in_use < self.bound and self._held.get(owner, 0) < self.per_owner

    def _take(self, owner: str) -> None:
        self._held[owner] = self._held.get(owner, 0) + 1
        self._in_use += 1

    def _drop(self, owner: str, fut: asyncio.Future[None]) -> None:
        queue = self._waiting.get(owner)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(fut)
        if not queue:
            del self._waiting[owner]

    def _grant(self) -> None:
        """Hand free slots to waiting owners, one each in round-robin order."""
        progressed = True
        while self._in_use < self.bound and self._waiting and progressed:
            progressed = False
            for owner in list(self._waiting):
                if self._in_use >= self.bound:
                    break
                if not self._free_for(owner):
                    continue
                queue = self._waiting[owner]
                fut = queue.popleft()
                if not queue:
                    del self._waiting[owner]
                else:
                    self._waiting.move_to_end(owner)  # others go first next time
                progressed = True
                if fut.done():
                    continue  # cancelled while waiting
                self._take(owner)
                fut.set_result(None)
