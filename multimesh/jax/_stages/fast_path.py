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

import re

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src.ir_contract import LOGICAL_TARGET, TASK_ATTR
from multimesh.jax import _contexts
from multimesh.jax._stages.call_checks import check_call
from multimesh.jax._stages.compiled import MemoryAnalysis, MpmdCompiled, missing_attribute
from multimesh.jax._trace_notes import TraceNotes
from multimesh.runtime.steps import layout_sharding

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
    from multimesh._src.ir_util import custom_call_target
    from multimesh._src.mlir import ir

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


class FastPath:
    """What ``MpmdLowered.compile`` needs to build the ``jax.jit`` executable."""

    def __init__(self, jaxpr, in_tree, out_tree, abstract_leaves, pins, devices, donated,
                 text, default_mesh=None):
        self.jaxpr = jaxpr  # closed jaxpr over the flat dynamic leaves
        self.out_tree = out_tree
        self.in_avals = tuple(jaxpr.in_avals)
        self.in_tree = in_tree
        self.abstract_leaves = abstract_leaves
        self.pins = pins
        self.devices = tuple(devices)
        self.donated = tuple(donated)
        self.text = text
        self.default_mesh = default_mesh  # (names, sizes) of the program's mesh, if given

    def compile(self) -> FastCompiled:
        if self.pins:  # the pinned inputs' mesh (one, see eligible)
            pos, names, sizes, _ = next(iter(self.pins.values()))
            mesh = Mesh(np.array([self.devices[p] for p in pos], dtype=object).reshape(sizes),
                        names)
        else:
            names, sizes = self.default_mesh or (("x",), (len(self.devices),))
            mesh = Mesh(np.array(self.devices, dtype=object).reshape(sizes), names)
        replicated = NamedSharding(mesh, PartitionSpec())
        in_sh = tuple(layout_sharding(self.pins[i], self.devices) if i in self.pins
                      else replicated for i in range(len(self.abstract_leaves)))
        # The program as traced for the MPMD path: no second trace of the user's code.
        flat = jaxpr_as_fun(self.jaxpr)

        # Without a sharded input every value is replicated, as on the MPMD path (the
        # implicit task has no logical mapping); otherwise jax propagates from the inputs.
        out_sh = replicated if not self.pins else None
        jitted = jax.jit(flat, in_shardings=in_sh, out_shardings=out_sh,
                         donate_argnums=self.donated, keep_unused=True)
        # (The only logical markers left are those of physical in_shardings; outside
        # mjit's trace they lower to identities.)
        lowered = jitted.lower(*self.abstract_leaves)
        return FastCompiled(self, lowered.compile(), in_sh)


class FastCompiled:
    """A program compiled by ``jax.jit`` on the fast path; used like ``MpmdCompiled``."""

    fast_path = True
    out_placements: dict = {}  # noqa: RUF012 - replaced by MpmdLowered.compile, never mutated

    def __init__(self, fast: FastPath, compiled, in_shardings):
        self._fast = fast
        self._compiled = compiled
        self._in_sh = in_shardings
        self.input_shardings = jax.tree.unflatten(fast.in_tree, list(in_shardings))
        self.output_shardings = jax.tree.unflatten(fast.out_tree, compiled.output_shardings)
        self.fragments: list = []
        self.transfers: list = []
        self.schedule = None

    def __call__(self, *args, **kwargs):
        leaves = check_call(self._fast.in_tree, self._fast.in_avals, args, kwargs)
        leaves = [_place(x, sh) for x, sh in zip(leaves, self._in_sh)]
        outs = self._compiled(*leaves)
        if self.out_placements:  # physical out_shardings (see MpmdLowered)
            outs = [jax.device_put(o, self.out_placements[i]) if i in self.out_placements
                    else o for i, o in enumerate(outs)]
        return jax.tree.unflatten(self._fast.out_tree, outs)

    def as_text(self) -> str:
        """The program as ``jax.jit`` compiled it (StableHLO before XLA)."""
        return self._fast.text

    def plan(self) -> str:
        ids = [d.id for d in self._fast.devices]
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

    @property
    def in_tree(self):
        return self._fast.in_tree

    @property
    def out_tree(self):
        return self._fast.out_tree

    @property
    def in_avals(self):
        return self._fast.in_avals

    def __getattr__(self, name):
        raise missing_attribute(self, name, MpmdCompiled)

    def memory_profile(self, *args, **kwargs):
        """Refused: a program without tasks has no submeshes to measure."""
        from multimesh._src.errors import MultimeshValueError
        from multimesh.jax._analysis.costs import _NO_TASKS

        raise MultimeshValueError(_NO_TASKS)

    step_profile = memory_profile

    def profile(self, *args, trace_path=None, **kwargs):
        """Run once synchronously, as one span (see ``MpmdCompiled.profile``)."""
        from multimesh.runtime.trace import TraceRecorder

        rec = TraceRecorder()
        ids = ",".join(str(d.id) for d in self._fast.devices)
        with rec.span(f"submesh 0 (devices {ids})", "fast_path"):  # as MPMD traces name it
            out = jax.block_until_ready(self(*args, **kwargs))
        if trace_path is not None:
            rec.write(trace_path)
        self.last_trace = rec
        return out


def _place(x, sharding):
    """``x`` on ``sharding`` unless it is there already (jit moves uncommitted values)."""
    if getattr(x, "_committed", False) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x
