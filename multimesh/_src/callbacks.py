"""Host callbacks (``jax.debug.print``, ``pure_callback``, ``io_callback``) across fragments.

jax lowers a Python callback to ``stablehlo.custom_call @xla_ffi_python_cpu_callback``
(``_gpu_``, ``_partitioned_``) whose ``mhlo.backend_config = {index = i}`` points into
the program's list of host callbacks, handed to XLA at compile time. multimesh
compiles each fragment on its own, so the index alone means nothing there (XLA
called a callback that was never registered: a segfault). Instead, each callback
gets a process-wide number when the program is lowered (:func:`adopt`, same object,
same number), written into the IR beside jax's index (``mm.callback`` in the backend
config); every fragment then says which callbacks it calls, its text (the
compile-cache key) differs whenever they differ, and :func:`take` gives a fragment's
callbacks the indices ``0..k-1`` and returns them for its compile.

Ordered callbacks (``ordered=True``) thread a ``!stablehlo.token`` through the
program. multimesh cuts those chains wherever the passes may split the program
(:func:`drop_tokens`, at lowering: no token crosses a task, a fragment or the
program's signature) and threads them again per fragment at compile time
(:func:`thread_tokens`): the fragment's ordered callbacks are chained in op order and
the fragment takes and returns jax's runtime token of each ordered effect, so jax
orders it against every other ordered computation, as it orders two ``jit`` calls.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence

from multimesh._src.errors import MultimeshValueError
from multimesh._src.ir_contract import CALLBACK_KEY, MICROBATCH_ATTR, TASK_ATTR
from multimesh._src.ir_util import (
    attr_dicts,
    custom_call_target,
    select_attr_entries,
    set_attr_dicts,
)
from multimesh._src.mlir import func, ir, stablehlo, walk

__all__ = ["TARGETS", "adopt", "may_call_back", "take", "drop_tokens", "ordered",
           "thread_tokens"]

TARGETS = frozenset(f"xla_ffi{p}_python_{d}_callback"
                    for p in ("", "_partitioned") for d in ("cpu", "gpu"))
"""The custom-call targets of jax's Python callbacks (FFI form, CPU and GPU)."""

_HOST_TRANSFER = ("stablehlo.send", "stablehlo.recv")

_LOCK = threading.Lock()
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # callable -> number
_BY_NUMBER: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # number -> callable
_NEXT = itertools.count(1)
_KEY = CALLBACK_KEY  # our number, beside jax's index, in ``mhlo.backend_config``


def _number(cb: Callable) -> int:
    with _LOCK:
        n = _NUMBERS.get(cb)
        if n is None:
            n = next(_NEXT)
            _NUMBERS[cb] = n
            _BY_NUMBER[n] = cb
        return n


def _callback_ops(module: ir.Module) -> list[ir.Operation]:
    ops: list[ir.Operation] = []
    walk(module.operation, lambda o: ops.append(o) if custom_call_target(o) in TARGETS
         else None)
    return ops


def _config(op: ir.Operation) -> dict[str, ir.Attribute]:
    cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
    return {cfg[i].name: cfg[i].attr for i in range(len(cfg))}


def _set_config(op: ir.Operation, **entries: int) -> None:
    """``mhlo.backend_config`` with exactly ``entries`` (unsigned integers)."""
    op.attributes["mhlo.backend_config"] = ir.DictAttr.get(
        {k: ir.IntegerAttr.get(ir.IntegerType.get_unsigned(64), v) for k, v in entries.items()})


def adopt(module: ir.Module, callbacks: Sequence[Callable]) -> list[Callable]:
    """Give jax's ``callbacks`` (the lowered program's list) their process-wide numbers
    in ``module`` and cut its token chains (:func:`drop_tokens`), in place; returns the
    callbacks, which the caller keeps alive for as long as the program may compile
    (the registry holds them weakly)."""
    if not callbacks:  # (the common case: nothing to walk)
        return []
    with module.context:
        for op in _callback_ops(module):
            index = ir.IntegerAttr(_config(op)["index"]).value
            _set_config(op, index=index, **{_KEY: _number(callbacks[index])})
    drop_tokens(module)
    return list(callbacks)


