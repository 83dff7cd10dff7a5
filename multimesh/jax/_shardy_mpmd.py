"""``compile_mpmd``: run a program partitioned by Shardy:MPMD on stock jax.

Shardy's partitioner (jaxlib's ``_sdy_mpmd`` extension) produces MPMD programs that only
Pathways can compile. ``mm-import-mpmd`` rewrites one into multimesh's MPMD form,
and the result goes through the same plan and executor as ``mjit``'s programs, so
the returned object is an :class:`~multimesh.jax._stages.compiled.MpmdCompiled`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from multimesh._src.brackets import deepest_nesting
from multimesh._src.errors import DiagnosticError, MultimeshTypeError, MultimeshValueError
from multimesh._src.ir_attrs import SourceError, decode_source
from multimesh._src.ir_contract import MESHES_ATTR
from multimesh._src.mlir import (
    element_dtype,
    file_line_col,
    ir,
    make_context,
    parse_module,
    print_module,
    py_to_attr,
    sdy,
)
from multimesh._src.stack import on_big_stack
from multimesh.jax._checks import few_devices_hint
from multimesh.jax._stages.call_checks import check_distinct_devices
from multimesh.jax._stages.compiled import MpmdCompiled
from multimesh.jax._stages.lowered import MpmdLowered
from multimesh.jax._stages.stage import LoweredProgram
from multimesh.passes.api import parse_mesh_tensor, parse_pipeline, read_topology

__all__ = ["compile_mpmd"]

_DONATION = ("jax.buffer_donor", "tf.aliasing_output")


def compile_mpmd(program, meshes: Mapping[str, Sequence[int] | Mesh] | None = None, *,
                 devices: Sequence | None = None, in_tree=None, out_tree=None) -> MpmdCompiled:
    """Compiles a Shardy:MPMD-partitioned program to run on stock jax.

    Args:
      program: the partitioner's output (jaxlib's ``_sdy_mpmd.apply_mpmd_partitioning(...)
        .mpmd_module``) as an ``ir.Module`` or MLIR text, or a program lowered by
        Shardy's JAX front end (``mpmd.jit(f, config).lower(...)``), whose topology,
        input and output trees are then used.
      meshes: the devices of each mesh of the program, by mesh name: device positions
        in ``devices`` (row-major over the mesh's axes) or a ``jax.sharding.Mesh``.
        The mpmd dialect names meshes but no devices, so this is required unless
        ``program`` comes from the front end.
      devices: the program's device list (default ``jax.devices()``).
      in_tree: the treedef of the positional arguments (``jax.tree.structure(args)``);
        default: one argument per ``@main`` argument.
      out_tree: the treedef of the outputs; default: a tuple, one per ``@main`` result.

    Returns:
      A compiled program, called like a jitted function, with ``mjit``'s compiled
      interface (``input_shardings``, ``output_shardings``, ``plan()``, ``profile()``,
      ``fragments``, ``transfers``, ``as_text()``). Calls run in the partitioner's order.
      Arguments the partitioner marked as donated are donated.
    """
    if isinstance(program, (str, bytes, bytearray)):
        program = _read_program(program)
        # MLIR recurses once per nesting level: a deep program (or bytecode, whose depth
        # is not known before parsing) compiles on a big stack, as in mm-opt.
        if isinstance(program, bytes) or deepest_nesting(program, _SHALLOW)[0] > _SHALLOW:
            return on_big_stack(lambda: _compile(program, meshes, devices, in_tree, out_tree),
                                name="compile_mpmd")
    return _compile(program, meshes, devices, in_tree, out_tree)


_SHALLOW = 1000
"""Nesting depth up to which ``compile_mpmd`` parses on the caller's stack."""


def _read_program(program: str | bytes | bytearray) -> str | bytes:
    """Text or bytecode, checked by the same source guard as ``mm-opt``'s."""
    try:
        return decode_source(program)
    except SourceError as e:
        where = f" (line {e.line}, column {e.col})" if e.line is not None else ""
        raise MultimeshValueError(
            f"`compile_mpmd` cannot read the program: {e.message}{where}.") from None


def _compile(program, meshes, devices, in_tree, out_tree) -> MpmdCompiled:
    text: str | bytes
    devices = tuple(jax.devices()) if devices is None else tuple(
        np.asarray(devices, dtype=object).flat)
    check_distinct_devices(devices)
    kept = in_avals = None
    if hasattr(program, "mpmd_module") and hasattr(program, "topology"):  # the front end
        if getattr(program, "const_args", None):
            raise MultimeshValueError(
                "`compile_mpmd` got a lowered Shardy program that takes closed-over constants "
                "as arguments (JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS); lower it with that flag "
                "off.")
        if meshes is None:
            meshes = dict(program.topology)
        in_tree = program.input_tree if in_tree is None else in_tree
        out_tree = program.output_tree if out_tree is None else out_tree
        kept = sorted(program.kept_inputs_indices)
        n_leaves = program.input_tree.num_leaves  # unused inputs are not in the module
        in_avals = list(program.global_flat_input_abstract_values)
        text = print_module(program.mpmd_module, debug_info=True)
    elif isinstance(program, ir.Module):
        text = print_module(program, debug_info=True)
    elif isinstance(program, (str, bytes)):
        text = program  # checked by _read_program; bytecode stays bytes
    else:
        raise MultimeshTypeError(
            f"`compile_mpmd` expects a module partitioned by Shardy:MPMD (MLIR text or "
            f"bytecode, or an ir.Module) or a program lowered by Shardy's front end, got "
            f"{type(program).__name__}.")
    info = _ProgramInfo(text)
    positions = _positions(meshes, info, devices)
    text = info.with_meshes(positions)  # so a repro of a failing import replays as is
    n_in, n_out = len(info.arg_types), len(info.result_types)
    if kept is None:  # a module: one leaf per @main argument
        kept, n_leaves = list(range(n_in)), n_in
    elif len(kept) != n_in:
        raise MultimeshValueError(
            f"`compile_mpmd`: the lowered Shardy program keeps {len(kept)} inputs but its "
            f"module takes {n_in}.")
    args_tree = _tree("in_tree", in_tree, n_leaves, "@main argument")
    res_tree = _tree("out_tree", out_tree, n_out, "@main result")
    lowered = MpmdLowered(LoweredProgram(
        text, devices, jax.tree.structure((jax.tree.unflatten(args_tree, [0] * n_leaves), {})),
        res_tree, tuple(kept), parse_pipeline(_PIPELINE), donated_leaves=tuple(info.donated),
        in_avals=tuple(info.arg_types if in_avals is None else in_avals),
        call_counters=tuple(info.counters)))  # the schedule is recovered from them
    compiled = lowered.compile()
    assert isinstance(compiled, MpmdCompiled)  # only mjit's lower sets a fast path
    return compiled


class _ProgramInfo:
    """What the Python side checks before the pass runs: meshes, types, donation."""

    def __init__(self, text: str | bytes):
        try:
            self.module = module = parse_module(text, make_context())
        except ir.MLIRError as e:
            raise MultimeshValueError(
                f"`compile_mpmd` could not parse the program: {e}") from None
        try:
            self._read(module)
        except DiagnosticError as e:
            flc = file_line_col(e.location)
            where = f" (line {flc[1]}, column {flc[2]})" if flc is not None and flc[1] else ""
            raise MultimeshValueError(
                f"`compile_mpmd` cannot run the program: {e.message}{where}.") from None

    def _read(self, module: ir.Module) -> None:
        with module.context:
            main: ir.Operation | None = None
            for view in module.body.operations:
                op = view.operation
                if op.name == "func.func" and \
                        ir.StringAttr(op.attributes["sym_name"]).value == "main":
                    main = op
            if main is None:
                raise MultimeshValueError("`compile_mpmd`: the program has no `main` function.")
            ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
            self.arg_types = [self._aval(t, f"argument #{i}") for i, t in
                              enumerate(ftype.inputs)]
            self.result_types = list(ftype.results)
            topology = read_topology(main)
            self.meshes = ({k: _mesh_shape(v) for k, v in topology.items()}
                           if topology is not None else None)
            self.counters = [_call_counter(op) for op in main.regions[0].blocks[0].operations
                             if op.operation.name == "mpmd.fragment_call"]
            self.donated = []
            if "arg_attrs" in main.attributes:
                for i, a in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
                    d = ir.DictAttr(a)
                    if any(k in d for k in _DONATION):
                        self.donated.append(i)

    def with_meshes(self, positions: dict[str, tuple[int, ...]]) -> str:
        """The program with its mesh map recorded for ``mm-import-mpmd`` (``mm.meshes``)."""
        with self.module.context:
            self.module.operation.attributes[MESHES_ATTR] = py_to_attr(
                {k: list(v) for k, v in positions.items()})
        return print_module(self.module, debug_info=True)

    @staticmethod
    def _aval(t, what: str):
        mt = parse_mesh_tensor(t)
        if mt is None:
            raise MultimeshValueError(
                f"`compile_mpmd`: @main {what} has type {t}, not an !mpmd.mesh_tensor; pass "
                f"the output of Shardy's MPMD partitioner.")
        rt = ir.RankedTensorType(mt.tensor)
        return jax.core.ShapedArray(tuple(rt.shape), element_dtype(str(rt.element_type)))


def _call_counter(op) -> int | None:
    """The microbatch a fragment call's ``call_counter`` attribute names, if it has one."""
    attrs = op.operation.attributes
    return ir.IntegerAttr(attrs["call_counter"]).value if "call_counter" in attrs else None


def _mesh_shape(attr) -> tuple[tuple[str, ...], tuple[int, ...]]:
    axes = [sdy.MeshAxisAttr(a) for a in sdy.MeshAttr(attr).axes]
    return tuple(a.name for a in axes), tuple(a.size for a in axes)


def _positions(meshes, info: _ProgramInfo, devices) -> dict[str, tuple[int, ...]]:
    """Mesh name -> device positions, from ``compile_mpmd``'s ``meshes``, checked
    against the program's own meshes (when it names them)."""
    known = sorted(info.meshes) if info.meshes is not None else None
    if meshes is None:
        names = f" ({', '.join(repr(k) for k in known)})" if known else ""
        raise MultimeshValueError(
            f"`compile_mpmd` needs `meshes`: the device positions of each mesh of the "
            f"program{names}, e.g. {{'m1': range(0, 4), 'm2': range(4, 8)}}.")
    if not isinstance(meshes, Mapping):
        raise MultimeshTypeError(
            f"`compile_mpmd` meshes must be a mapping from mesh name to device positions or "
            f"a jax.sharding.Mesh, got {type(meshes).__name__}.")
    index = {d: i for i, d in enumerate(devices)}
    out = {}
    for name, value in meshes.items():
        if isinstance(value, Mesh):
            pos = _mesh_positions(name, value, info, devices, index)
        else:
            pos = _listed_positions(name, value, devices)
        if info.meshes is not None and name not in info.meshes:
            raise MultimeshValueError(
                f"`compile_mpmd` meshes has mesh {name!r}, which the program does not have; "
                f"its meshes are {', '.join(repr(k) for k in sorted(info.meshes))}.")
        out[str(name)] = pos
    if info.meshes is not None:
        _check_every_mesh(out, info.meshes)
    return out


def _mesh_positions(name, value: Mesh, info: _ProgramInfo, devices,
                    index: dict) -> tuple[int, ...]:
    """The positions of a ``jax.sharding.Mesh`` given for mesh ``name``: its devices
    must be the program's, its axes the program's mesh's."""
    missing = [d.id for d in value.devices.flat if d not in index]
    if missing:
        raise MultimeshValueError(
            f"`compile_mpmd` mesh {name!r} has device {missing[0]}, which is not in "
            f"the program's devices {[d.id for d in devices]}.")
    if info.meshes is not None and name in info.meshes and \
            (tuple(value.axis_names), tuple(value.devices.shape)) != info.meshes[name]:
        want = dict(zip(*info.meshes[name]))
        raise MultimeshValueError(
            f"`compile_mpmd` mesh {name!r} has axes {dict(value.shape)} but the "
            f"program's mesh {name!r} has axes {want}.")
    return tuple(index[d] for d in value.devices.flat)


def _listed_positions(name, value, devices) -> tuple[int, ...]:
    """Device positions listed for mesh ``name``: integers, distinct, in range."""
    try:
        pos = tuple(int(p) for p in value)
    except (TypeError, ValueError):
        raise MultimeshTypeError(
            f"`compile_mpmd` meshes[{name!r}] must be a sequence of device positions "
            f"or a jax.sharding.Mesh, got {value!r}.") from None
    if len(set(pos)) != len(pos):
        raise MultimeshValueError(
            f"`compile_mpmd` meshes[{name!r}] lists a device position twice: "
            f"{list(pos)}.")
    bad = [p for p in pos if not 0 <= p < len(devices)]
    if bad:
        raise MultimeshValueError(
            f"`compile_mpmd` meshes[{name!r}] has device position {bad[0]}, but there "
            f"are {len(devices)} devices (valid positions are 0..{len(devices) - 1})."
            + few_devices_hint(devices))
    return pos


def _check_every_mesh(out: dict[str, tuple[int, ...]],
                      program: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]) -> None:
    """Every mesh of the program got positions, as many as it has devices."""
    for name in sorted(program):
        if name not in out:
            raise MultimeshValueError(
                f"`compile_mpmd` meshes gives no devices for the program's mesh {name!r} "
                f"(it gives {', '.join(repr(k) for k in sorted(out))}).")
        size = int(np.prod(program[name][1]))
        if len(out[name]) != size:
            raise MultimeshValueError(
                f"`compile_mpmd` meshes[{name!r}] has {len(out[name])} devices, but the "
                f"program's mesh {name!r} has {size} "
                f"(axes {dict(zip(*program[name]))}).")


def _tree(kind: str, tree, n: int, what: str):
    if tree is None:
        return jax.tree.structure(tuple(range(n)))
    if not isinstance(tree, jax.tree_util.PyTreeDef):
        raise MultimeshTypeError(
            f"`compile_mpmd` {kind} must be a PyTreeDef (jax.tree.structure(...)), got "
            f"{type(tree).__name__}.")
    if tree.num_leaves != n:
        raise MultimeshValueError(
            f"`compile_mpmd` {kind} has {tree.num_leaves} leaves but the program has {n} "
            f"{what}{'s' if n != 1 else ''}.")
    return tree


_PIPELINE = "builtin.module(mm-import-mpmd,mm-verify)"
