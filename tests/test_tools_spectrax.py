"""``tools/bench_spectrax.py`` without SpectraX (CI has none): it loads, says that SpectraX
is missing and exits with status 2, and its multimesh side computes ``jax.jit``'s loss
and gradients on its model (the check it applies to both sides when SpectraX is there)."""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from tests.tools import load_tool


def test_without_spectrax_the_tool_says_so_and_exits_2(monkeypatch, capsys):
    bench = load_tool("bench_spectrax")
    monkeypatch.setitem(sys.modules, "spectrax", None)  # as where it is not installed
    assert bench.main(["--schedules", "gpipe"]) == 2
    err = capsys.readouterr().err
    assert "bench_spectrax needs SpectraX" in err and "spectrax-lib" in err, err


def test_stages_are_placed_as_each_schedule_says():
    bench = load_tool("bench_spectrax")
    assert [bench.home("dualpipe-v", k) for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [bench.home("interleaved-1f1b", k) for k in range(8)] == [0, 1, 2, 3] * 2
    assert [bench.home("1f1b", k) for k in range(4)] == [0, 1, 2, 3]


def test_the_multimesh_side_computes_jax_jits_loss_and_gradients():
    bench = load_tool("bench_spectrax")
    cfg = bench.config(argparse.Namespace(blocks=4, d=16, heads=2, batch=8, seq=4,
                                          microbatches=4, reps=1, devices_per_stage=2))
    fn, params = bench.multimesh_step("1f1b", cfg)
    got = fn(params, jnp.asarray(cfg["x"]))
    jfn, jparams, jx = bench.jit_step(cfg)
    want = jfn(jparams, jx)
    assert bench.max_error(got, want) <= bench.TOLERANCE
    # each stage's gradients live where its parameters do: submesh k is devices 2k, 2k+1
    for k, stage in enumerate(got[1]):
        for leaf in jax.tree.leaves(stage):
            assert {d.id for d in leaf.sharding.device_set} == {2 * k, 2 * k + 1}
    # and the check can fail: a perturbed gradient is reported
    bad = (got[0], jax.tree.map(lambda g: g * 1.001, got[1]))
    assert bench.max_error(bad, want) > bench.TOLERANCE


def test_the_table_marks_a_side_that_differs():
    bench = load_tool("bench_spectrax")
    row = {"schedule": "gpipe", "stages": 4,
           "first_s": {"multimesh": 1.0, "spectrax": 2.0, "jax.jit": 0.5},
           "step_s": {"multimesh": 0.1, "spectrax": 0.2, "jax.jit": 0.05},
           "first_ratio_spectrax": 0.5, "first_ratio_jit": 2.0,
           "first_cpu_ratio_spectrax": 0.25, "first_cpu_ratio_jit": 1.5,
           "step_ratio_spectrax": 0.5, "step_ratio_jit": 2.0,
           "max_error": {"multimesh": 2e-7, "spectrax": 3e-2},
           "agree": {"multimesh": True, "spectrax": False}, "load": [1.0, 1.5]}
    line = bench.format_table([row]).splitlines()[-1]
    assert line == ("| gpipe | 4 | 1.00 / 2.00 / 0.50 | 0.50, 2.00 (0.25, 1.50) | 100.0 / 200.0 / 50.0 | "
                    "0.50, 2.00 | 2.0e-07, 3.0e-02 (**differs**) | 1.0–1.5 |"), line
