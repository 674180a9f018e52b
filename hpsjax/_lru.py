"""A small cache of built objects that keeps the most recently used."""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any


class LruCache:
    """Objects built once per key, the ``size`` most recently used kept.

    Examples:
      >>> cache = LruCache(2)
      >>> cache.get("a", lambda: [1]) is cache.get("a", lambda: [2])
      True
    """

    def __init__(self, size: int):
        self._size = size
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The object kept under ``key``, or ``build()`` kept there now; an
        unhashable key builds afresh and keeps nothing."""
        try:
            hit = self._items.get(key)
        except TypeError:
            return build()
        if hit is None:
            hit = self._items[key] = build()
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return hit
