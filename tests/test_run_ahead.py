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
from multimesh.runtime import runahead, steps
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
    """Every fragment call and every wait of a real call (the generated dispatch
    function) is logged and replayed against the windows: the host waits on its
    submesh's oldest call, and never lets more than ``limit`` run. The interpreted
    program (the steps' ``run``) dispatches and waits in the same order."""
    compiled, ws, x, ref = _program(schedule, remat)
    assert compiled.run_ahead == runahead.default_run_ahead("cpu") == 2
    log, made_by = _logged(compiled, monkeypatch)
    flat = compiled.convention.inputs((ws, x), {})
    for limit in (None, 1, 3):
        compiled.run_ahead = limit  # rebuilds the dispatch program with the logged calls
        log.clear()
        value, grads = compiled(ws, x)
        np.testing.assert_allclose(value, ref[0], rtol=1e-5)
        for g, r in zip(grads, ref[1]):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        bounded = [s for s in compiled._exec._bounded if isinstance(s, steps.FragmentCall)]
        assert [e for e in log if e[0] == "call"] == [("call", k) for k in range(len(bounded))]
        generated = list(log)
        if limit is None:
            assert not any(e[0] == "wait" for e in generated)  # the plain program
            continue
        assert _most_in_flight(generated, bounded, made_by) == limit
        log.clear()
        exe = compiled._exec
        steps.run_program(exe._runs, exe.start(flat))
        assert _named(log, made_by) == _named(generated, made_by)
        # the interpreted run lets go of the outputs it watched
        assert all(not s.window.pending for s in bounded)


def _logged(compiled, monkeypatch):
    """Log each fragment call (``("call", k)``, the k-th of the run) and each wait of the
    run-ahead bound (``("wait", array)``); ``made_by``: id of an output -> its call."""
    log: list = []
    made_by: dict[int, int] = {}
    keep: list = []  # the outputs stay alive: their ids stay theirs

    def logged(fn):
        def call(*args):
            k = sum(1 for e in log if e[0] == "call")
            log.append(("call", k))
            outs = fn(*args)
            keep.extend(outs)
            made_by.update({id(o): k for o in outs})
            return outs
        return call

    for s in compiled._exec._program:
        if isinstance(s, steps.FragmentCall):
            s.fn = logged(s.fn)
    real_wait = runahead.wait

    def wait(x):
        log.append(("wait", x))
        real_wait(x)
    monkeypatch.setattr(runahead, "wait", wait)
    return log, made_by


def _named(log, made_by):
    return [e if e[0] == "call" else ("wait", made_by[id(e[1])]) for e in log]


def _most_in_flight(log, bounded, made_by) -> int:
    """Replay ``log`` against the windows of the ``bounded`` calls: each wait is on its
    submesh's oldest watched call not waited on yet. The most watched calls of one
    submesh not waited on, before a call is dispatched and at the end."""
    pending: dict[int, list[int]] = {}
    most = 0
    for kind, what in [*log, ("end", None)]:
        if kind == "wait":
            k = made_by[id(what)]
            assert k == pending[id(bounded[k].window)].pop(0)
            continue
        most = max([most, *map(len, pending.values())])
        if kind == "call" and bounded[what].watch is not None:
            pending.setdefault(id(bounded[what].window), []).append(what)
    return most