def _check_ffi(module: ir.Module, name: str) -> None:
    """Callbacks lowered to host send/recv (jax on TPU) are bound to the whole
    program's channels and cannot be split across fragments."""
    found: list[str] = []
    walk(module.operation, lambda o: found.append(o.name) if o.name in _HOST_TRANSFER
         and "is_host_transfer" in o.attributes else None)
    if found:
        raise MultimeshValueError(
            f"Fragment `{name}` calls a Python host callback through a host transfer "
            f"(`{found[0]}`, as jax lowers jax.debug.print, pure_callback and "
            "io_callback on TPU). multimesh compiles each fragment on its own and "
            "supports host callbacks where jax lowers them to FFI calls (CPU and GPU); "
            "remove the callback or run the program with `jax.jit`.")


def may_call_back(text: str) -> bool:
    """Whether a fragment's text may hold a host callback (a substring test, so that
    fragments without one are never walked)."""
    return "_python_cpu_callback" in text or "_python_gpu_callback" in text \
        or "is_host_transfer" in text


def take(module: ir.Module, name: str) -> list[Callable]:
    """The callbacks ``module`` (one fragment) calls, renumbered ``0..k-1`` in place."""
    _check_ffi(module, name)
    ops = _callback_ops(module)
    out: list[Callable] = []
    local: dict[int, int] = {}
    with module.context:
        for op in ops:
            number = _config(op).get(_KEY)
            n = ir.IntegerAttr(number).value if number is not None else 0
            cb = _BY_NUMBER.get(n)  # numbers start at 1
            if cb is None:
                raise MultimeshValueError(
                    f"Fragment `{name}` calls a Python host callback (jax.debug.print, "
                    "pure_callback or io_callback) that this process does not hold. A "
                    "program with host callbacks compiles only through `mjit`, in the "
                    "process that traced it: a callback is a Python object, and a saved "
                    "or imported module holds only its index.")
            if n not in local:
                local[n] = len(out)
                out.append(cb)
            _set_config(op, index=local[n])
        _run_once([op for op in ops if "sdy.sharding" not in op.attributes], module)
    return out


_MESH = "mm_callback_device"


def _run_once(ops: list[ir.Operation], module: ir.Module) -> None:
    """Run each of ``ops`` once, on the fragment's first device: the maximal sharding
    that jax gives an unordered callback and none to an ordered one (``jax.jit`` allows
    those on one device only; XLA's partitioner wants a sharding on every side effect)."""
    if not ops:
        return
    module.body.append(ir.Operation.parse(f"sdy.mesh @{_MESH} = <[], device_ids=[0]>"))
    for op in ops:
        one = f"<@{_MESH}, []>"
        op.attributes["sdy.sharding"] = ir.Attribute.parse(
            f"#sdy.sharding_per_value<[{', '.join([one] * max(1, len(op.results)))}]>")


# ----------------------------------------------------------------------------
# Ordered callbacks: tokens

def _is_token(t: ir.Type) -> bool:
    return stablehlo.TokenType.isinstance(t)


def _fresh_token(before: ir.Operation) -> ir.Value:
    with ir.InsertionPoint(before), before.location:
        return stablehlo.AfterAllOp([]).result


def _funcs(module: ir.Module) -> list[ir.Operation]:
    return [o.operation for o in module.body.operations if o.operation.name == "func.func"]


