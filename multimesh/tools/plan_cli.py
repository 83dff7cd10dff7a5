"""``multimesh plan``: plan a described cluster from a model configuration.

``multimesh plan --model llama3-70b --device h100 --devices 256`` (or the model's
shapes: ``--layers 80 --d-model 8192 --heads 64 --kv-heads 8 --ffn 28672 --vocab
128256``, or ``--config model.json`` with those keys) prints the plan;
``--json`` prints it as JSON, ``--code`` as a program. Exit codes: 0 planned,
1 no plan (nothing fits, a bad figure), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from multimesh._src.errors import MultimeshError
from multimesh.jax import Cluster, Transformer, plan_cluster

PROG = "multimesh"
_SHAPE = ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab")
_PINS = ("tensor", "pipeline", "data", "fsdp", "microbatch_size", "virtual_stages")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} plan", description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", help="a known configuration: llama3-8b, llama3-70b, llama3-405b")
    m.add_argument("--config", help="a JSON file with the model's keys (layers, d_model, "
                   "heads, kv_heads, ffn, vocab, seq, global_batch)")
    for k in _SHAPE:
        m.add_argument(f"--{k.replace('_', '-')}", type=int)
    m.add_argument("--seq", type=int, help="tokens per sequence (default 8192)")
    m.add_argument("--global-batch", type=int, help="sequences per step (default 2048)")
    c = p.add_argument_group("cluster")
    c.add_argument("--device", default="h100", help="device kind (default h100)")
    c.add_argument("--devices", type=int, required=True)
    c.add_argument("--devices-per-node", type=int)
    c.add_argument("--hbm-gb", type=float, help="HBM per device, GB")
    c.add_argument("--link-gb-per-s", type=float, help="GB/s per device inside a node, one way")
    c.add_argument("--network-gb-per-s", type=float, help="GB/s per device between nodes")
    s = p.add_argument_group("pins (fix a choice instead of searching it)")
    for k in _PINS:
        s.add_argument(f"--{k.replace('_', '-')}", type=int)
    s.add_argument("--schedule")
    s.add_argument("--recompute", choices=("none", "selective", "full"))
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    o.add_argument("--code", action="store_true", help="print the plan as a program")
    return p


def _model(args):
    extra = {k: getattr(args, k) for k in ("seq", "global_batch") if getattr(args, k)}
    if args.model:
        name = args.model.lower().removeprefix("llama3-").removeprefix("llama-3-")
        return Transformer.llama3(name, **extra)
    cfg: dict = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            cfg = json.load(f)
    cfg.update({k: getattr(args, k) for k in _SHAPE if getattr(args, k) is not None})
    cfg.update(extra)
    cfg.setdefault("seq", 8192)
    cfg.setdefault("global_batch", 2048)
    missing = [k for k in _SHAPE if k not in cfg]
    if missing:
        raise SystemExit(f"{PROG} plan: error: give --model, --config or every shape; "
                         f"missing: {', '.join('--' + k.replace('_', '-') for k in missing)}")
    return Transformer(**cfg)


def _cluster(args):
    gb = 1e9
    return Cluster(args.device, args.devices, devices_per_node=args.devices_per_node,
                   hbm_bytes=args.hbm_gb * gb if args.hbm_gb else None,
                   link_bandwidth=args.link_gb_per_s * gb if args.link_gb_per_s else None,
                   network_bandwidth=args.network_gb_per_s * gb if args.network_gb_per_s else None)


def plan_main(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        model, cluster = _model(args), _cluster(args)
        pins = {k: getattr(args, k) for k in _PINS}
        plan = plan_cluster(model, cluster, schedule=args.schedule, recompute=args.recompute,
                            **pins)
    except SystemExit as e:
        sys.stderr.write(f"{e}\n")
        return 2
    except (MultimeshError, OSError, ValueError, TypeError) as e:
        sys.stderr.write(f"{PROG} plan: error: {e}\n")
        return 1
    print(plan.to_json() if args.json else plan.as_code() if args.code else plan)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``multimesh`` console script: ``multimesh plan ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} plan [options]   (plan a described cluster; "
              f"`{PROG} plan --help` lists the options)")
        return 0 if argv else 2
    if argv[0] != "plan":
        sys.stderr.write(f"{PROG}: error: unknown command {argv[0]!r}; the commands are: "
                         f"plan\n")
        return 2
    return plan_main(argv[1:])
