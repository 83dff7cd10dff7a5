"""How long each dispatch step of a real step took, by step, not by trace slice name.

:func:`run_timed` runs one step as ``Executor.run_traced`` does (blocking after every
step, recording the trace), and also keeps each step's plan origin with its span's
times (the trace's own clock, so trace and durations agree), so a reader maps
durations to fragment calls without parsing slice names.
"""

from __future__ import annotations

from dataclasses import dataclass

from multimesh.runtime import steps as st

__all__ = ["StepTime", "run_timed"]


@dataclass(frozen=True)
class StepTime:
    """One dispatch step's span: its plan origin (a ``Call`` or ``Transfer``; None for
    a step that stands for several), its trace category and ``perf_counter`` times."""

    origin: object
    cat: str
    start: float
    end: float


def run_timed(executor, recorder, args) -> tuple[list, list[StepTime]]:
    """Run one step of ``executor`` on ``args`` (placed as its ``__call__`` takes them),
    recording the trace on ``recorder``; returns the outputs and every step's time."""
    times: list[StepTime] = []
    runs = st.traced(executor.steps, recorder, executor.devices, executor.plan)

    def clocked(step: st.Step, run):
        def timed(env: list) -> None:
            run(env)  # records exactly one span: this step's
            start, end = recorder.events[-1][2:4]
            times.append(StepTime(step.origin, step.cat, start, end))
        return timed

    env = st.run_program([clocked(s, r) for s, r in zip(executor.steps, runs, strict=True)],
                         executor.start(args))
    return executor.finish(env), times
