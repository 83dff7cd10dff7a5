"""multimesh's in-memory caches, registered with jax's cache management.

Every cache here is an :class:`LRUCache` registered with jax, so
:func:`jax.clear_caches` (and :func:`clear_caches`, which calls it) empties all
of them along with jax's own: compiled fragments, the programs each ``mjit``
function compiled, and anything else built on this class.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, NamedTuple

from multimesh._src import jax_compat

__all__ = ["LRUCache", "WeakKeyCache", "clear_caches"]


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int | None
    currsize: int


class LRUCache:
    """A thread-safe mapping that keeps the ``max_size`` most recently used entries.

    ``cache_clear``/``cache_info`` follow ``functools.lru_cache``, which is what jax's
    cache registry expects. ``max_size=None`` never evicts.
    """

    def __init__(self, for_what: str, max_size: int | None = 256):
        self.for_what = for_what
        self.max_size = max_size
        self._data: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        # jax holds registered caches weakly: the registration lasts as long as we do.
        jax_compat.register_cache(self, for_what)

    def get(self, key, default=None) -> Any:
        with self._lock:
            try:
                value = self._data[key]
            except KeyError:
                self._misses += 1
                return default
            self._data.move_to_end(key)
            self._hits += 1
            return value

    def __setitem__(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if self.max_size is not None:
                while len(self._data) > self.max_size:
                    self._data.popitem(last=False)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list:
        """The cached values, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._data.values())

    def cache_clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._hits = self._misses = 0

    clear = cache_clear

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, self.max_size, len(self._data))

    def __repr__(self):
        return f"LRUCache({self.for_what!r}, {len(self._data)}/{self.max_size})"


class WeakKeyCache(weakref.WeakKeyDictionary):
    """A ``WeakKeyDictionary`` (entries go with their key) that jax can also clear."""

    def __init__(self, for_what: str):
        super().__init__()
        self.for_what = for_what
        jax_compat.register_cache(self, for_what)

    def __hash__(self):  # jax's registry is a WeakKeyDictionary too: hash by identity
        return id(self)

    def __eq__(self, other):
        return self is other

    def cache_clear(self) -> None:
        self.clear()

    def cache_info(self) -> CacheInfo:
        return CacheInfo(0, 0, None, len(self))


def clear_caches() -> None:
    """Empty every multimesh cache and jax's own (:func:`jax.clear_caches`).

    Compiled programs you still hold keep working; the next call of an ``mjit``
    function traces and compiles again.
    """
    import jax

    jax.clear_caches()  # clears every registered cache, ours included
