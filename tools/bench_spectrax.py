"""multimesh against SpectraX and ``jax.jit`` on the same pipelined training step.

    python tools/bench_spectrax.py [--schedules gpipe,1f1b,dualpipe-v] [--reps 5]
                                   [--devices-per-stage 2] [--json PATH]

Needs SpectraX (PyPI ``spectrax-lib``, AGPL-3.0) installed beside multimesh, in its own
environment (it is no dependency of multimesh, which never imports it; only this tool
does, when it runs): without it the tool says so and exits with status 2.

The model: ``--blocks`` pre-norm transformer blocks (``_bench_common.transformer_block``:
width ``--d``, ``--heads`` heads, a 4d GELU MLP), batch ``--batch`` of ``--seq`` tokens,
loss the mean square of the last block's output, on 4 submeshes of
``--devices-per-stage`` devices (the batch sharded over a submesh's devices), trained
over ``--microbatches`` microbatches. One set of parameters and one batch serve all
three:

* **multimesh**: ``mjit(microbatch(value_and_grad(loss), schedule=..., reduction="mean"))``,
  each stage a ``task`` on its submesh (``_bench_common.pipelined_transformer``);
* **SpectraX**: the same function with ``sxstage_iter`` between the stages, under
  ``sxjit(mesh=MpMdMesh(...), schedule=..., batch_argnums=(1,))`` and
  ``sxvalue_and_grad`` (its loss is the mean over microbatches, as multimesh's here);
* **jax.jit**: ``jax.jit(value_and_grad(loss))`` on the whole batch, data-parallel over
  the same devices (the parameters replicated): the reference.

Schedules, as multimesh names them (SpectraX's class beside): ``gpipe`` (GPipe),
``1f1b`` (Std1F1B), ``zero-bubble-h1`` (ZeroBubbleH1), ``interleaved-1f1b``
(InterleavedH1, 2 virtual stages, its
``"interleaved"`` layout), ``dualpipe-v`` (DualPipeV). 1F1B-like schedules put
``--blocks / 4`` blocks in each of 4 stages; interleaved and DualPipeV 8 stages of
``--blocks / 8``, placed round-robin and in a V (the tool checks that SpectraX's schedule places each
stage where multimesh's does). Each side's parameters are put on the
devices of their stage before timing (SpectraX requires it; multimesh is given the same).

Measured per schedule: the first call (trace, compile and the first step, the
in-memory caches of jax and multimesh cleared before each; jax's persistent cache off),
by wall-clock and by this process's CPU time (steadier on a loaded machine),
the steady step (median of ``--reps`` steps, the three alternating so they share the
machine's load), and whether each side's loss and gradients equal ``jax.jit``'s: the
largest ``|a - b| / max|b|`` over the gradient leaves (agreement: at most 1e-5). The
load average (``/proc/loadavg``) is read before and after. Output: a markdown table,
and ``--json PATH``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("LOGGING_LEVEL_ED", "WARNING")  # SpectraX's per-call INFO lines
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/ (its helpers)
from _bench_common import pipelined_transformer, transformer_block, write_json  # noqa: E402

SUBMESHES = 4
SCHEDULES = ("gpipe", "1f1b", "zero-bubble-h1", "interleaved-1f1b", "dualpipe-v")
DEFAULT = "gpipe,1f1b,dualpipe-v"
TOLERANCE = 1e-5
# multimesh's name -> (SpectraX's schedule class, its keyword arguments)
SPECTRAX_NAMES = {"gpipe": ("GPipe", {}), "1f1b": ("Std1F1B", {}),
                  "zero-bubble-h1": ("ZeroBubbleH1", {}),
                  "interleaved-1f1b": ("InterleavedH1", {"virtual_stages": 2,
                                                         "stage_layout": "interleaved"}),
                  "dualpipe-v": ("DualPipeV", {})}


class SpectraxMissing(RuntimeError):
    """SpectraX cannot be imported in this environment."""


def import_spectrax():
    """SpectraX's modules the tool uses, or :class:`SpectraxMissing` saying how to get them."""
    try:
        import spectrax
        from spectrax.runtime import mpmd, schedules
        from spectrax.runtime.types import MpMdMesh
    except ImportError as e:
        raise SpectraxMissing(
            f"bench_spectrax needs SpectraX, which cannot be imported here ({e}). Install it "
            "in a separate environment (it is AGPL-3.0 and no dependency of multimesh), e.g. "
            "`python3.11 -m venv /tmp/spx && /tmp/spx/bin/pip install jax==0.10.2 "
            "jaxlib==0.10.2 spectrax-lib==0.1.4`, and run this tool with that interpreter "
            "and PYTHONPATH=<multimesh checkout>.") from e
    return spectrax, mpmd, schedules, MpMdMesh


