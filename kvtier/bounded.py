"""The one bounded cache kvtier's caches are made of.

Each holds values that are pure functions of their keys (docs/design.md lists every one:
its key, what invalidates it, its bound, what a stale entry would do), so an entry can be
dropped at any time and made again. Past the bound the oldest entry goes (first in, first
out: a lookup takes no lock and moves nothing, which is what a hot path can afford; a key
in use and dropped is made again on its next call). Safe from several threads: a lookup is
one dict read, an insertion is one locked step, and a value made twice by two threads at
once is the same value.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Hashable, TypeVar

V = TypeVar("V")


class Bounded:
    """At most ``bound`` entries, the oldest dropped first."""

    __slots__ = ("bound", "_entries", "_lock", "get")

    def __init__(self, bound: int):
        self.bound = bound
        self._entries: Dict[Hashable, object] = {}
        self._lock = threading.Lock()
        self.get = self._entries.get        # ``get(key)``: the value or None; one dict read

    def put(self, key: Hashable, value: V) -> V:
        """Keep ``value`` under ``key``, dropping the oldest entries past the bound."""
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = value
            while len(self._entries) > self.bound:
                del self._entries[next(iter(self._entries))]
        return value

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value under ``key``, else ``make()``'s, kept."""
        value = self._entries.get(key)
        return value if value is not None else self.put(key, make())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def items(self) -> list:
        with self._lock:
            return list(self._entries.items())

    def values(self) -> list:
        with self._lock:
            return list(self._entries.values())
