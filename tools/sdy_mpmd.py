"""Shardy:MPMD programs on jax 0.10.2, without Shardy's JAX front end.

Shardy's front end (``mpmd.named_computation``, ``mpmd.call``, ``mpmd.jit``) is not on
PyPI, and its HEAD needs jax >= 0.11. Its programs are made of two ops that this
module lowers exactly as it does:

* :func:`named_computation` -> ``mpmd.named_computation<"name"(transpose_count)>``
  (a jax call-primitive; its transpose is the same computation with the count + 1);
* :func:`call` -> ``mpmd.call @f(...) {call_counter = i : ui32}`` (one microbatch;
  the backward keeps the counter, which is how the partitioner pipelines it).

:func:`partition` runs jaxlib's own partitioner (``jaxlib._sdy_mpmd``) on such a
module. The programs at the bottom are the ones the differential tests
(``tests/test_shardy_mpmd.py``), the ``mm-import-mpmd`` golden inputs
(``tools/gen_import_mpmd_inputs.py``) and P5 in ``tools/bench.py`` share, each also
written with multimesh tasks and as plain jax.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.api_util import debug_info, flatten_fun_nokwargs, shaped_abstractify
from jax.extend import linear_util as lu
from jax.extend.core import ClosedJaxpr, Primitive
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh._src import jax_compat
from multimesh._src.mlir import ir, mpmd, print_module


def partitioner():
    """``jaxlib._sdy_mpmd``, the partitioner extension."""
    return jax_compat.sdy_mpmd_partitioner()


# ----------------------------------------------------------------------------- primitives

named_computation_p = Primitive("sdy_mpmd_named_computation")
jax_compat.register_call_primitive(
    named_computation_p,
    transposed=lambda params: dict(params, transpose_count=params["transpose_count"] + 1))
call_p = Primitive("sdy_mpmd_call")
jax_compat.register_call_primitive(call_p, transposed=lambda params: params)


def _bind(prim, fn, args, **params):
    flat, in_tree = jax.tree.flatten(args)
    f = lu.wrap_init(fn, debug_info=debug_info(prim.name, fn, args, {}))
    f, out_tree = flatten_fun_nokwargs(f, in_tree)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(f, [shaped_abstractify(x) for x in flat])
    # Closed-over values become leading operands, as a call-primitive's would.
    jaxpr, consts = jax_compat.separate_consts(ClosedJaxpr(jaxpr, consts))
    out = prim.bind(*consts, *flat, call_jaxpr=jaxpr, **params)
    return jax.tree.unflatten(out_tree(), out)


def named_computation(fn, *, name: str):
    """``fn`` as one named computation, which the partitioner assigns to a mesh by name."""
    return lambda *args: _bind(named_computation_p, fn, args, name=name, transpose_count=0)


def call(fn, *, call_counter: int):
    """``fn`` as microbatch ``call_counter`` (``mpmd.call``)."""
    return lambda *args: _bind(call_p, fn, args, call_counter=call_counter)


def _named_computation_lowering(ctx, *args, call_jaxpr, name, transpose_count):
    origin = ir.Attribute.parse(f'#mpmd.user_origin<"{name}"({transpose_count})>')
    types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_in]
    op = mpmd.NamedComputationOp(
        [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out], list(args),
        origin)
    block = op.region.blocks.append(*types)
    with ir.InsertionPoint(block):
        outs, _ = mlir.jaxpr_subcomp(
            ctx.module_context, call_jaxpr.jaxpr, ctx.name_stack.extend(name),
            mlir.TokenSet(), [],
            *block.arguments, dim_var_values=ctx.dim_var_values,
            const_lowering=ctx.const_lowering, outer_traceback=ctx.traceback)
        mpmd.ReturnOp(list(outs))
    return op.results


def _call_lowering(ctx, *args, call_jaxpr, call_counter):
    op, outs = jax_compat.lower_call(
        ctx, f"mpmd_call_{call_counter}", call_jaxpr, args, ctx.avals_in,
        make_call=lambda types, callee, operands: mpmd.CallOp(types, operands, callee))
    op.attributes["call_counter"] = ir.IntegerAttr.get(
        ir.IntegerType.get_unsigned(32), call_counter)
    return outs


mlir.register_lowering(named_computation_p, _named_computation_lowering)
mlir.register_lowering(call_p, _call_lowering)


# ----------------------------------------------------------------------------- partitioning


def partition(module, meshes: dict[str, tuple[tuple[str, int], ...]],
              assignment: dict[str, str | tuple[str, int]], *, schedule: str | None = None,
              donate_argnums=(), phases=None) -> str:
    """Shardy's MPMD partitioner on a ``named_computation`` module; returns its output text.

    ``meshes`` maps mesh names to their axes (``{"m1": (("x", 4),)}``), ``assignment``
    computation names to a mesh (``"m1"``) or, for a pipeline schedule, ``(mesh,
    stage)``. ``schedule`` is one of the partitioner's pipeline schedules (``"1F1B"``,
    ``"GPipe"``, ...). The module is copied first (the partitioner works in place).
    """
    sdy_mpmd = partitioner()
    if isinstance(module, str):
        from multimesh._src.mlir import make_context, parse_module

        module = parse_module(module, make_context())
    else:
        module = sdy_mpmd.clone_mlir_module(module)
    main = next(o.operation for o in module.body.operations
                if o.operation.name == "func.func"
                and ir.StringAttr(o.operation.attributes["sym_name"]).value == "main")
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    options = {"mpmd_pipeline_schedule": schedule} if schedule else {}
    with module.context:
        result = sdy_mpmd.apply_mpmd_partitioning(
            module, "main", [(k, list(v)) for k, v in meshes.items()], dict(assignment),
            [None] * len(ftype.inputs), [None] * len(ftype.results), list(donate_argnums),
            partitioning_options=options, fragment_merge_rules=[], fragment_schedule_rules=[],
            phases=phases if phases is not None else sdy_mpmd.PartitioningPhase.ALL)
    return print_module(result.mpmd_module)


# ----------------------------------------------------------------------------- programs


def stage1(w, x):
    return jnp.tanh(x @ w)


def stage2(w, h):
    return jnp.sum(jnp.tanh(h @ w) ** 2)


@dataclass
class TwoStage:
    """A 2-stage MLP ``value_and_grad`` step three ways, on meshes ``m1`` and ``m2``.

    ``shardy(params, xs)`` is the Shardy:MPMD program (lower it, then :meth:`partitioned`),
    ``plain(params, xs)`` the same math as plain jax. ``xs`` has shape
    ``(microbatches, batch, width)``; the loss is summed over microbatches.
    """

    microbatches: int
    width: int
    batch: int
    m1: tuple[tuple[str, int], ...]
    m2: tuple[tuple[str, int], ...]

    @property
    def meshes(self) -> dict[str, tuple[tuple[str, int], ...]]:
        return {"m1": self.m1, "m2": self.m2}

    @property
    def positions(self) -> dict[str, tuple[int, ...]]:
        n1 = int(np.prod([s for _, s in self.m1]))
        n2 = int(np.prod([s for _, s in self.m2]))
        return {"m1": tuple(range(n1)), "m2": tuple(range(n1, n1 + n2))}

    def args(self, seed: int = 0):
        k = jax.random.key(seed)
        w = self.width
        params = (jax.random.normal(jax.random.fold_in(k, 1), (w, w)) / w ** 0.5,
                  jax.random.normal(jax.random.fold_in(k, 2), (w, w)) / w ** 0.5)
        xs = jax.random.normal(jax.random.fold_in(k, 3), (self.microbatches, self.batch, w))
        return params, xs

    def shardy(self):
        s1 = named_computation(stage1, name="stage1")
        s2 = named_computation(stage2, name="stage2")

        def forward(params, x):
            return s2(params[1], s1(params[0], x))

        def loss(params, xs):
            if self.microbatches == 1:
                return forward(params, xs[0])
            return sum(call(forward, call_counter=i)(params, xs[i])
                       for i in range(self.microbatches))

        return jax.value_and_grad(loss)

    def plain(self):
        def loss(params, xs):
            return sum(stage2(params[1], stage1(params[0], xs[i]))
                       for i in range(self.microbatches))

        return jax.value_and_grad(loss)

    def lowered_text(self) -> str:
        """The Shardy program as jax lowers it: ``named_computation``s (and ``call``s),
        the batch sharded over ``m1``'s first axis."""
        params, xs = self.args()
        devices = jax.devices()[:len(self.positions["m1"])]
        mesh = Mesh(np.array(devices).reshape([s for _, s in self.m1]),
                    tuple(n for n, _ in self.m1))
        step = jax.jit(self.shardy(), in_shardings=(NamedSharding(mesh, P()),
                                                    NamedSharding(mesh, P(None, self.m1[0][0]))))
        return step.lower(params, xs).as_text()

    def partitioned(self, schedule: str | None = None) -> str:
        """Shardy:MPMD's partitioned program (``schedule``: ``"1F1B"``, ``"GPipe"``, ...)."""
        staged = schedule is not None
        assignment = {"stage1": ("m1", 0) if staged else "m1",
                      "stage2": ("m2", 1) if staged else "m2"}
        return partition(self.lowered_text(), self.meshes, assignment, schedule=schedule)

    def multimesh(self, schedule: str = "1f1b"):
        """The same step written with multimesh tasks (``microbatch`` when pipelined)."""
        from multimesh.jax import TaskMesh, microbatch, task, with_sharding_constraint

        def mesh_of(axes, positions):
            return TaskMesh(devices=positions, axis_names=tuple(n for n, _ in axes),
                            axis_sizes=tuple(s for _, s in axes))

        pos = self.positions
        t1 = task(lambda w, x: stage1(w, with_sharding_constraint(x, P("batch", None))),
                  name="stage1", mesh=mesh_of(self.m1, pos["m1"]),
                  logical_axes=(("batch", self.m1[0][0]),))
        t2 = task(stage2, name="stage2", mesh=mesh_of(self.m2, pos["m2"]))

        def loss(params, x):  # x: one microbatch, (batch, width)
            return t2(params[1], t1(params[0], x))

        step = jax.value_and_grad(loss)
        if self.microbatches == 1:
            return lambda params, xs: step(params, xs[0])
        flat = microbatch(step, dim=0, size=self.batch, argnum=1, schedule=schedule)
        return lambda params, xs: flat(params, xs.reshape(-1, self.width))