def stages_of(schedule: str) -> int:
    """How many stages ``schedule`` runs on the 4 submeshes: 8 for the two-per-submesh
    schedules (interleaved, V-shaped), else 4."""
    return 2 * SUBMESHES if schedule in ("interleaved-1f1b", "dualpipe-v") else SUBMESHES


def home(schedule: str, k: int) -> int:
    """Stage ``k``'s submesh: round-robin, or for ``dualpipe-v`` down then back up."""
    if schedule == "dualpipe-v" and k >= SUBMESHES:
        return 2 * SUBMESHES - 1 - k
    return k % SUBMESHES


def block_params(blocks: int, d: int) -> list[dict]:
    """Each block's parameters, as numpy arrays (the same whatever the stage layout)."""
    import jax
    import numpy as np

    key = jax.random.key(0)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d),
              "w2": (4 * d, d)}
    return [{n: np.asarray(jax.random.normal(jax.random.fold_in(key, 10 * i + j), sh) / d)
             for j, (n, sh) in enumerate(shapes.items())} for i in range(blocks)]


def staged(blocks: list[dict], stages: int) -> list[list[dict]]:
    """``blocks`` cut into ``stages`` consecutive stages of equal length."""
    if len(blocks) % stages:
        raise ValueError(f"{len(blocks)} blocks do not split into {stages} equal stages; "
                         f"pass --blocks as a multiple of {stages}.")
    per = len(blocks) // stages
    return [blocks[k * per:(k + 1) * per] for k in range(stages)]


def plain_loss(heads: int):
    """The loss without stages: what ``jax.jit`` differentiates."""

    def loss(params, x):
        for ps in params:
            for p in ps:
                x = transformer_block(p, x, heads)
        return (x ** 2).mean()

    return loss


def submesh_devices(k: int, per: int) -> list:
    import jax

    return jax.devices()[per * k:per * (k + 1)]


