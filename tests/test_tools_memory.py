"""The memory tools of issue 33: ``tools/bench_memory.py``'s real peak (the RSS
high-water mark above the RSS before a run, reset per run) and ``tools/gpu_smoke.py``'s
``peak_bytes_in_use`` against theory, here with the statistics a GPU would report
stood in by a function (the CPU keeps none)."""

from __future__ import annotations

import re

import numpy as np

from tests.tools import load_tool


def test_bench_memory_measures_the_peak_of_one_run_above_its_start():
    bench = load_tool("bench_memory")
    big = 64 << 20

    def run():
        a = np.ones(big // 8)  # 64 MiB, freed before the run returns
        return float(a[0])

    first = bench._peak_of(run)
    assert big * 0.9 <= first <= big * 1.5
    # the high-water mark starts afresh: a small run after a big one measures small
    assert bench._peak_of(lambda: np.ones(1024).sum()) < big / 4


def test_gpu_smoke_reports_peak_bytes_in_use_against_theory():
    smoke = load_tool("gpu_smoke")

    def stats(device):  # before the two calls, then after them
        return {"bytes_in_use": 1 << 20, "peak_bytes_in_use": 3 << 20}

    lines = smoke.memory_checks(64, 16, stats, schedules=("zero-bubble-h1",))
    assert len(lines) == 2 * 8  # with and without remat, per device
    assert all(re.match(r"mem zero-bubble-h1( remat)? device \d: peak_bytes_in_use "
                        r"2\.0 MiB above the fixed part, theory [\d.]+ MiB, "
                        r"ratio [\d.]+ \(run_ahead=2\)", line) for line in lines), lines
    # the CPU's own devices keep no statistics: said so, nothing compiled
    assert smoke.memory_checks(64, 16) == [
        f"--  {s}: no memory_stats() on cpu"
        for s in ("1f1b", "1f1b remat", "zero-bubble-h1", "zero-bubble-h1 remat")]
