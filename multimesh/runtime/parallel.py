"""Compile independent fragments on a bounded pool of threads.

XLA releases the GIL while it compiles, so fragments compile concurrently on a host
with several cores. ``$MULTIMESH_COMPILE_THREADS`` bounds the pool (default: the CPUs
this process may use); ``1`` compiles serially, in the calling thread. Results come
back in the order of the inputs, and an error is the one serial compilation would
raise first, so the number of threads changes how long a compile takes, nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from multimesh._src import jax_compat
from multimesh._src.errors import MultimeshValueError

__all__ = ["THREADS_ENV", "compile_threads", "map_ordered"]

THREADS_ENV = "MULTIMESH_COMPILE_THREADS"

_T = TypeVar("_T")
_R = TypeVar("_R")


def compile_threads() -> int:
    """Threads that compile fragments: ``$MULTIMESH_COMPILE_THREADS``, or the CPU count."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        affinity = getattr(os, "sched_getaffinity", None)
        return max(1, len(affinity(0)) if affinity else (os.cpu_count() or 1))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise MultimeshValueError(
            f"{THREADS_ENV} must be a positive whole number of threads, got {raw!r}; for "
            f"example {THREADS_ENV}=4, or {THREADS_ENV}=1 to compile fragments serially.")
    return value


def map_ordered(fn: Callable[[_T], _R], items: Sequence[_T],
                threads: int | None = None) -> list[_R]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads, in the caller's jax config.

    The first item (in order) whose call raises raises here, as in the serial loop;
    items not yet started are cancelled.
    """
    threads = compile_threads() if threads is None else threads
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    enter = jax_compat.in_config_of_caller()

    def run(x: _T) -> _R:
        with enter():
            return fn(x)

    pool = ThreadPoolExecutor(max_workers=min(threads, len(items)),
                              thread_name_prefix="multimesh-compile")
    try:
        futures = [pool.submit(run, x) for x in items]
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