def drop_tokens(module: ir.Module) -> bool:
    """Cut every ``!stablehlo.token`` edge that multimesh could split, in place (jax
    threads one per ordered effect, ``main`` included); returns whether there was any.

    ``main``, task and microbatch bodies and the functions that call them (the code
    that the passes split between tasks) lose their token arguments and results, and
    each of their ops that took a token takes a fresh ``stablehlo.after_all()``, so no
    token crosses a task, a fragment or the program's signature. Other functions (jax's
    own calls, loop bodies) keep their chains. :func:`thread_tokens` chains each
    fragment again.
    """
    split = _split_funcs(module)
    changed = False
    with module.context:
        for fn in split:
            changed |= _drop_signature_tokens(fn)
        names = {_name(fn) for fn in split}
        rebuild: list[ir.Operation] = []  # calls of split functions (anywhere), returns
        walk(module.operation, lambda o: rebuild.append(o) if _calls(o, names) else None)
        cut: list[ir.Operation] = []  # other ops of split functions that take a token
        for fn in split:
            for o in (fn.regions[0].blocks[0].operations if fn.regions[0].blocks else ()):
                op = o.operation
                if _calls(op, names) or not any(_is_token(v.type) for v in op.operands):
                    continue
                (rebuild if op.name == "func.return" else cut).append(op)
        for op in rebuild:
            changed |= _rebuild_without_tokens(op)
        for op in cut:
            changed = True
            for i, v in enumerate(list(op.operands)):
                if _is_token(v.type):
                    op.operands[i] = _fresh_token(op)
        if changed:
            _erase_dead_tokens(module)
    return changed


def _calls(op: ir.Operation, names: set[str]) -> bool:
    return (op.name == "func.call"
            and ir.FlatSymbolRefAttr(op.attributes["callee"]).value in names)


def _call_ops(fn: ir.Operation) -> list[ir.Operation]:
    calls: list[ir.Operation] = []
    walk(fn, lambda o: calls.append(o) if o.name == "func.call" else None)
    return calls


def _name(fn: ir.Operation) -> str:
    return ir.StringAttr(fn.attributes["sym_name"]).value


def _split_funcs(module: ir.Module) -> list[ir.Operation]:
    """``main``, the bodies of task and microbatch calls, and the functions that call
    any of these (the passes inline them)."""
    funcs = {_name(fn): fn for fn in _funcs(module)}
    callees: dict[str, set[str]] = {}
    split = {"main"}
    for name, fn in funcs.items():
        calls = _call_ops(fn)
        callees[name] = {ir.FlatSymbolRefAttr(c.attributes["callee"]).value for c in calls}
        split |= {ir.FlatSymbolRefAttr(c.attributes["callee"]).value for c in calls
                  if TASK_ATTR in c.attributes or MICROBATCH_ATTR in c.attributes}
    grown = True
    while grown:
        more = {n for n, cs in callees.items() if cs & split} - split
        split |= more
        grown = bool(more)
    return [funcs[n] for n in funcs if n in split]


def _erase_dead_tokens(module: ir.Module) -> None:
    for fn in _funcs(module):
        for block in fn.regions[0].blocks:
            for op in [o.operation for o in block.operations]:
                if (op.name == "stablehlo.after_all" and not list(op.operands)
                        and not list(op.results[0].uses)):
                    op.erase()


def _drop_signature_tokens(fn: ir.Operation) -> bool:
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    keep_in = [i for i, t in enumerate(ftype.inputs) if not _is_token(t)]
    keep_out = [i for i, t in enumerate(ftype.results) if not _is_token(t)]
    if len(keep_in) == len(ftype.inputs) and len(keep_out) == len(ftype.results):
        return False
    if fn.regions[0].blocks:
        body = fn.regions[0].blocks[0]
        first = list(body.operations)[0]
        for i in reversed(range(len(ftype.inputs))):
            if i not in keep_in:
                arg = body.arguments[i]
                if list(arg.uses):
                    arg.replace_all_uses_with(_fresh_token(first))
                body.erase_argument(i)
    fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        [ftype.inputs[i] for i in keep_in], [ftype.results[i] for i in keep_out]))
    select_attr_entries(fn, "arg_attrs", keep_in)
    select_attr_entries(fn, "res_attrs", keep_out)
    return True


