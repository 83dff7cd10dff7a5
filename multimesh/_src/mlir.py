"""The one place that imports jaxlib's MLIR bindings.

Every other module gets ``ir``, ``passmanager`` and the dialects from here, so
a jaxlib upgrade touches one file. Helpers here are tiny and generic; anything
that knows about multimesh's IR contract lives in ``multimesh.passes``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np
from jax.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import func, mpmd, sdy, stablehlo

from multimesh._src.brackets import line_col
from multimesh._src.jax_compat import fresh_ir_context

__all__ = [
    "ir", "passmanager", "func", "mpmd", "sdy", "stablehlo",
    "make_context", "reused_context", "parse_module", "zero_sub_axis", "sub_axis_at", "print_module",
    "module_bytecode", "clone_module", "unchanged_on_error", "probe_bytecode",
    "walk", "top_level_ops", "str_attr", "int_attr", "dict_attr",
    "get_attr", "set_attr", "del_attr", "location_of", "file_line_col",
    "symbol_table", "attr_to_py", "py_to_attr", "element_dtype",
]


def make_context() -> ir.Context:
    """A fresh context with every dialect jax emits (func, stablehlo, sdy, mhlo, ...).

    Multithreading is off: some malformed inputs make the threaded parser hang
    (found by fuzzing); our passes are module-level Python anyway.
    """
    ctx = fresh_ir_context()
    ctx.enable_multithreading(False)
    return ctx


_REUSES = 10  # callers one thread's context serves before it is replaced
_THREAD = threading.local()


def reused_context() -> ir.Context:
    """:func:`make_context`, but one context per thread serves up to 10 callers, as jax
    >= 0.11's own lowering hands its context out: making one costs 3-10 ms (every
    dialect registered), and a compile parses every fragment it compiles or loads. For
    modules dropped once used (a fragment, once compiled): a context keeps what its
    modules uniqued (attributes, types) until it goes, so it is replaced after 10 uses,
    and a program that keeps its module (the lowered program) takes a context of its
    own, freed with it. A thread's context is its own (multithreading is off)."""
    got = getattr(_THREAD, "context", None)
    if got is None or got[1] >= _REUSES:
        got = _THREAD.context = [make_context(), 0]
    got[1] += 1
    return got[0]


def probe_bytecode(data: bytes, patience_s: float = 60.0) -> str | None:
    """Why MLIR's bytecode reader cannot read ``data`` without harm, or None.

    The reader trusts the sizes and offsets it reads: damaged bytecode (a byte deleted)
    can crash it (SIGSEGV, found by bytecode fuzzing) or make LLVM raise an error that is
    no diagnostic ("SmallVector unable to grow"). So bytecode is parsed first in a
    forked child, single-threaded, which only parses and exits; the parent parses it
    only if the child came back. The child touches nothing but MLIR's parser (no XLA,
    no imports), so jax's warning about forking a multithreaded process is silenced; a
    child that does not come back within ``patience_s`` (a lock another thread held at
    the fork, or a very large module) is killed, and the parent parses as before.
    """
    if not hasattr(os, "fork"):
        return None
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        pid = os.fork()
    if pid == 0:  # the child: parse, say how it went, exit without cleanup
        os.close(read)
        code, message = 0, b""
        try:
            ctx = make_context()
            ctx.enable_multithreading(False)
            with ctx:
                ir.Module.parse(data)
        except ir.MLIRError:
            pass  # diagnostics: the parent's own parse reports them
        except BaseException as e:  # noqa: BLE001 - what the probe is for
            code, message = 3, f"{type(e).__name__}: {e}".encode(errors="replace")[:2000]
        os.write(write, message)
        os._exit(code)
    os.close(write)
    deadline = time.monotonic() + patience_s
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.002)
        reason = os.read(read, 4096).decode(errors="replace")
    finally:
        os.close(read)
    if os.WIFSIGNALED(status):
        return (f"MLIR's bytecode reader crashes on it "
                f"({signal.Signals(os.WTERMSIG(status)).name}); the bytecode is damaged")
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
        return f"MLIR's bytecode reader fails on it ({reason})"
    return None


