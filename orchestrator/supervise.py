"""Background tasks that outlive their own mistakes.

`supervised(name, factory)` runs `factory()` and, when it raises anything but
cancellation, logs the exception and starts it again after a short pause that
doubles up to a ceiling; a task that returns normally is done. The gateway's
reaper and heartbeats run this way, so one bad pass never ends them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

FIRST_PAUSE = 1.0
MAX_PAUSE = 60.0


async def supervised(
    name: str,
    factory: Callable[[], Awaitable[None]],
    *,
    first_pause: float = FIRST_PAUSE,
    max_pause: float = MAX_PAUSE,
) -> None:
    pause = first_pause
    while True:
        try:
            await factory()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("background task %s failed; restarting in %.1f s", name, pause)
        await asyncio.sleep(pause)
        pause = min(max_pause, pause * 2)
