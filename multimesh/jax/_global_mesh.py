"""The global mesh a task's ``mesh_slice`` cuts: the innermost ``MultiMesh`` entered in
this thread, else jax's current mesh.

It sits below the tasks (``Task.mesh_slice`` is resolved here) and the contexts
(``MultiMesh.__enter__`` pushes onto ``stack``), and imports neither.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
from jax.sharding import Mesh

from multimesh._src import jax_compat
from multimesh._src.errors import MeshError, MultimeshTypeError

__all__ = ["stack", "active_multimesh", "current_global_mesh", "slice_global_mesh",
           "slice_devices"]


class _MeshStack(threading.local):
    """The MultiMeshes entered in this thread, innermost last."""

    def __init__(self):
        self.meshes: list[tuple[Mesh, object]] = []  # (MultiMesh, autoshard token)


stack = _MeshStack()


def slice_devices(mesh: Mesh, kw: Mapping[str, int], who: str) -> np.ndarray:
    """The devices of ``mesh`` at ``{axis: index}`` (sliced axes kept with size 1)."""
    names = tuple(mesh.axis_names)
    shape = mesh.devices.shape
    unknown = sorted(set(kw) - set(names))
    if unknown:
        raise MeshError(
            f"{who}: unknown axis name(s) {unknown}; the global mesh has axes {names}.")
    idx = []
    for name, size in zip(names, shape, strict=True):
        if name not in kw:
            idx.append(slice(None))
            continue
        i = kw[name]
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise MeshError(
                f"{who}: the index for axis {name!r} must be an integer, got {i!r}.")
        if not 0 <= int(i) < size:
            raise MeshError(
                f"{who}: index {int(i)} is out of range for axis {name!r} of size {size} "
                f"(valid indices are 0..{size - 1}).")
        idx.append(slice(int(i), int(i) + 1))
    return mesh.devices[tuple(idx)]


def active_multimesh() -> Mesh | None:
    """The innermost :class:`MultiMesh` entered in this thread, if any."""
    meshes = stack.meshes
    return meshes[-1][0] if meshes else None


def current_global_mesh() -> Mesh | None:
    """The global mesh a ``mesh_slice`` cuts: the innermost entered :class:`MultiMesh`,
    else jax's current mesh (``jax.set_mesh(mesh)``, then ``with mesh:``), else None."""
    mesh = active_multimesh()
    if mesh is None:
        mesh = jax_compat.concrete_mesh()
    return getattr(mesh, "global_mesh", mesh)  # a MultiMesh: the jax Mesh it wraps


def slice_global_mesh(name: str, mesh_slice: Mapping[str, int]) -> Mesh:
    """The submesh a task's ``mesh_slice`` selects in the current global mesh."""
    mesh = current_global_mesh()
    if mesh is None:
        raise MeshError(
            f"Task {name!r} has mesh_slice={dict(mesh_slice)!r}, but there is no global mesh "
            f"to slice. A mesh_slice selects part of the global mesh: compile inside "
            f"`with MultiMesh(...):` or `with jax.set_mesh(mesh):` (or decorate the function "
            f"with the MultiMesh), or give the task a `mesh` instead.")
    if not isinstance(mesh_slice, Mapping):
        raise MultimeshTypeError(
            f"Task {name!r}: `mesh_slice` must be a mapping {{axis_name: index}}, got "
            f"{type(mesh_slice).__name__} {mesh_slice!r}.")
    devs = slice_devices(mesh, dict(mesh_slice), who=f"Task {name!r} mesh_slice")
    return Mesh(devs, mesh.axis_names, axis_types=mesh.axis_types)