def parse_module(text: str | bytes, context: ir.Context | None = None) -> ir.Module:
    """Parse ``text``; a size-0 sub-axis in an mpmd type raises instead of killing us."""
    if isinstance(text, str) and (offset := zero_sub_axis(text)) is not None:
        line, col = line_col(text, offset)
        raise ValueError(f"Unable to parse module assembly: {line}:{col}: sub-axis sizes must "
                         f"be greater than 1, got {sub_axis_at(text, offset)}.")
    ctx = context or make_context()
    with ctx:
        return ir.Module.parse(text)


# A Shardy sub-axis, ``"x":(pre-size)size``, inside a ``!mpmd.mesh_tensor`` type.
_SUB_AXIS = re.compile(r'"[^"\n]*"\s*:\s*\(\s*\d+\s*\)\s*(\d+)')


def sub_axis_at(text: str, offset: int) -> str:
    """The sub-axis text (``"x":(1)0``) that :func:`zero_sub_axis` found at ``offset``."""
    return text[offset:].split("]", 1)[0].split("}", 1)[0]


def zero_sub_axis(text: str) -> int | None:
    """Offset of the first sub-axis of size 0 in an mpmd type, or None.

    jaxlib's mpmd dialect divides by a sub-axis size while it parses an
    ``!mpmd.mesh_tensor``, before Shardy's verifier rejects sizes below 2, so a size of
    0 kills the process (SIGFPE; found by fuzzing). Plain ``sdy`` attributes are
    verified first and fail cleanly, so only text with mpmd types is scanned.
    """
    if "mpmd.mesh_tensor" not in text:
        return None
    for m in _SUB_AXIS.finditer(text):
        if int(m[1]) == 0:
            return m.start()
    return None


def print_module(module: ir.Module | ir.Operation, *, debug_info: bool = False,
                 generic: bool = False) -> str:
    op = module.operation if isinstance(module, ir.Module) else module
    # str(): the bindings type get_asm as object (it returns bytes with binary=True)
    return str(op.get_asm(enable_debug_info=debug_info, print_generic_op_form=generic))


def module_bytecode(module: ir.Module | ir.Operation) -> bytes:
    """The module as MLIR bytecode (what ``mlir-opt --emit-bytecode`` writes)."""
    op = module.operation if isinstance(module, ir.Module) else module
    buf = io.BytesIO()
    op.write_bytecode(buf)
    return buf.getvalue()


def clone_module(module: ir.Module) -> ir.Module:
    """A deep copy in the *same* context (jax's ``compiler_ir()`` is cached and shared)."""
    with module.context:
        return ir.Module.parse(str(module.operation.get_asm(enable_debug_info=True,
                                                             print_generic_op_form=True)))


@contextlib.contextmanager
def unchanged_on_error(module: ir.Module) -> Iterator[None]:
    """Run the body; if it raises, put ``module`` back as it was before.

    The snapshot is a C++-side clone of the module (about 0.4 µs an op, a tenth of
    printing it), so every pass can afford one. On failure the module's body and
    attributes are replaced by the snapshot's: the ``ir.Module`` object stays the
    same, and handles to ops inside it from before the failure are invalid.
    """
    snapshot = module.operation.clone()
    try:
        yield
    except BaseException:
        _restore(module, snapshot)
        raise


def _restore(module: ir.Module, snapshot: ir.Operation) -> None:
    with module.context:
        body = module.body
        for op in reversed(list(body.operations)):  # users before producers
            op.operation.erase()
        for op in list(snapshot.regions[0].blocks[0].operations):
            body.append(op.operation)
        attrs = module.operation.attributes
        for name in [attrs[i].name for i in range(len(attrs))]:
            del attrs[name]
        saved = snapshot.attributes
        for i in range(len(saved)):
            attrs[saved[i].name] = saved[i].attr


def walk(op: ir.Operation, fn: Callable[[ir.Operation], None], *,
         pre_order: bool = True) -> None:
    """Call ``fn`` on every op nested in ``op`` (``op`` included)."""

    def cb(o):
        fn(o)
        return ir.WalkResult.ADVANCE

    order = ir.WalkOrder.PRE_ORDER if pre_order else ir.WalkOrder.POST_ORDER
    op.walk(cb, order)


def top_level_ops(block: ir.Block) -> list[ir.Operation]:
    return [o.operation for o in block.operations]


def str_attr(s: str) -> ir.Attribute:
    return ir.StringAttr.get(s)


def int_attr(i: int, bits: int = 64) -> ir.Attribute:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(bits), int(i))


