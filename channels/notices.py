"""Once per chat per window (R4): a channel's notices and help text never flood.

`OncePerWindow.due(chat_id, now, every)` is True at most once per `every`
seconds for a chat; it remembers the newest `max_chats` chats only, so a
flood of distinct chats costs bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_CHATS = 4096


class OncePerWindow:
    def __init__(self, max_chats: int = MAX_CHATS) -> None:
        self._last: OrderedDict[str, float] = OrderedDict()
        self._max = max_chats

    def due(self, chat_id: str, now: float, every: float) -> bool:
        last = self._last.get(chat_id)
        if last is not None and now - last < every:
            return False
        self._last[chat_id] = now
        self._last.move_to_end(chat_id)
        while len(self._last) > self._max:
            self._last.popitem(last=False)
        return True
