"""Run a program lowered by Shardy's own JAX front end with ``multimesh.jax.compile_mpmd``.

    python tools/shardy_frontend.py PATH    # PATH: a shardy source tree at 4b908d99

Shardy's front end (``shardy/integrations/python/jax/mpmd``: ``mpmd.jit``,
``named_computation``, ``call``, pipeline schedules) is not on PyPI. At shardy commit
``4b908d99`` (2026-05-14) it runs on jax 0.10.2 once :func:`install_shims` has
supplied three imports; later commits need jax >= 0.11 (``jax._src.flattree``).

The script lowers a 2-stage x 4-microbatch 1F1B ``value_and_grad`` step with
``mpmd.jit`` (meshes ``m1`` = ``x=4`` on devices 0-3 and ``m2`` = ``x=2, y=2`` on
4-7, plus an unused argument the front end drops), runs ``compile_mpmd(lowered)``,
checks values, gradients and devices against ``jax.jit``, and shows that Shardy's
own ``lowered.compile()`` stops at ``PjRtCompiler requires an HloProgram`` (Pathways
only). It is a manual check: CI cannot install the front end.
"""

from __future__ import annotations

import os
import sys
import types
import typing

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def install_shims() -> None:
    """What Shardy's front end (4b908d99) needs to import on jax 0.10.2."""
    import jaxlib.mlir
    import jaxlib.mlir.ir

    from multimesh._src.jax_compat import sdy_mpmd_partitioner

    sdy_mpmd_partitioner()  # aliases jax.jaxlib._jax, which the extension imports
    # `from mlir import ir`
    sys.modules.setdefault("mlir", jaxlib.mlir)
    sys.modules.setdefault("mlir.ir", jaxlib.mlir.ir)
    # Two names from packages jax does not depend on, used only as annotations/dicts.
    if "jaxtyping" not in sys.modules:
        jt = types.ModuleType("jaxtyping")
        jt.PyTree = type("PyTree", (), {"__class_getitem__": classmethod(
            lambda cls, item: typing.Any)})
        sys.modules["jaxtyping"] = jt
    if "immutabledict" not in sys.modules:
        im = types.ModuleType("immutabledict")
        im.immutabledict = dict
        sys.modules["immutabledict"] = im


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    sys.path.insert(0, os.path.abspath(argv[0]))
    install_shims()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from shardy.integrations.python.jax import mpmd
    from shardy.integrations.python.jax.mpmd import pipeline_registry

    import multimesh.jax as mm

    d = jax.devices()
    topology = {"m1": Mesh(np.array(d[:4]), ("x",)),
                "m2": Mesh(np.array(d[4:]).reshape(2, 2), ("x", "y"))}
    stage1 = mpmd.named_computation(lambda w, x: jnp.tanh(x @ w), name="stage1")
    stage2 = mpmd.named_computation(lambda w, h: jnp.sum(jnp.tanh(h @ w) ** 2), name="stage2")

    def loss(params, xs, unused):
        return sum(mpmd.call(lambda p, x: stage2(p[1], stage1(p[0], x)), call_counter=i)(
            params, xs[i]) for i in range(xs.shape[0]))

    def plain(params, xs, unused):
        return sum(jnp.sum(jnp.tanh(jnp.tanh(xs[i] @ params[0]) @ params[1]) ** 2)
                   for i in range(xs.shape[0]))

    config = mpmd.make_config(
        topology, {"stage1": "m1", "stage2": "m2"},
        name_to_stage_assignment={"stage1": 0, "stage2": 1},
        pipeline_schedule=pipeline_registry.get_pipeline_schedule("ONE_FWD_ONE_BWD"))
    k = jax.random.key(0)
    params = (jax.random.normal(jax.random.fold_in(k, 1), (16, 16)) / 4,
              jax.random.normal(jax.random.fold_in(k, 2), (16, 16)) / 4)
    xs = jax.random.normal(jax.random.fold_in(k, 3), (4, 8, 16))
    replicated = NamedSharding(topology["m1"], P())
    step = mpmd.jit(jax.value_and_grad(loss), config,
                    in_shardings=((replicated, replicated),
                                  NamedSharding(topology["m1"], P(None, "x")), replicated))
    lowered = step.lower(params, xs, jnp.zeros(3))
    compiled = mm.compile_mpmd(lowered)
    print(compiled.plan())
    value, grads = compiled(params, xs, jnp.zeros(3))
    want_value, want_grads = jax.jit(jax.value_and_grad(plain))(params, xs, jnp.zeros(3))
    errors = [float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves((value, grads)),
                              jax.tree.leaves((want_value, want_grads)))]
    devices = [sorted(x.id for x in a.devices()) for a in jax.tree.leaves((value, grads))]
    print("max |error| (loss, dW1, dW2):", errors)
    print("devices (loss, dW1, dW2):", devices)
    assert max(errors) < 1e-4 and devices == [[4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    try:
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - report whatever Shardy's own path raises
        print(f"Shardy's own compile: {type(e).__name__}: {str(e).splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
