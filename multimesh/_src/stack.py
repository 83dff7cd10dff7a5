"""Running MLIR work on a thread with a big stack.

MLIR's parser, verifier, printer and walks recurse once per nesting level; on the main
thread's 8 MiB stack a module nested ~5,000 deep crashes the process. ``mm-opt`` and
``compile_mpmd`` therefore run deeply nested inputs on a thread whose stack is
:data:`STACK_BYTES` (reserved, not committed), and refuse inputs deeper than
``multimesh._src.ir_attrs.MAX_NESTING``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["STACK_BYTES", "on_big_stack"]

STACK_BYTES = 512 << 20

T = TypeVar("T")


def on_big_stack(fn: Callable[[], T], name: str = "multimesh") -> T:
    """``fn()`` on a thread with a :data:`STACK_BYTES` stack: its result, or its
    exception re-raised here. Runs ``fn`` here where stacks cannot be sized."""
    result: list = []
    error: list[BaseException] = []

    def target():
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            error.append(e)

    old = threading.stack_size()
    try:
        threading.stack_size(STACK_BYTES)
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()  # the stack size applies to threads started while it is set
    except (ValueError, RuntimeError):  # platform without settable stacks: run here
        return fn()
    finally:
        threading.stack_size(old)
    while t.is_alive():
        t.join(0.1)
    if error:
        raise error[0].with_traceback(error[0].__traceback__)
    return result[0]
