"""One transfer-route decision (``distributed.transfer_route``): what a process does to
move a value between two device sets, typed (:class:`~multimesh.runtime.distributed.Route`),
asked by ``cross_move``, ``ProcessPlan`` and ``CrossTransfer`` alike. The multi-process
runs themselves are in tests/test_multiprocess.py."""

from __future__ import annotations

import ast
import pathlib
from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh.runtime import distributed
from multimesh.runtime.distributed import Route, transfer_route

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Device(NamedTuple):
    id: int
    process_index: int


def _devices(*processes):
    """Fake devices: one per entry, on that process (ids 0.. in order)."""
    return [_Device(i, p) for i, p in enumerate(processes)]


D = _devices(0, 0, 1, 1, 0, 1)  # devices 0, 1, 4 on process 0; 2, 3, 5 on process 1


@pytest.mark.parametrize("src,dst,me,named,route", [
    ([0, 1], [4], 1, True, Route.SKIP),  # process 1 holds none of them
    ([0, 1], [4], 0, True, Route.LOCAL),
    ([0, 2], [2, 0], 0, True, Route.RESHARD),  # one device set across both processes
    ([0, 1], [2, 3], 0, True, Route.PAIRED),
    ([0, 1], [2, 3], 1, True, Route.PAIRED),  # the receiver agrees
    ([0, 1], [2, 3], 0, False, Route.REPLICATED),  # no mesh to keep: whole copies
    ([0, 1], [5], 1, True, Route.REPLICATED),  # 2 -> 1 devices
    ([0, 1], [2, 3], None, True, Route.PAIRED),  # the collective, whoever asks
    ([0, 1], [4], None, True, Route.REPLICATED),
])
def test_the_route_of_a_move(src, dst, me, named, route):
    got = transfer_route([D[i] for i in src], [D[i] for i in dst], me=me, named=named)
    assert got is route and got == route.value  # a typed value that reads as its tag


def test_one_process_moves_locally():
    """In one process every move of ``cross_move`` is local: a device_put, placed
    exactly as jax.device_put places it."""
    devs = jax.devices()
    a = NamedSharding(Mesh(np.array(devs[:2]), ("x",)), PartitionSpec("x"))
    b = NamedSharding(Mesh(np.array(devs[2:6]).reshape(2, 2), ("x", "y")),
                      PartitionSpec(None, "y"))
    assert transfer_route(list(a.mesh.devices.flat),
                          list(b.mesh.devices.flat), me=jax.process_index()) is Route.LOCAL
    x = jax.device_put(np.arange(8.0).reshape(2, 4), a)
    y = distributed.cross_move(x, b)
    want = jax.device_put(x, b)
    assert y.sharding == want.sharding == b
    assert [s.device for s in y.addressable_shards] == [s.device for s in
                                                       want.addressable_shards]
    np.testing.assert_array_equal(np.asarray(y), np.arange(8.0).reshape(2, 4))


@pytest.mark.parametrize("path", ["multimesh/runtime/distributed.py",
                                  "multimesh/runtime/executor.py"])
def test_the_route_is_decided_in_one_place(path):
    """No other code returns or compares a route as a string tag: it asks
    ``transfer_route`` (a second decision would drift from it). ``"skip"`` is also a
    call's decision (:meth:`ProcessPlan.kind`), and is left out."""
    tags = {r.value for r in Route} - {"skip"}
    tree = ast.parse((ROOT / path).read_text())
    used = [n for n in ast.walk(tree) if isinstance(n, (ast.Compare, ast.Return))]
    hits = [c.lineno for n in used for c in ast.walk(n)
            if isinstance(c, ast.Constant) and c.value in tags]
    assert not hits, f"{path}: route tags compared or returned at lines {hits}"
