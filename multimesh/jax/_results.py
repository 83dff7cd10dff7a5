"""What ``parallelize`` and ``parallelize_step`` return: tuples with named fields.

The original library (NVIDIA's multimesh-jax, docs/compared.md) returned plain
tuples whose length depended on the keywords passed
(``parallelize``: 3 values with ``get_input_batch``, 2 with ``initial_batch``;
``parallelize_step``: 4 with ``local_batch``, 3 with ``global_batch``), and its
tutorials unpack them. These classes keep that: each is a ``tuple`` holding
exactly the values of the form that was called, so ``a, b, c = parallelize(...)``
still works, while *every* field is an attribute in every form
(``result.get_sharded_batch``, ``result.prepare_batch``). A ``NamedTuple`` cannot
change its length, hence a small tuple subclass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar


class _FormTuple(tuple):
    """A tuple of the first ``length`` fields; all fields readable by name."""

    _fields: ClassVar[tuple[str, ...]] = ()
    _all: tuple

    def __new__(cls, values: tuple, length: int):
        if len(values) != len(cls._fields) or not 0 < length <= len(values):
            raise AssertionError(f"{cls.__name__} takes {len(cls._fields)} values")
        self = super().__new__(cls, values[:length])
        self._all = tuple(values)
        return self

    def _asdict(self) -> dict[str, Any]:
        """Every field by name, including those the tuple form leaves out."""
        return dict(zip(self._fields, self._all))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in
                          zip(self._fields[:len(self)], self._all))
        return f"{type(self).__name__}({shown})"

    def __getnewargs__(self):  # pickling and copy keep every field and the length
        return self._all, len(self)


class ParallelizeResult(_FormTuple):
    """What :func:`multimesh.jax.parallelize` returns.

    Unpacks as ``(sharded_fun, init_sharded_params, get_sharded_batch)`` when
    ``get_input_batch`` was given and as ``(sharded_fun, init_sharded_params)``
    when ``initial_batch`` was (the original library's two forms). ``get_sharded_batch`` is
    an attribute in both: with ``initial_batch`` it returns that batch placed
    where the program reads it.
    """

    _fields = ("sharded_fun", "init_sharded_params", "get_sharded_batch")

    @property
    def sharded_fun(self):
        """The compiled program (:class:`MpmdCompiled`), ``sharded_fun(params, batch)``."""
        return self._all[0]

    @property
    def init_sharded_params(self) -> Callable[[], Any]:
        """Creates the parameters on the submeshes of the tasks that read them."""
        return self._all[1]

    @property
    def get_sharded_batch(self) -> Callable[[], Any]:
        """Creates (or places) the batch where the program reads it."""
        return self._all[2]


class ParallelizeStepResult(_FormTuple):
    """What :func:`multimesh.jax.flax.parallelize_step` returns.

    Unpacks as ``(step_fn, state, mesh, prepare_batch)`` when ``local_batch`` was
    given and as ``(step_fn, state, mesh)`` when ``global_batch`` was (the original
    library's two forms); ``prepare_batch`` is an attribute in both.
    """

    _fields = ("step_fn", "state", "mesh", "prepare_batch")
    plan: Any = None
    """The :class:`~multimesh.jax.PipelinePlan` that ``num_stages="auto"`` chose, else None."""

    @property
    def step_fn(self):
        """The compiled step: ``loss, state = step_fn(state, batch)``."""
        return self._all[0]

    @property
    def state(self):
        """The first state, every variable on the submesh of the task that uses it."""
        return self._all[1]

    @property
    def mesh(self):
        """The ``jax.sharding.Mesh`` of the program's devices."""
        return self._all[2]

    @property
    def prepare_batch(self) -> Callable[[Any], Any]:
        """This process's part of the batch (host data) -> the global batch arrays."""
        return self._all[3]
