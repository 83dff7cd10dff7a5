"""flax's partitioning boxes in a linen ``parallelize_step`` state name the mesh their
value lives on.

A linen state holds flax's boxes (``nn.LogicallyPartitioned``, ``nn.Partitioned``)
around values that live on their stage's devices. A box's ``mesh`` None means "the
mesh in context", and ``nn.unbox`` constrains each value on that mesh: under
``jax.set_mesh(global_mesh)`` a value on a stage's slice would be constrained onto the
whole global mesh, which jax refuses. So the state ``parallelize_step`` returns, and
the state each step returns, carry in every box the mesh of its value's own
``NamedSharding``: ``nn.unbox``, ``nn.get_partition_spec``, ``nn.get_sharding``,
flax's serialization and orbax read them as flax's own, and they tell the truth.

A box's ``mesh`` is part of the state's tree structure; the step (:class:`StepFn`)
was compiled for the boxes as the model made them, and takes a state whose boxes
name any meshes, re-reading its values in that structure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import NamedSharding

__all__ = ["name_meshes", "StepFn", "PlacedLogicallyPartitioned", "PlacedPartitioned"]


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)  # nn.LogicallyPartitioned too


def own_mesh(value):
    """The concrete mesh ``value`` lives on (None for a tracer or an abstract value)."""
    if isinstance(value, jax.core.Tracer) or not isinstance(value, jax.Array):
        return None
    sharding = getattr(value, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _same_box(self, other):
    """Equality as flax's boxes have it: the same class, and the values compared as a
    tuple (so arrays compare without an elementwise truth value)."""
    if self is other:
        return True
    if other.__class__ is self.__class__:
        return (self.value,) == (other.value,)
    return NotImplemented


class PlacedLogicallyPartitioned(nn.LogicallyPartitioned):
    """``nn.LogicallyPartitioned`` around a value that lives on ``mesh`` (its stage's).

    ``unbox()`` of a concrete value places it on that mesh as the rules say (what
    flax's constraint does, without entering the mesh in context, which may be the
    larger global mesh: jax's eager constraint refuses a value on a submesh of it)."""

    __eq__ = _same_box

    def unbox(self, apply_constraint=True):
        if not apply_constraint or self.mesh is None:
            return super().unbox(apply_constraint)
        spec = nn.logical_to_mesh_axes(tuple(self.names), self.rules)
        return _placed(self, spec, lambda: super(PlacedLogicallyPartitioned, self).unbox())


class PlacedPartitioned(nn.Partitioned):
    """``nn.Partitioned`` around a value that lives on ``mesh`` (see
    :class:`PlacedLogicallyPartitioned`)."""

    __eq__ = _same_box

    def unbox(self, apply_constraint=True):
        if not apply_constraint or self.mesh is None:
            return super().unbox(apply_constraint)
        return _placed(self, self.get_partition_spec(),
                       lambda: super(PlacedPartitioned, self).unbox())


def _placed(box, spec, constrain):
    """``box``'s value constrained to ``spec`` on ``box.mesh``: a concrete value on that
    mesh is placed there (``device_put``), a traced one constrained as flax does
    (``constrain()``). Names that are no axes of the mesh (multimesh's logical names,
    which each task's ``logical_axes`` resolved when the step placed the value) leave
    it where the step placed it, as flax leaves a value with no mesh to constrain on."""
    names = {n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None}
    if not names <= set(box.mesh.axis_names):
        return box.value
    if own_mesh(box.value) == box.mesh:
        return jax.device_put(box.value, NamedSharding(box.mesh, spec))
    return constrain()


def name_meshes(tree):
    """``tree`` with each of flax's partitioning boxes naming the mesh its value lives
    on (a box whose value has no mesh of its own is left as it is)."""
    def one(x):
        if not _is_box(x):
            return x
        mesh = own_mesh(x.value)
        if mesh is None:
            return x
        cls = PlacedLogicallyPartitioned if isinstance(x, nn.LogicallyPartitioned) \
            else PlacedPartitioned
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
        return cls(**{**fields, "mesh": mesh})

    return jax.tree.map(one, tree, is_leaf=_is_box)


def _unboxed(tree):
    """``tree``'s structure with every box replaced by its value."""
    return jax.tree.structure(jax.tree.map(lambda x: x.value if _is_box(x) else x, tree,
                                           is_leaf=_is_box))


class StepFn:
    """A compiled linen training step, ``loss, state = step(state, batch)``, whose
    returned state's boxes name their values' meshes (see the module's docstring).
    Everything else (``cost_analysis``, ``schedule``, ``as_text``, ...) is the compiled
    program's."""

    def __init__(self, compiled, state_template):
        self._compiled = compiled
        self._treedef = jax.tree.structure(state_template)
        self._bare = _unboxed(state_template)

    def __call__(self, state, *args, **kwargs):
        treedef: Any = jax.tree.structure(state)  # a PyTreeDef: jax's alias is opaque to mypy
        if treedef != self._treedef and _unboxed(state) == self._bare:
            state = jax.tree.unflatten(self._treedef, jax.tree.leaves(state))
        loss, new_state = self._compiled(state, *args, **kwargs)
        return loss, name_meshes(new_state)

    def __getattr__(self, name):
        return getattr(self._compiled, name)

    def __repr__(self) -> str:
        return f"StepFn({self._compiled!r})"
