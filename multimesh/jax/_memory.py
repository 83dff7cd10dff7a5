"""``MpmdCompiled.memory_profile``: measured memory per submesh beside the schedule's theory."""

from __future__ import annotations

import dataclasses

import jax

from multimesh.runtime.memory import SubmeshMemory, measure_step

__all__ = ["MemoryProfile", "memory_profile"]


@dataclasses.dataclass
class MemoryProfile:
    """Per submesh (schedule order), what one real step held and what the schedule
    predicts: ``predicted_microbatches`` live activations (the schedule's
    ``live_activations``) times ``residual_bytes`` per stage and microbatch."""

    schedule: str | None
    submeshes: list[SubmeshMemory]
    predicted_microbatches: list[int]

    @property
    def predicted_activations(self) -> list[int]:
        return [n * s.residual_bytes for n, s in zip(self.predicted_microbatches, self.submeshes)]

    def format(self) -> str:
        """A table, one row per submesh, sizes in KiB per device."""
        head = (f"{'devices':<14}{'peak':>9}{'inputs':>9}{'activ.':>9}{'other':>9}{'temp':>9}"
                f"{'act.peak':>10}{'mbs':>5}{'theory':>9}{'(mbs)':>6}")
        rows = [head]
        for s, n, t in zip(self.submeshes, self.predicted_microbatches,
                           self.predicted_activations):
            ids = ",".join(map(str, s.devices))
            rows.append(f"{ids:<14}" + "".join(f"{v / 1024:>9.1f}" for v in (
                s.peak, s.inputs, s.activations, s.other, s.temporaries))
                + f"{s.peak_activations / 1024:>10.1f}{s.peak_microbatches:>5}"
                + f"{t / 1024:>9.1f}{n:>6}")
        return "\n".join(rows)


def memory_profile(compiled, args, kwargs) -> MemoryProfile:
    """Run one step of ``compiled`` on ``args`` and measure it (see :class:`MemoryProfile`)."""
    low = compiled._lowered
    flat, _ = jax.tree.flatten((args, kwargs))
    flat = [flat[i] for i in low.dyn_idx]
    if low.key_inputs:
        flat = [jax.random.key_data(x) if k else x for x, k in zip(flat, low.key_inputs)]
    measured = {tuple(s.devices): s for s in measure_step(compiled._exec, flat)}
    sched = compiled.schedule
    if sched is None:
        return MemoryProfile(None, list(measured.values()), [0] * len(measured))
    ids = [tuple(low.devices[p].id for p in where) for where in sched.devices]
    live = sched.live_activations()
    rows = [measured.get(i, SubmeshMemory(i)) for i in ids]
    return MemoryProfile(sched.name, rows, list(live))