def _rebuild_without_tokens(op: ir.Operation) -> bool:
    """A ``func.call`` or ``func.return`` without its token operands and results; a
    token result that is still used gets a fresh token. Returns whether it had any."""
    operands = [v for v in op.operands if not _is_token(v.type)]
    if len(operands) == len(op.operands) and not any(_is_token(r.type) for r in op.results):
        return False
    with ir.InsertionPoint(op), op.location:
        if op.name == "func.return":
            func.ReturnOp(operands)
            op.erase()
            return True
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"])
        new = func.CallOp([r.type for r in op.results if not _is_token(r.type)], callee,
                          operands).operation
    for name in _attr_names(op):
        if name not in ("callee", "arg_attrs", "res_attrs"):
            new.attributes[name] = op.attributes[name]
    results = iter(new.results)
    for r in op.results:
        if not _is_token(r.type):
            r.replace_all_uses_with(next(results))
        elif list(r.uses):
            r.replace_all_uses_with(_fresh_token(op))
    op.erase()
    return True


def _attr_names(op: ir.Operation) -> list[str]:
    return [a if isinstance(a, str) else a.name for a in op.attributes]


def ordered(module: ir.Module) -> bool:
    """Whether ``module`` (one fragment) has an ordered callback: one that takes a
    token (after :func:`drop_tokens`, a fresh one or one from a loop's chain)."""
    return any(any(_is_token(v.type) for v in op.operands) for op in _callback_ops(module))


def thread_tokens(module: ir.Module, n: int) -> None:
    """Give the fragment's ``main`` ``n`` leading token arguments and results (jax's
    form for ``n`` ordered effects, ``jax.token``) and chain every op of its body that
    takes a token, in op order, from them to the results: the fragment's ordered
    callbacks run in program order, after those of every earlier call that took the
    same tokens."""
    with module.context:
        main = next(f for f in _funcs(module)
                    if ir.StringAttr(f.attributes["sym_name"]).value == "main")
        main = _prepend_tokens(main, n)
        body = main.regions[0].blocks[0]
        ops = [o.operation for o in body.operations]
        with ir.InsertionPoint(ops[0]), ops[0].location:
            cur = stablehlo.AfterAllOp(list(body.arguments)[:n]).result
        for op in ops[:-1]:
            took = [i for i, v in enumerate(op.operands) if _is_token(v.type)]
            for i in took:
                op.operands[i] = cur
            if took:  # (a fresh token that nothing takes yet starts no chain)
                cur = next((r for r in op.results if _is_token(r.type)), cur)
        ret = ops[-1]
        with ir.InsertionPoint(ret), ret.location:
            # one token op per result: XLA outputs may not share a buffer
            func.ReturnOp([stablehlo.AfterAllOp([cur]).result for _ in range(n)]
                          + list(ret.operands))
        ret.erase()


def _prepend_tokens(main: ir.Operation, n: int) -> ir.Operation:
    """``main`` rebuilt with ``n`` token arguments and results first (MLIR's Python
    API cannot insert a block argument, so the body moves into a new function)."""
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    token = stablehlo.TokenType.get()
    marker: dict[str, ir.Attribute] = {"jax.token": ir.BoolAttr.get(True)}
    args, results = attr_dicts(main, "arg_attrs"), attr_dicts(main, "res_attrs")
    with ir.InsertionPoint(main), main.location:
        new = func.FuncOp("main", ir.FunctionType.get(
            [token] * n + list(ftype.inputs), [token] * n + list(ftype.results))).operation
    for name in _attr_names(main):
        if name not in ("function_type", "arg_attrs", "res_attrs"):
            new.attributes[name] = main.attributes[name]
    set_attr_dicts(new, "arg_attrs", [marker] * n + args)
    set_attr_dicts(new, "res_attrs", [marker] * n + results)
    old = main.regions[0].blocks[0]
    types = [token] * n + list(ftype.inputs)
    body = new.regions[0].blocks.append(*types, arg_locs=[main.location] * len(types))
    for i, arg in enumerate(old.arguments):
        arg.replace_all_uses_with(body.arguments[n + i])
    for op in [o.operation for o in old.operations]:
        body.append(op)
    main.erase()
    return new
