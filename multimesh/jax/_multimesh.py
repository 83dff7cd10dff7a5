"""``MultiMesh``: a global mesh that tasks carve submeshes out of, and a task context;
``compile_token``, what a compiled program depends on in this thread.

The rest of what this module once held lives beside it: registrations and contexts
(``_registrations``), the global-mesh lookup (``_global_mesh``) and the compile-time
scan for registered tasks (``_implicit_tasks``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from multimesh._src import jax_compat
from multimesh._src.errors import MeshError, MultimeshTypeError, MultimeshValueError
from multimesh.jax import _checks, _contexts
from multimesh.jax._global_mesh import active_multimesh, slice_devices, stack
from multimesh.jax._registrations import Context, active_registrations

__all__ = ["MultiMesh", "compile_token"]


class MultiMesh(Context, Mesh):
    """A global mesh that tasks carve submeshes out of, and a task context.

    ``MultiMesh(global_mesh=mesh)`` wraps a :class:`jax.sharding.Mesh`;
    ``MultiMesh(axis_sizes=..., axis_names=..., devices=None)`` builds one (from
    ``jax.devices()`` by default). It *is* a :class:`jax.sharding.Mesh` (the
    devices and axes of the wrapped one, and equal to it), so
    ``NamedSharding(multi_mesh, spec)``, ``shard_map(..., mesh=multi_mesh)`` and
    ``jax.set_mesh(multi_mesh)`` work as with the wrapped mesh. Entering it
    (``with`` or as a decorator) turns on :func:`autoshard`, makes it the active
    global mesh — a task with ``mesh_slice={"stage": 0}`` then runs on
    ``self.slice(stage=0)`` — and makes its registered tasks take effect. Programs
    compiled inside use its devices as their device list unless given others.
    """

    # jax's Mesh is interned and immutable; a MultiMesh is neither (it holds task
    # registrations), so it is built here and keeps attributes of its own.
    __setattr__ = object.__setattr__
    __delattr__ = object.__delattr__
    global_mesh: Mesh  # the wrapped mesh (set in __new__)

    def __new__(cls, *, axis_sizes=None, axis_names=None, devices=None,
                global_mesh: Mesh | None = None):
        mesh = _global_mesh_of(axis_sizes, axis_names, devices, global_mesh)
        obj = object.__new__(cls)
        # Every field jax's Mesh.__new__ sets: devices, axis_names, axis_types, size, and
        # on jax >= 0.11 the cached device list that shardings read.
        for field, value in vars(mesh).items():
            object.__setattr__(obj, field, value)
        object.__setattr__(obj, "global_mesh", mesh)
        return obj

    def __init__(self, *, axis_sizes=None, axis_names=None, devices=None,
                 global_mesh: Mesh | None = None):
        del axis_sizes, axis_names, devices, global_mesh  # read by __new__
        Context.__init__(self)

    @property
    def mesh(self) -> Mesh:
        """The wrapped :class:`jax.sharding.Mesh`."""
        return self.global_mesh

    # Equal to (and hashed like) the mesh it wraps: a sharding on either is the same.
    def __eq__(self, other):
        if isinstance(other, MultiMesh):
            other = other.global_mesh
        return other is self.global_mesh

    def __hash__(self):
        return hash(self.global_mesh)

    def __reduce__(self):  # pickles as the plain mesh: registrations are not data
        return (_identity, (self.global_mesh,))

    def __repr__(self):
        return f"MultiMesh({self.global_mesh!r})"

    def _slice_devices(self, kw: Mapping[str, int], who: str = "MultiMesh.slice") -> np.ndarray:
        return slice_devices(self.global_mesh, kw, who)

    def slice(self, **to_slice: int) -> Mesh:
        """The submesh at ``{axis: index}``; sliced axes stay, with size 1."""
        devs = self._slice_devices(to_slice)
        return Mesh(devs, self.global_mesh.axis_names,
                    axis_types=self.global_mesh.axis_types)

    def single_slice_devices(self, **to_slice: int) -> list:
        """The devices of :meth:`slice`, flattened in mesh order."""
        return list(self._slice_devices(to_slice).flat)

    def single_slice_ids(self, **to_slice: int) -> list[int]:
        """The device ids of :meth:`slice`, flattened in mesh order."""
        return [d.id for d in self._slice_devices(to_slice).flat]

    def __enter__(self):
        token = _contexts.push("autoshard", True)
        Context.__enter__(self)
        stack.meshes.append((self, token))
        return self

    def __exit__(self, *exc):
        # Exits may come in any order (two MultiMeshes closed out of order): each one
        # undoes only its own entries, and autoshard comes back once all are closed.
        meshes = stack.meshes
        for i in range(len(meshes) - 1, -1, -1):
            if meshes[i][0] is self:
                _, token = meshes.pop(i)
                break
        else:
            raise MultimeshValueError(
                "MultiMesh.__exit__ was called without a matching __enter__ in this "
                "thread; use the MultiMesh in a `with` statement (or as a decorator) so "
                "that every exit has its enter.")
        try:
            Context.__exit__(self, *exc)
        finally:
            _contexts.pop(token)
        return False


def _identity(x):
    return x


def _global_mesh_of(axis_sizes, axis_names, devices, global_mesh) -> Mesh:
    """The jax Mesh a ``MultiMesh(...)`` call describes."""
    if global_mesh is not None:
        if axis_sizes is not None or axis_names is not None or devices is not None:
            raise MultimeshValueError(
                "MultiMesh takes either `global_mesh` or `axis_sizes`/`axis_names`/"
                "`devices`, not both.")
        if isinstance(global_mesh, MultiMesh):
            return global_mesh.global_mesh
        if not isinstance(global_mesh, Mesh):
            raise MultimeshTypeError(
                f"MultiMesh `global_mesh` must be a jax.sharding.Mesh, got "
                f"{type(global_mesh).__name__}.")
        return global_mesh
    if axis_names is None:
        raise MultimeshValueError(
            "MultiMesh needs `axis_names` (with `axis_sizes` and/or `devices`) or a "
            "`global_mesh`.")
    axis_names = _checks.axis_names(axis_names, "MultiMesh")
    devs = np.asarray(jax.devices() if devices is None else devices, dtype=object)
    if axis_sizes is not None:
        axis_sizes = _checks.axis_sizes(axis_sizes, "MultiMesh")
        if len(axis_sizes) != len(axis_names):
            raise MeshError(
                f"MultiMesh got {len(axis_names)} axis names {axis_names} but "
                f"{len(axis_sizes)} axis sizes {axis_sizes}.")
        if int(np.prod(axis_sizes)) != devs.size:
            raise MeshError(
                f"MultiMesh axis_sizes {axis_sizes} describe {int(np.prod(axis_sizes))}"
                f" devices but {devs.size} devices were given.")
        devs = devs.reshape(axis_sizes)
    elif devs.ndim != len(axis_names):
        raise MeshError(
            f"MultiMesh devices have shape {devs.shape} but axis_names {axis_names} "
            f"name {len(axis_names)} axes; give axis_sizes to reshape them.")
    return Mesh(devs, axis_names)


def compile_token() -> tuple:
    """What a compiled program depends on in this thread (for ``mjit``'s cache key):
    the registered tasks, the active MultiMesh, jax's concrete mesh (``jax.set_mesh``,
    ``with mesh:``: its devices and their order, which a ``mesh_slice`` cuts, as
    ``jax.jit`` keys it) and the context switches."""
    return (tuple(active_registrations()), active_multimesh(), jax_compat.concrete_mesh(),
            _contexts.compile_state())
