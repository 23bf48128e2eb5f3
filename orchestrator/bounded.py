"""`LruMap`: a map that keeps only its newest `size` keys.

Every in-memory map that grows with strangers (rate buckets, turn outcomes,
retry counts, delivery receipts) is one of these, so none grows without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LruMap(Generic[K, V]):
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
