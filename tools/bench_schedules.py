"""P6: bubble fraction and peak live activations of each pipeline schedule.

    python tools/bench_schedules.py [--json PATH]

Simulated with unit costs (forward 1, backward 2, each half of a split backward 1)
on textbook pipelines (``multimesh.schedules``, each schedule's ``textbook_units``), next to the theory:
(P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(V*M+P-1) for interleaved 1F1B with V
stages per submesh, (P-1)/(3M+P-1) for zero bubble H1 and H2; eager 1F1B and GPipe
with 1F1B on the last submesh as 1F1B, interleaved GPipe and circular with reversed
backward as interleaved 1F1B; DualPipeV and ZB-V (V-shape, 2P half-size stages) the
lower bound (P-1)/(6M+P-1); Kimi-K2 as interleaved 1F1B. The stage bubble is
the idle share inside each submesh's own span (first unit to last), what a submesh
loses when consecutive steps overlap: ZB-H2's theory is 0. Peak live activations are
per submesh, in (stage, microbatch) activations: 1F1B holds at most P, GPipe M,
ZB-H2 2P, eager 1F1B 2P-1, interleaved GPipe and circular with reversed backward
V*M, DualPipeV 2P+1, ZB-V 2P, Kimi-K2 (V+1)P (``theoretical_peak_live``; docs/schedules.md derives each). ``tools/bench.py``
calls :func:`P6`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from multimesh.schedules import (  # noqa: E402
    all_schedules,
    build_schedule,
    get_schedule,
    live_activations,
    pipeline_units,
    theoretical_bubble,
    theoretical_peak_live,
)

# (schedule, interleave, split backward): the setups P6 measures, every registered
# schedule with a textbook pipeline (ScheduleAlgorithm.textbook_units).
SETUPS = tuple((s.name, s.interleave, s.splits_backward) for s in all_schedules()
               if s.has_textbook)
SHAPES = ((2, 4), (4, 8), (4, 16), (8, 32))


def P6_rows(shapes=SHAPES, setups=SETUPS) -> list[dict]:
    """One row per (P, M, schedule): simulated and theoretical bubble, peak activations."""
    rows = []
    for P, M in shapes:
        for name, V, split in setups:
            algo = get_schedule(name)
            units = (algo.textbook_units(P, M) if (V, split) == (algo.interleave,
                                                               algo.splits_backward)
                     else pipeline_units(P, M, interleave=V, split_backward=split))
            sched = build_schedule(units, name)
            theory = theoretical_bubble(name, P, M, V)
            rows.append({"P": P, "M": M, "schedule": name, "interleave": V,
                         "bubble": sched.bubble_fraction(), "theory": theory,
                         "stage_bubble": sched.timeline().stage_bubble_fraction(),
                         "peak_live": max(live_activations(sched)),
                         "peak_theory": theoretical_peak_live(name, P, M, V)})
    return rows


def P6(shapes=SHAPES, setups=SETUPS) -> dict[str, float]:
    """Flat measures for tools/bench.py: ``P6/<schedule>/P<P>M<M>/{bubble,theory,peak_live}``."""
    out: dict[str, float] = {}
    for r in P6_rows(shapes, setups):
        key = f"P6/{r['schedule']}/P{r['P']}M{r['M']}"
        out[f"{key}/bubble"] = r["bubble"]
        if r["theory"] is not None:
            out[f"{key}/theory"] = r["theory"]
        out[f"{key}/stage_bubble"] = r["stage_bubble"]
        out[f"{key}/peak_live"] = float(r["peak_live"])
        if r["peak_theory"] is not None:
            out[f"{key}/peak_theory"] = float(r["peak_theory"])
    return out


def format_table(rows: list[dict]) -> str:
    lines = [f"{'P':>3} {'M':>3}  {'schedule':<28}{'bubble':>8}{'theory':>8}"
             f"{'stage bubble':>14}{'peak live':>11}{'theory':>8}"]
    for r in rows:
        theory = f"{r['theory']:.3f}" if r["theory"] is not None else "-"
        peak = str(r["peak_theory"]) if r["peak_theory"] is not None else "-"
        lines.append(f"{r['P']:>3} {r['M']:>3}  {r['schedule']:<28}{r['bubble']:>8.3f}"
                     f"{theory:>8}{r['stage_bubble']:>14.3f}{r['peak_live']:>11}{peak:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the flat P6 measures as JSON to this path")
    args = ap.parse_args(argv)
    print(format_table(P6_rows()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(P6(), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