def dict_attr(d: dict) -> ir.Attribute:
    return ir.DictAttr.get({k: py_to_attr(v) for k, v in d.items()})


def py_to_attr(v) -> ir.Attribute:
    """Python value -> builtin attribute (str, bool, int, float, list/tuple, dict)."""
    if isinstance(v, ir.Attribute):
        return v
    if isinstance(v, bool):
        return ir.BoolAttr.get(v)
    if isinstance(v, str):
        return ir.StringAttr.get(v)
    if isinstance(v, int):
        return int_attr(v)
    if isinstance(v, float):
        return ir.FloatAttr.get(ir.F64Type.get(), v)
    if isinstance(v, dict):
        return dict_attr(v)
    if isinstance(v, (list, tuple)):
        return ir.ArrayAttr.get([py_to_attr(x) for x in v])
    raise TypeError(f"Cannot convert {v!r} of type {type(v).__name__} to an MLIR attribute.")


def attr_to_py(a: ir.Attribute):
    """Builtin attribute -> Python value; the inverse of :func:`py_to_attr`."""
    a = a.maybe_downcast() if hasattr(a, "maybe_downcast") else a
    if isinstance(a, ir.StringAttr):
        return a.value
    if isinstance(a, ir.BoolAttr):
        return a.value
    if isinstance(a, ir.IntegerAttr):
        return a.value
    if isinstance(a, ir.FloatAttr):
        return a.value
    if isinstance(a, (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr)):
        return list(a)
    if isinstance(a, ir.ArrayAttr):
        return [attr_to_py(x) for x in a]
    if isinstance(a, ir.DictAttr):
        return {na.name: attr_to_py(na.attr) for na in (a[i] for i in range(len(a)))}
    return a


def get_attr(op: ir.Operation, name: str, default=None):
    return op.attributes[name] if name in op.attributes else default


def set_attr(op: ir.Operation, name: str, value) -> None:
    op.attributes[name] = py_to_attr(value)


def del_attr(op: ir.Operation, name: str) -> None:
    if name in op.attributes:
        del op.attributes[name]


def symbol_table(module: ir.Module) -> ir.SymbolTable:
    return ir.SymbolTable(module.operation)


_LOC_RE = re.compile(r'loc\("?([^"]*?)"?:(\d+):(\d+)')
_FLC_RE = re.compile(r'"([^"]+)":(\d+):(\d+)')


def file_line_col(loc: ir.Location | None) -> tuple[str, int, int] | None:
    """The first ``file:line:col`` inside a (possibly fused/named/callsite) location."""
    if loc is None:
        return None
    m = _FLC_RE.search(str(loc))
    if not m:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3))


def location_of(op: ir.Operation) -> ir.Location:
    return op.location


def iter_funcs(module: ir.Module) -> Iterable[ir.Operation]:
    for op in module.body.operations:
        if op.operation.name == "func.func":
            yield op.operation


# numpy's own dtypes first: ``i1`` is ``bool``, not ml_dtypes' ``int1``.
_NUMPY_DTYPES: tuple[type[np.generic], ...] = (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)


@functools.cache
def _element_dtypes() -> dict[str, np.dtype]:
    """MLIR element type name (``f32``, ``complex<f32>``, ``f8E4M3FN``, ``i4``) -> dtype.

    Derived from jax's own lowering of every numpy and ml_dtypes scalar type, so a
    dtype that ``jax.jit`` lowers has an entry without anyone listing it here.
    """
    extra: list[type[np.generic]] = [t for t in vars(ml_dtypes).values()
                                     if isinstance(t, type) and issubclass(t, np.generic)]
    table: dict[str, np.dtype] = {}
    with make_context():
        for t in (*_NUMPY_DTYPES, *extra):
            dtype = np.dtype(t)
            try:
                name = str(jax_mlir.dtype_to_ir_type(dtype))
            except TypeError:  # ml_dtypes types that jax does not lower (complex32)
                continue
            table.setdefault(name, dtype)
    return table


def element_dtype(name: str) -> np.dtype:
    """The numpy dtype of an MLIR tensor element type, by its printed name."""
    try:
        return _element_dtypes()[name]
    except KeyError:
        raise ValueError(
            f"No numpy dtype for the MLIR element type {name!r}; known element types: "
            f"{', '.join(sorted(_element_dtypes()))}.") from None
