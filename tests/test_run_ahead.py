"""The run-ahead bound (issue 33 item 2): how many fragment calls of one submesh the
host dispatches before the oldest has finished.

Its default per backend and from ``$MULTIMESH_RUN_AHEAD``, its check, that the bound
holds while a step dispatches, and that values and gradients equal plain JAX's
gradient accumulation with and without it, for the schedules it was measured on.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.errors import MultimeshValueError
from multimesh.runtime import runahead
from tests.models import tanh_chain

M, ROWS = 4, 8


def _program(schedule, remat=None, stages=4):
    loss, ws, _ = tanh_chain(stages)
    x = jax.numpy.linspace(-1, 1, M * ROWS * 16).reshape(M * ROWS, 16)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=ROWS, argnum=1,
                         schedule=schedule, remat=remat)
    compiled = mm.mjit(step).lower(ws, x).compile()
    with mm.ignore_transforms():
        parts = [jax.value_and_grad(loss)(ws, x[ROWS * m:ROWS * (m + 1)]) for m in range(M)]
    ref = sum(p[0] for p in parts), jax.tree.map(lambda *g: sum(g), *[p[1] for p in parts])
    return compiled, ws, x, ref


def test_default_per_backend_and_from_the_environment(monkeypatch):
    monkeypatch.delenv(runahead.RUN_AHEAD_ENV, raising=False)
    assert runahead.default_run_ahead("cpu") == 2
    assert runahead.default_run_ahead("gpu") is None
    assert runahead.default_run_ahead("tpu") is None
    monkeypatch.setenv(runahead.RUN_AHEAD_ENV, "none")
    assert runahead.default_run_ahead("cpu") is None
    monkeypatch.setenv(runahead.RUN_AHEAD_ENV, "3")
    assert runahead.default_run_ahead("gpu") == 3
    monkeypatch.setenv(runahead.RUN_AHEAD_ENV, "many")
    with pytest.raises(MultimeshValueError, match=r"MULTIMESH_RUN_AHEAD must be a positive whole number.*got 'many'"):
        runahead.default_run_ahead("cpu")
    monkeypatch.setenv(runahead.RUN_AHEAD_ENV, "1")
    compiled, ws, x, ref = _program("gpipe", stages=2)
    assert compiled.run_ahead == 1
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(MultimeshValueError, match="`run_ahead` must be a positive integer"):
            compiled.run_ahead = bad


@pytest.mark.parametrize("schedule,remat", [("gpipe", None), ("1f1b", None),
                                            ("zero-bubble-h1", True), ("1f1b", True)])
def test_the_bound_holds_and_values_equal_plain_jax(schedule, remat, monkeypatch):
    compiled, ws, x, ref = _program(schedule, remat)
    assert compiled.run_ahead == runahead.default_run_ahead("cpu") == 2
    most = {"in flight": 0, "calls": 0}
    plain_run = runahead.BoundedCall.run

    def run(self, env):
        plain_run(self, env)
        most["calls"] += 1
        most["in flight"] = max(most["in flight"], len(self.window.pending))
        # what the host let go of had finished: only the last `limit` may still run
        assert len(self.window.pending) <= self.window.limit

    monkeypatch.setattr(runahead.BoundedCall, "run", run)
    for limit in (None, 1, 3):
        compiled.run_ahead = limit  # rebuilds the dispatch program with the patched run
        value, grads = compiled(ws, x)
        np.testing.assert_allclose(value, ref[0], rtol=1e-5)
        for g, r in zip(grads, ref[1]):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        if limit is not None:
            assert most["in flight"] == limit
            assert most["calls"] == len(compiled.plan_data.calls())
        else:
            assert most["calls"] == 0  # no bound: the plain dispatch program
        most.update({"in flight": 0, "calls": 0})
    # a run lets go of the outputs it watched
    compiled.run_ahead = 2
    compiled(ws, x)
    windows = {id(s.window): s.window for s in _bounded(compiled)}
    assert windows and all(not w.pending for w in windows.values())


def _bounded(compiled):
    return [r.__self__ for r in compiled._exec._runs
            if isinstance(getattr(r, "__self__", None), runahead.BoundedCall)]
