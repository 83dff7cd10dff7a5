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

import jax

from multimesh._src import jax_compat

__all__ = ["CacheInfo", "CachesInfo", "LRUCache", "ProgramCaches", "WeakKeyCache",
           "cache_info", "clear_caches"]


class CacheInfo(NamedTuple):
    """Hits, misses, bound and size of one cache (as ``functools.lru_cache``'s)."""

    hits: int
    misses: int
    maxsize: int | None
    currsize: int


def _sum(infos) -> CacheInfo:
    infos = list(infos)
    sizes = [i.maxsize for i in infos]
    return CacheInfo(sum(i.hits for i in infos), sum(i.misses for i in infos),
                     None if None in sizes else sum(s for s in sizes if s is not None),
                     sum(i.currsize for i in infos))


class CachesInfo(NamedTuple):
    """:func:`multimesh.jax.cache_info`: multimesh's two kinds of compile cache."""

    programs: CacheInfo
    """The programs every live ``mjit`` function compiled (one per argument types and
    context), summed over the functions."""
    fragments: CacheInfo
    """Compiled fragments (XLA executables), shared by every program."""


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every LRUCache, for cache_info()


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
        _LIVE.add(self)

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


def _kind(cache: LRUCache) -> str | None:
    """Which field of :class:`CachesInfo` a cache counts in, by what it holds."""
    for kind in CachesInfo._fields:
        if kind in cache.for_what:
            return kind
    return None


def cache_info() -> CachesInfo:
    """Hits, misses and sizes of multimesh's compile caches, as :class:`CachesInfo`.

    ``programs`` sums the caches of every ``mjit`` function still alive;
    ``fragments`` is the cache of compiled fragments they share. jax's own caches
    are not counted (each fragment is also in jax's, as a ``jax.jit`` is).
    """
    live = list(_LIVE)
    return CachesInfo(*(_sum(c.cache_info() for c in live if _kind(c) == kind)
                        for kind in CachesInfo._fields))


class ProgramCaches:
    """``cache_info()``/``clear_cache()`` of an ``mjit`` function (like ``jax.jit``'s
    ``clear_cache``): over the :class:`LRUCache` attributes named in ``_program_caches``."""

    _program_caches: tuple[str, ...] = ("_cache",)

    def _caches(self) -> list[LRUCache]:
        return [c for c in (getattr(self, n, None) for n in self._program_caches)
                if c is not None]

    def cache_info(self) -> CacheInfo:
        """Hits, misses and size of the programs this function compiled."""
        return _sum(c.cache_info() for c in self._caches())

    def clear_cache(self) -> None:
        """Forget the programs this function compiled; the next call compiles again.

        Compiled fragments stay in the shared cache (:func:`clear_caches` empties it).
        """
        for c in self._caches():
            c.cache_clear()


def clear_caches() -> None:
    """Empty every multimesh cache and jax's own (:func:`jax.clear_caches`).

    Compiled programs you still hold keep working; the next call of an ``mjit``
    function traces and compiles again.
    """
    jax.clear_caches()  # clears every registered cache, ours included