def place(params: list[list[dict]], schedule: str, per: int) -> list[list[dict]]:
    """Each stage's parameters replicated on the devices of its submesh."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    out = []
    for k, ps in enumerate(params):
        mesh = Mesh(submesh_devices(home(schedule, k), per), ("x",))
        out.append(jax.device_put(ps, NamedSharding(mesh, P())))
    return out


def multimesh_step(schedule: str, cfg: dict):
    """The step multimesh compiles: ``(fn, params)``."""
    import jax

    import multimesh.jax as mm

    stages, per = stages_of(schedule), cfg["devices_per_stage"]
    loss, _ = pipelined_transformer(
        stages, cfg["blocks"] // stages, cfg["d"], cfg["heads"],
        lambda k: range(per * home(schedule, k), per * home(schedule, k) + per))
    step = mm.microbatch(jax.value_and_grad(loss), dim=0,
                         size=cfg["batch"] // cfg["microbatches"], argnum=1,
                         schedule=schedule, reduction="mean")
    params = place(staged(cfg["params"], stages), schedule, per)
    return mm.mjit(step), params


def spectrax_step(schedule: str, cfg: dict):
    """The same step under SpectraX: ``(fn, params)``, ``fn`` returning ``(loss, grads)``."""
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    _, mpmd, schedules, MpMdMesh = import_spectrax()
    stages, per, heads = stages_of(schedule), cfg["devices_per_stage"], cfg["heads"]
    import jax

    devices = np.array(jax.devices()[:SUBMESHES * per]).reshape(SUBMESHES, per)
    mesh = MpMdMesh(Mesh(devices, ("pp", "dp")), "pp")
    edge = P("dp") if per > 1 else None

    def loss(params, x):
        for k, ps in enumerate(params):
            for p in ps:
                x = transformer_block(p, x, heads)
            if k < len(params) - 1:
                x = mpmd.sxstage_iter(x, sharding=edge)
        return (x ** 2).mean()

    cls, kwargs = SPECTRAX_NAMES[schedule]
    sched = getattr(schedules, cls)(microbatches=cfg["microbatches"], **kwargs)
    ranks = {sched.logical_at(r, v, SUBMESHES): r for r in range(SUBMESHES)
             for v in range(sched.virtual_stages_per_rank())}
    ours = {k: home(schedule, k) for k in range(stages)}
    if ranks != ours:
        raise RuntimeError(f"SpectraX's {cls} places the stages on the ranks {ranks}, "
                           f"multimesh's {schedule!r} on {ours}: not the same program.")
    fn = mpmd.sxjit(loss, mesh=mesh, schedule=sched, batch_argnums=(1,))
    vg = mpmd.sxvalue_and_grad(fn, argnums=0)

    def step(params, x):
        value, (grads,) = vg(params, x)
        return value, grads

    return step, place(staged(cfg["params"], stages), schedule, per)


def jit_step(cfg: dict):
    """``jax.jit`` of the whole step, data-parallel over the same devices: ``(fn, params, x)``."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices()[:SUBMESHES * cfg["devices_per_stage"]], ("data",))
    params = jax.device_put(staged(cfg["params"], SUBMESHES), NamedSharding(mesh, P()))
    x = jax.device_put(cfg["x"], NamedSharding(mesh, P("data")))
    return jax.jit(jax.value_and_grad(plain_loss(cfg["heads"]))), params, x


def max_error(got, want) -> float:
    """The largest ``|a - b| / max|b|`` over the leaves (loss included), flattened in
    block order whatever the stage layout."""
    import jax
    import numpy as np

    errs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
    return max(errs)


