"""``enable_fast_path``: a program that is one plain SPMD computation goes through ``jax.jit``.

MultiMesh compiles a program that partitions into a single SPMD task without any
MultiMesh construct straight with the base client. Here the same holds: when the
traced program has no task call, no registered-task match, no logical constraint
and no microbatch loop, it is exactly one computation on the program's devices
(the implicit ``mm.default`` task), so ``mjit`` compiles it with ``jax.jit``
instead of running the pass pipeline and dispatching it through the MPMD runtime.
Placement is the one the MPMD path gives such a program: inputs replicated on all
the program's devices unless the caller pinned them (physical input shardings,
``_inputs``), outputs replicated when no input is sharded. The compiled object has
``fast_path = True``; ``with enable_fast_path(False):`` turns it off.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src.errors import MultimeshValueError
from multimesh._src.ir_contract import LOGICAL_TARGET, TASK_ATTR
from multimesh._src.ir_util import custom_call_target
from multimesh._src.jax_compat import is_committed
from multimesh._src.mlir import ir
from multimesh.jax import _contexts
from multimesh.jax._analysis.costs import NO_TASKS
from multimesh.jax._stages.call_convention import CallConvention
from multimesh.jax._stages.compiled import MemoryAnalysis, MpmdCompiled
from multimesh.jax._stages.stage import LoweredProgram, ProgramStage, forward
from multimesh.jax._trace_notes import TraceNotes
from multimesh.runtime.steps import layout_sharding
from multimesh.runtime.trace import TraceRecorder

__all__ = ["eligible", "FastPath", "FastCompiled"]

_TASK_CALL = re.compile(rf"\b{re.escape(TASK_ATTR)} = \{{")
_MARKER = re.compile(rf"@{re.escape(LOGICAL_TARGET)}\b")


def eligible(program, implicit, notes: TraceNotes, pins: dict, num_devices: int) -> bool:
    """Whether the lowered program (its text, or the parsed module: then it is walked,
    not printed; inputs already pinned) is one plain SPMD computation that ``jax.jit``
    can compile as is."""
    if not _contexts.state.fast_path or implicit or notes.microbatch is not None:
        return False
    if isinstance(program, str):
        if _TASK_CALL.search(program) or _MARKER.search(program):
            return False
    elif _has_task_or_marker(program):
        return False
    # One jax.jit executable: every pinned input on one mesh over the program's devices.
    meshes = {tuple(lay[:3]) for lay in pins.values()}
    return len(meshes) <= 1 and all(m[0] == tuple(range(num_devices)) for m in meshes)


def _has_task_or_marker(module) -> bool:
    """Whether any op carries ``mm.task`` or is a ``@mm.logical_sharding`` marker."""
    found = []

    def cb(op):
        attrs = op.attributes
        if len(attrs) and (TASK_ATTR in attrs
                           or custom_call_target(op) == LOGICAL_TARGET):
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    module.operation.walk(cb, ir.WalkOrder.PRE_ORDER)
    return bool(found)


@dataclasses.dataclass(frozen=True, slots=True)
class FastPath:
    """What ``MpmdLowered.compile`` needs, beside its record, to build the ``jax.jit``
    executable."""

    jaxpr: Any
    """The closed jaxpr over the flat dynamic leaves."""
    abstract_leaves: list
    pins: dict
    text: str
    """The program as ``jax.jit`` compiles it (``FastCompiled.as_text``)."""

    def compile(self, rec: LoweredProgram) -> FastCompiled:
        devices = rec.devices
        if self.pins:  # the pinned inputs' mesh (one, see eligible)
            pos, names, sizes, _ = next(iter(self.pins.values()))
            mesh = Mesh(np.array([devices[p] for p in pos], dtype=object).reshape(sizes),
                        names)
        else:
            names, sizes = rec.default_mesh or (("x",), (len(devices),))
            mesh = Mesh(np.array(devices, dtype=object).reshape(sizes), names)
        replicated = NamedSharding(mesh, PartitionSpec())
        in_sh = tuple(layout_sharding(self.pins[i], devices) if i in self.pins
                      else replicated for i in range(len(self.abstract_leaves)))
        # The program as traced for the MPMD path: no second trace of the user's code.
        flat = jaxpr_as_fun(self.jaxpr)

        # Without a sharded input every value is replicated, as on the MPMD path (the
        # implicit task has no logical mapping); otherwise jax propagates from the inputs.
        out_sh = replicated if not self.pins else None
        jitted = jax.jit(flat, in_shardings=in_sh, out_shardings=out_sh,
                         donate_argnums=rec.donated_leaves, keep_unused=True)
        # (The only logical markers left are those of physical in_shardings; outside
        # mjit's trace they lower to identities.)
        lowered = jitted.lower(*self.abstract_leaves)
        return FastCompiled(rec, self.text, lowered.compile(), in_sh)


class FastCompiled(ProgramStage):
    """A program compiled by ``jax.jit`` on the fast path; used like ``MpmdCompiled``."""

    fast_path = True
    _jax_class = MpmdCompiled._jax_class
    _not_offered = MpmdCompiled._not_offered

    def __init__(self, record: LoweredProgram, text: str, compiled, in_shardings):
        self.record = record
        self._text = text
        self._compiled = compiled
        self.convention = CallConvention.for_jit(record, in_shardings, _place)
        """How a call's arguments become ``jax.jit``'s, and its outputs results."""
        self.input_shardings = self.convention.input_shardings(in_shardings)
        self.output_shardings = self.convention.output_shardings(compiled.output_shardings)
        self.fragments: list = []
        self.transfers: list = []
        self.schedule = None
        self.last_trace: TraceRecorder | None = None
        """The trace of the last ``profile`` (None before one)."""

    out_placements = forward("record", "out_placements",
                             "Output leaf -> the physical ``out_shardings`` entry it is moved onto.")

    def __call__(self, *args, **kwargs):
        conv = self.convention
        return conv.results(self._compiled(*conv.inputs(args, kwargs)))

    def as_text(self) -> str:
        """The program as ``jax.jit`` compiled it (StableHLO before XLA)."""
        return self._text

    def plan(self) -> str:
        ids = [d.id for d in self.record.devices]
        return f"multimesh fast path: one jax.jit executable on devices {ids}"

    def cost_analysis(self, *, by_fragment: bool = False) -> dict:
        """XLA's cost estimates of the one executable (``by_fragment=True``: under the
        name ``"main"``, as ``MpmdCompiled`` gives one entry per fragment)."""
        ca = self._compiled.cost_analysis()
        out = dict(ca[0] if isinstance(ca, (list, tuple)) else ca or {})
        return {"main": out} if by_fragment else out

    def memory_analysis(self, *, by_fragment: bool = False):
        """XLA's memory estimates of the one executable (see ``cost_analysis``)."""
        stats = self._compiled.memory_analysis()
        return {"main": stats} if by_fragment else MemoryAnalysis.total([stats])

    def memory_profile(self, *args, **kwargs):
        """Refused: a program without tasks has no submeshes to measure."""
        raise MultimeshValueError(NO_TASKS)

    step_profile = memory_profile

    def profile(self, *args, trace_path=None, **kwargs):
        """Run once synchronously, as one span (see ``MpmdCompiled.profile``)."""
        rec = TraceRecorder()
        ids = ",".join(str(d.id) for d in self.record.devices)
        with rec.span(f"submesh 0 (devices {ids})", "fast_path"):  # as MPMD traces name it
            out = jax.block_until_ready(self(*args, **kwargs))
        if trace_path is not None:
            rec.write(trace_path)
        self.last_trace = rec
        return out


def _place(x, sharding):
    """``x`` on ``sharding`` unless it is there already (jit moves uncommitted values)."""
    if is_committed(x) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x
