"""2 processes x 4 devices: cross-process moves of every kind, shape and dtype.

``distributed.cross_move`` between submeshes of one process, of the other, spanning
both, of different sizes and layouts; scalars, bool, int and bfloat16 data; and an
``mjit`` program whose input arrives on the other process's devices.
"""

import itertools

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.runtime.distributed import cross_move  # noqa: E402

devs = jax.devices()


def sharding(pos, spec, shape=None):
    arr = np.array([devs[p] for p in pos], dtype=object)
    names = ("x",) if shape is None else ("x", "y")
    return NamedSharding(Mesh(arr.reshape(shape or (len(pos),)), names), spec)


shardings = {
    "p0 rows": ((0, 1, 2, 3), P("x")),
    "p1 rows": ((4, 5, 6, 7), P("x")),
    "p1 cols": ((7, 6, 5, 4), P(None, "x")),
    "span rows": ((0, 1, 4, 5), P("x")),
    "p1 pair replicated": ((6, 7), P()),
    "all 8 rows": (tuple(range(8)), P("x")),
}
count = 0
for (a, (pa, sa)), (b, (pb, sb)) in itertools.permutations(shardings.items(), 2):
    for dtype in (np.float32, np.int32):
        ref = (np.arange(8 * 8).reshape(8, 8) - 20).astype(dtype)
        x = jax.make_array_from_callback(ref.shape, sharding(pa, sa), lambda i, ref=ref: ref[i],
                                       dtype=ref.dtype)
        y = cross_move(x, sharding(pb, sb))
        common.check(f"{a} -> {b} {np.dtype(dtype).name}", y, ref, pb)
        count += 1

# scalars, bool and bfloat16 between the two processes, both ways
for ref in [np.asarray(np.float32(3.5)), np.array([True, False] * 4),
            np.linspace(-2, 2, 16).astype(jnp.bfloat16).reshape(4, 4)]:
    spec = P() if ref.ndim == 0 else P("x")  # sharded by rows where it has rows
    for src, dst in [((0, 1, 2, 3), (4, 5, 6, 7)), ((4, 5), (0, 1, 2, 3))]:
        x = jax.make_array_from_callback(ref.shape, sharding(src, spec), lambda i, ref=ref: ref[i],
                                         dtype=ref.dtype)
        y = cross_move(x, sharding(dst, spec))
        common.check(f"{ref.dtype} {src}->{dst}", y, ref, dst)
        count += 1

# an mjit program whose argument lives on the other process's devices
layer = mm.task(lambda w, v: jnp.tanh(v @ w), name="t0",
                mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,)))
w = jax.make_array_from_callback((4, 4), sharding((6, 7), P()),
                                 lambda i: np.eye(4, dtype=np.float32)[i] * 0.5, dtype=np.float32)
v = jnp.arange(8.0).reshape(2, 4)
out = mm.mjit(layer)(w, v)
common.check("mjit input from process 1", out, np.tanh(np.arange(8.0).reshape(2, 4) * 0.5),
             [0, 1])
print(f"process {me}: {count} moves", flush=True)
common.done()
