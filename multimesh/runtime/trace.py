"""Chrome / Perfetto trace files of a pipeline step: one track per submesh.

Events are ``(track, name, start_s, end_s)`` tuples, optionally with a fifth
element, a dict of arguments shown in the viewer (its ``"cat"`` key, if any,
becomes the event category, e.g. ``"fragment"`` or ``"transfer"``). Times are in
seconds on any clock; the file starts at the earliest event. Open the JSON in
``chrome://tracing`` or https://ui.perfetto.dev. A *flow* ``(i, j)`` draws an
arrow from event ``i`` to event ``j`` (indices into the events), e.g. from the call
that made a value to its transfer onto another submesh.

    rec = TraceRecorder()
    with rec.span("submesh 0", "layer1_fwd mb0"):
        out = exe(*args); jax.block_until_ready(out)
    rec.write("step.json")
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["trace_events", "write_trace", "TraceRecorder"]

Event = tuple  # (track, name, start_s, end_s[, args])


def trace_events(events: Iterable[Event], *, process_name: str = "multimesh",
                 tracks: Sequence[str] | None = None,
                 flows: Sequence[tuple[int, int]] = ()) -> dict:
    """The trace as a Chrome trace-event dictionary (``{"traceEvents": [...]}``).

    Tracks become threads of one process, in the order of ``tracks`` (if given) and
    then of first appearance; every event is a complete (``"ph": "X"``) slice, and
    every flow a pair of flow events (``"ph": "s"`` / ``"f"``, one ``id``).
    """
    events = [tuple(e) for e in events]
    for e in events:
        if len(e) not in (4, 5):
            raise ValueError(f"trace event must be (track, name, start_s, end_s[, args]), got {e!r}")
        if float(e[3]) < float(e[2]):
            raise ValueError(f"trace event {e[1]!r} on {e[0]!r} ends before it starts")
    order = list(dict.fromkeys([*(tracks or ()), *(str(e[0]) for e in events)]))
    tid = {t: k + 1 for k, t in enumerate(order)}
    t0 = min((float(e[2]) for e in events), default=0.0)
    out = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
            "args": {"name": process_name}}]
    for t, k in tid.items():
        out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": k, "args": {"name": t}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": k,
                    "args": {"sort_index": k}})
    for e in events:
        track, name, start, end = str(e[0]), str(e[1]), float(e[2]), float(e[3])
        args = dict(e[4]) if len(e) == 5 and e[4] else {}
        ev = {"name": name, "ph": "X", "pid": 1, "tid": tid[track],
              "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6,
              "cat": str(args.pop("cat", "fragment"))}
        if args:
            ev["args"] = {k: _jsonable(v) for k, v in args.items()}
        out.append(ev)
    out.extend(_flow_events(out[1 + 2 * len(tid):], flows))
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _flow_events(slices: list[dict], flows: Sequence[tuple[int, int]]) -> list[dict]:
    """Flow events for ``flows`` between ``slices``: each end sits inside its slice
    (at its middle), which is how a viewer binds a flow to a slice."""
    out = []
    for n, (i, j) in enumerate(flows, 1):
        if not (0 <= i < len(slices) and 0 <= j < len(slices)):
            raise ValueError(f"trace flow {(i, j)} names an event that is not in the trace "
                             f"({len(slices)} events)")
        a, b = slices[i], slices[j]
        for ph, e in (("s", a), ("f", b)):
            ev = {"name": b["name"], "cat": b["cat"], "ph": ph, "id": n, "pid": 1,
                  "tid": e["tid"], "ts": e["ts"] + e["dur"] / 2}
            if ph == "f":
                ev["bp"] = "e"
            out.append(ev)
    return out


def write_trace(events: Iterable[Event], path: str | os.PathLike, *,
                process_name: str = "multimesh", tracks: Sequence[str] | None = None,
                flows: Sequence[tuple[int, int]] = ()) -> dict:
    """Write ``events`` as a Chrome/Perfetto trace JSON file; returns the dictionary."""
    trace = trace_events(events, process_name=process_name, tracks=tracks, flows=flows)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return trace


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


class TraceRecorder:
    """Collects events while a step runs (``time.perf_counter`` seconds)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def record(self, track: str, name: str, start_s: float, end_s: float, **args) -> None:
        self.events.append((track, name, start_s, end_s, args) if args
                           else (track, name, start_s, end_s))

    @contextmanager
    def span(self, track: str, name: str, **args) -> Iterator[None]:
        """Time the body as one slice; block on the outputs inside it for device time."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.record(track, name, t, time.perf_counter(), **args)

    def write(self, path: str | os.PathLike, *, process_name: str = "multimesh",
              tracks: Sequence[str] | None = None) -> dict:
        return write_trace(self.events, path, process_name=process_name, tracks=tracks)