def first_call(make):
    """Build the step with ``make()`` (``(fn, params, x)``) after clearing the in-memory
    caches, and time its first call to the result: ``(fn, params, x, (wall seconds, CPU
    seconds of this process), result)``."""
    import jax

    import multimesh.jax as mm

    jax.clear_caches()
    mm.clear_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    fn, params, x = make()
    out = jax.block_until_ready(fn(params, x))
    return fn, params, x, (time.perf_counter() - t0, time.process_time() - c0), out


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run(schedule: str, cfg: dict) -> dict:
    """One schedule: first calls (``jax.jit``, multimesh, SpectraX), then ``--reps``
    alternating steps of the three, and both sides' results against ``jax.jit``'s."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(cfg["x"])  # on the default device, uncommitted: each side places it
    jfn, jparams, jx, j_first, want = first_call(lambda: jit_step(cfg))
    mfn, mparams, _, m_first, m_out = first_call(lambda: (*multimesh_step(schedule, cfg), x))
    sfn, sparams, _, s_first, s_out = first_call(lambda: (*spectrax_step(schedule, cfg), x))
    variants = {"multimesh": (mfn, mparams, x), "spectrax": (sfn, sparams, x),
                "jax.jit": (jfn, jparams, jx)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn, params, xs in variants.values():  # each once: clearing the caches for a
        jax.block_until_ready(fn(params, xs))  # first call dropped the others' executables
    loads = [loadavg()]
    for _ in range(cfg["reps"]):
        for name, (fn, params, xs) in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, xs))
            times[name].append(time.perf_counter() - t0)
    loads.append(loadavg())
    m_err, s_err = max_error(m_out, want), max_error(s_out, want)
    step = {k: statistics.median(v) for k, v in times.items()}
    return {"schedule": schedule, "stages": stages_of(schedule),
            "first_s": {"multimesh": m_first[0], "spectrax": s_first[0],
                        "jax.jit": j_first[0]},
            "first_cpu_s": {"multimesh": m_first[1], "spectrax": s_first[1],
                            "jax.jit": j_first[1]},
            "step_s": step, "steps_s": times,
            "step_ratio_spectrax": step["multimesh"] / step["spectrax"],
            "step_ratio_jit": step["multimesh"] / step["jax.jit"],
            "first_ratio_spectrax": m_first[0] / s_first[0],
            "first_ratio_jit": m_first[0] / j_first[0],
            "first_cpu_ratio_spectrax": m_first[1] / s_first[1],
            "first_cpu_ratio_jit": m_first[1] / j_first[1],
            "max_error": {"multimesh": m_err, "spectrax": s_err},
            "agree": {"multimesh": m_err <= TOLERANCE, "spectrax": s_err <= TOLERANCE},
            "loss": {"multimesh": float(m_out[0]), "spectrax": float(s_out[0]),
                     "jax.jit": float(want[0])},
            "load": loads}


def format_table(rows: list[dict]) -> str:
    """The markdown table of :func:`run`'s rows."""
    lines = ["| schedule | stages | first call: multimesh / SpectraX / jax.jit (s) | "
             "ratio to SpectraX, to jax.jit (by CPU time) | step: multimesh / SpectraX / jax.jit (ms) | "
             "ratio to SpectraX, to jax.jit | max error against jax.jit: multimesh, "
             "SpectraX | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, s, e = r["first_s"], r["step_s"], r["max_error"]
        ok = {k: "" if v else " (**differs**)" for k, v in r["agree"].items()}
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {f['multimesh']:.2f} / {f['spectrax']:.2f}"
            f" / {f['jax.jit']:.2f} | {r['first_ratio_spectrax']:.2f}, "
            f"{r['first_ratio_jit']:.2f} ({r['first_cpu_ratio_spectrax']:.2f}, "
            f"{r['first_cpu_ratio_jit']:.2f}) | {s['multimesh'] * 1e3:.1f} / "
            f"{s['spectrax'] * 1e3:.1f} / {s['jax.jit'] * 1e3:.1f} | "
            f"{r['step_ratio_spectrax']:.2f}, {r['step_ratio_jit']:.2f} | "
            f"{e['multimesh']:.1e}{ok['multimesh']}, {e['spectrax']:.1e}{ok['spectrax']} | "
            f"{r['load'][0]:.1f}–{r['load'][1]:.1f} |")
    return "\n".join(lines)


def config(args) -> dict:
    import jax
    import numpy as np

    if args.batch % (args.microbatches * args.devices_per_stage):
        raise SystemExit(f"--batch {args.batch} must be a multiple of --microbatches "
                         f"({args.microbatches}) times --devices-per-stage "
                         f"({args.devices_per_stage}).")
    x = np.asarray(jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d)))
    return {"blocks": args.blocks, "d": args.d, "heads": args.heads, "batch": args.batch,
            "seq": args.seq, "microbatches": args.microbatches, "reps": args.reps,
            "devices_per_stage": args.devices_per_stage,
            "params": block_params(args.blocks, args.d), "x": x}


def versions() -> dict:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for name in ("jax", "jaxlib", "spectrax-lib"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default=DEFAULT,
                    help=f"comma-separated, of {','.join(SCHEDULES)}")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--devices-per-stage", type=int, default=2, choices=(1, 2))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    schedules = args.schedules.split(",")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        ap.error(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
    try:
        import_spectrax()
    except SpectraxMissing as e:
        print(e, file=sys.stderr)
        return 2
    import jax

    cfg = config(args)
    head = {"model": f"{args.blocks} blocks, d={args.d}, {args.heads} heads, batch "
                     f"{args.batch} x {args.seq} tokens, M={args.microbatches}, "
                     f"{SUBMESHES} submeshes x {args.devices_per_stage} devices",
            "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{head['model']}; {head['versions']}; load {loadavg():.1f}", flush=True)
    jax.block_until_ready(jax.jit(lambda a: a + 1)(1.0))  # the backend's one-time start
    rows = []
    for schedule in schedules:
        rows.append(run(schedule, cfg))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    write_json(args.json, {**head, "rows": rows})
    return 0 if all(all(r["agree"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
